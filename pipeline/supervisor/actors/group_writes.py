"""Making a finished group durable: its Arrow batch written to the spool in a thread.

A write the storage refuses (the run directory is full or read-only:
pipeline.contracts.durable.storage_fault_kind) is retried with a doubling delay (`retry_s` = (first,
longest)) while the finished group waits in memory; meanwhile `blocked` is true and the scheduler admits
nothing new, so production pauses, nothing finished is lost, and the run goes on by itself when space
returns. Each refused write counts in rollwise_storage_errors_total{component="spool"};
rollwise_storage_blocked{component="spool"} is 1 meanwhile, and `notify` gets one line when the outage
starts and one when it ends. Any other failure of a write propagates (the group is lost)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import pyarrow as pa

from pipeline.contracts.durable import RefusedWrites, retry_delays
from pipeline.supervisor.observability import metrics
from pipeline.transport.spool import SpoolEntry, SpoolWriter

log = logging.getLogger(__name__)


class GroupWriter:
    """Writes groups to `spool`, retrying refused writes; `on_writable` runs when writes go through again."""

    def __init__(
        self,
        spool: SpoolWriter,
        retry_s: tuple[float, float],
        notify: Callable[[str], None],
        on_writable: Callable[[], None],
    ) -> None:
        self.spool = spool
        self.retry_s = retry_s
        self.notify = notify
        self.on_writable = on_writable
        self.refusals = RefusedWrites(spool.spool_dir)

    @property
    def blocked(self) -> bool:
        """The spool refuses writes (a full or read-only run directory)."""
        return self.refusals.blocked

    async def write(self, batch: pa.RecordBatch, group_id: str) -> SpoolEntry:
        delays = retry_delays(*self.retry_s)
        while True:
            try:
                entry = await asyncio.to_thread(self.spool.write_group, batch, group_id=group_id)
                metrics.SPOOL_WRITE_LATENCY.observe(entry.write_s)
                metrics.GROUPS_WRITTEN.inc()
            except Exception as exc:
                if not self._refused(exc):
                    raise
                await asyncio.sleep(next(delays))
                continue
            if (recovered := self.refusals.wrote()) is not None:
                metrics.STORAGE_BLOCKED.labels(component="spool").set(0)
                text = f"spool writable again after {recovered.blocked_s:.1f} s; admission resumes"
                log.warning("%s", text)
                self.notify(text)
                self.on_writable()
            return entry

    def _refused(self, exc: Exception) -> bool:
        """Count a refused write (announcing the first of an outage); False when the storage is not its
        cause."""
        refusal = self.refusals.refused(exc)
        if refusal is None:
            return False
        metrics.STORAGE_ERRORS.labels(component="spool", kind=refusal.kind).inc()
        if refusal.first:
            metrics.STORAGE_BLOCKED.labels(component="spool").set(1)
            text = (
                f"spool write refused ({refusal.kind}: {exc}); finished groups wait in memory and "
                f"admission is paused until {self.spool.spool_dir} takes writes again"
            )
            log.error("%s", text)
            self.notify(text)
        return True


async def finish_writes(
    writes: list[asyncio.Future[SpoolEntry]], grace_s: float, blocked: Callable[[], bool]
) -> None:
    """Wait for pending writes at shutdown; those the storage still refuses after `grace_s` (`blocked()`
    true then) are given up, and their groups lost."""
    _, stuck = await asyncio.wait(writes, timeout=grace_s)
    if stuck and blocked():
        for write in stuck:
            write.cancel()
        log.error(
            "%d finished group(s) lost at shutdown: the spool refused their writes for the whole grace "
            "period (%.0f s)",
            len(stuck),
            grace_s,
        )
    await asyncio.gather(*writes, return_exceptions=True)
