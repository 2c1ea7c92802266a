"""Checkpoints of a learner of several ranks (torch.distributed.checkpoint), and the HF weights the engines
load, gathered onto rank 0 and written by it alone.

    <checkpoints_dir>/step<n>/dcp/              model and AdamW state: one file per rank plus .metadata
    <checkpoints_dir>/step<n>/trainer_state.pt  LR scheduler, shuffling generator, torch RNG (rank 0's)
    <checkpoints_dir>/step<n>/state.json        format 2: counters, consumed trajectories, RNG, extra, ranks

DCP records every tensor with its global shape, so such a checkpoint resumes under any number of ranks,
one process included (learner.process.checkpoint.restore sends it here); a one-process checkpoint
(format 1: HF weights and a torch.save'd optimizer) resumes under several ranks as well. Atomic like
learner.process.checkpoint: every rank writes its shard into a staging directory that rank 0 named,
rank 0 writes state.json last, renames the directory into place and only then moves `latest`. The spool
position and the consumed group ids are rank 0's (it alone reads the spool), so they stay exactly-once
whatever the number of ranks.
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from learner.distributed import Ranks
from learner.model.model_io import hf_weights, quiet_transformers, replace_dir_atomically, save_hf
from learner.process.checkpoint_state import (
    SHARDED_FORMAT_VERSION,
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
from pipeline.contracts.run_dir import CHECKPOINT_STATE, LATEST_CHECKPOINT, checkpoint_dirs, checkpoint_name

SHARDS_DIR = "dcp"
TRAINER_STATE = "trainer_state.pt"


def _group_sizes(optimizer: torch.optim.Optimizer) -> list[int]:
    return [len(group["params"]) for group in optimizer.param_groups]


def save_sharded_checkpoint(
    checkpoints_dir: str | Path,
    trainer: Trainer,
    *,
    consumed: ConsumedState,
    ranks: Ranks,
    extra: dict[str, Any] | None = None,
    keep: int = 2,
) -> Path:
    """Every rank: write `step<trainer.steps>` (collective). Rank 0 also records `consumed` and `extra`,
    points `latest` at it and keeps the newest `keep` step dirs. Returns the step dir on every rank."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    root = Path(checkpoints_dir)
    name = checkpoint_name(trainer.steps)
    staged_name = None
    if ranks.leader:
        root.mkdir(parents=True, exist_ok=True)
        staged_name = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=root)
    staged = Path(ranks.broadcast(staged_name) or "")
    target = root / name
    try:
        state = {
            "model": get_model_state_dict(trainer.model),
            "optimizer": get_optimizer_state_dict(trainer.model, trainer.optimizer),
        }
        dcp.save(state, checkpoint_id=staged / SHARDS_DIR, process_group=ranks.control)
        if ranks.leader:
            _write_leader_files(staged, trainer, consumed, extra or {}, ranks.world)
            replace_dir_atomically(staged, target)
    except BaseException as exc:
        error = as_storage_error(exc, root)  # before the staged files give their space back
        if ranks.leader:
            shutil.rmtree(staged, ignore_errors=True)
        if error is not exc:
            raise error from exc
        raise
    if ranks.leader:
        write_text_atomically(root / LATEST_CHECKPOINT, name + "\n")
        for _, old in checkpoint_dirs(root)[:-keep]:
            if old != target:
                shutil.rmtree(old, ignore_errors=True)
        for leftover in root.glob(".step*"):  # staging dirs of saves that crashed before their rename
            if leftover.is_dir():
                shutil.rmtree(leftover, ignore_errors=True)
    return target


def _write_leader_files(
    staged: Path, trainer: Trainer, consumed: ConsumedState, extra: dict[str, Any], world: int
) -> None:
    tensors: dict[str, Any] = {
        "scheduler": trainer.scheduler.state_dict(),
        "generator": trainer.generator.get_state(),
        "torch_rng": torch.get_rng_state(),
    }
    torch.save(tensors, staged / TRAINER_STATE)
    state = {
        "format": SHARDED_FORMAT_VERSION,
        "step": trainer.steps,
        "counters": trainer.counters(),
        "consumed": asdict(consumed),
        "extra": extra,
        "rng": {"python": list(python_state()), "numpy": numpy_state_to_json()},
        "ranks": world,
        "optimizer_groups": _group_sizes(trainer.optimizer),
    }
    (staged / CHECKPOINT_STATE).write_text(json.dumps(state) + "\n", encoding="utf-8")


def restore_sharded(trainer: Trainer, ckpt: Checkpoint) -> None:
    """Load `ckpt` into `trainer` in place, whichever of the two is sharded: a format-2 checkpoint into a
    trainer of any number of ranks, or a one-process checkpoint into a sharded trainer. Collective when
    the trainer is sharded."""
    model, optimizer = trainer.model, trainer.optimizer
    # Memory-mapped: a rank reads only what it uses (a one-process checkpoint's optimizer: rank 0 alone).
    tensors = torch.load(ckpt.path / TRAINER_STATE, map_location="cpu", weights_only=True, mmap=True)
    if ckpt.sharded:
        _check_group_sizes(ckpt, optimizer)
        state: dict[str, Any] = {
            "model": get_model_state_dict(model),
            "optimizer": get_optimizer_state_dict(model, optimizer),
        }
        control = trainer.ranks.control if trainer.ranks is not None else None
        with warnings.catch_warnings():
            # One process reads every shard itself, which is the intent; torch warns that it assumes so.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            dcp.load(
                state,
                checkpoint_id=ckpt.path / SHARDS_DIR,
                process_group=control,
                no_dist=trainer.ranks is None,
            )
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optimizer, state["optimizer"])
    else:
        weights = ckpt.model_dir / "model.safetensors"
        if not weights.is_file():
            raise FileNotFoundError(f"checkpoint {ckpt.path} has no {weights.name} under model/")
        check_optimizer_layout(ckpt, tensors["optimizer"], optimizer)
        # Rank 0 reads the whole weights and optimizer state; every rank receives its shards from it.
        leader = trainer.ranks is None or trainer.ranks.leader
        full = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        full_weights: dict[str, Any] = dict(hf_weights(ckpt.model_dir, model)) if leader else {}
        set_model_state_dict(model, full_weights, options=full)
        named = _keyed_by_name(tensors["optimizer"], trainer) if leader else {}
        set_optimizer_state_dict(model, optimizer, named, options=full)
    trainer.scheduler.load_state_dict(tensors["scheduler"])
    trainer.generator.set_state(tensors["generator"])
    torch.set_rng_state(tensors["torch_rng"])
    version, internal, gauss = ckpt.rng["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy_state_from_json(ckpt.rng["numpy"])
    trainer.load_counters(ckpt.counters)


def _check_group_sizes(ckpt: Checkpoint, optimizer: torch.optim.Optimizer) -> None:
    state = json.loads((ckpt.path / CHECKPOINT_STATE).read_text(encoding="utf-8"))
    saved = {"param_groups": [{"params": [None] * n} for n in state["optimizer_groups"]]}
    check_optimizer_layout(ckpt, saved, optimizer)


def _keyed_by_name(saved: dict[str, Any], trainer: Trainer) -> dict[str, Any]:
    """A torch.optim state dict (parameters by position in their group) keyed by parameter name instead,
    the form torch.distributed.checkpoint.state_dict loads into a sharded optimizer. The trainer builds its
    groups in the same order whatever the sharding, so position k of group g is the same parameter."""
    names = {id(p): name for name, p in trainer.model.named_parameters()}
    state: dict[str, Any] = {}
    groups = []
    for saved_group, group in zip(saved["param_groups"], trainer.optimizer.param_groups, strict=True):
        fqns = [names[id(p)] for p in group["params"]]
        for index, fqn in zip(saved_group["params"], fqns, strict=True):
            if index in saved["state"]:
                state[fqn] = saved["state"][index]
        groups.append({**saved_group, "params": fqns})
    return {"state": state, "param_groups": groups}


def export_gathered(
    trainer: Trainer, tokenizer: Any, out_dir: str | Path, version: int, ranks: Ranks
) -> Path:
    """Publish policy `version` as an HF directory (learner.model.model_io.export_weights' layout): every
    rank gives its shards, rank 0 gathers them on the CPU, one tensor at a time, and writes the directory.
    Collective."""
    if version < 0:
        raise ValueError(f"policy version must be >= 0, got {version}")
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    gathered = get_model_state_dict(trainer.model, options=options)  # empty on every rank but 0
    if not ranks.leader:
        return Path(out_dir)
    quiet_transformers()
    tensors = {name: value for name, value in gathered.items() if isinstance(value, torch.Tensor)}
    return save_hf(trainer.model, tokenizer, out_dir, version=version, state_dict=tensors)
