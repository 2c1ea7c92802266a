"""`rollwise bench sandbox`: executions/s and latency of a trivial snippet, sandboxed vs bare subprocess.run.

At each concurrency level c (default 1, 8 and 64), ``--calls`` executions of ``print(1)`` run c at a
time, in alternating rounds:

- bare: c threads, each calling ``subprocess.run([python, "-c", "print(1)"], capture_output=True)``
  with the interpreter the sandbox uses (no limits, no isolation, no working directory);
- sandbox: c concurrent ``Sandbox.run_python("print(1)")`` calls from one event loop, with
  ``max_concurrency = c`` (so nothing waits in the queue), once per isolation this machine offers:
  bubblewrap (when it works) and rlimits only.

Reported per level and side: executions/s of the best round, that round's p50 and p99 latency of one
call, the CPU this process spent per execution (the event loop's cost of driving one sandbox; the
threads' for bare), and the sandbox's ratios to bare (throughput, p50). Ratios travel between
machines better than the absolute numbers, which a loaded 2-core machine moves a lot.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

from envs.sandbox.runner import Sandbox, SandboxConfig

SNIPPET = "print(1)"
DEFAULT_LEVELS = (1, 8, 64)


@dataclass
class Round:
    execs_per_s: float
    p50_ms: float
    p99_ms: float
    parent_cpu_ms: float  # CPU of this process per execution: what one event loop (or thread pool) pays


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by the nearest-rank method."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(q * len(ordered))))
    return ordered[rank - 1]


def _round(latencies: list[float], wall_s: float, cpu_s: float) -> Round:
    return Round(
        len(latencies) / wall_s,
        percentile(latencies, 0.5) * 1e3,
        percentile(latencies, 0.99) * 1e3,
        cpu_s / len(latencies) * 1e3,
    )


def bare_round(python: str, calls: int, concurrency: int) -> Round:
    def one(_: int) -> float:
        started = time.perf_counter()
        done = subprocess.run([python, "-c", SNIPPET], capture_output=True, check=False)
        if done.stdout != b"1\n":
            raise RuntimeError(
                f"bare {python} -c {SNIPPET!r} printed {done.stdout!r}: {done.stderr[-200:]!r}"
            )
        return time.perf_counter() - started

    started, cpu = time.perf_counter(), time.process_time()
    with ThreadPoolExecutor(concurrency) as pool:
        latencies = list(pool.map(one, range(calls)))
    return _round(latencies, time.perf_counter() - started, time.process_time() - cpu)


async def sandbox_round(sandbox: Sandbox, calls: int, concurrency: int) -> Round:
    latencies: list[float] = []
    remaining = iter(range(calls))

    async def worker() -> None:
        for _ in remaining:
            started = time.perf_counter()
            result = await sandbox.run_python(SNIPPET)
            if result.stdout != "1\n":
                raise RuntimeError(
                    f"sandboxed {SNIPPET!r} printed {result.stdout!r}: {result.stderr[-200:]!r}"
                )
            latencies.append(time.perf_counter() - started)

    started, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return _round(latencies, time.perf_counter() - started, time.process_time() - cpu)


def _sandboxes(concurrency: int, isolations: list[str]) -> dict[str, Sandbox]:
    options = {"bwrap": {"require": "bwrap"}, "rlimits": {"require": "rlimits", "bwrap": ""}}
    return {
        kind: Sandbox(SandboxConfig.from_options({**options[kind], "max_concurrency": concurrency}))
        for kind in isolations
    }


def measure(calls: int, levels: list[int], repeats: int) -> dict[str, Any]:
    probe = Sandbox(SandboxConfig.from_options({"require": "rlimits"}))
    isolations = ["bwrap", "rlimits"] if probe.isolation.kind == "bwrap" else ["rlimits"]
    python = probe.isolation.interpreter.path
    report: dict[str, Any] = {
        "snippet": SNIPPET,
        "python": f"{probe.isolation.interpreter.version} ({python})",
        "bwrap": probe.isolation.describe()
        if probe.isolation.kind == "bwrap"
        else probe.isolation.fallback_reason,
        "calls": calls,
        "repeats": repeats,
        "levels": {},
    }
    for concurrency in levels:
        sandboxes = _sandboxes(concurrency, isolations)
        rounds: dict[str, list[Round]] = {side: [] for side in ["bare", *isolations]}
        for _ in range(repeats):  # alternate, so load that comes and goes hits every side alike
            rounds["bare"].append(bare_round(python, calls, concurrency))
            for kind, sandbox in sandboxes.items():
                rounds[kind].append(asyncio.run(sandbox_round(sandbox, calls, concurrency)))
        best = {side: max(rs, key=lambda r: r.execs_per_s) for side, rs in rounds.items()}
        level: dict[str, Any] = {side: asdict(r) for side, r in best.items()}
        for kind in isolations:
            level[kind]["execs_ratio"] = best[kind].execs_per_s / best["bare"].execs_per_s
            level[kind]["p50_ratio"] = best[kind].p50_ms / best["bare"].p50_ms
        report["levels"][str(concurrency)] = level
    return report


def format_report(report: dict[str, Any]) -> str:
    lines = [
        f"rollwise bench sandbox: {report['calls']} executions of {report['snippet']} per level and side, "
        f"best of {report['repeats']} alternating rounds; python {report['python']}",
        f"bubblewrap: {report['bwrap']}",
        "",
        f"{'concurrent':>10}  {'side':<22}{'execs/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'CPU ms':>8}"
        "   vs bare: execs/s, p50",
    ]
    for concurrency, level in report["levels"].items():
        for side, row in level.items():
            name = "bare subprocess.run" if side == "bare" else f"sandbox, {side}"
            ratios = f"   {row['execs_ratio']:.2f}x, {row['p50_ratio']:.2f}x" if side != "bare" else ""
            numbers = f"{row['execs_per_s']:>9.1f}{row['p50_ms']:>9.1f}{row['p99_ms']:>9.1f}"
            numbers += f"{row['parent_cpu_ms']:>8.2f}"
            lines.append(f"{concurrency:>10}  {name:<22}{numbers}{ratios}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`rollwise bench sandbox`."""
    parser = argparse.ArgumentParser(prog="rollwise bench sandbox", description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=256, help="executions per level, side and round")
    parser.add_argument(
        "--levels", default=",".join(map(str, DEFAULT_LEVELS)), help="concurrent calls, comma-separated"
    )
    parser.add_argument("--repeats", type=int, default=2, help="alternating rounds; the best round per side")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    try:
        levels = [int(level) for level in args.levels.split(",")]
    except ValueError:
        parser.error(f"--levels must be comma-separated integers, got {args.levels!r}")
    if min(args.calls, args.repeats, *levels) < 1:
        parser.error("--calls, --repeats and every level must be >= 1")
    report = measure(args.calls, levels, args.repeats)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
