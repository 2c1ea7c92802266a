"""The learner's side of the spool: read up to 2·B groups ahead (each decoded once), take the one with the
earliest staleness deadline (pipeline.contracts.staleness.deadline_key) and triage it (train, or drop and
say why: learner.groups). Where it stands is a SpoolCursor (learner.spool_cursor).

Retention: spool files are deleted once the *oldest retained* checkpoint has consumed them, so falling back
to any checkpoint on disk still finds every group it has not trained on.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from learner.groups import TrainGroup, triage_group
from learner.process.checkpoint_state import ConsumedState
from learner.process.startup import Start
from learner.process.storage import EventSink
from learner.spool_cursor import SpoolCursor
from pipeline.contracts import events
from pipeline.contracts.config import Config
from pipeline.contracts.run_dir import RunDir
from pipeline.contracts.schema import EpisodeSegment, RejectedRow, batch_to_segments
from pipeline.contracts.staleness import deadline_key
from pipeline.contracts.waste import trainable_tokens
from pipeline.transport.readers import GroupReader, open_spool_reader
from pipeline.transport.spool import QuarantinedFile, SpoolItem, read_group_file, spool_name

if TYPE_CHECKING:
    from pathlib import Path

    import pyarrow as pa

log = logging.getLogger("rollwise.learner")


@dataclass
class Pending:
    """Groups taken since the last step: the ones to train and every id consumed with them."""

    items: list[tuple[SpoolItem, TrainGroup]] = field(default_factory=list)
    consumed_ids: list[str] = field(default_factory=list)
    dropped: dict[str, str] = field(default_factory=dict)  # group_id -> reason, of consumed_ids


@dataclass(frozen=True)
class Read:
    """A spool group read ahead and decoded once, waiting to be taken."""

    item: SpoolItem
    rows: list[EpisodeSegment]
    rejected: list[RejectedRow]
    oldest_version: int | None  # of its trainable rows' generated tokens

    @property
    def key(self) -> tuple[int, int]:
        return deadline_key(self.oldest_version, self.item.seq)


def read_ahead(item: SpoolItem) -> Read:
    rows, rejected = batch_to_segments(item.batch)
    versions = [v for row in rows if row.trainable and (v := row.min_version()) is not None]
    return Read(item, rows, rejected, min(versions) if versions else None)


@dataclass(frozen=True)
class Triage:
    """What a group is judged against (learner.groups.triage_group): the learner's version at the time,
    the staleness bound and the model's vocabulary and MoE routing shape."""

    version: Callable[[], int]
    max_staleness: int
    vocab_size: int | None
    routing: tuple[int, int, int] | None  # (layers, top-k, experts) of an MoE policy

    def verdict(
        self, group_id: str, rows: list[EpisodeSegment], rejected: list[RejectedRow]
    ) -> TrainGroup | str:
        """A decoded group's triage at the learner's version: a TrainGroup, or why it is dropped."""
        verdict = triage_group(
            group_id,
            rows,
            learner_version=self.version(),
            max_staleness=self.max_staleness,
            rejected=rejected,
            vocab_size=self.vocab_size,
            routing=self.routing,
        )
        if verdict == "routing_mismatch":
            problems = [
                problem
                for row in rows
                if row.routed_experts is not None
                and (problem := row.routed_experts.model_problem(*(self.routing or (0, 0, 0)))) is not None
            ]
            log.warning("group %s dropped: %s", group_id, problems[0] if problems else verdict)
        return verdict


class Intake:
    """Rank 0's reading of the spool; `read_groups` is how the other ranks read a step's groups."""

    def __init__(
        self,
        reader: GroupReader,
        spool: Path,
        cursor: SpoolCursor,
        triage: Triage,
        out: EventSink,
        *,
        batch_groups: int,
        keep_checkpoints: int,
        resumed: bool,
    ) -> None:
        self.reader = reader
        self.spool = spool
        self.cursor = cursor
        self.triage = triage
        self.out = out
        self.batch_groups = batch_groups
        # Read ahead: one batch beyond the one being filled, so a group that ran long can be taken before
        # groups admitted after it (learner.spool_cursor); bounded, since each is held decoded in memory.
        self.lookahead_groups = 2 * batch_groups
        self.lookahead: list[Read] = []
        self.refresh = True  # read ahead once per step, and whenever the held groups cannot fill the batch
        self.pending = Pending()
        # The watermarks of the checkpoints on disk, oldest first.
        self.checkpoint_seqs: collections.deque[int] = collections.deque(maxlen=keep_checkpoints)
        if resumed:  # the cursor is the checkpoint's
            self.checkpoint_seqs.append(self.consumed_seq)

    @property
    def consumed_seq(self) -> int:
        return self.cursor.committed.watermark

    @property
    def consumed_after(self) -> list[int]:
        return list(self.cursor.committed.after)

    @property
    def batch_ready(self) -> bool:
        return len(self.pending.items) >= self.batch_groups

    def next_item(self) -> Read | None:
        """The waiting group with the earliest staleness deadline among those read ahead.

        The spool is read once per step (each read lists the spool directory, or asks the Flight service)
        and again whenever the held groups cannot complete the batch; a Flight read waits on the
        service for a new group only when nothing is held."""
        room = self.lookahead_groups - len(self.lookahead)
        if room > 0 and (self.refresh or len(self.lookahead) < self.batch_groups - len(self.pending.items)):
            self.refresh = False
            self._read(room)
        if not self.lookahead:
            return None
        first = min(range(len(self.lookahead)), key=lambda k: self.lookahead[k].key)
        return self.lookahead.pop(first)

    def _read(self, room: int) -> None:
        items = self.reader.poll(limit=room, wait=not self.lookahead)
        for blocked, message in self.reader.drain_reachability():  # once per outage, once per recovery
            self.out.emit(events.Unreachable(what="spool", blocked=blocked, message=message))
        for bad in self.reader.drain_quarantined():
            self.report_quarantined(bad)
        for item in items:
            if self.cursor.consumed(item.seq):  # consumed before the restart (its checkpoint's `after`)
                continue
            self.cursor.read(item.seq)
            self.lookahead.append(read_ahead(item))

    def report_quarantined(self, bad: QuarantinedFile) -> None:
        self.out.emit(events.Quarantined(seq=bad.seq, file=bad.file, kind=bad.kind, reason=bad.reason))
        self.cursor.passed(bad.seq)
        self.drop(bad.seq, bad.file, "quarantined")

    def drop(self, seq: int, group_id: str, reason: str, tokens: int = 0) -> None:
        """Announce a group that will never train; `tokens` = its trainable rows' generated tokens."""
        self.out.emit(events.Dropped(seq=seq, group_id=group_id, reason=reason, tokens=tokens))

    def take(self, read: Read) -> None:
        """Train the group or drop it."""
        item, rejected = read.item, read.rejected
        verdict = self.triage.verdict(item.group_id, read.rows, rejected)
        if rejected:
            log.warning(
                "group %s (seq %d): %d invalid row(s), first: %s",
                item.group_id,
                item.seq,
                len(rejected),
                rejected[0].reason,
            )
        self.cursor.take(item.seq)
        self.pending.consumed_ids.append(item.group_id)
        if isinstance(verdict, str):
            self.drop(item.seq, item.group_id, verdict, trainable_tokens(read.rows))
            self.pending.dropped[item.group_id] = verdict
        else:
            self.pending.items.append((item, verdict))

    def take_pending(self) -> Pending:
        """The step's groups; the next ones are gathered afresh."""
        pending, self.pending = self.pending, Pending()
        return pending

    def commit(self, pending: Pending, *, updated: bool) -> None:
        """The step is done: its takes count (groups that updated no weight are reported dropped, which
        keeps the actors' admission count `accepted = v·B + unconsumed` true)."""
        if not updated:
            for item, group in pending.items:
                self.drop(item.seq, item.group_id, "no_update", trainable_tokens(group.rows))
                pending.dropped[item.group_id] = "no_update"
        self.cursor.commit()
        self.refresh = True

    def depth(self) -> tuple[int, int]:
        """(groups, bytes) waiting to be trained: after the watermark, less those consumed out of order."""
        return self.reader.depth(self.consumed_seq, consumed=self.cursor.committed.after)

    def consumed_state(self, group_ids: Sequence[str]) -> ConsumedState:
        return ConsumedState(last_seq=self.consumed_seq, group_ids=list(group_ids), after=self.consumed_after)

    def checkpointed(self) -> None:
        """A checkpoint at the current position is on disk: prune what the oldest one kept has consumed."""
        self.checkpoint_seqs.append(self.consumed_seq)
        if len(self.checkpoint_seqs) == self.checkpoint_seqs.maxlen:
            try:
                self.reader.prune(self.checkpoint_seqs[0])
            except OSError as exc:  # the next checkpoint prunes them (retention.json is written first)
                log.error("pruning consumed spool files failed: %s", exc)

    def read_groups(self, seqs: Sequence[int]) -> list[TrainGroup]:
        """A step's groups as rank 0 took them: read from the spool and triaged here the same way (same
        files, same learner version, same verdicts), so every rank builds the same step input."""
        groups = []
        for seq in seqs:
            group_id, batch = read_group_file(self.spool / spool_name(seq))
            verdict = self._triage_batch(group_id, batch)
            if isinstance(verdict, str):
                raise RuntimeError(
                    f"spool group {group_id} (seq {seq}): rank 0 trains it, this rank finds {verdict}"
                )
            groups.append(verdict)
        return groups

    def _triage_batch(self, group_id: str, batch: pa.RecordBatch) -> TrainGroup | str:
        rows, rejected = batch_to_segments(batch)
        return self.triage.verdict(group_id, rows, rejected)


def open_intake(cfg: Config, run: RunDir, start: Start, out: EventSink, version: Callable[[], int]) -> Intake:
    """The spool as this learner reads it, after the position it starts from (`start.cursor`)."""
    triage = Triage(version, cfg.async_.max_staleness, start.vocab_size, start.routing)
    reader = open_spool_reader(cfg, run.spool, after_seq=start.cursor.committed.watermark)
    return Intake(
        reader,
        run.spool,
        start.cursor,
        triage,
        out,
        batch_groups=cfg.learner.batch_groups,
        keep_checkpoints=cfg.learner.keep_checkpoints,
        resumed=start.resumed,
    )
