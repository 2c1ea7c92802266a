"""Loading what the engine serves: the HF causal LM, its tokenizer and its end-of-sequence ids.

`load_model` is the only path weights take into the engine (at start and on /update_weights_from_disk):
`from_pretrained` on a directory, as for a real checkpoint, in the dtype `resolve_dtype` chose at start.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from pipeline.contracts.cpu_features import auto_cpu_dtype

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(requested: str, device: str) -> tuple[str, str]:
    """(dtype the engine serves in, why). `auto` picks bfloat16 where bf16 matmuls are native: on a CPU
    with AMX or AVX512-BF16 (pipeline.contracts.cpu_features), on a CUDA device that supports bf16;
    float32 elsewhere. Any other value is taken as given."""
    if requested != "auto":
        if requested not in DTYPES:
            raise ValueError(f"unknown dtype {requested!r}; choose auto or one of {sorted(DTYPES)}")
        return requested, "--dtype given"
    if torch.device(device).type == "cpu":
        return auto_cpu_dtype()
    if torch.device(device).type == "cuda" and torch.cuda.is_bf16_supported():
        return "bfloat16", f"auto: {device} supports bf16"
    return "float32", f"auto: no native bf16 known on {device}"


def load_model(path: str, device: str, dtype: str) -> Any:
    """HF causal LM from a directory, through `from_pretrained` (the path of a real checkpoint)."""
    from transformers import AutoModelForCausalLM

    if not Path(path).is_dir():
        raise FileNotFoundError(f"model_path {path!r} is not a directory")
    model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype])
    return model.to(device).eval()


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # token-in/token-out still works; responses then carry no "text"
        log.warning("no tokenizer in %s (%s): responses will have no 'text'", path, exc)
        return None


def eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    return frozenset(ids)
