"""The daemon's answer to each learner event (docs/architecture.md, Contract 5's table), in one place.

`LearnerEvents.handle` is the learner child's `on_event`: versions go to the `Lineage` (sync the engines),
dropped groups give admission its slot back, steps feed Prometheus, the step log and the status line,
storage faults and quarantined files become metrics and messages, and `finished` stops the daemon.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from pipeline.contracts import events, tracing
from pipeline.contracts.run_dir import RunDir
from pipeline.supervisor.lineage import Lineage
from pipeline.supervisor.observability import learner_metrics, metrics
from pipeline.supervisor.progress import Progress
from pipeline.supervisor.run_logs import JsonLinesLog

log = logging.getLogger("rollwise.supervisor")


class StepTracker(Protocol):
    """Where the learner's steps go besides Prometheus (pipeline.supervisor.observability.trackers)."""

    def log_step(self, event: events.Step) -> None: ...


class SchedulerSide(Protocol):
    """What the scheduler hears of the learner: a dropped group gives its admission slot back, and each
    step's version and spool position say which running groups are at their last chance (late_cut)."""

    def on_dropped(self, count: int) -> None: ...

    def on_learner_step(self, version: int, consumed_groups: int) -> None: ...


@dataclass
class StepBook:
    """What the status line shows of the learner: its step and step time, the rewards of the steps since
    the last status line, the staleness of the tokens trained so far, the spool's depth."""

    step: int = 0
    last_step_time_s: float | None = None
    rewards: list[float] = field(default_factory=list)
    staleness_sum: float = 0.0  # versions behind, summed over trained tokens
    staleness_tokens: int = 0
    spool_depth_groups: int = 0

    def record(self, event: events.Step) -> None:
        self.step = event.step
        self.last_step_time_s = event.metric("step_time_s")
        if (reward := event.metric("reward_mean")) is not None:
            self.rewards.append(reward)
        self.staleness_sum += sum(lag * tokens for lag, tokens in event.staleness.items())
        self.staleness_tokens += sum(event.staleness.values())
        self.spool_depth_groups = event.spool_depth_groups

    def take_rewards(self) -> list[float]:
        rewards, self.rewards = self.rewards, []
        return rewards


class StepLog:
    """logs/steps.jsonl, the run's own learning curve (`rollwise report --run-dir` reads it without
    Prometheus); run_logs says what a refused write costs."""

    def __init__(self, run_dir: RunDir) -> None:
        self.lines = JsonLinesLog(run_dir.step_log, "step_log")
        self.path = run_dir.step_log

    def open(self) -> None:
        self.lines.open()

    def append(self, event: events.Step) -> None:
        self.lines.append(events.encode(event))

    def close(self) -> None:
        self.lines.close()


def step_line(event: events.Step) -> dict[str, Any]:
    """A step as the progress view shows it: the step's metrics beside its counts, one level deep."""
    fields = {k: v for k, v in dataclasses.asdict(event).items() if k != "metrics"}
    fields["staleness"] = {str(k): v for k, v in event.staleness.items()}
    return {**event.metrics, **fields}


class LearnerEvents:
    """`request_stop(why)` stops the daemon; `attach(scheduler)` once the scheduler runs (drops announced
    before it existed are counted and handed over then)."""

    def __init__(
        self,
        lineage: Lineage,
        progress: Progress,
        step_log: StepLog,
        *,
        request_stop: Callable[[str], None],
        trackers: StepTracker | None = None,
    ) -> None:
        self.lineage = lineage
        self.trackers = trackers  # experiment trackers (observability/trackers.py), None when all are off
        self.progress = progress
        self.step_log = step_log
        self.request_stop = request_stop
        self.book = StepBook()
        self.dropped_seqs: set[int] = set()
        self.drops_unclaimed = 0  # dropped groups announced before the scheduler existed
        self.scheduler: SchedulerSide | None = None
        self.storage_blocked: set[str] = set()  # learner components waiting for the run directory

    def attach(self, scheduler: SchedulerSide) -> int:
        """From now on dropped groups go to `scheduler`; returns those announced before it existed."""
        self.scheduler = scheduler
        unclaimed, self.drops_unclaimed = self.drops_unclaimed, 0
        return unclaimed

    async def handle(self, event: events.LearnerEvent) -> None:
        match event:
            case events.Step():
                self.on_step(event)
            case events.Published():
                # The learner's publish span goes on here: sync and served check are its children.
                attributes = {"rollwise.policy_version": event.version}
                with tracing.span("publish", attributes, traceparent=event.traceparent):
                    tracing.remember_version(event.version)
                    await self.lineage.on_published(event)
            case events.Dropped():
                self.on_dropped(event.seq, event.reason, event.tokens)
            case events.Ready():
                self.book.step = event.step
                metrics.LEARNER_STEP.set(event.step)
                # The first ready event comes before the scheduler; later ones are a learner restarted alone.
                await self.lineage.on_ready(event, restarted=self.scheduler is not None)
            case events.Finished():
                self.request_stop(f"the learner finished: {event.reason}")
            case events.CheckpointSaved():
                learner_metrics.record_checkpoint(event)
            case events.StorageFault():
                self.on_storage_fault(event)
            case events.Quarantined():
                learner_metrics.record_quarantined(event)
                self.progress.message(f"spool file quarantined: {event.file}: {event.reason}")
            case events.Unreachable():
                (log.warning if event.blocked else log.info)("learner: %s", event.message)
                self.progress.message(f"learner: {event.message}")
            case events.Error():
                self.progress.message(f"learner error: {event.message}")

    def on_step(self, event: events.Step) -> None:
        learner_metrics.record_step(event)
        self.step_log.append(event)
        self.book.record(event)
        self.progress.on_step(step_line(event))
        if self.trackers is not None:
            self.trackers.log_step(event)
        if self.scheduler is not None:
            self.scheduler.on_learner_step(event.version, event.consumed_seq + len(event.consumed_after))

    def on_dropped(self, seq: int, reason: str, tokens: int = 0) -> None:
        """A written group the learner will never train: admission gets its slot back, its `tokens` count
        as waste. Deduplicated by spool sequence number, because a restarted learner re-reads the groups
        after its checkpoint."""
        if seq in self.dropped_seqs:
            return
        self.dropped_seqs.add(seq)
        learner_metrics.record_dropped(reason, tokens)
        if self.scheduler is not None:
            self.scheduler.on_dropped(1)
        else:
            self.drops_unclaimed += 1

    def on_storage_fault(self, event: events.StorageFault) -> None:
        """The learner's checkpoint or weight export was refused by the storage (it holds its work and
        retries), or goes through again."""
        component = event.component
        if event.blocked:
            metrics.STORAGE_ERRORS.labels(component=component, kind=event.kind).inc()
            if component not in self.storage_blocked:
                self.storage_blocked.add(component)
                metrics.STORAGE_BLOCKED.labels(component=component).set(1)
                self.progress.message(f"learner {component} write refused ({event.kind}): {event.message}")
        elif component in self.storage_blocked:
            self.storage_blocked.discard(component)
            metrics.STORAGE_BLOCKED.labels(component=component).set(0)
            self.progress.message(f"learner {component} writable again: {event.message}")
