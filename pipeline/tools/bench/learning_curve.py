"""`rollwise bench learn`: learning claims with seeds. A config runs N times, one seed after another, and
its held-out evaluation (`logs/eval.jsonl`, pipeline.supervisor.eval_schedule) becomes a curve with intervals.

    rollwise bench learn --config F --seeds N (--minutes M | --max-steps S) [--threshold 0.9]
                         [--bucket-versions 100] [--mode greedy] [--out DIR] [--set K=V ...] [--json]
    rollwise bench learn --from OUT [--from OUT ...] [--minutes M] [--threshold 0.9] ...

`--from` runs nothing: it reports the seeds already run into each OUT (OUT/seed<s>/logs/eval.jsonl),
so seeds run one at a time, on other machines or by separate commands make one table.

Each seed s is `rollwise run --config F --set run.seed=s` in its own run directory (OUT/seed<s>), stopped
with SIGTERM after M minutes of its own clock or by `run.max_steps`. The eval task set is the config's
`eval.seed` stream, the same for every seed, so the seeds differ only in training. Reported:

- per minute m (and per `--bucket-versions` policy versions): the last evaluation finished by then, its
  success in `--mode` (greedy by default), as the mean over seeds and a two-sided 95% Student-t interval
  (mean ± t(0.975, n-1) · s / √n, clipped to [0, 1]); seeds with no evaluation yet are left out (n says
  how many counted);
- how many seeds crossed `--threshold` and when: the first evaluation at or above it, in minutes and in
  policy versions, with the same interval over the seeds that crossed.

A policy version is one learner step that updated the weights (the version an evaluation scored; the
learner step counter can run a little ahead of it).

Minutes count from the daemon's start (its `elapsed_s`, model creation included) and depend on what else
runs on the machine; versions do not, which is what `--max-steps` comparisons are for. The summary
is also written to OUT/summary.json.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# Two-sided 95% quantiles of Student's t, t(0.975, df), for df = 1..30; beyond, the values at 40, 60, 120.
_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip
_T975_LARGE = ((40, 2.021), (60, 2.000), (120, 1.980))
REPO = Path(__file__).resolve().parents[2]


def t_quantile_975(df: int) -> float:
    """t(0.975, df); for df above 30, the tabulated value of the next smaller tabulated df (conservative)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if df <= 30:
        return _T975[df - 1]
    value = _T975[-1]
    for at, t in _T975_LARGE:
        if df >= at:
            value = t
    return value


@dataclass(frozen=True)
class Interval:
    """Mean of n values and its 95% t-interval (low = high = mean when n = 1)."""

    n: int
    mean: float
    low: float
    high: float


def t_interval(values: Sequence[float], *, bounds: tuple[float, float] | None = None) -> Interval | None:
    """mean ± t(0.975, n-1) · s / √n (s: the sample standard deviation); None for no values. `bounds`
    clips the interval (a success rate cannot leave [0, 1])."""
    if not values:
        return None
    n = len(values)
    mean = statistics.fmean(values)
    half = t_quantile_975(n - 1) * statistics.stdev(values) / math.sqrt(n) if n > 1 else 0.0
    low, high = mean - half, mean + half
    if bounds is not None:
        low, high = max(bounds[0], low), min(bounds[1], high)
    return Interval(n, mean, low, high)


def success_of(row: dict[str, Any], mode: str) -> float | None:
    block = row.get(mode)
    value = block.get("success") if isinstance(block, dict) else None
    return float(value) if isinstance(value, (int, float)) else None


def last_by(rows: Sequence[dict[str, Any]], key: str, limit: float, mode: str) -> float | None:
    """Success of the last evaluation with rows[key] <= limit (rows oldest first), None before any."""
    value = None
    for row in rows:
        at = row.get(key)
        if isinstance(at, (int, float)) and at <= limit and (s := success_of(row, mode)) is not None:
            value = s
    return value


def first_crossing(rows: Sequence[dict[str, Any]], threshold: float, mode: str) -> dict[str, float] | None:
    """Elapsed minutes and policy version of the first evaluation whose success reached `threshold`."""
    for row in rows:
        s = success_of(row, mode)
        if s is not None and s >= threshold:
            return {"minutes": float(row["elapsed_s"]) / 60.0, "version": float(row["version"])}
    return None


def summarise(
    runs: dict[int, list[dict[str, Any]]],
    *,
    mode: str,
    threshold: float,
    minutes: int | None,
    bucket_versions: int,
) -> dict[str, Any]:
    """The report of seed -> its eval rows (module docstring), as plain data."""
    seeds = sorted(runs)
    last_version = max((int(r["version"]) for rows in runs.values() for r in rows), default=0)
    horizon = (
        minutes
        if minutes is not None
        else math.ceil(
            max((float(r["elapsed_s"]) for rows in runs.values() for r in rows), default=0.0) / 60.0
        )
    )

    def curve(key: str, points: list[float], scale: float) -> list[dict[str, Any]]:
        out = []
        for at in points:
            values = [v for s in seeds if (v := last_by(runs[s], key, at * scale, mode)) is not None]
            interval = t_interval(values, bounds=(0.0, 1.0))
            crossed = sum(1 for v in values if v >= threshold)
            out.append({"at": at, "interval": asdict(interval) if interval else None, "crossed": crossed})
        return out

    crossings = {s: first_crossing(runs[s], threshold, mode) for s in seeds}
    hit = [c for c in crossings.values() if c is not None]
    return {
        "mode": mode,
        "threshold": threshold,
        "seeds": seeds,
        "interval": "two-sided 95% Student-t over seeds, clipped to [0, 1]",
        "per_minute": curve("elapsed_s", [float(m) for m in range(1, horizon + 1)], 60.0),
        "per_version": curve(
            "version", [float(b) for b in range(bucket_versions, last_version + 1, bucket_versions)], 1.0
        ),
        "crossings": {str(s): c for s, c in crossings.items()},
        "crossed": len(hit),
        # Times and versions cannot be negative: the interval is clipped at 0 like the rates at [0, 1].
        "minutes_to_threshold": _asdict(t_interval([c["minutes"] for c in hit], bounds=(0.0, math.inf))),
        "versions_to_threshold": _asdict(t_interval([c["version"] for c in hit], bounds=(0.0, math.inf))),
    }


def _asdict(interval: Interval | None) -> dict[str, Any] | None:
    return asdict(interval) if interval is not None else None


def format_report(summary: dict[str, Any]) -> str:
    seeds = len(summary["seeds"])
    lines = [
        f"held-out {summary['mode']} success over {seeds} seeds ({summary['interval']}); "
        f"threshold {summary['threshold']}"
    ]

    def table(title: str, rows: list[dict[str, Any]], unit: str) -> None:
        lines.append(f"{title:>8}  {'n':>2}  {'mean':>5}  {'95% interval':<14}  seeds >= threshold")
        for row in rows:
            iv = row["interval"]
            at = f"{row['at']:.0f}{unit}"
            if iv is None:
                lines.append(f"{at:>8}  {0:>2}  {'-':>5}  {'':<14}  0/{seeds}")
            else:
                span = f"[{iv['low']:.2f}, {iv['high']:.2f}]"
                lines.append(
                    f"{at:>8}  {iv['n']:>2}  {iv['mean']:>5.2f}  {span:<14}  {row['crossed']}/{seeds}"
                )

    table("minute", summary["per_minute"], "")
    if summary["per_version"]:
        table("version", summary["per_version"], "")
    crossed = [f"seed {s}: " + (f"{c['minutes']:.1f} min, v{c['version']:.0f}" if c else "not crossed")
               for s, c in summary["crossings"].items()]  # fmt: skip
    lines.append(f"crossed {summary['threshold']}: {summary['crossed']}/{seeds} seeds ({'; '.join(crossed)})")
    for key, unit in (("minutes_to_threshold", "minutes"), ("versions_to_threshold", "policy versions")):
        iv = summary[key]
        if iv is not None:
            lines.append(
                f"  {unit} to threshold over the {iv['n']} that crossed: {iv['mean']:.1f} "
                f"[{iv['low']:.1f}, {iv['high']:.1f}]"
            )
    return "\n".join(lines)


def run_seed(
    config: str | None,
    seed: int,
    out: Path,
    *,
    minutes: float | None,
    max_steps: int | None,
    overrides: Sequence[str],
    grace_s: float = 60.0,
) -> list[dict[str, Any]]:
    """One daemon run of `config` at `seed` in OUT/seed<seed>; returns its eval rows."""
    from pipeline.supervisor.eval_schedule import read_eval_log

    run_dir = out / f"seed{seed}"
    argv = [sys.executable, "-m", "pipeline.cli", "run", "--run-dir", str(run_dir), "--log-format", "json"]
    if config is not None:
        argv += ["--config", config]
    if max_steps is not None:
        argv += ["--max-steps", str(max_steps)]
    for item in ["engine.port=0", "metrics.port=0", "admin.port=0", f"run.seed={seed}", *overrides]:
        argv += ["--set", item]
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    with (out / f"seed{seed}.jsonl").open("wb") as stdout, (out / f"seed{seed}.stderr").open("wb") as stderr:
        proc = subprocess.Popen(argv, stdout=stdout, stderr=stderr, cwd=REPO)
        stopped = False  # stopped by us at its time limit: any exit code then is ours, not a failure
        try:
            limit = None if minutes is None else minutes * 60.0
            started = time.monotonic()
            while proc.poll() is None:
                if limit is not None and time.monotonic() - started >= limit:
                    proc.send_signal(signal.SIGTERM)
                    stopped = True
                    try:
                        proc.wait(timeout=grace_s)
                    except subprocess.TimeoutExpired:  # its evaluations are on disk: kill it, keep them
                        print(f"seed {seed}: no exit {grace_s:.0f} s after SIGTERM; killed", file=sys.stderr)
                    break
                time.sleep(0.5)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if not stopped and proc.returncode not in (0, -signal.SIGTERM, 128 + signal.SIGTERM):
        raise RuntimeError(f"seed {seed}: rollwise run exited {proc.returncode}; see {out}/seed{seed}.stderr")
    return read_eval_log(run_dir / "logs" / "eval.jsonl")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="rollwise bench learn", description=__doc__.splitlines()[0])
    p.add_argument("--config", help="TOML config (default: built-in defaults); its [eval] is the yardstick")
    p.add_argument("--seeds", type=int, help="runs, with run.seed = first-seed .. + N - 1")
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--minutes", type=float, help="stop each run after this many minutes")
    p.add_argument("--max-steps", type=int, help="stop each run after this many learner steps")
    p.add_argument("--threshold", type=float, default=0.9, help="success a run must reach (default 0.9)")
    p.add_argument("--mode", choices=["greedy", "sampled"], default="greedy")
    p.add_argument("--bucket-versions", type=int, default=100, help="width of the per-version table")
    p.add_argument("--out", type=Path, help="directory for the runs (default: runs/bench-learn-<time>)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument(
        "--from",
        dest="from_dirs",
        action="append",
        type=Path,
        default=[],
        metavar="OUT",
        help="report the seeds already run into OUT (repeatable) instead of running any",
    )
    args = p.parse_args(list(argv))
    if args.from_dirs:
        if args.seeds is not None or args.max_steps is not None or args.config is not None or args.set:
            p.error("--from reports finished runs: --seeds, --max-steps, --config and --set do not apply")
    elif args.seeds is None or args.seeds < 1:
        p.error("--seeds must be >= 1")
    elif args.minutes is None and args.max_steps is None:
        p.error("give --minutes and/or --max-steps: a run must end")
    if (args.minutes is not None and args.minutes <= 0) or (
        args.max_steps is not None and args.max_steps < 1
    ):
        p.error("--minutes must be > 0 and --max-steps >= 1")
    if args.bucket_versions < 1 or not 0.0 < args.threshold <= 1.0:
        p.error("--bucket-versions must be >= 1 and --threshold in (0, 1]")
    return args


def collect_runs(dirs: Sequence[Path]) -> dict[int, list[dict[str, Any]]]:
    """seed -> eval rows of every OUT/seed<s>/logs/eval.jsonl under `dirs`; a directory without one, or a
    seed found twice, is an error (two runs of one seed would be counted as two samples)."""
    from pipeline.supervisor.eval_schedule import read_eval_log

    runs: dict[int, list[dict[str, Any]]] = {}
    for out in dirs:
        found = 0
        for log in sorted(out.glob("seed*/logs/eval.jsonl")):
            name = log.parents[1].name.removeprefix("seed")
            if not name.isdigit():
                continue
            if int(name) in runs:
                raise ValueError(f"seed {name} appears twice (again in {log})")
            runs[int(name)] = read_eval_log(log)
            found += 1
        if not found:
            raise ValueError(f"{out}: no seed<s>/logs/eval.jsonl (not an OUT of rollwise bench learn)")
    return runs


def _summary(
    runs: dict[int, list[dict[str, Any]]], args: argparse.Namespace, argv: Sequence[str]
) -> dict[str, Any]:
    minutes = math.ceil(args.minutes) if args.minutes is not None else None
    summary = summarise(
        runs, mode=args.mode, threshold=args.threshold, minutes=minutes, bucket_versions=args.bucket_versions
    )
    summary["command"] = ["rollwise", "bench", "learn", *argv]
    return summary


def main(argv: Sequence[str]) -> int:
    from pipeline.contracts.config import ConfigError, load_config

    args = parse_args(argv)
    if args.from_dirs:
        try:
            finished = collect_runs(args.from_dirs)
        except ValueError as exc:
            print(f"rollwise bench learn: {exc}", file=sys.stderr)
            return 2
        summary = _summary(finished, args, argv)
        print(json.dumps(summary) if args.json else format_report(summary))
        return 0
    try:  # the whole config is checked once before the first run starts
        cfg = load_config(args.config, [*args.set, "run.seed=0"])
    except ConfigError as exc:
        print(f"rollwise bench learn: {exc}", file=sys.stderr)
        return 2
    if cfg.eval.every_versions == 0:
        print(
            "rollwise bench learn: the config evaluates nothing: set eval.every_versions > 0", file=sys.stderr
        )
        return 2
    out = (args.out or REPO / "runs" / f"bench-learn-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    config = str(Path(args.config).resolve()) if args.config is not None else None
    runs: dict[int, list[dict[str, Any]]] = {}
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        print(f"seed {seed}: running in {out / f'seed{seed}'}", file=sys.stderr, flush=True)
        try:
            runs[seed] = run_seed(
                config, seed, out, minutes=args.minutes, max_steps=args.max_steps, overrides=args.set
            )
        except RuntimeError as exc:
            print(f"rollwise bench learn: {exc}", file=sys.stderr)
            return 1
    summary = _summary(runs, args, argv)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary) if args.json else format_report(summary))
    return 0
