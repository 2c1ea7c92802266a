"""What a learner checkpoint records besides tensors, and how it is found and read: the format, the
consumed trajectories, the counters and RNG states of state.json. learner.process.checkpoint writes one
process's checkpoint, learner.process.sharded_checkpoint one of several ranks; both read them here.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline.contracts.durable import fsync_dir
from pipeline.contracts.run_dir import CHECKPOINT_STATE, latest_checkpoint_dir

FORMAT_VERSION = 1
# Several ranks write torch.distributed.checkpoint shards instead (learner.process.sharded_checkpoint).
SHARDED_FORMAT_VERSION = 2
ADAPTER_DIR = "adapter"


@dataclass
class ConsumedState:
    """Which trajectories the learner has already trained on (spool resume point, learner.spool_cursor)."""

    last_seq: int = -1  # the watermark: every spool seq <= it is consumed; -1: none yet
    group_ids: list[str] = field(default_factory=list)
    after: list[int] = field(default_factory=list)  # seqs > last_seq consumed too (taken out of write order)


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint on disk; tensors are read by `restore`."""

    path: Path
    step: int
    counters: dict[str, int]
    consumed: ConsumedState
    extra: dict[str, Any]
    rng: dict[str, Any]
    sharded: bool = False

    @property
    def model_dir(self) -> Path:
        """HF directory of the checkpointed weights (loadable with learner.model.model_io.load_policy)."""
        return self.path / "model"


def numpy_state_to_json() -> dict[str, Any]:
    state = np.random.get_state(legacy=True)
    if not isinstance(state, tuple):
        raise TypeError(f"numpy legacy RNG state is a tuple, got {type(state)}")
    name, keys, pos, has_gauss, cached = state
    return {
        "name": name,
        "keys": keys.tolist(),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached": cached,
    }


def numpy_state_from_json(state: dict[str, Any]) -> None:
    keys = np.asarray(state["keys"], dtype=np.uint32)
    np.random.set_state((state["name"], keys, state["pos"], state["has_gauss"], state["cached"]))


def write_text_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def python_state() -> tuple[Any, ...]:
    version, internal, gauss = random.getstate()
    return (version, list(internal), gauss)


def read_checkpoint(path: Path) -> Checkpoint:
    state = json.loads((path / CHECKPOINT_STATE).read_text(encoding="utf-8"))
    if state.get("format") not in (FORMAT_VERSION, SHARDED_FORMAT_VERSION):
        raise ValueError(
            f"checkpoint {path} has format {state.get('format')!r}, expected {FORMAT_VERSION} or "
            f"{SHARDED_FORMAT_VERSION}"
        )
    return Checkpoint(
        path=path,
        step=int(state["step"]),
        counters={k: int(v) for k, v in state["counters"].items()},
        consumed=ConsumedState(**state["consumed"]),
        extra=dict(state["extra"]),
        rng=dict(state["rng"]),
        sharded=state["format"] == SHARDED_FORMAT_VERSION,
    )


def load_latest_checkpoint(checkpoints_dir: str | Path) -> Checkpoint | None:
    """The checkpoint `latest` names; else the newest complete step dir; None when there is none."""
    path = latest_checkpoint_dir(Path(checkpoints_dir))
    return read_checkpoint(path) if path is not None else None


def check_optimizer_layout(ckpt: Checkpoint, saved: dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
    """Raise naming the config key when the saved parameter groups differ from the trainer's (torch's own
    error names neither the key nor the checkpoint)."""
    saved_sizes = [len(group["params"]) for group in saved["param_groups"]]
    sizes = [len(group["params"]) for group in optimizer.param_groups]
    if saved_sizes != sizes:
        raise ValueError(
            f"checkpoint {ckpt.path} holds optimizer parameter groups of sizes {saved_sizes}, this learner "
            f"has {sizes}: learner.optim.embedding_weight_decay gives the embeddings their own group when it "
            f"differs from learner.optim.weight_decay; resume with the values the run was started with"
        )
