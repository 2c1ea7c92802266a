"""The daemon's tokenizer (pipeline.supervisor.wiring.load_tokenizer): AutoTokenizer's own result, loaded
without importing torch when the model directory names the plain fast tokenizer."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.supervisor import wiring
from pipeline.supervisor.wiring import load_tokenizer, named_tokenizer_class

REPO = Path(__file__).resolve().parents[2]


def test_a_plain_tokenizer_is_autotokenizers_own_and_imports_no_torch(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    assert named_tokenizer_class(tiny_model_dir) == "PreTrainedTokenizerFast"
    ours, theirs = load_tokenizer(tiny_model_dir), AutoTokenizer.from_pretrained(str(tiny_model_dir))
    assert type(ours) is type(theirs)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Calculate 7 + 8."}]
    assert ours.apply_chat_template(messages, add_generation_prompt=True) == theirs.apply_chat_template(
        messages, add_generation_prompt=True
    )
    assert (ours.eos_token_id, ours.pad_token_id, ours.all_special_ids) == (
        theirs.eos_token_id,
        theirs.pad_token_id,
        theirs.all_special_ids,
    )
    probe = (
        "import sys; from pathlib import Path; from pipeline.supervisor.wiring import load_tokenizer; "
        f"load_tokenizer(Path({str(tiny_model_dir)!r})); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_another_named_class_goes_through_autotokenizer(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "Qwen2Tokenizer"}))
    calls: list[str] = []
    import transformers

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda path, **kw: calls.append(path))
    load_tokenizer(model)
    assert calls == [str(model)]
    (model / "tokenizer_config.json").write_text("not json")
    assert named_tokenizer_class(model) is None
    assert {"PreTrainedTokenizerFast", "TokenizersBackend"} == wiring.PLAIN_TOKENIZERS
