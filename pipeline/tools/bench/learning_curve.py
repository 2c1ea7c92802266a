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

After each seed a line gives the run's budgets (pipeline.tools.bench.run_budgets): the share of its time
the learner waited for groups, its tokens/s, and the share of their cores the embedded engines did not
compute on (their CPU time, sampled while the run went on, start-up included); it is also written to
OUT/seed<s>/logs/budgets.txt.

A policy version is one learner step that updated the weights (the version an evaluation scored; the
learner step counter can run a little ahead of it).

Minutes count from the daemon's start (its `elapsed_s`, model creation included) and depend on what else
runs on the machine; versions do not, which is what `--max-steps` comparisons are for. The summary
is also written to OUT/summary.json.

`--offline-eval` takes the evaluation off the training clock: the daemon runs with every [eval] trigger
at 0, and every `--snapshot-every-s` seconds of its clock this process copies its newest published version
(weights/v<N>, an adapter with LoRA) into OUT/seed<s>/snapshots/ (manifest.jsonl: when each version was
written, copying time left out; the limit of `--minutes` is extended by the copying time). After the run
every snapshot, the initial model first, is scored by `rollwise eval`'s evaluation (an embedded engine in
this process, greedy, the config's [eval] tasks) into snapshots/scores.jsonl, and the report reads those
rows: an evaluation then never shares the CPU with training.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pipeline.tools.bench.run_budgets import (
    ChildCpu,
    engine_busy_fraction,
    learner_budget,
    render_budgets,
    run_limit,
)

# Two-sided 95% quantiles of Student's t, t(0.975, df), for df = 1..30; beyond, the values at 40, 60, 120.
_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip
_T975_LARGE = ((40, 2.021), (60, 2.000), (120, 1.980))
# The engines' CPU time is read this often while a seed runs (a child that restarts is a new PID).
ENGINE_SAMPLE_S = 5.0
REPO = Path(__file__).resolve().parents[3]  # the repository root (runs/, the working directory of runs)


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


# ---- evaluation off the clock (--offline-eval; `rollwise bench trl` uses the same pieces) -----------------
SNAPSHOTS = "snapshots"  # <seed dir>/snapshots/: the kept policies, manifest.jsonl and scores.jsonl
MANIFEST = "manifest.jsonl"
SCORES = "scores.jsonl"
_VERSION_DIR = re.compile(r"^v(\d+)$")
UNMEASURED = ("timeout", "engine_error")  # finish reasons of the machine, not of the policy


def evaluation_off() -> list[str]:
    """The overrides that turn evaluation during training off: every trigger `[eval]` has set to 0."""
    from pipeline.contracts.config import EvalConfig

    return [f"eval.{key}=0" for key in ("every_versions", "every_minutes") if key in EvalConfig.model_fields]


def evaluates_during_training(cfg: Any) -> bool:
    """Some `[eval]` trigger is set (a config of before the minute trigger has only every_versions)."""
    return cfg.eval.every_versions > 0 or getattr(cfg.eval, "every_minutes", 0) > 0


def cadence_index(clock_s: float, every_s: float) -> int:
    """How many snapshot points (every `every_s` training seconds, the first at `every_s`) `clock_s` has
    passed; a snapshot is due whenever this grows. Point 0, the start, is the initial model."""
    if every_s <= 0:
        raise ValueError(f"snapshot interval must be > 0, got {every_s}")
    return max(0, math.floor(clock_s / every_s))


@dataclass(frozen=True)
class Snapshot:
    """A policy kept during training, scored after it. `at_s`: training seconds at which it was the
    policy (snapshot-saving time left out); `path`: an HF model directory, or a PEFT adapter directory
    over the run's initial model; `version`: rollwise's policy version, `step`: the trainer's step
    (either may be unknown); `save_s`: seconds spent keeping it."""

    at_s: float
    path: str
    version: int | None = None
    step: int | None = None
    save_s: float = 0.0


def append_manifest(directory: Path, snapshot: Snapshot) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    with (directory / MANIFEST).open("a", encoding="utf-8") as out:
        out.write(json.dumps(asdict(snapshot)) + "\n")


def read_manifest(directory: Path) -> list[Snapshot]:
    """The snapshots of `directory`/manifest.jsonl in training-time order (a line cut by a crash skipped)."""
    found = []
    path = directory / MANIFEST
    for line in path.read_text(encoding="utf-8").splitlines() if path.is_file() else []:
        try:
            found.append(Snapshot(**json.loads(line)))
        except (ValueError, TypeError):
            continue
    return sorted(found, key=lambda s: s.at_s)


def _newest_version(weights: Path) -> int | None:
    from pipeline.contracts.run_dir import is_published_dir

    versions = [
        int(m.group(1))
        for child in (weights.iterdir() if weights.is_dir() else [])
        if (m := _VERSION_DIR.match(child.name)) and is_published_dir(child)
    ]
    return max(versions, default=None)


class VersionSnapshots:
    """Keeps a running daemon's policy at a cadence of its training clock: whenever the clock passes a
    snapshot point, the newest published `weights/v<N>` is copied into `dest` (the daemon keeps only the
    newest few; a version pruned mid-copy is retried with the next one). A copy's `at_s` is when the
    version was written (its files' mtime, on the clock the daemon was launched on), less the copying
    time spent before it; the copying time in all is `spent_s`, which the caller takes off the clock."""

    def __init__(self, run_dir: Path, dest: Path, every_s: float, initial_model: Path) -> None:
        self.weights = run_dir / "weights"
        self.dest = dest
        self.every_s = every_s
        self.initial_model = initial_model
        self.launched_at = time.time()
        self.spent_s = 0.0
        self.taken = 0  # snapshot points passed so far
        self.last_version = 0

    def start(self) -> None:
        """At the daemon's launch: point 0 is the initial model (built by the daemon, scored after)."""
        self.launched_at = time.time()
        append_manifest(self.dest, Snapshot(at_s=0.0, path=str(self.initial_model), version=0))

    def poll(self, clock_s: float) -> None:
        index = cadence_index(clock_s, self.every_s)
        if index > self.taken:
            self.taken = index
            self.keep_newest()

    def keep_newest(self) -> None:
        """Copy the newest published version unless it is the one kept last."""
        started = time.monotonic()
        for _ in range(5):
            version = _newest_version(self.weights)
            if version is None or version == self.last_version:
                break
            source, target = self.weights / f"v{version}", self.dest / f"v{version}"
            try:
                written = max(f.stat().st_mtime for f in source.iterdir())
                shutil.copytree(source, target, dirs_exist_ok=True)
            except (FileNotFoundError, ValueError, shutil.Error):  # pruned meanwhile: take the newer one
                shutil.rmtree(target, ignore_errors=True)
                continue
            at_s = max(0.0, written - self.launched_at - self.spent_s)
            save_s = time.monotonic() - started
            append_manifest(self.dest, Snapshot(at_s=at_s, path=str(target), version=version, save_s=save_s))
            self.last_version = version
            break
        self.spent_s += time.monotonic() - started


def score_snapshots(
    cfg_file: Path | None,
    overrides: Sequence[str],
    snapshots: Sequence[Snapshot],
    base_model: Path,
    scores: Path,
    *,
    threads: int | None = None,
    concurrency: int | None = None,
    log: Any = None,
) -> list[dict[str, Any]]:
    """Each snapshot scored by rollwise's held-out evaluation (`rollwise eval`'s: the config's [eval]
    tasks, greedy only, an embedded engine in this process), one after the other; returns the eval rows
    (logs/eval.jsonl's shape, `elapsed_s` = the snapshot's `at_s`, plus `snapshot`), oldest first, also
    appended to `scores`. A snapshot already in `scores` is not scored again. An adapter snapshot is
    served over `base_model`; `concurrency`: episodes in flight (default eval.max_concurrent_episodes).
    Episodes that timed out or failed at the engine measure the machine, not
    the policy (a loaded CPU engine with `eval.max_concurrent_episodes` in flight can outlast the env's
    episode timeout): the snapshot is scored again with half as many in flight, down to one; the row
    records the concurrency it was scored at and any episodes still unmeasured then."""
    import asyncio
    import dataclasses

    from pipeline.contracts.config import load_config
    from pipeline.contracts.run_dir import is_model_dir
    from pipeline.supervisor.eval_schedule import append_line, eval_row, read_eval_log, resolve_eval
    from pipeline.tools.offline_eval import evaluate_weights

    cfg = load_config(cfg_file, list(overrides))
    setup = resolve_eval(cfg, greedy=True, samples=0)
    if concurrency is not None:
        setup = dataclasses.replace(setup, max_concurrent=concurrency)
    done = {row.get("snapshot"): row for row in read_eval_log(scores)} if scores.is_file() else {}
    rows = []
    for index, snap in enumerate(snapshots):
        row = done.get(snap.path)
        if row is None:
            path = Path(snap.path)
            model, adapter = (path, None) if is_model_dir(path) else (base_model, path)
            version = snap.version if snap.version is not None else (snap.step or 0)
            at = setup
            while True:
                results, seconds = asyncio.run(
                    evaluate_weights(cfg, at, model, adapter=adapter, version=version, threads=threads)
                )
                unmeasured = sum(r.finish_reasons.get(k, 0) for r in results.values() for k in UNMEASURED)
                if not unmeasured or at.max_concurrent == 1:
                    break
                if log is not None:
                    print(f"  snapshot {index + 1}: {unmeasured} episodes timed out or failed at the engine "
                          f"with {at.max_concurrent} in flight; scoring it again with "
                          f"{at.max_concurrent // 2}", file=log, flush=True)  # fmt: skip
                at = dataclasses.replace(at, max_concurrent=at.max_concurrent // 2)
            row = eval_row(setup, results, version=version, step=snap.step, elapsed_s=snap.at_s,
                           duration_s=seconds)  # fmt: skip
            row |= {"snapshot": snap.path, "concurrency": at.max_concurrent, "unmeasured": unmeasured}
            append_line(scores, row)
        if log is not None:
            success = success_of(row, "greedy")
            shown = "-" if success is None else f"{success:.3f}"
            print(f"  snapshot {index + 1}/{len(snapshots)} at {snap.at_s:.0f} s: greedy success {shown}",
                  file=log, flush=True)  # fmt: skip
        rows.append(row)
    return sorted(rows, key=lambda r: float(r["elapsed_s"]))


def run_seed(
    config: str | None,
    seed: int,
    out: Path,
    *,
    minutes: float | None,
    max_steps: int | None,
    overrides: Sequence[str],
    grace_s: float = 60.0,
    snapshots: VersionSnapshots | None = None,
) -> list[dict[str, Any]]:
    """One daemon run of `config` at `seed` in OUT/seed<seed>; returns its eval rows. With `snapshots`
    (watching this run directory), its policy is kept at their cadence while it runs, and `minutes`
    counts training time: the copying time is added to the wall-clock limit."""
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
        if snapshots is not None:
            snapshots.start()
        proc = subprocess.Popen(argv, stdout=stdout, stderr=stderr, cwd=REPO)
        engines = ChildCpu(parent=proc.pid, marker="pipeline.engine")
        stopped = False  # stopped by us at its time limit: any exit code then is ours, not a failure
        try:
            limit = None if minutes is None else minutes * 60.0
            started = time.monotonic()
            sampled, ran_s = started, 0.0
            while proc.poll() is None:
                ran_s = time.monotonic() - started
                if time.monotonic() - sampled >= ENGINE_SAMPLE_S:
                    engines.sample()
                    sampled = time.monotonic()
                clock = time.monotonic() - started - (snapshots.spent_s if snapshots is not None else 0.0)
                if snapshots is not None:
                    snapshots.poll(clock)
                if limit is not None and clock >= limit:
                    if snapshots is not None:
                        snapshots.keep_newest()  # the policy at the time limit
                    engines.sample()
                    ran_s = time.monotonic() - started
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
    report_budgets(run_dir, seed, engines, wall_s=ran_s)
    if snapshots is not None and not stopped:
        snapshots.keep_newest()  # it ended by itself (run.max_steps): its last version is still on disk
    if not stopped and proc.returncode not in (0, -signal.SIGTERM, 128 + signal.SIGTERM):
        raise RuntimeError(f"seed {seed}: rollwise run exited {proc.returncode}; see {out}/seed{seed}.stderr")
    return read_eval_log(run_dir / "logs" / "eval.jsonl")


def report_budgets(run_dir: Path, seed: int, engines: ChildCpu, *, wall_s: float) -> str:
    """The run's learner and engine idle shares (pipeline.tools.bench.run_budgets), printed and written to
    the run directory's logs/budgets.txt."""
    from pipeline.contracts.config import EmbeddedEngine, ManagedEngine, load_config

    learner = learner_budget(run_dir / "logs" / "steps.jsonl")
    busy, limit = None, None
    resolved = run_dir / "config.toml"
    if resolved.is_file() and engines.seconds:
        cfg = load_config(resolved)
        e = cfg.engine
        threads = (e.threads if isinstance(e, EmbeddedEngine) else None) or 1
        count = e.num_engines if isinstance(e, ManagedEngine) else 1
        busy = engine_busy_fraction(engines.total_s, wall_s, threads, count)
        limit = run_limit(
            run_dir / "logs" / "steps.jsonl",
            run_dir.parent / f"{run_dir.name}.jsonl",  # the daemon's progress (run_seed)
            wall_s=wall_s,
            engine_busy_s=engines.total_s / (threads * count),
            batch_groups=cfg.learner.batch_groups,
        )
    line = f"seed {seed}: {render_budgets(learner, busy)}" + (f"; {limit}" if limit else "")
    print(line, file=sys.stderr, flush=True)
    if (run_dir / "logs").is_dir():
        (run_dir / "logs" / "budgets.txt").write_text(line + "\n")
    return line


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
        "--offline-eval",
        action="store_true",
        help="evaluate nothing while training: keep the policy every --snapshot-every-s of training time "
        "and score the snapshots after each run (greedy, the config's [eval] tasks)",
    )
    p.add_argument(
        "--snapshot-every-s", type=float, default=30.0, help="--offline-eval: snapshot cadence (default 30)"
    )
    p.add_argument(
        "--eval-threads", type=int, help="--offline-eval: the scoring engine's threads (default: every core)"
    )
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
    if args.snapshot_every_s <= 0 or (args.eval_threads is not None and args.eval_threads < 1):
        p.error("--snapshot-every-s must be > 0 and --eval-threads >= 1")
    return args


def collect_runs(dirs: Sequence[Path]) -> dict[int, list[dict[str, Any]]]:
    """seed -> eval rows of every OUT/seed<s>/logs/eval.jsonl under `dirs` (OUT/seed<s>/snapshots/
    scores.jsonl instead where a run was scored off the clock); a directory without one, or a seed found
    twice, is an error (two runs of one seed would be counted as two samples)."""
    from pipeline.supervisor.eval_schedule import read_eval_log

    runs: dict[int, list[dict[str, Any]]] = {}
    for out in dirs:
        found = 0
        for seed_dir in sorted(out.glob("seed*")):
            name = seed_dir.name.removeprefix("seed")
            scored = seed_dir / SNAPSHOTS / SCORES
            log = scored if scored.is_file() else seed_dir / "logs" / "eval.jsonl"
            if not name.isdigit() or not log.is_file():
                continue
            if int(name) in runs:
                raise ValueError(f"seed {name} appears twice (again in {log})")
            runs[int(name)] = sorted(read_eval_log(log), key=lambda r: float(r.get("elapsed_s") or 0.0))
            found += 1
        if not found:
            raise ValueError(f"{out}: no seed<s>/logs/eval.jsonl (not an OUT of rollwise bench learn)")
    return runs


def run_seed_offline(
    config: str | None,
    seed: int,
    out: Path,
    args: argparse.Namespace,
    overrides: Sequence[str],
    model_path: str | None,
) -> list[dict[str, Any]]:
    """`run_seed` with its policy kept every --snapshot-every-s and scored after the run (--offline-eval);
    returns the scored rows."""
    from pipeline.contracts.cpu_features import usable_cores
    from pipeline.contracts.run_dir import RunDir

    run_dir = out / f"seed{seed}"
    if (run_dir / SNAPSHOTS).exists():
        raise RuntimeError(f"seed {seed}: {run_dir / SNAPSHOTS} exists already: pass a fresh --out")
    initial = RunDir.at(run_dir, model_path).initial_model
    snapshots = VersionSnapshots(run_dir, run_dir / SNAPSHOTS, args.snapshot_every_s, initial)
    run_seed(
        config, seed, out, minutes=args.minutes, max_steps=args.max_steps, overrides=overrides,
        snapshots=snapshots,
    )  # fmt: skip
    print(f"seed {seed}: scoring {len(read_manifest(snapshots.dest))} snapshots (copying took "
          f"{snapshots.spent_s:.1f} s, off the clock)", file=sys.stderr, flush=True)  # fmt: skip
    return score_snapshots(
        run_dir / "config.toml",
        [f"run.run_dir={json.dumps(str(run_dir))}"],
        read_manifest(snapshots.dest),
        initial,
        snapshots.dest / SCORES,
        threads=args.eval_threads if args.eval_threads is not None else usable_cores(),
        log=sys.stderr,
    )


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
    overrides = [*args.set, *evaluation_off()] if args.offline_eval else list(args.set)
    try:  # the whole config is checked once before the first run starts
        cfg = load_config(args.config, [*overrides, "run.seed=0"])
    except ConfigError as exc:
        print(f"rollwise bench learn: {exc}", file=sys.stderr)
        return 2
    if not evaluates_during_training(cfg) and not args.offline_eval:
        print(
            "rollwise bench learn: the config evaluates nothing: set eval.every_versions > 0, or pass "
            "--offline-eval",
            file=sys.stderr,
        )
        return 2
    out = (args.out or REPO / "runs" / f"bench-learn-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    config = str(Path(args.config).resolve()) if args.config is not None else None
    runs: dict[int, list[dict[str, Any]]] = {}
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        print(f"seed {seed}: running in {out / f'seed{seed}'}", file=sys.stderr, flush=True)
        try:
            if args.offline_eval:
                runs[seed] = run_seed_offline(config, seed, out, args, overrides, cfg.model.path)
            else:
                runs[seed] = run_seed(
                    config, seed, out, minutes=args.minutes, max_steps=args.max_steps, overrides=overrides
                )
        except RuntimeError as exc:
            print(f"rollwise bench learn: {exc}", file=sys.stderr)
            return 1
    summary = _summary(runs, args, argv)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary) if args.json else format_report(summary))
    return 0
