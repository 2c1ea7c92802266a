"""Handing the C allocator's free pages back to the kernel, at most once per interval.

glibc keeps what a process frees: it returns only the top of its main heap on its own. The embedded
engine frees its prefix cache's KV at every weight update, tens of MiB spread over its worker thread's
arena, and the next cycle reuses those chunks in another order, touching pages that had not been
resident. Resident memory then creeps up while the allocator's books stay flat: in the 60-minute soak
of 2026-11-26 the engine grew 8.5 MiB/h with malloc's in-use and free-held bytes unchanged, and one
malloc_trim(0) after 15 minutes gave back 31 MiB (docs/troubleshoot.md, "The engine's growth found").
malloc_trim(0) releases the free pages of every arena (madvise), not only the heap's top.

Only glibc has it; elsewhere `Trimmer.maybe` does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

TRIM_EVERY_S = 60.0


@functools.cache
def libc() -> ctypes.CDLL | None:
    """The C library, loaded once (`find_library` runs a subprocess); None where it cannot be loaded."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def _load_trim() -> Callable[[int], int] | None:
    library = libc()
    trim = getattr(library, "malloc_trim", None) if library is not None else None
    if trim is None:
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def trim_now() -> bool:
    """malloc_trim(0) at once; False where there is no glibc."""
    trim = _load_trim()
    if trim is None:
        return False
    trim(0)
    return True


class Trimmer:
    """`maybe()` trims when `every_s` has passed since its last trim (the first call always does)."""

    def __init__(
        self,
        every_s: float = TRIM_EVERY_S,
        *,
        clock: Callable[[], float] = time.monotonic,
        trim: Callable[[int], int] | None = None,
    ) -> None:
        self.every_s = every_s
        self._clock = clock
        self._trim = trim if trim is not None else _load_trim()
        self._last: float | None = None
        self.trims = 0
        self.last_duration_s = 0.0

    @property
    def available(self) -> bool:
        return self._trim is not None

    def maybe(self) -> bool:
        """Trim if due; True when it did."""
        now = self._clock()
        if self._trim is None or (self._last is not None and now - self._last < self.every_s):
            return False
        started = time.perf_counter()
        self._trim(0)
        self.last_duration_s = time.perf_counter() - started
        self._last = now
        self.trims += 1
        log.debug("malloc_trim took %.1f ms", 1e3 * self.last_duration_s)
        return True
