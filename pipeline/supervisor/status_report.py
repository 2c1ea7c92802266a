"""The daemon's periodic status (`{"event": "status", ...}` or the live view's footer): the running totals
of the scheduler and the learner's step book, turned into the last interval's rates by
`progress.status_between`. With a run directory each status is also appended to logs/status.jsonl and
the metrics snapshot logs/metrics.prom is replaced (run_logs)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import asdict

from pipeline.contracts.run_dir import RunDir
from pipeline.supervisor.actors.scheduler import GroupScheduler
from pipeline.supervisor.learner_dispatch import StepBook
from pipeline.supervisor.observability import metrics
from pipeline.supervisor.observability.learner_metrics import token_books
from pipeline.supervisor.progress import Progress, Totals, status_between
from pipeline.supervisor.run_logs import JsonLinesLog, write_metrics_snapshot

STATUS_INTERVAL_S = 5.0
STATUS_LOG, METRICS_SNAPSHOT = "status.jsonl", "metrics.prom"


class StatusReport:
    def __init__(
        self,
        progress: Progress,
        book: StepBook,
        *,
        version: Callable[[], int],
        scheduler: Callable[[], GroupScheduler | None],
        started_at: float,
        interval_s: float = STATUS_INTERVAL_S,
        run_dir: RunDir | None = None,
    ) -> None:
        self.progress = progress
        self.book = book
        self.version = version
        self.scheduler = scheduler  # None until the children are ready
        self.started_at = started_at
        self.interval_s = interval_s
        self._since: Totals | None = None  # where the next interval starts; None before run()
        self.log = None if run_dir is None else JsonLinesLog(run_dir.logs / STATUS_LOG, "status_log")
        self.snapshot = None if run_dir is None else run_dir.logs / METRICS_SNAPSHOT

    def totals(self) -> Totals:
        sched = self.scheduler()
        return Totals(
            at=time.monotonic(),
            episodes=sched.episodes_finished if sched is not None else 0,
            successes=sched.episodes_succeeded if sched is not None else 0,
            staleness_sum=self.book.staleness_sum,
            staleness_count=self.book.staleness_tokens,
            spool_depth_groups=self.book.spool_depth_groups,
        )

    async def run(self) -> None:
        self._since = self.totals()
        if self.log is not None:
            self.log.open()
        try:
            while True:
                await asyncio.sleep(self.interval_s)
                self._since = self.report(since=self._since)
        finally:
            if self.log is not None:
                self.log.close()  # final() reopens it for its one line

    def final(self) -> None:
        """One more status at shutdown, after the drain: the run's last books, where every generated token
        is trained, waste by cause, or (a group the spool still holds) waiting for the next start."""
        if self._since is None:
            return
        if self.log is not None:
            self.log.open()
        self._since = self.report(since=self._since)
        if self.log is not None:
            self.log.close()

    def report(self, since: Totals) -> Totals:
        """Show the status of the interval since `since`; returns the totals the next interval starts from."""
        now = self.totals()
        status = status_between(
            since,
            now,
            elapsed_s=time.monotonic() - self.started_at,
            version=self.version(),
            step=self.book.step,
            step_time_s=self.book.last_step_time_s,
            step_rewards=self.book.take_rewards(),
        )
        sched = self.scheduler()
        if sched is not None:
            status = dataclasses.replace(
                status,
                groups_running=sched.running,
                groups_accepted=sched.accepted,
                groups_dropped_in_flight=sched.dropped_in_flight,
            )
        generated, wasted = token_books()
        no_signal = int(metrics.REGISTRY.get_sample_value("rollwise_generated_tokens_no_signal_total") or 0)
        status = dataclasses.replace(
            status, generated_tokens=generated, wasted_tokens=wasted, no_signal_tokens=no_signal
        )
        self.progress.on_status(status)
        if self.log is not None and self.log.wanted:
            self.log.append(json.dumps({"event": "status", "time": round(time.time(), 3), **asdict(status)}))
        if self.snapshot is not None:
            write_metrics_snapshot(self.snapshot)
        return now
