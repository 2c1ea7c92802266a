"""Cores shared in time between the learner and the embedded engines of one machine
(`engine.share_cores = "time"`).

With disjoint shares (pipeline/supervisor/fleet/core_split.py) each side owns some cores all the time,
and the side that waits leaves its cores idle: a learner-bound run keeps the engine's cores mostly idle,
while the learner's threads cannot use them (a torch thread on a core the engine also runs stalls every
parallel region at its barrier). Shared in time, both get every core and take turns: while the learner
computes a step, the engines finish the decode step they are in and then wait; while the learner waits
for data, the engines run. Each turn uses the whole machine, and the engines' waiting bounds the
staleness of what they generate to the step in progress.

The lease is one byte in a file of the run directory, mapped by both processes (the page cache makes a
write visible to every mapping at once, with no system call on the reading side):

    0   the learner is waiting: the engines run
    1   the learner is computing: the engines yield between decode steps

Rules: only the learner (rank 0) writes it; it clears it whenever it stops computing, also on an
exception, and when it starts (a learner killed mid-step left it held). An engine that finds no file, or
a file it cannot map, never yields (a stale lease must not stop generation). `NO_LEASE` is the
do-nothing twin that every other configuration gets.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.contracts.config import Config

LEASE_FILE = "cores.lease"


class CoreLease:
    """The learner's side (`holding`) and the engines' (`held`) of the shared byte at `path`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, 1)
        finally:
            os.close(fd)

    @staticmethod
    def create(path: Path) -> CoreLease:
        """Make (or reset to 0) the lease file, then map it; the supervisor's, before anything starts."""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"\0")
        return CoreLease(path)

    def held(self) -> bool:
        return self._map[0] == 1

    def hold(self) -> None:
        self._map[0] = 1

    def release(self) -> None:
        self._map[0] = 0

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        self.hold()
        try:
            yield
        finally:
            self.release()

    def close(self) -> None:
        self._map.close()


class NoLease(CoreLease):
    """Never held: the engines never yield and the learner's holding does nothing."""

    def __init__(self) -> None:  # nothing to map
        self.path = Path(os.devnull)

    def held(self) -> bool:
        return False

    def hold(self) -> None:
        pass

    def release(self) -> None:
        pass

    def close(self) -> None:
        pass


NO_LEASE = NoLease()


def open_lease(path: Path | None) -> CoreLease:
    """The lease at `path`, or NO_LEASE when there is none (no path, no file, not mappable)."""
    if path is None:
        return NO_LEASE
    try:
        return CoreLease(path)
    except (OSError, ValueError):
        return NO_LEASE


def time_shared(cfg: Config) -> bool:
    """Whether the run's resolved config shares the cores in time (the supervisor's core split turned
    `engine.share_cores = "time"` back to "split" where the learner is not on this CPU)."""
    return getattr(cfg.engine, "share_cores", "split") == "time"
