"""Loading the policy and writing it back as an HF directory (the weights an engine reloads from disk)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from pipeline.contracts.durable import fsync_dir

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
VERSION_FILE = "rollwise_version.json"
# Files a tokenizer may consist of; copied verbatim when the tokenizer was loaded from a local directory.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)


def resolve_device(name: str) -> torch.device:
    """Device for a config name: auto (cuda if available, else cpu), cpu, or cuda (an error without a GPU)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device 'cuda' requested but torch.cuda.is_available() is False")
        return torch.device("cuda")
    raise ValueError(f"unknown device {name!r}; expected 'auto', 'cpu' or 'cuda'")


def quiet_transformers() -> None:
    """Turn off transformers' progress bars (one per save/load would flood the learner's logs)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def load_policy(
    model_dir: str | Path, *, device: str | torch.device = "cpu", dtype: str = "float32"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Model (train mode, on `device`, its weights in `dtype`) and tokenizer from an HF directory.

    The weights' dtype is learner.precision's (bf16 only for the pure-bf16 mode); bf16 on a CPU works but
    is slow, and is meant for tests and experiments.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPES)}")
    target = resolve_device(device) if isinstance(device, str) else device
    quiet_transformers()
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=DTYPES[dtype])
    torch.nn.Module.to(model, target)  # transformers' typed `to` wrapper rejects a plain device
    model.train()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return model, tokenizer


def hf_weights(model_dir: str | Path, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights of the HF directory `model_dir` keyed as `model.state_dict()` keys them, on the CPU.

    The file's own tensors when its keys are the model's (a tied output layer is saved once: both names
    are filled). Otherwise the layout on disk is not the module layout (transformers converts on load:
    a Qwen3-MoE checkpoint stores one tensor per expert projection, the model one 3D tensor per layer),
    and the weights are what `from_pretrained` makes of them."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    weights = Path(model_dir) / "model.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(f"{model_dir} has no {weights.name}")
    aliases: dict[int, list[str]] = {}
    for name, value in model.state_dict(keep_vars=True).items():
        aliases.setdefault(id(value), []).append(name)
    expected = {name for names in aliases.values() for name in names}
    with safe_open(str(weights), "pt") as f:
        on_disk = set(f.keys())
    if on_disk <= expected:
        saved = load_file(weights)
    else:
        from transformers import AutoModelForCausalLM

        quiet_transformers()
        dtype = next(iter(model.state_dict().values())).dtype
        saved = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).state_dict()
    full = dict(saved)
    for names in aliases.values():
        present = [name for name in names if name in saved]
        for name in names:
            if name not in full and present:
                full[name] = saved[present[0]]
    return full


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    fsync_dir(root)


def replace_dir_atomically(staged: Path, target: Path) -> None:
    """Move the complete directory `staged` to `target`; readers see the old or the new one, never half.

    An existing `target` is first renamed aside and removed afterwards (rename cannot replace a non-empty
    directory), so there is a moment without `target` but never one with a partial `target`.
    """
    _fsync_tree(staged)
    old: Path | None = None
    if target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.rename(target, old)
    os.rename(staged, target)
    fsync_dir(target.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def save_tokenizer(tokenizer: PreTrainedTokenizerBase, out_dir: Path) -> None:
    """Write `tokenizer` into `out_dir`, byte-identical to its source directory when it has one.

    Copying keeps what an engine reads unchanged across versions: re-serialising through the installed
    transformers would rewrite tokenizer_config.json in its own dialect (transformers 5 names its own
    backend class there, which an engine on transformers 4 cannot load).
    """
    source = Path(str(getattr(tokenizer, "name_or_path", "") or ""))
    if source.is_dir() and (source / "tokenizer_config.json").is_file():
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copy2(source / name, out_dir / name)
        return
    tokenizer.save_pretrained(out_dir)


def save_hf(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase | None,
    out_dir: str | Path,
    *,
    version: int | None = None,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write `model` (and `tokenizer`) as an HF directory at `out_dir`, atomically (temp dir + rename).

    With `version`, the directory also holds `rollwise_version.json` ({"policy_version": version}) so a
    reader can tell which policy it loaded without trusting the path. `state_dict` replaces the model's
    own tensors (a sharded model's, gathered: learner.process.sharded_checkpoint).
    """
    quiet_transformers()

    def write(staged: Path) -> None:
        model.save_pretrained(staged, state_dict=state_dict)
        if tokenizer is not None:
            save_tokenizer(tokenizer, staged)

    return write_dir_atomically(Path(out_dir), write, version=version)


def write_dir_atomically(target: Path, write: Callable[[Path], None], *, version: int | None = None) -> Path:
    """`write(staged)` into a fresh directory beside `target`, add `rollwise_version.json` with `version`,
    then `replace_dir_atomically`: readers of `target` never see a partial directory."""
    if version is not None and version < 0:
        raise ValueError(f"policy version must be >= 0, got {version}")
    target.parent.mkdir(parents=True, exist_ok=True)
    staged = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        write(staged)
        if version is not None:
            (staged / VERSION_FILE).write_text(json.dumps({"policy_version": version}) + "\n")
        replace_dir_atomically(staged, target)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    return target


def export_weights(
    model_or_trainer: object,
    tokenizer: PreTrainedTokenizerBase | None,
    out_dir: str | Path,
    version: int,
    *,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Publish policy `version` as an HF directory an engine can load (update_weights_from_disk).

    `model_or_trainer` is a PreTrainedModel or an object whose `.model` is one (the Trainer). `state_dict`
    replaces the model's own tensors (a snapshot taken earlier: learner.process.background_export).
    """
    model = model_or_trainer if hasattr(model_or_trainer, "save_pretrained") else None
    if model is None:
        model = getattr(model_or_trainer, "model", None)
    if model is None or not hasattr(model, "save_pretrained"):
        raise TypeError(
            f"export_weights needs a PreTrainedModel or a trainer holding one, got {type(model_or_trainer)}"
        )
    if version < 0:
        raise ValueError(f"policy version must be >= 0, got {version}")
    return save_hf(cast("PreTrainedModel", model), tokenizer, out_dir, version=version, state_dict=state_dict)
