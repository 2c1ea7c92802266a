"""What an engine holds now: SGLang's /get_load (entrypoints/v1_loads.py), a list with one entry per DP
rank, `{dp_rank, num_reqs, num_waiting_reqs, num_tokens, ...}`, where num_reqs counts the requests
running and those waiting in the queue."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipeline.supervisor.engines.protocol import EngineProtocolError


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """Summed over the DP ranks: requests running and queued, those of them waiting in the queue, and the
    tokens of the running batch (its KV cache in use). `capacity`: the engine's max_running_requests
    where known (/server_info; not part of /get_load)."""

    requests: int
    waiting: int
    tokens: int
    capacity: int | None = None

    @property
    def queued(self) -> bool:
        """More requests wait than the engine has free slots: they wait for capacity, not for the next
        step of the scheduler loop (a request that arrived since its last step waits that long, with free
        slots). Without a known capacity any waiting request counts."""
        free = 0 if self.capacity is None else max(0, self.capacity - (self.requests - self.waiting))
        return self.waiting > free


def parse_load(loads: Any) -> EngineLoad:
    """A /get_load reply; EngineProtocolError naming what is wrong. Some versions answer one rank as an
    object; `num_waiting_reqs` and `num_tokens` count 0 when a version leaves them out."""
    if isinstance(loads, dict):
        loads = [loads]
    if not isinstance(loads, list) or not all(isinstance(x, dict) for x in loads):
        raise EngineProtocolError(f"/get_load replied {loads!r}, expected a list of objects")
    try:
        return EngineLoad(
            requests=sum(_count(entry["num_reqs"]) for entry in loads),
            waiting=sum(_count(entry.get("num_waiting_reqs", 0)) for entry in loads),
            tokens=sum(_count(entry.get("num_tokens", 0)) for entry in loads),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise EngineProtocolError(f"/get_load entry without integer request counts: {loads!r}") from exc


def _count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{value!r} is not a count")
    return value
