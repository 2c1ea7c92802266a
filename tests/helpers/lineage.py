"""A `Lineage` over real engine clients, for tests of how versions reach the engines: the engines are
external URLs (usually a tests.fakes SGLang fake), the versions they were told about are collected."""

from __future__ import annotations

import asyncio
import io
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.contracts.config import load_config
from pipeline.contracts.run_dir import RunDir
from pipeline.supervisor.fleet.engine_fleet import EngineFleet
from pipeline.supervisor.lineage import Lineage
from pipeline.supervisor.progress import JsonProgress


@dataclass
class LineageUnderTest:
    lineage: Lineage
    fleet: EngineFleet
    run_dir: RunDir
    served: list[int] = field(default_factory=list)  # every version on_served was told, in order
    failures: list[str] = field(default_factory=list)
    progress: io.StringIO = field(default_factory=io.StringIO)

    async def close(self) -> None:
        await self.lineage.stop()
        await self.fleet.pool.close()


def lineage_for(engine_urls: list[str], run_root: Path, overrides: Sequence[str] = ()) -> LineageUnderTest:
    urls = ", ".join(f'"{url}"' for url in engine_urls)
    cfg = load_config(None, ['engine.kind="external"', f"engine.urls=[{urls}]", *overrides])
    run_dir = RunDir.at(run_root)
    stopping = asyncio.Event()
    out = io.StringIO()
    holder: list[Lineage] = []
    failures: list[str] = []
    fleet = EngineFleet(
        cfg, run_dir, stopping, served_version=lambda: holder[0].version, fail=failures.append
    )
    served: list[int] = []
    lineage = Lineage(
        cfg,
        run_dir,
        fleet,
        None,
        JsonProgress(out),
        stopping=stopping,
        fail=failures.append,
        on_served=served.append,
        mirror_retry_s=(0.05, 0.2),
    )
    holder.append(lineage)
    return LineageUnderTest(lineage, fleet, run_dir, served, failures, out)
