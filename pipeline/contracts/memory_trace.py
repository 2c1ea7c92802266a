"""Where a long-running process's memory goes: the C allocator's books and tracemalloc snapshot diffs over
time, switched on by the environment (`rollwise bench soak --tracemalloc` sets it for the supervisor and
every child).

With `ROLLWISE_TRACEMALLOC=<dir>` a process that calls `start_from_env(role)` waits
`ROLLWISE_TRACEMALLOC_WARMUP_S` (600 s), then every `ROLLWISE_TRACEMALLOC_EVERY_S` (600 s) appends to
`<dir>/<role>-<pid>.txt` one line of native figures - resident memory and its anonymous part, glibc
malloc's bytes in use and bytes free but held (fragmentation), mmapped bytes, CPython's small-object
arenas (mapped outside malloc) and the bytes live in them, and Arrow's allocated bytes - and, unless
`ROLLWISE_TRACEMALLOC_FRAMES` is 0, the Python allocation sites that grew most since a baseline snapshot
(tracemalloc with that many frames, 8 by default, started after the warm-up: tracing a start, a model
load with its imports, slows it tenfold). Growth of RSS with flat Python figures is native: malloc in
use (a C-level leak) or malloc free-but-held (fragmentation, which malloc_trim returns). With
`ROLLWISE_TRACEMALLOC_TRIM=1` each report is followed by malloc_trim(0) and a second line of figures:
memory that growth left resident in free pages shows as the gap between the two. Nothing happens
without the variable. Imports only the standard library (Arrow's figure only where it is imported).
"""

from __future__ import annotations

import ctypes
import functools
import linecache
import os
import sys
import tempfile
import threading
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

from pipeline.contracts.malloc_trim import libc, trim_now

TRACE_ENV = "ROLLWISE_TRACEMALLOC"
EVERY_ENV = "ROLLWISE_TRACEMALLOC_EVERY_S"
WARMUP_ENV = "ROLLWISE_TRACEMALLOC_WARMUP_S"
FRAMES_ENV = "ROLLWISE_TRACEMALLOC_FRAMES"
TRIM_ENV = "ROLLWISE_TRACEMALLOC_TRIM"
FRAMES = 8
TOP = 25
SETTLE_S = 60.0
# Allocations of the tracer itself and of the import machinery are not the process's growth.
_IGNORED = (tracemalloc.__file__, linecache.__file__, "<frozen importlib._bootstrap>", "<unknown>")
_MIB = 2**20


def start_from_env(role: str) -> threading.Thread | None:
    """Start the reporting thread when TRACE_ENV names a directory; None otherwise."""
    target = os.environ.get(TRACE_ENV)
    if not target:
        return None
    every_s = float(os.environ.get(EVERY_ENV, "600"))
    warmup_s = float(os.environ.get(WARMUP_ENV, "600"))
    frames = int(os.environ.get(FRAMES_ENV, str(FRAMES)))
    trim = os.environ.get(TRIM_ENV, "") not in ("", "0")
    out = Path(target) / f"{role}-{os.getpid()}.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    thread = threading.Thread(
        target=_report_loop,
        args=(out, warmup_s, every_s, frames, trim),
        name="tracemalloc-report",
        daemon=True,
    )
    thread.start()
    return thread


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
            "keepcost",
        )
    ]  # fmt: skip


@functools.cache
def _mallinfo2() -> Callable[[], _MallInfo2] | None:
    """glibc's mallinfo2 (2.33 and later), typed once; None without it."""
    library = libc()
    function = getattr(library, "mallinfo2", None) if library is not None else None
    if function is not None:
        function.restype = _MallInfo2
    return function


def native_figures() -> dict[str, float]:
    """MiB: rss (VmRSS), rss_anon (RssAnon), malloc_in_use, malloc_free_held, malloc_mmapped (glibc
    mallinfo2, summed over its arenas), obmalloc_arenas and obmalloc_in_use (CPython's small-object
    allocator, which maps its arenas itself, outside malloc's books) and arrow_allocated (when pyarrow is
    imported). Missing sources are left out."""
    figures: dict[str, float] = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                figures["rss"] = int(line.split()[1]) / 1024
            elif line.startswith("RssAnon:"):
                figures["rss_anon"] = int(line.split()[1]) / 1024
    except OSError:
        pass
    mallinfo2 = _mallinfo2()
    if mallinfo2 is not None:
        info = mallinfo2()
        figures["malloc_in_use"] = (info.uordblks + info.hblkhd) / _MIB
        figures["malloc_free_held"] = info.fordblks / _MIB
        figures["malloc_mmapped"] = info.hblkhd / _MIB
    figures.update(obmalloc_figures())
    arrow = sys.modules.get("pyarrow")
    if arrow is not None:
        figures["arrow_allocated"] = arrow.total_allocated_bytes() / _MIB
    return figures


def obmalloc_figures() -> dict[str, float]:
    """MiB in CPython's small-object allocator: `obmalloc_arenas` mapped and `obmalloc_in_use` in live
    blocks; empty where the interpreter does not print them (also while tracemalloc runs: its hooks stand
    in front of the allocator, and CPython then prints nothing). `sys._debugmallocstats` writes to the C
    stderr only, so fd 2 points at a temporary file for the call; whatever another thread wrote there
    meanwhile is passed on to the real stderr."""
    debug_stats = getattr(sys, "_debugmallocstats", None)
    if debug_stats is None:
        return {}
    with tempfile.TemporaryFile() as capture:
        sys.stderr.flush()
        saved = os.dup(2)
        try:
            os.dup2(capture.fileno(), 2)
            debug_stats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        capture.seek(0)
        text = capture.read().decode("utf-8", "replace")
    figures, other = parse_obmalloc_stats(text)
    if other:
        os.write(2, other.encode())
    return figures


def parse_obmalloc_stats(text: str) -> tuple[dict[str, float], str]:
    """The arena and live-block figures of `sys._debugmallocstats` output, and its lines that are not
    part of that output (another thread's writes)."""
    figures: dict[str, float] = {}
    other: list[str] = []
    arena_bytes = 0
    for line in text.splitlines(keepends=True):
        key, sep, value = line.partition("=")
        digits = value.strip().replace(",", "")
        if sep and digits.isdigit():
            if key.startswith("# arenas allocated current"):
                figures["obmalloc_arenas"] = int(digits)
            elif "bytes/arena" in key:
                arena_bytes = int(key.split("*")[1].split()[0])
            elif key.startswith("# bytes in allocated blocks"):
                figures["obmalloc_in_use"] = int(digits) / _MIB
        elif not _is_stats_line(line):
            other.append(line)
    if "obmalloc_arenas" in figures:
        figures["obmalloc_arenas"] = figures["obmalloc_arenas"] * (arena_bytes or _MIB) / _MIB
    return figures, "".join(other)


def _is_stats_line(line: str) -> bool:
    """Headings, `... = N` figures and the size-class table's rows of numbers (a log line of another
    thread, which starts with a date, is none of these)."""
    stripped = line.strip()
    return (
        not stripped
        or stripped.replace(" ", "").isdigit()
        or " = " in stripped
        or stripped.startswith(("#", "-", "class", "Small block", "arena map"))
    )


def _native_line(at_s: float) -> str:
    figures = " ".join(f"{key}={value:.2f}" for key, value in native_figures().items())
    return f"native at {at_s:.0f} s (MiB): {figures}\n"


def _snapshot() -> tracemalloc.Snapshot:
    return tracemalloc.take_snapshot().filter_traces(
        [tracemalloc.Filter(False, pattern) for pattern in _IGNORED]
    )


def _report_loop(out: Path, warmup_s: float, every_s: float, frames: int, trim: bool) -> None:
    started = time.monotonic()
    time.sleep(warmup_s)
    baseline = None
    if frames > 0:
        tracemalloc.start(frames)
        time.sleep(min(SETTLE_S, every_s))
        baseline = _snapshot()
        base_total = sum(stat.size for stat in baseline.statistics("filename"))
        with open(out, "a", encoding="utf-8") as handle:
            handle.write(
                f"# baseline at {time.monotonic() - started:.0f} s: {base_total / _MIB:.2f} MiB traced\n"
            )
    with open(out, "a", encoding="utf-8") as handle:
        handle.write(_native_line(time.monotonic() - started))
    while True:
        time.sleep(every_s)
        at_s = time.monotonic() - started
        report = _native_line(at_s)
        if baseline is not None:
            report += diff_report(baseline, _snapshot(), at_s)
        if trim and trim_now():
            report += "after malloc_trim: " + _native_line(at_s)
        with open(out, "a", encoding="utf-8") as handle:
            handle.write(report)


def diff_report(baseline: tracemalloc.Snapshot, now: tracemalloc.Snapshot, at_s: float) -> str:
    """The traced total and the TOP sites that grew most since `baseline`: by line, then the 5 largest
    by their whole traceback."""
    total = sum(stat.size for stat in now.statistics("filename"))
    lines = [f"## at {at_s:.0f} s: {total / _MIB:.2f} MiB traced"]
    for stat in now.compare_to(baseline, "lineno")[:TOP]:
        lines.append(f"{stat.size_diff / 1024:+10.1f} KiB {stat.count_diff:+8d} blocks  {stat.traceback}")
    for stat in now.compare_to(baseline, "traceback")[:5]:
        lines.append(f"-- {stat.size_diff / 1024:+.1f} KiB, {stat.count_diff:+d} blocks, allocated at:")
        lines.extend(f"     {frame}" for frame in stat.traceback.format())
    return "\n".join(lines) + "\n"
