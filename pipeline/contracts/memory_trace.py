"""Where a long-running process's Python memory goes: tracemalloc snapshot diffs over time, switched on by
the environment (`rollwise bench soak --tracemalloc` sets it for the supervisor and every child).

With `ROLLWISE_TRACEMALLOC=<dir>` a process that calls `start_from_env(role)` starts tracemalloc
(`FRAMES` frames per allocation) once `ROLLWISE_TRACEMALLOC_WARMUP_S` (600 s) have passed (tracing the
start, a model load with its imports, would slow it tenfold), takes a baseline snapshot `SETTLE_S` later,
and then every `ROLLWISE_TRACEMALLOC_EVERY_S` (600 s) appends to `<dir>/<role>-<pid>.txt` the traced
total and the allocation sites that grew most since the baseline (by line, and the largest by
traceback). Only allocations made after tracing started are seen: what a process holds from before is
its level, not its growth. Nothing happens without the variable. Imports only the standard library.
"""

from __future__ import annotations

import linecache
import os
import threading
import time
import tracemalloc
from pathlib import Path

TRACE_ENV = "ROLLWISE_TRACEMALLOC"
EVERY_ENV = "ROLLWISE_TRACEMALLOC_EVERY_S"
WARMUP_ENV = "ROLLWISE_TRACEMALLOC_WARMUP_S"
FRAMES = 8
TOP = 25
SETTLE_S = 60.0
# Allocations of the tracer itself and of the import machinery are not the process's growth.
_IGNORED = (tracemalloc.__file__, linecache.__file__, "<frozen importlib._bootstrap>", "<unknown>")


def start_from_env(role: str) -> threading.Thread | None:
    """Start tracing and the reporting thread when TRACE_ENV names a directory; None otherwise."""
    target = os.environ.get(TRACE_ENV)
    if not target:
        return None
    every_s = float(os.environ.get(EVERY_ENV, "600"))
    warmup_s = float(os.environ.get(WARMUP_ENV, "600"))
    out = Path(target) / f"{role}-{os.getpid()}.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    thread = threading.Thread(
        target=_report_loop, args=(out, warmup_s, every_s), name="tracemalloc-report", daemon=True
    )
    thread.start()
    return thread


def _snapshot() -> tracemalloc.Snapshot:
    return tracemalloc.take_snapshot().filter_traces(
        [tracemalloc.Filter(False, pattern) for pattern in _IGNORED]
    )


def _report_loop(out: Path, warmup_s: float, every_s: float) -> None:
    started = time.monotonic()
    time.sleep(warmup_s)
    tracemalloc.start(FRAMES)
    time.sleep(min(SETTLE_S, every_s))
    baseline = _snapshot()
    base_total = sum(stat.size for stat in baseline.statistics("filename"))
    with open(out, "a", encoding="utf-8") as handle:
        handle.write(
            f"# baseline at {time.monotonic() - started:.0f} s: {base_total / 2**20:.2f} MiB traced\n"
        )
    while True:
        time.sleep(every_s)
        report = diff_report(baseline, _snapshot(), time.monotonic() - started)
        with open(out, "a", encoding="utf-8") as handle:
            handle.write(report)


def diff_report(baseline: tracemalloc.Snapshot, now: tracemalloc.Snapshot, at_s: float) -> str:
    """The traced total and the TOP sites that grew most since `baseline`: by line, then the 5 largest
    by their whole traceback."""
    total = sum(stat.size for stat in now.statistics("filename"))
    lines = [f"## at {at_s:.0f} s: {total / 2**20:.2f} MiB traced"]
    for stat in now.compare_to(baseline, "lineno")[:TOP]:
        lines.append(f"{stat.size_diff / 1024:+10.1f} KiB {stat.count_diff:+8d} blocks  {stat.traceback}")
    for stat in now.compare_to(baseline, "traceback")[:5]:
        lines.append(f"-- {stat.size_diff / 1024:+.1f} KiB, {stat.count_diff:+d} blocks, allocated at:")
        lines.extend(f"     {frame}" for frame in stat.traceback.format())
    return "\n".join(lines) + "\n"
