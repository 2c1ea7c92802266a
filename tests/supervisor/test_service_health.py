"""The gauges alerts read that no event reports: the run directory's free space, the engine fleet's health."""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from pipeline.supervisor.observability import service_health
from pipeline.supervisor.observability.metrics import REGISTRY


def gauge(name: str) -> float | None:
    return REGISTRY.get_sample_value(name)


async def test_the_run_directorys_free_space_is_read_until_the_stop(tmp_path: Path) -> None:
    stopping = asyncio.Event()
    task = asyncio.create_task(service_health.watch_run_dir(tmp_path, stopping, period_s=0.05))
    await asyncio.sleep(0.2)
    usage = os.statvfs(tmp_path)
    free, capacity = gauge("rollwise_run_dir_free_bytes"), gauge("rollwise_run_dir_capacity_bytes")
    assert capacity == usage.f_blocks * usage.f_frsize
    assert free is not None and 0 < free <= capacity
    assert abs(free - usage.f_bavail * usage.f_frsize) < 64 * 2**20  # other writers on the same disk
    stopping.set()
    await asyncio.wait_for(task, 1.0)


async def test_an_unreadable_run_directory_is_logged_once_and_never_stops_the_watch(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    stopping = asyncio.Event()
    with caplog.at_level(logging.WARNING, logger="rollwise.supervisor"):
        task = asyncio.create_task(service_health.watch_run_dir(tmp_path / "gone", stopping, period_s=0.02))
        await asyncio.sleep(0.2)
        assert not task.done()
        stopping.set()
        await asyncio.wait_for(task, 1.0)
    complaints = [r.message for r in caplog.records if "cannot read the free space" in r.message]
    assert len(complaints) == 1 and str(tmp_path / "gone") in complaints[0]


@dataclass
class FakePool:
    members: list[str] = field(default_factory=list)
    healthy_members: list[str] = field(default_factory=list)


@dataclass
class FakeFleet:
    pool: FakePool
    down: list[str] = field(default_factory=list)

    def not_up(self) -> list[str]:
        return self.down


def test_the_fleet_gauges_follow_the_pool_at_each_scrape() -> None:
    fleet = FakeFleet(FakePool(["a", "b", "c"], ["a", "b", "c"]))
    service_health.watch_fleet(fleet)
    assert (gauge("rollwise_engine_pool_members"), gauge("rollwise_engine_pool_ejected")) == (3, 0)
    assert gauge("rollwise_engines_not_up") == 0
    fleet.pool.healthy_members.remove("b")  # ejected after failures
    fleet.down.append("engine-2")  # its process restarts
    assert (gauge("rollwise_engine_pool_ejected"), gauge("rollwise_engines_not_up")) == (1, 1)
