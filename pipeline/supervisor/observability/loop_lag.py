"""How late the supervisor's event loop runs: a blocked loop shows up here first."""

from __future__ import annotations

import asyncio

from pipeline.supervisor.observability import metrics

LOOP_LAG_PERIOD_S = 0.1


async def measure_loop_lag(stopping: asyncio.Event) -> None:
    """How late a 100 ms timer fires: a blocked event loop shows up here first. Once a second it also
    counts the loop's tasks (a leak of tasks is a leak of memory a soak would find hours later)."""
    loop = asyncio.get_running_loop()
    ticks = 0
    while not stopping.is_set():
        started = loop.time()
        await asyncio.sleep(LOOP_LAG_PERIOD_S)
        metrics.EVENT_LOOP_LAG.observe(max(0.0, loop.time() - started - LOOP_LAG_PERIOD_S))
        ticks += 1
        if ticks % 10 == 0:
            metrics.SUPERVISOR_TASKS.set(len(asyncio.all_tasks(loop)))
