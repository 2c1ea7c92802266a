"""Publishing a version: write `weights/v<version>`, then announce it (a `published` event with the
served-policy probe) and keep the last 3 versions on disk. One Publisher is chosen at start-up:

- one process, inline: HF weights, or with LoRA the PEFT adapter (serving "adapter") or the merged weights
  (serving "merged"), written in the step; a write the storage refuses is retried (learner.process.storage)
  and, when a stop gives it up, the version is not published;
- one process, in the background (learner.export_in_background, full weights): the weights are copied to
  the CPU at the step's end and written and announced on a thread while the next step trains. One write
  runs at a time and a publish waits for the previous one, so versions are published in order, none
  skipped, the same files the inline publisher writes;
- several ranks: the shards are gathered onto rank 0, which writes them (collective; a storage fault ends
  the learner, which restarts from its checkpoint).

Everything the announcement takes from the live model (the probe's log-probs) is taken before the next step.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from learner.groups import TrainGroup
from learner.process.background_export import BackgroundExport, WeightSnapshot
from learner.process.group import Group
from learner.process.startup import Start
from learner.process.storage import DurableWriter, EventSink, StorageGaveUp
from pipeline.contracts import events, tracing
from pipeline.contracts.learner_config import LearnerConfig
from pipeline.contracts.run_dir import prune_weights

if TYPE_CHECKING:
    import torch

    from learner.distributed import Ranks
    from learner.model.lora import LoraPolicy
    from learner.trainer import Trainer

log = logging.getLogger("rollwise.learner")

# (target directory, version) -> the directory written; None when the write was given up (logged).
Export = Callable[[Path, int], Path | None]


class ServedProbe:
    """The served-policy check's probe (learner.served_probe): picked from the groups of the first step
    after a publish and scored, before that step's update, with the weights the engines serve (`prev`)."""

    def __init__(self, model: Any, tokens: int | None) -> None:
        self.model = model
        self.tokens = tokens  # None: the check is off
        self.ids: list[int] = []
        self.prev: list[float] = []

    def prepare(self, groups: Sequence[TrainGroup], *, due: bool) -> None:
        """Pick and score the probe when `due` (nothing published since). Every rank runs it (under FSDP
        the forward is a collective), on the same groups."""
        if self.tokens is None or not due or not groups:
            return
        from learner.served_probe import probe_ids

        self.ids = probe_ids(groups, self.tokens)
        self.prev = self.score(self.ids)

    def score(self, ids: Sequence[int]) -> list[float]:
        """The log-probs of `ids` under the model now ([] for no ids)."""
        from learner.served_probe import probe_logprobs

        return probe_logprobs(self.model, ids) if ids else []


@dataclass(frozen=True)
class Announcement:
    """What a `published` event says beside the path, taken when the version's weights were."""

    version: int
    probe: list[int]
    logprobs: list[float]
    logprobs_prev: list[float]
    traceparent: str | None


class Announcer:
    """Sends `published` events and prunes old versions in `weights`."""

    def __init__(self, out: EventSink, weights: Path, weights_url: str | None) -> None:
        self.out = out
        self.weights = weights
        self.weights_url = weights_url  # where a learner with its own run directory serves them

    def announce(self, path: Path, a: Announcement) -> None:
        from learner.model.lora import directory_bytes

        self.out.emit(
            events.Published(
                version=a.version,
                path=str(path),
                bytes=directory_bytes(path),
                probe_ids=a.probe if a.logprobs else [],
                probe_logprobs=a.logprobs,
                probe_logprobs_prev=a.logprobs_prev if len(a.logprobs_prev) == len(a.logprobs) else [],
                weights_url=self.weights_url,
                traceparent=a.traceparent,
            )
        )

    def prune(self, version: int) -> None:
        prune_weights(self.weights, version)


class Publisher:
    """Writes a version in the step (`export`), then announces it (rank 0)."""

    def __init__(
        self,
        export: Export,
        weights_of: Callable[[int], Path],
        probe: ServedProbe,
        announcer: Announcer,
        *,
        leader: bool,
        published: int,
    ) -> None:
        self.export = export
        self.weights_of = weights_of
        self.probe = probe
        self.announcer = announcer
        self.leader = leader
        self.last_published = published  # written and announced (the checkpoint's record)
        self.last_exported = published  # written, or being written in the background

    def publish(self, version: int, *, announce: bool = True) -> None:
        """Write `weights/v<version>`; with `announce`, send the `published` event with the probe."""
        probe = list(self.probe.ids) if announce else []
        path = self.export(self.weights_of(version), version)
        if path is None:
            return
        self.last_published = self.last_exported = version
        logprobs = self.probe.score(probe)  # under FSDP a collective: every rank, with rank 0's ids
        if not self.leader:
            return
        if announce:
            announcement = Announcement(version, probe, logprobs, self.probe.prev, tracing.traceparent())
            self.announcer.announce(path, announcement)
        self.announcer.prune(version)

    def check(self) -> None:
        """Raise what a write in the background raised."""

    def wait(self) -> None:
        """Return once no write is in flight (raising what it raised)."""


class BackgroundPublisher(Publisher):
    """Announced versions are written and announced on a thread from a CPU copy of the weights."""

    def __init__(
        self,
        inline: Publisher,
        model: Any,
        write_state: Callable[[Path, int, dict[str, torch.Tensor]], Path],
        writes: DurableWriter,
    ) -> None:
        super().__init__(
            inline.export,
            inline.weights_of,
            inline.probe,
            inline.announcer,
            leader=inline.leader,
            published=inline.last_published,
        )
        self.model = model
        self.write_state = write_state
        self.writes = writes
        self.background = BackgroundExport()
        self.snapshot = WeightSnapshot()

    def publish(self, version: int, *, announce: bool = True) -> None:
        if not announce:  # the version resumed from, for the engines' start: written at once
            super().publish(version, announce=False)
            return
        self.background.wait()  # the previous version first: in order, none skipped
        state = self.snapshot.take(self.model.state_dict())
        self.last_exported = version
        probe = list(self.probe.ids)
        announcement = Announcement(
            version, probe, self.probe.score(probe), list(self.probe.prev), tracing.traceparent()
        )
        write = functools.partial(self.write_state, self.weights_of(version), version, state)
        self.background.start(
            functools.partial(self._write_and_announce, write, announcement), name=f"export-v{version}"
        )

    def _write_and_announce(self, write: Callable[[], Path], announcement: Announcement) -> None:
        """The thread's job: write the snapshot (retried like any export), then announce it."""
        try:
            path = self.writes.write("weights", self.announcer.weights, write)
        except StorageGaveUp as exc:
            log.error("version %d not published: %s", announcement.version, exc)
            return
        self.last_published = announcement.version
        self.announcer.announce(path, announcement)
        self.announcer.prune(announcement.version)

    def check(self) -> None:
        self.background.check()

    def wait(self) -> None:
        self.background.wait()


def durable(write: Callable[[Path, int], Path], writes: DurableWriter) -> Export:
    """`write`, retried while the storage refuses it; None (logged) when a stop gives it up."""

    def export(target: Path, version: int) -> Path | None:
        try:
            return writes.write("weights", target.parent, functools.partial(write, target, version))
        except StorageGaveUp as exc:
            log.error("version %d not published: %s", version, exc)
            return None

    return export


def full_weights(trainer: Trainer, tokenizer: Any) -> Callable[[Path, int], Path]:
    from learner.model.model_io import export_weights

    return functools.partial(export_weights, trainer, tokenizer)


def lora_weights(lora: LoraPolicy, tokenizer: Any, serving: str) -> Callable[[Path, int], Path]:
    if serving == "adapter":
        return lora.publish_adapter
    return lambda target, version: lora.publish_merged(target, tokenizer, version)


def gathered_weights(trainer: Trainer, tokenizer: Any, ranks: Ranks) -> Export:
    from learner.process.sharded_checkpoint import export_gathered

    return lambda target, version: export_gathered(trainer, tokenizer, target, version, ranks)


def state_weights(trainer: Trainer, tokenizer: Any) -> Callable[[Path, int, dict[str, torch.Tensor]], Path]:
    from learner.model.model_io import export_weights

    return lambda target, version, state: export_weights(
        trainer, tokenizer, target, version, state_dict=state
    )


def choose_publisher(
    cfg: LearnerConfig,
    start: Start,
    group: Group,
    probe: ServedProbe,
    announcer: Announcer,
    writes: DurableWriter,
    weights_of: Callable[[int], Path],
) -> Publisher:
    """The publisher for this learner (module docstring); LoRA runs in one process (a config rule)."""
    trainer, tokenizer = start.trainer, start.tokenizer
    if group.ranks is not None:
        export = gathered_weights(trainer, tokenizer, group.ranks)
    elif start.lora is not None:
        export = durable(lora_weights(start.lora, tokenizer, cfg.lora.serving), writes)
    else:
        export = durable(full_weights(trainer, tokenizer), writes)
    inline = Publisher(export, weights_of, probe, announcer, leader=group.leader, published=start.published)
    if cfg.export_in_background and group.ranks is None and start.lora is None:
        return BackgroundPublisher(inline, trainer.model, state_weights(trainer, tokenizer), writes)
    return inline
