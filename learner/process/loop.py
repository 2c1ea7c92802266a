"""The learner's loop (docs/architecture.md, Contract 5): take groups from the spool (learner.process.intake)
until B are trainable -> Trainer.step -> publish every `sync_every_steps` versions
(learner.process.publisher) -> checkpoint every `checkpoint_every` steps (learner.process.checkpointer)
-> a `step` event. It stops between steps when the StopFlag is set, and at run.max_steps (a `finished`
event), checkpointing what was trained since the last checkpoint.

With several ranks rank 0 runs this loop and tells the others (learner.process.group) before each piece
of collective work; they `follow`: they read the step's groups from the spool themselves, train their
share of its rows, and take their part in publishing and in the sharded checkpoint.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

from learner.distributed import Command
from learner.groups import token_staleness, token_staleness_split
from learner.process.checkpointer import choose_checkpointer
from learner.process.group import Group, OneProcess
from learner.process.intake import Pending, open_intake
from learner.process.publisher import Announcer, ServedProbe, choose_publisher
from learner.process.startup import start_policy
from learner.process.storage import DurableWriter, EventSink
from pipeline.contracts import events, tracing
from pipeline.contracts.config import Config
from pipeline.contracts.core_lease import open_lease, time_shared
from pipeline.contracts.run_dir import DROPPED_GROUPS_KEY, PUBLISHED_VERSION_KEY, RunDir, is_published_dir
from pipeline.contracts.staleness import written_at

log = logging.getLogger("rollwise.learner")

POLL_INTERVAL_S = 0.05


class Stop(Protocol):
    reason: str

    def set(self, reason: str) -> None: ...

    def is_set(self) -> bool: ...

    def wait(self, timeout_s: float) -> bool: ...


class LearnerWorker:
    """The learner process's state; `run()` is rank 0's loop, `follow()` the other ranks'."""

    def __init__(
        self,
        cfg: Config,
        run: RunDir,
        out: EventSink,
        stop: Stop,
        group: Group | None = None,
        *,
        weights_url: str | None = None,
        initial_model_digest: str | None = None,
    ) -> None:
        self.cfg, self.run_dir, self.out, self.stop = cfg, run, out, stop
        self.group = group if group is not None else OneProcess()
        self.weights_url = weights_url  # with its own run directory: where versions are fetched from
        self.initial_model_digest = initial_model_digest  # and the digest of the preset it built
        start = start_policy(cfg, run, self.group)
        self.trainer = start.trainer
        self.intake = open_intake(cfg, run, start, out, lambda: self.version)
        check = cfg.async_.served_check
        self.probe = ServedProbe(self.trainer.model, check.probe_tokens if check.enabled else None)
        writes = DurableWriter(out, stop)
        announcer = Announcer(out, run.weights, weights_url)
        self.publisher = choose_publisher(
            cfg.learner, start, self.group, self.probe, announcer, writes, run.weights_of
        )
        self.checkpointer = choose_checkpointer(run, start, cfg.learner.keep_checkpoints, self.group, writes)
        self.idle_s = 0.0
        self.lease = open_lease(run.core_lease if time_shared(cfg) else None)  # held while computing
        self.lease.release()  # a learner killed mid-step left it held, and the engines waiting
        self.last_checkpoint_step = self.trainer.steps
        self.consumed_since_checkpoint: list[str] = []
        self.dropped_since_checkpoint: dict[str, str] = {}

    @property
    def version(self) -> int:
        return int(self.trainer.policy_version)

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
                consumed_seq=self.intake.consumed_seq,
                consumed_after=self.intake.consumed_after,
                path=str(path),
                weights_url=self.weights_url,
                initial_model_digest=self.initial_model_digest,
            )
        )

    # ------------------------------------------------------------------ the loop
    def run(self) -> int:
        self.announce_ready()
        while not self.stop.is_set():
            self.publisher.check()
            if self.at_max_steps():
                break
            if self.intake.batch_ready:
                with (
                    self.lease.holding(),
                    tracing.root_span("learner.step", {"rollwise.step": self.trainer.steps + 1}),
                ):
                    self.train_step()
                continue
            read = self.intake.next_item()
            if read is not None:
                self.intake.take(read)
                continue
            waited = time.monotonic()
            self.stop.wait(POLL_INTERVAL_S)
            self.idle_s += time.monotonic() - waited
            self.group.keep_waiting()
        self.publisher.wait()
        self.checkpoint_if_needed()
        self.group.tell(Command("stop"))
        log.info(
            "learner stopping (%s) at step %d, version %d", self.stop.reason, self.trainer.steps, self.version
        )
        return 0

    def at_max_steps(self) -> bool:
        """The one place run.max_steps is checked: exact here, and the supervisor stops on the `finished`
        event, so the last version is announced before it."""
        max_steps = self.cfg.run.max_steps
        if max_steps is None or self.trainer.steps < max_steps:
            return False
        self.publisher.wait()
        self.out.emit(events.Finished(step=self.trainer.steps, reason=f"run.max_steps = {max_steps}"))
        self.stop.set("run.max_steps")
        return True

    def follow(self) -> int:
        """Ranks other than 0: do what rank 0 tells, in its order, until it says stop."""
        while True:
            command = self.group.listen()
            if command.kind == "train":
                groups = self.intake.read_groups(command.seqs)
                self.probe.prepare(groups, due=self.version == self.publisher.last_exported)
                self.trainer.step(groups)
            elif command.kind == "publish":
                self.probe.ids = list(command.probe)
                self.publish(announce=bool(self.probe.ids))
            elif command.kind == "checkpoint":
                self.checkpoint()
            elif command.kind == "stop":
                log.info("rank %d stopping at step %d", self.group.rank, self.trainer.steps)
                return 0

    def train_step(self) -> None:
        started = time.monotonic()
        pending = self.intake.take_pending()
        groups = [group for _, group in pending.items]
        version_before = self.version
        self.group.tell(Command("train", tuple(item.seq for item, _ in pending.items)))
        self.probe.prepare(groups, due=version_before == self.publisher.last_exported)
        metrics = self.trainer.step(groups)
        updated = self.version != version_before
        self.write_trace(version_before)
        self.intake.commit(pending, updated=updated)
        self.consumed_since_checkpoint.extend(pending.consumed_ids)
        self.dropped_since_checkpoint.update(pending.dropped)
        if updated and self.version - self.publisher.last_exported >= self.cfg.async_.sync_every_steps:
            with tracing.span("learner.publish", {"rollwise.policy_version": self.version}):
                self.publish()
        if self.trainer.steps % self.cfg.learner.checkpoint_every == 0:
            self.checkpoint()
        self.out.emit(self.step_event(pending, metrics, version_before, updated, time.monotonic() - started))
        self.idle_s = 0.0

    def step_event(
        self, pending: Pending, metrics: dict[str, float], version_before: int, updated: bool, busy_s: float
    ) -> events.Step:
        groups = [group for _, group in pending.items]
        written = [(group, written_at(item.batch.schema.metadata)) for item, group in pending.items]
        in_flight, in_queue = token_staleness_split(written, version_before)
        depth_groups, depth_bytes = self.intake.depth()
        return events.Step(
            step=self.trainer.steps,
            version=self.version,
            groups=len(groups) if updated else 0,
            group_ids=[item.group_id for item, _ in pending.items],
            consumed_seq=self.intake.consumed_seq,
            consumed_after=self.intake.consumed_after,
            metrics={k: events.finite_or_none(v) for k, v in metrics.items()},
            staleness=dict(sorted(token_staleness(groups, version_before).items())),
            idle_s=self.idle_s,
            busy_s=busy_s,
            spool_read_s=self.intake.reader.take_read_seconds(),
            spool_depth_groups=depth_groups,
            spool_depth_bytes=depth_bytes,
            staleness_in_flight=dict(sorted(in_flight.items())),
            staleness_in_queue=dict(sorted(in_queue.items())),
        )

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
    def publish(self, *, announce: bool = True) -> None:
        """Publish the current version (learner.process.publisher); without `announce` only write it."""
        probe = tuple(self.probe.ids) if announce else ()
        self.group.tell(Command("publish", probe=probe))
        self.publisher.publish(self.version, announce=announce)

    def checkpoint(self) -> None:
        started = time.monotonic()
        # The checkpoint records the published version: waiting for a write in flight makes that record
        # exact, so a resumed run's engines start on the version the learner resumes from.
        self.publisher.wait()
        consumed = self.intake.consumed_state(self.consumed_since_checkpoint)
        extra = {
            # Below the policy version when this one was not due (sync_every_steps) or its write failed.
            PUBLISHED_VERSION_KEY: self.publisher.last_published,
            DROPPED_GROUPS_KEY: dict(self.dropped_since_checkpoint),
        }
        self.group.tell(Command("checkpoint"))
        path = self.checkpointer.save(consumed, extra)
        if path is None:
            return
        self.consumed_since_checkpoint, self.dropped_since_checkpoint = [], {}
        self.last_checkpoint_step = self.trainer.steps
        if not self.group.leader:
            return
        self.out.emit(
            events.CheckpointSaved(
                step=self.trainer.steps,
                path=str(path),
                consumed_seq=self.intake.consumed_seq,
                consumed_after=self.intake.consumed_after,
                seconds=time.monotonic() - started,
            )
        )
        self.intake.checkpointed()

    def checkpoint_if_needed(self) -> None:
        if self.trainer.steps > self.last_checkpoint_step:
            self.checkpoint()
