"""How many groups may run at once: a fixed number, or a limit that follows the engines' load.

`rollout.concurrency = "adaptive"` (the default) runs an additive-increase / multiplicative-decrease
controller between a floor of B groups (a step's worth: fewer could starve the learner) and the ceiling
`rollout.max_concurrent_groups`. Every `interval_s` it reads each engine's /get_load:
- a reading where no engine is queued raises the limit by one group;
- two readings in a row where some engine is queued halve it (never below the floor): the engines hold
  more than they run, so more groups in flight only lengthen every group (and age its tokens) without
  generating faster.
An engine is queued when more requests wait than it has free slots (`EngineLoad.queued`, with its
max_running_requests): a request that arrived since the engine's last scheduling step waits too, with
slots free, and that is no sign of load.
The limit starts at the ceiling (where a fixed limit stays), so a fleet that keeps up runs as it did
with a fixed one; it falls where the engines cannot. `"fixed"` keeps the ceiling. Either is chosen once
at start-up (`concurrency_limit`); the scheduler sees only its limit, given through
`GroupScheduler.set_max_concurrent`, and the limit is exported as rollwise_admission_concurrency_limit.

An engine that does not answer /get_load (a reading fails) leaves the limit where it is: a failing engine
is the fleet's to eject, not a signal about load.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

from pipeline.contracts.config_sections import RolloutConfig
from pipeline.supervisor.engines.client import EngineClient
from pipeline.supervisor.engines.engine_load import EngineLoad
from pipeline.supervisor.engines.pool import EnginePool
from pipeline.supervisor.engines.protocol import EngineError
from pipeline.supervisor.observability import metrics

log = logging.getLogger(__name__)

QUEUED_READINGS_TO_DECREASE = 2


@dataclass
class Aimd:
    """The controller's state (pure): `limit` between `floor` and `ceiling`."""

    floor: int
    ceiling: int
    limit: int
    queued_readings: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.floor <= self.ceiling:
            raise ValueError(f"concurrency floor {self.floor} must be in [1, ceiling {self.ceiling}]")
        self.limit = min(max(self.limit, self.floor), self.ceiling)

    def update(self, loads: Sequence[EngineLoad]) -> int:
        """One reading of every engine: the new limit (module docstring)."""
        if any(load.queued for load in loads):
            self.queued_readings += 1
            if self.queued_readings >= QUEUED_READINGS_TO_DECREASE:
                self.limit = max(self.floor, self.limit // 2)
                self.queued_readings = 0
        else:
            self.queued_readings = 0
            self.limit = min(self.ceiling, self.limit + 1)
        return self.limit

    def set_ceiling(self, ceiling: int) -> int:
        """The fleet grew or shrank: a new ceiling (at least the floor), the limit clamped to it."""
        self.ceiling = max(self.floor, ceiling)
        self.limit = min(self.limit, self.ceiling)
        return self.limit


class ConcurrencyLimit:
    """A fixed limit: the ceiling, always; `apply` hears it at start and when the fleet changes it."""

    def __init__(self, ceiling: int, apply: Callable[[int], None]) -> None:
        self.limit = ceiling
        self.apply = apply

    def set_ceiling(self, ceiling: int) -> None:
        self._set(ceiling)

    def _set(self, limit: int) -> None:
        self.limit = limit
        self.apply(limit)
        metrics.ADMISSION_CONCURRENCY_LIMIT.set(limit)

    async def run(self, stop: asyncio.Event) -> None:
        self._set(self.limit)


class AdaptiveLimit(ConcurrencyLimit):
    """The AIMD controller's task: reads the engines' load every `interval_s` and tells `apply` each new
    limit."""

    def __init__(
        self,
        state: Aimd,
        read_loads: Callable[[], Awaitable[list[EngineLoad]]],
        apply: Callable[[int], None],
        interval_s: float,
    ) -> None:
        super().__init__(state.limit, apply)
        self.state = state
        self.read_loads = read_loads
        self.interval_s = interval_s

    def set_ceiling(self, ceiling: int) -> None:
        self._set(self.state.set_ceiling(ceiling))

    async def run(self, stop: asyncio.Event) -> None:
        self._set(self.limit)
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=self.interval_s)
                return
            except TimeoutError:
                pass
            try:
                loads = await self.read_loads()
            except EngineError as exc:
                log.debug("concurrency: an engine's load could not be read (%s); the limit stays", exc)
                continue
            if (limit := self.state.update(loads)) != self.limit:
                (log.info if limit < self.limit else log.debug)(
                    "concurrency: up to %d groups at once (engines' queues: %s)", limit, _queues(loads)
                )
                self._set(limit)


def _queues(loads: Sequence[EngineLoad]) -> str:
    return ", ".join(f"{load.waiting} waiting of {load.requests}" for load in loads)


def concurrency_limit(
    rollout: RolloutConfig,
    batch_groups: int,
    pool: EnginePool,
    capacity: Mapping[str, int],
    apply: Callable[[int], None],
) -> ConcurrencyLimit:
    """The limit `rollout.concurrency` chooses, once at start-up; `apply` is the scheduler's
    `set_max_concurrent`. The adaptive one reads every engine of `pool` that is not ejected, each with
    its max_running_requests from `capacity` (engine URL -> requests; the fleet's)."""
    ceiling = rollout.max_concurrent_groups
    if rollout.concurrency == "fixed":
        return ConcurrencyLimit(ceiling, apply)

    async def read(client: EngineClient) -> EngineLoad:
        return dataclasses.replace(await client.load_detail(), capacity=capacity.get(client.base_url))

    async def read_loads() -> list[EngineLoad]:
        return list(await asyncio.gather(*(read(client) for client in pool.healthy_members)))

    state = Aimd(floor=min(batch_groups, ceiling), ceiling=ceiling, limit=ceiling)
    return AdaptiveLimit(state, read_loads, apply, rollout.concurrency_interval_s)
