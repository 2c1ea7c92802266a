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


# safetensors' memory-mapped reads keep two Python ints alive for every tensor they read (safetensors
# 0.6.2, 0.7.0 and 0.8.0 alike: 2.0 objects of 28 bytes per `get_tensor` or `get_slice(...)[...]`; reading a
# whole file from bytes keeps none). An engine reads every tensor at every weight update: the toy's soak
# loaded ~6,500 versions an hour and its engine grew ~9 MiB/h of them. Checkpoints up to this size are
# read from bytes instead (transformers' `disable_mmap`), which holds the file in memory once more while
# it loads; larger ones are mapped, as they are loaded rarely and that extra copy would cost more.
READ_WHOLE_LIMIT = 1 << 30


def read_whole(path: Path) -> bool:
    """True when the checkpoint's safetensors files fit READ_WHOLE_LIMIT bytes together."""
    files = list(path.glob("*.safetensors"))
    return bool(files) and sum(f.stat().st_size for f in files) <= READ_WHOLE_LIMIT


def load_model(path: str, device: str, dtype: str) -> Any:
    """HF causal LM from a directory, through `from_pretrained` (the path of a real checkpoint)."""
    from transformers import AutoModelForCausalLM

    directory = Path(path)
    if not directory.is_dir():
        raise FileNotFoundError(f"model_path {path!r} is not a directory")
    model: Any = AutoModelForCausalLM.from_pretrained(
        path, dtype=DTYPES[dtype], disable_mmap=read_whole(directory)
    )
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
