"""The learner process (docs/architecture.md, Contract 5).

    python -m learner.worker --config RUN_DIR/config.toml --run-dir RUN_DIR
    python -m learner.worker --config - --run-dir LEARNER_DIR        (its own run directory)

Loop: tail the spool after the checkpoint's position (learner.spool_cursor), reading up to 2·B groups
ahead and decoding each once -> take them earliest staleness deadline first
(pipeline.contracts.staleness.deadline_key) and triage each (train, or drop and say why: learner.groups)
-> B trainable groups -> Trainer.step -> publish weights every
`sync_every_steps` versions (full weights written on a thread while the next step trains:
learner.background_export) -> checkpoint every `checkpoint_every` steps. It tells the supervisor what
happened as typed events (pipeline.contracts.events), one JSON line each on stdout; logs go to stderr.

Control (stdin): `{"cmd": "stop"}`, SIGTERM or SIGINT -> finish the current step, checkpoint, exit 0;
EOF on stdin (the parent died) -> the same. At run.max_steps it sends `finished`, checkpoints and exits 0.
A second learner on the same run directory waits on `learner.lock` until the first one has exited.

A full or read-only run directory: a checkpoint or weight export the storage refuses
(pipeline.contracts.durable.storage_fault_kind) is retried with a doubling delay (0.5 s to 10 s), each refusal
reported as a `storage` event; training waits meanwhile (nothing is consumed, so the actors pause on
their staleness bound), and a `storage` event with blocked=false says when it went through. A stop
request while blocked gives up the write (the steps since the last checkpoint are redone on restart).
Half-written files are never read: every write is staged under a temporary name and renamed.

Retention: weights/v<k> for the last 3 published versions (older ones are deleted after the next
publish); spool files are deleted once the *oldest retained* checkpoint has consumed them, so falling
back to any checkpoint on disk still finds every group it has not trained on.

Its own run directory (learner.remote.run_dir, a learner on another machine): started with `--config -`, it
reads the resolved config (and the secrets it needs) as the first line on stdin, writes it to its own
run directory, builds the preset there when model.path is unset, reads the spool over Flight
(learner.remote.spool_url) and serves its published versions over HTTP (learner.remote.weights_host/port); its
`ready` and `published` events say where (weights_url), and `ready` carries the preset's digest.
Checkpoints stay on its disk.

Several ranks (learner.distributed.nproc x learner.distributed.nnodes > 1, started by torchrun): rank 0 is
the process described above and the only one that reads stdin, tails the spool or writes events. Before each
collective piece of work it broadcasts a learner.distributed.Command; the other ranks `follow`: they read the
step's groups from the spool themselves, train their share of its rows, and take their part in publishing
(the weights are gathered and written by rank 0) and in the sharded checkpoint. A rank that dies takes the
learner down (torchrun stops the others); the supervisor restarts it from the last checkpoint.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, TextIO, TypeVar

from learner.background_export import BackgroundExport, WeightSnapshot
from learner.distributed import Command, Ranks, follow_launcher, join, leave, quiet_stdout, rank_environment
from learner.groups import TrainGroup, token_staleness, triage_group
from learner.spool_cursor import SpoolCursor
from pipeline.contracts import events, memory_trace, tracing
from pipeline.contracts.config import (
    Config,
    ConfigError,
    config_from_toml,
    load_config,
    reveal,
    set_secret,
    write_resolved,
)
from pipeline.contracts.durable import RefusedWrites, retry_delays
from pipeline.contracts.kernel_caches import bound_kernel_caches
from pipeline.contracts.run_dir import (
    DROPPED_GROUPS_KEY,
    PUBLISHED_VERSION_KEY,
    RunDir,
    acquire_learner_lock,
    append_consumed,
    is_published_dir,
    model_digest,
    prune_weights,
    published_version,
)
from pipeline.contracts.schema import EpisodeSegment, RejectedRow, batch_to_segments
from pipeline.contracts.staleness import deadline_key
from pipeline.transport.readers import open_spool_reader
from pipeline.transport.spool import QuarantinedFile, SpoolItem, read_group_file, spool_name

if TYPE_CHECKING:
    import pyarrow as pa

    from pipeline.transport.weights_http import WeightServerThread

log = logging.getLogger("rollwise.learner")
T = TypeVar("T")

POLL_INTERVAL_S = 0.05
# While rank 0 waits for the spool, the other ranks wait in a broadcast; a `wait` command this often keeps
# it well inside the process group's timeout (minutes: engines may take that long to start).
KEEP_WAITING_S = 30.0


class EventStream:
    """Typed events as JSON lines on a stream, one flush per event (the stdin thread writes too)."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self._lock = threading.Lock()

    def emit(self, event: events.LearnerEvent) -> None:
        line = events.encode(event)
        with self._lock:
            self.stream.write(line + "\n")
            self.stream.flush()


class StopFlag:
    """Set by {"cmd": "stop"}, EOF on stdin or SIGTERM; the training loop checks it between steps."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.reason = ""

    def set(self, reason: str) -> None:
        if not self.event.is_set():
            self.reason = reason
            log.info("stop requested: %s", reason)
        self.event.set()

    def is_set(self) -> bool:
        return self.event.is_set()

    def wait(self, timeout_s: float) -> bool:
        return self.event.wait(timeout_s)


def deliver_signals(signums: Sequence[signal.Signals], on_signal: Callable[[str], None]) -> None:
    """Call `on_signal(name)` from a thread for each of `signums` (call from the main thread).

    Python runs a signal handler in the main thread between two bytecodes, possibly while that thread
    holds a lock the handler needs: `threading.Event.set` on the StopFlag that `Event.wait` holds a
    moment before and after each poll, or logging's. Taking it there deadlocks the learner for good.
    So the handler does nothing; the interpreter's C handler writes the signal number to the wakeup
    fd, and a daemon thread reads it and calls `on_signal` with no lock held.
    """
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)  # set_wakeup_fd requires it: the C handler must never block
    for signum in signums:
        signal.signal(signum, _note_signal)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    wanted = {int(s) for s in signums}

    def relay() -> None:
        while True:
            for number in os.read(read_fd, 64):
                if number in wanted:
                    on_signal(signal.Signals(number).name)

    threading.Thread(target=relay, name="signals", daemon=True).start()


def _note_signal(signum: int, frame: FrameType | None) -> None:
    """Installed so the signal is caught (and written to the wakeup fd) rather than fatal; the work is
    in deliver_signals' thread."""


def watch_stdin(stream: TextIO, stop: StopFlag, out: EventStream) -> None:
    """Thread body: commands on stdin; EOF means the parent is gone."""
    for line in stream:
        line = line.strip()
        if not line:
            continue
        try:
            cmd = json.loads(line).get("cmd")
        except (ValueError, AttributeError):
            out.emit(events.Error(f"unreadable command on stdin: {line[:200]!r}"))
            continue
        if cmd == "stop":
            stop.set("stop command")
        else:
            out.emit(events.Error(f"unknown command {cmd!r} on stdin"))
    stop.set("stdin closed (parent exited)")


class StorageGaveUp(Exception):
    """A write the storage kept refusing was given up because the learner is stopping."""


@dataclass
class _Pending:
    """Groups taken since the last step: the ones to train and every id consumed with them."""

    items: list[tuple[SpoolItem, TrainGroup]] = field(default_factory=list)
    consumed_ids: list[str] = field(default_factory=list)
    dropped: dict[str, str] = field(default_factory=dict)  # group_id -> reason, of consumed_ids


@dataclass(frozen=True)
class _Announcement:
    """What a `published` event says beside the path, taken when the version's weights were."""

    version: int
    probe: list[int]
    logprobs: list[float]
    logprobs_prev: list[float]
    traceparent: str | None


@dataclass(frozen=True)
class _Read:
    """A spool group read ahead and decoded once, waiting to be taken."""

    item: SpoolItem
    rows: list[EpisodeSegment]
    rejected: list[RejectedRow]
    oldest_version: int | None  # of its trainable rows' generated tokens

    @property
    def key(self) -> tuple[int, int]:
        return deadline_key(self.oldest_version, self.item.seq)


def read_ahead(item: SpoolItem) -> _Read:
    rows, rejected = batch_to_segments(item.batch)
    versions = [v for row in rows if row.trainable and (v := row.min_version()) is not None]
    return _Read(item, rows, rejected, min(versions) if versions else None)


class LearnerWorker:
    """State of the learner process; `run()` is the loop described in the module docstring."""

    def __init__(
        self,
        cfg: Config,
        run: RunDir,
        out: EventStream,
        stop: StopFlag,
        ranks: Ranks | None = None,
        *,
        weights_url: str | None = None,
        initial_model_digest: str | None = None,
    ) -> None:
        self.cfg = cfg
        self.run_dir = run
        self.out = out
        self.stop = stop
        self.ranks = ranks
        # With its own run directory: where the supervisor fetches published versions, and the digest
        # of the preset this learner built (both travel in its events).
        self.weights_url = weights_url
        self.initial_model_digest = initial_model_digest
        self.leader = ranks is None or ranks.leader
        self.told_at = time.monotonic()
        self.batch_groups = cfg.learner.batch_groups
        self._setup_model()
        self.reader = open_spool_reader(cfg, run.spool, after_seq=self.consumed_seq)
        # Read ahead: one batch beyond the one being filled, so a group that ran long can be taken before
        # groups admitted after it (learner.spool_cursor); bounded, since each is held decoded in memory.
        self.lookahead_groups = 2 * self.batch_groups
        self.lookahead: list[_Read] = []
        self.refresh = True  # read ahead once per step, and whenever the held groups cannot fill the batch
        self.pending = _Pending()
        self.idle_s = 0.0
        self.last_checkpoint_step = self.trainer.steps
        self.consumed_since_checkpoint: list[str] = []
        self.dropped_since_checkpoint: dict[str, str] = {}
        self.probe: list[int] = []  # the served-policy check's probe (learner.served_probe)
        self.probe_prev: list[float] = []  # its log-probs under the last published version
        # Full weights in one process are written on a thread while the next step trains
        # (learner.background_export); LoRA adapters are small, and several ranks gather collectively.
        self.background: BackgroundExport | None = None
        self.snapshot = WeightSnapshot()
        if cfg.learner.export_in_background and ranks is None and self.lora is None:
            self.background = BackgroundExport()

    # ------------------------------------------------------------------ start-up
    def _setup_model(self) -> None:
        import torch

        from learner.checkpoint import restore
        from learner.checkpoint_state import load_latest_checkpoint
        from learner.policy_setup import build_policy

        cfg = self.cfg
        policy = build_policy(cfg, self.run_dir.initial_model, self.ranks)
        self.trainer, self.tokenizer, self.lora = policy.trainer, policy.tokenizer, policy.lora
        model = self.trainer.model
        embeddings = model.get_input_embeddings()
        self.vocab_size = embeddings.num_embeddings if isinstance(embeddings, torch.nn.Embedding) else None
        moe = self.trainer.moe
        self.routing = (moe.layers, moe.topk, moe.num_experts) if moe is not None else None
        ckpt = load_latest_checkpoint(self.run_dir.checkpoints)
        if self.ranks is not None:
            seen = self.ranks.gather(None if ckpt is None else str(ckpt.path))
            if len(set(seen)) != 1:
                raise RuntimeError(
                    f"the learner's ranks see different latest checkpoints {seen}: every rank must see the "
                    "same run directory (a shared file system across the learner's nodes)"
                )
        self.cursor = SpoolCursor()  # where the spool is consumed up to (learner.spool_cursor)
        self.checkpoint_seqs: collections.deque[int] = collections.deque(maxlen=cfg.learner.keep_checkpoints)
        self.last_published = 0  # written and announced (the checkpoint's record)
        if self.leader:
            append_consumed(self.run_dir.consumed_log, {"restored": ckpt.step if ckpt is not None else 0})
        if ckpt is not None:
            restore(self.trainer, ckpt, adapter=self.lora)
            self.cursor = SpoolCursor(max(0, ckpt.consumed.last_seq), ckpt.consumed.after)
            self.checkpoint_seqs.append(self.consumed_seq)
            self.last_published = published_version(ckpt.path)
            log.info(
                "restored %s: step %d, version %d, consumed through seq %d and %d group(s) after it",
                ckpt.path,
                ckpt.step,
                self.trainer.policy_version,
                self.consumed_seq,
                len(self.cursor.committed.after),
            )
        else:
            log.info(
                "no checkpoint in %s: starting from %s", self.run_dir.checkpoints, self.run_dir.initial_model
            )
        self.last_exported = self.last_published  # written, or being written in the background

    @property
    def version(self) -> int:
        return int(self.trainer.policy_version)

    @property
    def consumed_seq(self) -> int:
        return self.cursor.committed.watermark

    def announce_ready(self) -> None:
        path = self.run_dir.weights_of(self.version)
        if self.version > 0 and not is_published_dir(path):
            # The engines must be able to load the version the learner resumes from. No "published"
            # event: the ready event names the path, and the supervisor has no engines yet.
            self.publish(announce=False)
        self.out.emit(
            events.Ready(
                version=self.version,
                step=self.trainer.steps,
                consumed_seq=self.consumed_seq,
                consumed_after=list(self.cursor.committed.after),
                path=str(path),
                weights_url=self.weights_url,
                initial_model_digest=self.initial_model_digest,
            )
        )

    # ------------------------------------------------------------------ the loop
    def run(self) -> int:
        self.announce_ready()
        max_steps = self.cfg.run.max_steps
        while not self.stop.is_set():
            if self.background is not None:
                self.background.check()
            if max_steps is not None and self.trainer.steps >= max_steps:
                # The one place run.max_steps is checked: exact here, and the daemon stops on this event,
                # so the last version is announced before it.
                if self.background is not None:
                    self.background.wait()
                self.out.emit(events.Finished(step=self.trainer.steps, reason=f"run.max_steps = {max_steps}"))
                self.stop.set("run.max_steps")
                break
            if len(self.pending.items) >= self.batch_groups:
                with tracing.root_span("learner.step", {"rollwise.step": self.trainer.steps + 1}):
                    self.train_step()
                continue
            item = self.next_item()
            if item is None:
                waited = time.monotonic()
                self.stop.wait(POLL_INTERVAL_S)
                self.idle_s += time.monotonic() - waited
                if time.monotonic() - self.told_at > KEEP_WAITING_S:
                    self.tell(Command("wait"))
                continue
            self.take(item)
        if self.background is not None:
            self.background.wait()
        self.checkpoint_if_needed()
        self.tell(Command("stop"))
        log.info(
            "learner stopping (%s) at step %d, version %d", self.stop.reason, self.trainer.steps, self.version
        )
        return 0

    # ------------------------------------------------------------------ several ranks
    def tell(self, command: Command) -> None:
        """Rank 0: have the other ranks (waiting in `follow`) enter the same work. No-op anywhere else."""
        if self.ranks is not None and self.leader:
            self.ranks.broadcast(command)
            self.told_at = time.monotonic()

    def follow(self) -> int:
        """Ranks other than 0: do what rank 0 broadcasts, in its order, until it says stop."""
        assert self.ranks is not None and not self.leader
        while True:
            command = self.ranks.broadcast(Command("wait"))  # rank 0's replaces it
            if command.kind == "train":
                groups = self.read_groups(command.seqs)
                self.prepare_probe(groups)
                self.trainer.step(groups)
            elif command.kind == "publish":
                self.probe = list(command.probe)
                self.publish(announce=bool(self.probe))
            elif command.kind == "checkpoint":
                self.checkpoint()
            elif command.kind == "stop":
                log.info("rank %d stopping at step %d", self.ranks.rank, self.trainer.steps)
                return 0

    def read_groups(self, seqs: Sequence[int]) -> list[TrainGroup]:
        """A step's groups as rank 0 took them: read from the spool and triaged here the same way (same
        files, same learner version, same verdicts), so every rank builds the same step input."""
        groups = []
        for seq in seqs:
            group_id, batch = read_group_file(self.run_dir.spool / spool_name(seq))
            verdict, _ = self.triage(group_id, batch)
            if isinstance(verdict, str):
                raise RuntimeError(
                    f"spool group {group_id} (seq {seq}): rank 0 trains it, this rank finds {verdict}"
                )
            groups.append(verdict)
        return groups

    def next_item(self) -> _Read | None:
        """The waiting group with the earliest staleness deadline among those read ahead.

        The spool is read once per step (each read lists the spool directory, or asks the Flight service)
        and again whenever the held groups cannot complete the batch; a Flight read waits on the
        service for a new group only when nothing is held."""
        room = self.lookahead_groups - len(self.lookahead)
        if room > 0 and (self.refresh or len(self.lookahead) < self.batch_groups - len(self.pending.items)):
            self.refresh = False
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
        if not self.lookahead:
            return None
        first = min(range(len(self.lookahead)), key=lambda k: self.lookahead[k].key)
        return self.lookahead.pop(first)

    def report_quarantined(self, bad: QuarantinedFile) -> None:
        self.out.emit(events.Quarantined(seq=bad.seq, file=bad.file, kind=bad.kind, reason=bad.reason))
        self.cursor.passed(bad.seq)
        self.drop(bad.seq, bad.file, "quarantined")

    def drop(self, seq: int, group_id: str, reason: str) -> None:
        self.out.emit(events.Dropped(seq=seq, group_id=group_id, reason=reason))

    def triage(self, group_id: str, batch: pa.RecordBatch) -> tuple[TrainGroup | str, list[RejectedRow]]:
        """Decode and validate a spool group once: train it (a TrainGroup) or drop it (the reason), at
        this learner's version (learner.groups.triage_group); and the rows that broke the schema."""
        rows, rejected = batch_to_segments(batch)
        return self.verdict(group_id, rows, rejected), rejected

    def verdict(
        self, group_id: str, rows: list[EpisodeSegment], rejected: list[RejectedRow]
    ) -> TrainGroup | str:
        """A decoded group's triage at this learner's version (learner.groups.triage_group)."""
        verdict = triage_group(
            group_id,
            rows,
            learner_version=self.version,
            max_staleness=self.cfg.async_.max_staleness,
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

    def take(self, read: _Read) -> None:
        """Train the group or drop it."""
        item, rejected = read.item, read.rejected
        verdict = self.verdict(item.group_id, read.rows, rejected)
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
            self.drop(item.seq, item.group_id, verdict)
            self.pending.dropped[item.group_id] = verdict
        else:
            self.pending.items.append((item, verdict))

    def train_step(self) -> None:
        started = time.monotonic()
        pending, self.pending = self.pending, _Pending()
        groups = [group for _, group in pending.items]
        version_before = self.version
        self.tell(Command("train", tuple(item.seq for item, _ in pending.items)))
        self.prepare_probe(groups)
        metrics = self.trainer.step(groups)
        updated = self.version != version_before
        self.write_trace(version_before)
        if not updated:
            # Keeps the actors' admission count `accepted = v·B + unconsumed` true.
            for item, _ in pending.items:
                self.drop(item.seq, item.group_id, "no_update")
                pending.dropped[item.group_id] = "no_update"
        self.cursor.commit()
        self.refresh = True
        self.consumed_since_checkpoint.extend(pending.consumed_ids)
        self.dropped_since_checkpoint.update(pending.dropped)
        if updated and self.version - self.last_exported >= self.cfg.async_.sync_every_steps:
            with tracing.span("learner.publish", {"rollwise.policy_version": self.version}):
                self.publish()
        if self.trainer.steps % self.cfg.learner.checkpoint_every == 0:
            self.checkpoint()
        # What waits to be trained: the groups after the watermark, less those consumed out of order.
        depth_groups, depth_bytes = self.reader.depth(self.consumed_seq, consumed=self.cursor.committed.after)
        self.out.emit(
            events.Step(
                step=self.trainer.steps,
                version=self.version,
                groups=len(groups) if updated else 0,
                group_ids=[item.group_id for item, _ in pending.items],
                consumed_seq=self.consumed_seq,
                consumed_after=list(self.cursor.committed.after),
                metrics={k: events.finite_or_none(v) for k, v in metrics.items()},
                staleness=dict(sorted(token_staleness(groups, version_before).items())),
                idle_s=self.idle_s,
                busy_s=time.monotonic() - started,
                spool_read_s=self.reader.take_read_seconds(),
                spool_depth_groups=depth_groups,
                spool_depth_bytes=depth_bytes,
            )
        )
        self.idle_s = 0.0

    def write_trace(self, version_before: int) -> None:
        """The step's traced rows (learner.trace) for `rollwise inspect`; a failed write costs the trace
        of this step, never the step."""
        from learner.trace import trace_batch, write_trace

        rows = self.trainer.tracer.take()
        if not rows:
            return
        step = self.trainer.steps
        try:
            batch = trace_batch(rows, step=step, learner_version=version_before)
            write_trace(self.run_dir.trace, batch, step=step, keep=self.cfg.trace.keep_steps)
        except OSError as exc:
            log.warning("could not write the trace of step %d: %s", step, exc)

    # ------------------------------------------------------------------ publishing and checkpoints
    def durably(self, component: str, directory: Path, write: Callable[[], T]) -> T:
        """`write()`, retried while the storage refuses it (module docstring); StorageGaveUp when a stop
        is requested meanwhile. Errors that are not the storage's propagate at once."""
        delays = retry_delays()
        refusals = RefusedWrites(directory)
        while True:
            try:
                result = write()
            except Exception as exc:
                refusal = refusals.refused(exc)
                if refusal is None:
                    raise
                if refusal.first:
                    log.error(
                        "%s write refused by the storage (%s): %s; retrying", component, refusal.kind, exc
                    )
                fault = events.StorageFault(
                    component, blocked=True, kind=refusal.kind, message=str(exc)[:500]
                )
                self.out.emit(fault)
                if self.stop.wait(next(delays)):
                    raise StorageGaveUp(f"{component}: {refusal.kind}: {exc}") from exc
                continue
            if (recovered := refusals.wrote()) is not None:
                log.warning("%s written after %.1f s of refusals", component, recovered.blocked_s)
                message = f"written after {recovered.blocked_s:.1f} s of refusals"
                self.out.emit(
                    events.StorageFault(component, blocked=False, kind=recovered.kind, message=message)
                )
            return result

    def prepare_probe(self, groups: Sequence[TrainGroup]) -> None:
        """The first step after a publish picks the served-policy check's probe from its groups (the
        start of its longest sequence) and scores it with the weights the engines serve now, before the
        update: the previous version the check compares each engine against. Every rank runs it (under
        FSDP the forward is a collective), on the same groups."""
        if not self.cfg.async_.served_check.enabled or self.version != self.last_exported or not groups:
            return
        from learner.served_probe import probe_ids, probe_logprobs

        self.probe = probe_ids(groups, self.cfg.async_.served_check.probe_tokens)
        self.probe_prev = probe_logprobs(self.trainer.model, self.probe) if self.probe else []

    def publish(self, *, announce: bool = True) -> None:
        """Write `weights/v<version>`: HF weights, or with LoRA the PEFT adapter (serving "adapter") or
        the merged weights (serving "merged"); then announce it with the served-policy probe. With
        `self.background` the write and the announcement happen on its thread (`export_in_background`)."""
        from learner.model import export_weights
        from learner.served_probe import probe_logprobs

        version = self.version
        target = self.run_dir.weights_of(version)
        probe = list(self.probe) if announce else []
        if self.background is not None and announce:
            self.background.wait()  # the previous version first: in order, none skipped
            state = self.snapshot.take(self.trainer.model.state_dict())
            self.last_exported = version
            # Everything taken from the live model is taken now: the next step changes it.
            logprobs = probe_logprobs(self.trainer.model, probe) if probe else []
            prev = list(self.probe_prev)
            announcement = _Announcement(version, probe, logprobs, prev, tracing.traceparent())

            def write() -> Path:
                return export_weights(self.trainer, self.tokenizer, target, version, state_dict=state)

            self.background.start(
                functools.partial(self._export_and_announce, write, announcement), name=f"export-v{version}"
            )
            return
        if self.ranks is None:

            def export() -> Path:
                if self.lora is None:
                    return export_weights(self.trainer, self.tokenizer, target, version)
                if self.cfg.learner.lora.serving == "adapter":
                    return self.lora.publish_adapter(target, version)
                return self.lora.publish_merged(target, self.tokenizer, version)

            try:
                path = self.durably("weights", target.parent, export)
            except StorageGaveUp as exc:
                log.error("version %d not published: %s", version, exc)
                return
        else:
            # One rank cannot retry a collective alone: a storage fault here ends the learner, which
            # the supervisor restarts from its checkpoint. (LoRA runs in one process: config rule.)
            from learner.sharded_checkpoint import export_gathered

            self.tell(Command("publish", probe=tuple(probe)))
            path = export_gathered(self.trainer, self.tokenizer, target, version, self.ranks)
        self.last_published = self.last_exported = version
        # Under FSDP the probe's forward is a collective: every rank runs it with rank 0's ids.
        logprobs = probe_logprobs(self.trainer.model, probe) if probe else []
        if not self.leader:
            return
        if announce:
            prev = self.probe_prev
            self.announce(path, _Announcement(version, probe, logprobs, prev, tracing.traceparent()))
        prune_weights(self.run_dir.weights, version)

    def _export_and_announce(self, write: Callable[[], Path], announcement: _Announcement) -> None:
        """The background thread's job: write the snapshot (retried like any export), then announce it."""
        try:
            path = self.durably("weights", self.run_dir.weights, write)
        except StorageGaveUp as exc:
            log.error("version %d not published: %s", announcement.version, exc)
            return
        self.last_published = announcement.version
        self.announce(path, announcement)
        prune_weights(self.run_dir.weights, announcement.version)

    def announce(self, path: Path, a: _Announcement) -> None:
        from learner.lora import directory_bytes

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

    def checkpoint(self) -> None:
        from learner.checkpoint import save_checkpoint
        from learner.checkpoint_state import ConsumedState

        started = time.monotonic()
        if self.background is not None:
            # The checkpoint records the published version: waiting for the write in flight makes that
            # record exact, so a resumed run's engines start on the version the learner resumes from.
            # It costs one step in checkpoint_every its overlap, beside a checkpoint's larger write.
            self.background.wait()
        consumed = ConsumedState(
            last_seq=self.consumed_seq,
            group_ids=list(self.consumed_since_checkpoint),
            after=list(self.cursor.committed.after),
        )
        extra = {
            # Below the policy version when this one was not due (sync_every_steps) or its write failed.
            PUBLISHED_VERSION_KEY: self.last_published,
            DROPPED_GROUPS_KEY: dict(self.dropped_since_checkpoint),
        }
        keep = self.cfg.learner.keep_checkpoints
        record = {"step": self.trainer.steps, "consumed": dataclasses.asdict(consumed), "extra": extra}
        if self.ranks is None:

            def save() -> Path:
                append_consumed(self.run_dir.consumed_log, record)  # before the commit: the ledger's rule
                return save_checkpoint(
                    self.run_dir.checkpoints,
                    self.trainer,
                    consumed=consumed,
                    extra=extra,
                    keep=keep,
                    tokenizer=self.tokenizer,
                    adapter=self.lora,
                )

            try:
                path = self.durably("checkpoint", self.run_dir.checkpoints, save)
            except StorageGaveUp as exc:
                log.error("step %d not checkpointed (it is redone on restart): %s", self.trainer.steps, exc)
                return
        else:
            from learner.sharded_checkpoint import save_sharded_checkpoint

            if self.leader:
                append_consumed(self.run_dir.consumed_log, record)
            self.tell(Command("checkpoint"))
            path = save_sharded_checkpoint(
                self.run_dir.checkpoints,
                self.trainer,
                consumed=consumed,
                ranks=self.ranks,
                extra=extra,
                keep=keep,
            )
        self.consumed_since_checkpoint = []
        self.dropped_since_checkpoint = {}
        self.last_checkpoint_step = self.trainer.steps
        if not self.leader:
            return
        self.checkpoint_seqs.append(self.consumed_seq)
        self.out.emit(
            events.CheckpointSaved(
                step=self.trainer.steps,
                path=str(path),
                consumed_seq=self.consumed_seq,
                consumed_after=list(self.cursor.committed.after),
                seconds=time.monotonic() - started,
            )
        )
        if len(self.checkpoint_seqs) == self.checkpoint_seqs.maxlen:
            # The oldest checkpoint kept on disk has consumed these; nothing can need them again.
            try:
                self.reader.prune(self.checkpoint_seqs[0])
            except OSError as exc:  # the next checkpoint prunes them (retention.json is written first)
                log.error("pruning consumed spool files failed: %s", exc)

    def checkpoint_if_needed(self) -> None:
        if self.trainer.steps > self.last_checkpoint_step:
            self.checkpoint()


# The first stdin line of a learner started with `--config -` (a learner with its own run directory):
# {"cmd": "config", "toml": <the resolved config, no secrets>, "secrets": {"transport.token": ...}}.
CONFIG_COMMAND = "config"


def receive_config(stream: TextIO) -> Config:
    """The config the supervisor sends as the first line on stdin (`--config -`): the resolved TOML it
    writes into its own run directory, and the secrets this learner needs, which never touch a disk or a
    command line. ConfigError naming what is wrong."""
    line = stream.readline()
    if not line.strip():
        raise ConfigError("--config -: stdin closed before the supervisor sent the config")
    try:
        message = json.loads(line)
    except ValueError as exc:
        raise ConfigError(f"--config -: the first stdin line is not JSON: {exc}") from None
    if not isinstance(message, dict) or message.get("cmd") != CONFIG_COMMAND:
        raise ConfigError(f"--config -: expected a {CONFIG_COMMAND!r} command first, got {line[:80]!r}")
    text, secrets = message.get("toml"), message.get("secrets") or {}
    if not isinstance(text, str) or not isinstance(secrets, dict):
        raise ConfigError("--config -: the config command needs 'toml' (a string) and 'secrets' (an object)")
    cfg = config_from_toml(text, what="the config received on stdin")
    for key, value in secrets.items():
        if not isinstance(value, str):
            raise ConfigError(f"--config -: secret {key} must be a string")
        try:
            set_secret(cfg, str(key), value)
        except (ValueError, AttributeError) as exc:
            raise ConfigError(f"--config -: {exc}") from None
    return cfg


@dataclass
class OwnRunDir:
    """What a learner with its own run directory (learner.remote.run_dir) sets up before it loads the model:
    its copy of the config, the preset (built here, deterministically; its digest goes to the supervisor)
    and the weight server the supervisor fetches published versions from."""

    server: WeightServerThread
    weights_url: str
    initial_model_digest: str | None

    @staticmethod
    def open(cfg: Config, run: RunDir) -> OwnRunDir:
        from learner.model_init import ensure_model
        from pipeline.contracts.config import learner_tls
        from pipeline.contracts.tls import check_files, context_for
        from pipeline.transport.weights_http import WeightServerThread, advertised_url

        write_resolved(cfg, run.root)  # what this learner runs with, secrets left out
        digest = None
        if cfg.model.path is None:
            ensure_model(run.initial_model, preset=cfg.model.preset, seed=cfg.run.seed)
            digest = model_digest(run.initial_model)
        remote = cfg.learner.remote
        tls = learner_tls(cfg)
        check_files(tls, "learner.remote.tls (or tls)")  # paths on this machine: checked here
        context = context_for(remote.weights_host, tls)
        server = WeightServerThread(
            run.weights_of,
            remote.weights_host,
            remote.weights_port,
            reveal(remote.weights_token),
            what="the learner's weight server",
            ssl_context=context,
        )
        port = server.start()
        scheme = "https" if context is not None else "http"
        url = remote.weights_url or advertised_url(remote.weights_host, port, scheme)
        log.info("own run directory %s; published weights served at %s", run.root, url)
        return OwnRunDir(server, url, digest)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m learner.worker", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--config",
        required=True,
        help="resolved config TOML (run_dir/config.toml), or - to receive it as the first line on stdin",
    )
    parser.add_argument("--run-dir", required=True, help="run directory (spool, weights, checkpoints)")
    args = parser.parse_args(list(argv) if argv is not None else None)
    launched = rank_environment()
    rank = launched[0] if launched is not None else 0
    name = "learner" if launched is None or launched[1] == 1 else f"learner[{rank}]"
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format=f"%(asctime)s {name} %(levelname)s %(message)s"
    )
    if launched is not None:
        follow_launcher()
    if rank != 0:
        quiet_stdout()
    memory_trace.start_from_env(name)
    bound_kernel_caches()  # before the first matmul: micro-batches come in ever new token counts
    out = EventStream(sys.stdout)
    stop = StopFlag()

    def on_signal(name: str) -> None:
        if rank == 0:
            stop.set(name)
        else:  # rank 0 decides when to stop (and checkpoints with everyone first)
            log.info("rank %d: %s noted; waiting for rank 0", rank, name)

    # SIGINT too: Ctrl-C reaches the whole process group, and the learner should checkpoint, not die.
    deliver_signals((signal.SIGTERM, signal.SIGINT), on_signal)
    own: OwnRunDir | None = None
    try:
        cfg = receive_config(sys.stdin) if args.config == "-" else load_config(args.config)
        if rank == 0:
            tracing.configure(cfg.tracing, process="learner")
        run = RunDir.at(args.run_dir, cfg.model.path)
        lock_fd = acquire_learner_lock(run) if rank == 0 else None
        if cfg.learner.remote.run_dir is not None and rank == 0:
            own = OwnRunDir.open(cfg, run)
        ranks = join(cfg.learner.world_size, cfg.learner.device)
        if rank == 0:
            threading.Thread(
                target=watch_stdin, args=(sys.stdin, stop, out), name="stdin", daemon=True
            ).start()
        worker = LearnerWorker(
            cfg,
            run,
            out,
            stop,
            ranks,
            weights_url=own.weights_url if own else None,
            initial_model_digest=own.initial_model_digest if own else None,
        )
        try:
            code = worker.run() if worker.leader else worker.follow()
        finally:
            if own is not None:  # the port is free before the next learner may take the lock
                own.server.stop()
            if lock_fd is not None:
                os.close(lock_fd)
        leave(ranks)  # after a failure torchrun ends the other ranks instead
        return code
    except Exception as exc:
        log.exception("learner failed")
        if rank == 0:
            out.emit(events.Error(f"{type(exc).__name__}: {exc}"))
        return 1
    finally:
        if own is not None:
            own.server.stop()
        tracing.shutdown()


if __name__ == "__main__":
    sys.exit(main())
