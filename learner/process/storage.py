"""Writes the storage refuses (a full or read-only run directory: pipeline.contracts.durable) are retried
with a doubling delay (0.5 s to 10 s), each refusal reported as a `storage` event, and a `storage` event
with blocked=false says when one went through. Training waits meanwhile: nothing is consumed, so the actors
pause on their staleness bound. A stop requested while blocked gives the write up (StorageGaveUp).
Errors that are not the storage's propagate at once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, TypeVar

from pipeline.contracts import events
from pipeline.contracts.durable import RefusedWrites, retry_delays

log = logging.getLogger("rollwise.learner")
T = TypeVar("T")


class EventSink(Protocol):
    def emit(self, event: events.LearnerEvent) -> None: ...


class StopSignal(Protocol):
    def wait(self, timeout_s: float) -> bool: ...


class StorageGaveUp(Exception):
    """A write the storage kept refusing was given up because the learner is stopping."""


class DurableWriter:
    """Runs writes until the storage takes them (module docstring), telling `out` what it refused."""

    def __init__(self, out: EventSink, stop: StopSignal) -> None:
        self.out = out
        self.stop = stop

    def write(self, component: str, directory: Path, write: Callable[[], T]) -> T:
        """`write()`, retried while the storage refuses it; StorageGaveUp when a stop is requested
        meanwhile."""
        delays = retry_delays()
        refusals = RefusedWrites(directory)
        while True:
            try:
                result = write()
            except Exception as exc:
                refusal = refusals.refused(exc)
                if refusal is None:
                    raise
                if refusal.first:
                    log.error(
                        "%s write refused by the storage (%s): %s; retrying", component, refusal.kind, exc
                    )
                fault = events.StorageFault(
                    component, blocked=True, kind=refusal.kind, message=str(exc)[:500]
                )
                self.out.emit(fault)
                if self.stop.wait(next(delays)):
                    raise StorageGaveUp(f"{component}: {refusal.kind}: {exc}") from exc
                continue
            if (recovered := refusals.wrote()) is not None:
                log.warning("%s written after %.1f s of refusals", component, recovered.blocked_s)
                message = f"written after {recovered.blocked_s:.1f} s of refusals"
                self.out.emit(
                    events.StorageFault(component, blocked=False, kind=recovered.kind, message=message)
                )
            return result
