"""Atomic learner checkpoints: enough state that a restarted learner takes exactly the same next step.

Layout (docs/architecture.md, Contract 5; names and the `latest` pointer are pipeline.contracts.run_dir's):

    <checkpoints_dir>/step<n>/model/            HF directory (config.json, model.safetensors[, tokenizer])
    <checkpoints_dir>/step<n>/adapter/          with [learner.lora] instead of model/: the PEFT adapter
                                                (learner.lora; the base is the run's initial model)
    <checkpoints_dir>/step<n>/trainer_state.pt  optimizer, LR scheduler, torch RNG + the trainer's generator
    <checkpoints_dir>/step<n>/state.json        counters, consumed trajectories, python/numpy RNG, extra
    <checkpoints_dir>/latest                    name of the newest complete step dir

A step dir is staged under a hidden temp name, fsync'd and renamed, and only then does `latest` move
(temp file + fsync + rename), so a crash leaves either the previous checkpoint or the new one.
`trainer_state.pt` holds tensors and plain containers only and is read with `weights_only=True`.
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from learner.model.model_io import hf_weights, quiet_transformers, replace_dir_atomically, save_tokenizer
from learner.process.checkpoint_state import (
    ADAPTER_DIR,
    FORMAT_VERSION,
    Checkpoint,
    ConsumedState,
    check_optimizer_layout,
    numpy_state_from_json,
    numpy_state_to_json,
    python_state,
    write_text_atomically,
)
from learner.trainer import Trainer
from pipeline.contracts.durable import as_storage_error
from pipeline.contracts.run_dir import (
    CHECKPOINT_STATE,
    LATEST_CHECKPOINT,
    checkpoint_dirs,
    checkpoint_name,
)

if TYPE_CHECKING:
    from learner.model.lora import LoraPolicy


def save_checkpoint(
    checkpoints_dir: str | Path,
    trainer: Trainer,
    *,
    consumed: ConsumedState,
    extra: dict[str, Any] | None = None,
    keep: int = 2,
    tokenizer: Any = None,
    adapter: LoraPolicy | None = None,
) -> Path:
    """Write `step<trainer.steps>` atomically, point `latest` at it and keep the newest `keep` step dirs.

    `extra` must be JSON-serialisable (e.g. the resolved config hash, wall-clock of the run).
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    quiet_transformers()
    root = Path(checkpoints_dir)
    root.mkdir(parents=True, exist_ok=True)
    name = checkpoint_name(trainer.steps)
    staged = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=root))
    try:
        if adapter is not None:
            adapter.save(staged / ADAPTER_DIR)
        else:
            trainer.model.save_pretrained(staged / "model")
            if tokenizer is not None:
                save_tokenizer(tokenizer, staged / "model")
        tensors: dict[str, Any] = {
            "optimizer": trainer.optimizer.state_dict(),
            "scheduler": trainer.scheduler.state_dict(),
            "generator": trainer.generator.get_state(),
            "torch_rng": torch.get_rng_state(),
        }
        if torch.cuda.is_available():
            tensors["cuda_rng"] = torch.cuda.get_rng_state_all()
        torch.save(tensors, staged / "trainer_state.pt")
        state = {
            "format": FORMAT_VERSION,
            "step": trainer.steps,
            "counters": trainer.counters(),
            "consumed": asdict(consumed),
            "extra": extra or {},
            "rng": {"python": list(python_state()), "numpy": numpy_state_to_json()},
        }
        (staged / CHECKPOINT_STATE).write_text(json.dumps(state) + "\n", encoding="utf-8")
        target = root / name
        replace_dir_atomically(staged, target)
    except BaseException as exc:
        error = as_storage_error(exc, root)  # before the staged files give their space back
        shutil.rmtree(staged, ignore_errors=True)
        if error is not exc:
            raise error from exc
        raise
    write_text_atomically(root / LATEST_CHECKPOINT, name + "\n")
    for _, old in checkpoint_dirs(root)[:-keep]:
        if old != target:
            shutil.rmtree(old, ignore_errors=True)
    # Staging dirs of saves that crashed before their rename (one learner writes here at a time).
    for leftover in root.glob(".step*"):
        if leftover.is_dir():
            shutil.rmtree(leftover, ignore_errors=True)
    return target


def restore(trainer: Trainer, ckpt: Checkpoint, *, adapter: LoraPolicy | None = None) -> None:
    """Load weights (or the LoRA `adapter`'s), optimizer, scheduler, RNG states and counters of `ckpt`
    into `trainer` in place."""
    has_adapter = (ckpt.path / ADAPTER_DIR).is_dir()
    if has_adapter != (adapter is not None):
        raise ValueError(
            f"checkpoint {ckpt.path} holds {'a LoRA adapter' if has_adapter else 'full weights'} but "
            f"learner.lora.enabled is {adapter is not None}: resume with the setting the run started with"
        )
    if ckpt.sharded or trainer.ranks is not None:  # written or resumed by several ranks: any pair works
        from learner.process.sharded_checkpoint import restore_sharded

        restore_sharded(trainer, ckpt)
        return
    if adapter is not None:
        adapter.load(ckpt.path / ADAPTER_DIR)
    else:
        weights = ckpt.model_dir / "model.safetensors"
        if not weights.is_file():
            raise FileNotFoundError(f"checkpoint {ckpt.path} has no {weights.name} under model/")
        # strict: a key mismatch raises naming the keys; tied embeddings are saved once, both names filled;
        # a layout transformers converts on load (an MoE's experts) is read through it
        # (learner.model.model_io).
        trainer.model.load_state_dict(hf_weights(ckpt.model_dir, trainer.model), strict=True)
    tensors = torch.load(ckpt.path / "trainer_state.pt", map_location="cpu", weights_only=True)
    check_optimizer_layout(ckpt, tensors["optimizer"], trainer.optimizer)
    trainer.optimizer.load_state_dict(tensors["optimizer"])
    trainer.scheduler.load_state_dict(tensors["scheduler"])
    trainer.generator.set_state(tensors["generator"])
    torch.set_rng_state(tensors["torch_rng"])
    if "cuda_rng" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(tensors["cuda_rng"])
    version, internal, gauss = ckpt.rng["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy_state_from_json(ckpt.rng["numpy"])
    trainer.load_counters(ckpt.counters)
