"""Checkpoints as the learner process writes them, chosen once at start-up: one process's
(learner.process.checkpoint, retried while the storage refuses it, given up when a stop comes meanwhile: the
steps since the last checkpoint are then redone on restart) or the sharded one of several ranks
(learner.process.sharded_checkpoint, collective: a storage fault ends the learner, which restarts from the
previous checkpoint). Rank 0 appends the step's record to the consumed ledger before the checkpoint
commits (pipeline.contracts.run_dir.append_consumed).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Protocol

from learner.process.checkpoint_state import ConsumedState
from learner.process.group import Group
from learner.process.startup import Start
from learner.process.storage import DurableWriter, StorageGaveUp
from pipeline.contracts.run_dir import RunDir, append_consumed

log = logging.getLogger("rollwise.learner")


class Checkpointer(Protocol):
    def save(self, consumed: ConsumedState, extra: dict[str, Any]) -> Path | None:
        """Write the checkpoint of the trainer's current step; None when it was given up (logged)."""
        ...


def _record(step: int, consumed: ConsumedState, extra: dict[str, Any]) -> dict[str, Any]:
    return {"step": step, "consumed": dataclasses.asdict(consumed), "extra": extra}


class OneProcessCheckpointer:
    """The trainer's full state (or its LoRA adapter's) in one directory per step."""

    def __init__(self, run: RunDir, start: Start, keep: int, writes: DurableWriter) -> None:
        self.run = run
        self.start = start
        self.keep = keep
        self.writes = writes

    def save(self, consumed: ConsumedState, extra: dict[str, Any]) -> Path | None:
        from learner.process.checkpoint import save_checkpoint

        trainer = self.start.trainer

        def save() -> Path:
            append_consumed(
                self.run.consumed_log, _record(trainer.steps, consumed, extra)
            )  # the ledger's rule
            return save_checkpoint(
                self.run.checkpoints,
                trainer,
                consumed=consumed,
                extra=extra,
                keep=self.keep,
                tokenizer=self.start.tokenizer,
                adapter=self.start.lora,
            )

        try:
            return self.writes.write("checkpoint", self.run.checkpoints, save)
        except StorageGaveUp as exc:
            log.error("step %d not checkpointed (it is redone on restart): %s", trainer.steps, exc)
            return None


class ShardedCheckpointer:
    """Every rank writes its shards (torch.distributed.checkpoint); rank 0 the rest."""

    def __init__(self, run: RunDir, start: Start, keep: int, group: Group) -> None:
        self.run = run
        self.start = start
        self.keep = keep
        self.group = group

    def save(self, consumed: ConsumedState, extra: dict[str, Any]) -> Path:
        from learner.process.sharded_checkpoint import save_sharded_checkpoint

        trainer = self.start.trainer
        assert self.group.ranks is not None
        if self.group.leader:
            append_consumed(self.run.consumed_log, _record(trainer.steps, consumed, extra))
        return save_sharded_checkpoint(
            self.run.checkpoints,
            trainer,
            consumed=consumed,
            ranks=self.group.ranks,
            extra=extra,
            keep=self.keep,
        )


def choose_checkpointer(
    run: RunDir, start: Start, keep: int, group: Group, writes: DurableWriter
) -> Checkpointer:
    if group.ranks is None:
        return OneProcessCheckpointer(run, start, keep, writes)
    return ShardedCheckpointer(run, start, keep, group)
