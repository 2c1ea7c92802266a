"""Gauges an operator's alerts need that no event reports: the run directory's free space and the engine
fleet's health (grafana/alerts/rollwise.rules.yml reads them)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from pipeline.supervisor.observability import metrics

log = logging.getLogger("rollwise.supervisor")

DISK_PERIOD_S = 15.0


async def watch_run_dir(path: Path, stopping: asyncio.Event, period_s: float = DISK_PERIOD_S) -> None:
    """rollwise_run_dir_{free,capacity}_bytes every `period_s` until `stopping`. statvfs runs in a thread
    (a hung network mount must not stall the event loop); a failure is logged once and the gauges keep
    their last value."""
    complained = False
    while not stopping.is_set():
        try:
            usage = await asyncio.to_thread(os.statvfs, path)
        except OSError as exc:
            if not complained:
                complained = True
                log.warning("cannot read the free space of %s: %s", path, exc)
        else:
            metrics.RUN_DIR_FREE_BYTES.set(usage.f_bavail * usage.f_frsize)
            metrics.RUN_DIR_CAPACITY_BYTES.set(usage.f_blocks * usage.f_frsize)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stopping.wait(), period_s)


class _Pool(Protocol):
    @property
    def members(self) -> Sequence[object]: ...

    @property
    def healthy_members(self) -> Sequence[object]: ...


class Fleet(Protocol):
    @property
    def pool(self) -> _Pool: ...

    def not_up(self) -> list[str]: ...


def watch_fleet(fleet: Fleet) -> None:
    """The engine gauges read the fleet at each scrape (nothing to keep in step)."""
    metrics.ENGINE_POOL_MEMBERS.set_function(lambda: len(fleet.pool.members))
    metrics.ENGINE_POOL_EJECTED.set_function(
        lambda: len(fleet.pool.members) - len(fleet.pool.healthy_members)
    )
    metrics.ENGINES_NOT_UP.set_function(lambda: len(fleet.not_up()))
