"""The daemon's periodic status (`{"event": "status", ...}` or the live view's footer): the running totals
of the scheduler and the learner's step book, turned into the last interval's rates by
`progress.status_between`."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable

from pipeline.supervisor.actors.scheduler import GroupScheduler
from pipeline.supervisor.learner_dispatch import StepBook
from pipeline.supervisor.observability.learner_metrics import token_books
from pipeline.supervisor.progress import Progress, Totals, status_between

STATUS_INTERVAL_S = 5.0


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
    ) -> None:
        self.progress = progress
        self.book = book
        self.version = version
        self.scheduler = scheduler  # None until the children are ready
        self.started_at = started_at
        self.interval_s = interval_s

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
        totals = self.totals()
        while True:
            await asyncio.sleep(self.interval_s)
            totals = self.report(since=totals)

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
            status = dataclasses.replace(status, groups_running=sched.running, groups_accepted=sched.accepted)
        generated, wasted = token_books()
        status = dataclasses.replace(status, generated_tokens=generated, wasted_tokens=wasted)
        self.progress.on_status(status)
        return now
