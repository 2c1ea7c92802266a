"""`rollwise bench trl`: rollwise against TRL's GRPOTrainer (GSPO settings), evaluation off the clock.

The same model, task, reward, token budget, cores and minutes, one side after the other:

    rollwise bench trl --minutes 10 --seeds 0 1 2 [--max-new-tokens 48]
                       [--config examples/smollm2_arithmetic.toml] [--out DIR] [--sides rollwise trl]
                       [--snapshot-every-s 30] [--set K=V ...] [--json]
    rollwise bench trl --from OUT      (report what OUT holds; runs nothing)

For each seed s, one after the other and never at the same time:

- rollwise: `rollwise run --config F --set run.seed=s --set eval.every_versions=0 (every [eval] trigger
  at 0) --set sampling.max_new_tokens=N` in OUT/rollwise/seed<s>, stopped with SIGTERM after `--minutes`
  of its clock; every `--snapshot-every-s` this process copies its newest published version into
  OUT/rollwise/seed<s>/snapshots/ (`learning_curve.VersionSnapshots`).
- TRL: `pipeline/tools/bench/trl_grpo_run.py` in a process of its own (`--trl-python`, default this
  interpreter): GRPOTrainer on the HF directory rollwise's preset builds (`rollwise model init`, seed s),
  the same training task stream (the env's `tasks(run.seed)` in order, the prompts rollwise's runner sends,
  written to OUT/trl/seed<s>/tasks.jsonl), the env's own step as the reward, N completion tokens, GSPO
  settings (sequence-level ratio, loss_type "dapo", beta 0, epsilon 3e-4 / 4e-4), fp32 full fine-tuning,
  lr 2e-6, 2 prompts x 8 completions per step, temperature 1, 2 torch threads (each a flag); its
  callback saves the model every `--snapshot-every-s` of its clock into OUT/trl/seed<s>/snapshots/.
- Then every snapshot of both, the initial model first, is scored by rollwise's held-out evaluation
  (`rollwise eval`'s `evaluate_weights`: an embedded engine in this process, greedy, the config's [eval]
  tasks and seed, the same reward, `--eval-concurrency` episodes in flight, in `--eval-dtype`: float32 by
  default, because in bf16 the greedy replies depend on what else is in the batch, measured at 31, 33,
  33 and 35 of 64 tasks for the same model, in flight 32, 16, 8 and 8) into
  <side>/seed<s>/snapshots/scores.jsonl. Full-weight TRL
  snapshots are deleted once scored unless `--keep-snapshots` (~270 MB each for SmolLM2-135M).

Both clocks start when this process launches the side's process (model loading and start-up count) and
leave out the time spent keeping snapshots. The curve of a run is (clock seconds at which a snapshot's
policy existed, its held-out success); the time to a threshold (0.7 and 0.8 by default) is that of its
first snapshot at or above it, so it is known to within one snapshot interval or one training step.
Reported per side and seed: success at start, time to each threshold, final success (the policy at the
time limit); per side, the mean and 95% t-interval over seeds (times over the seeds that reached it);
and the ratio rollwise/TRL of the times. Also written to OUT/summary.json.

Exit codes: 0 reported, 1 a run failed, 2 bad arguments or TRL missing (the message says how to install
it: `pip install -e '.[trl]'`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pipeline.tools.bench.learning_curve import (
    REPO,
    SCORES,
    SNAPSHOTS,
    Interval,
    VersionSnapshots,
    evaluation_off,
    read_manifest,
    run_seed,
    score_snapshots,
    success_of,
    t_interval,
)

SIDES = ("rollwise", "trl")
LABELS = {"rollwise": "rollwise", "trl": "TRL"}
DEFAULT_CONFIG = REPO / "examples" / "smollm2_arithmetic.toml"
TRL_INSTALL = "pip install -e '.[trl]'"  # the optional extra: the TRL version this bench was written for
TRL_SCRIPT = "pipeline.tools.bench.trl_grpo_run"


def trl_missing(python: str) -> str | None:
    """None when `python` imports trl; else the message saying how to install it."""
    try:
        done = subprocess.run(
            [python, "-c", "import trl"], capture_output=True, text=True, timeout=300, check=False
        )
    except OSError as exc:
        return f"cannot run {python} ({exc}): pass --trl-python, a Python that has TRL"
    if done.returncode == 0:
        return None
    return (
        f"TRL is not installed for {python}: install the optional extra with `{TRL_INSTALL}` (TRL 1.16, "
        "beside rollwise in its virtualenv), or pass --trl-python, a Python that has it "
        "(or run only the rollwise side: --sides rollwise)"
    )


# ---- the report -------------------------------------------------------------------------------------------
def seed_result(rows: Sequence[dict[str, Any]], thresholds: Sequence[float]) -> dict[str, Any]:
    """One run's curve (scored rows, any order) -> success at start (the first snapshot), minutes to each
    threshold (the first snapshot at or above it; None when none), final success and step (the last
    snapshot; its row's `version`: rollwise's policy version, TRL's optimizer step)."""
    curve = sorted(
        (
            (float(r["elapsed_s"]), s, r.get("version"))
            for r in rows
            if (s := success_of(r, "greedy")) is not None
        ),
        key=lambda point: point[0],
    )
    reached: dict[str, float | None] = {}
    for threshold in thresholds:
        at = next((t for t, s, _ in curve if s >= threshold), None)
        reached[str(threshold)] = None if at is None else at / 60.0
    return {
        "start": curve[0][1] if curve else None,
        "final": curve[-1][1] if curve else None,
        "final_minutes": curve[-1][0] / 60.0 if curve else None,
        "final_step": curve[-1][2] if curve else None,
        "minutes_to": reached,
        "snapshots": len(curve),
    }


def _iv(values: Sequence[float], bounds: tuple[float, float]) -> dict[str, Any] | None:
    interval: Interval | None = t_interval(values, bounds=bounds)
    return asdict(interval) if interval is not None else None


def seed_ratio(rollwise: float | None, trl: float | None, minutes: float | None) -> dict[str, Any]:
    """rollwise's time over TRL's for one seed; a bound when one side did not reach it within `minutes`
    (that side would have needed more than all of them)."""
    if rollwise is not None and trl is not None:
        return {"ratio": rollwise / trl}
    if rollwise is not None and minutes:
        return {"below": rollwise / minutes}  # TRL needs > minutes
    if trl is not None and minutes:
        return {"above": minutes / trl}
    return {}


def summarise(
    curves: dict[str, dict[int, list[dict[str, Any]]]],
    *,
    thresholds: Sequence[float],
    minutes: float | None,
) -> dict[str, Any]:
    """side -> seed -> scored rows, as the report (module docstring) in plain data."""
    sides: dict[str, Any] = {}
    for side, runs in curves.items():
        per_seed = {seed: seed_result(rows, thresholds) for seed, rows in sorted(runs.items())}
        results = list(per_seed.values())
        to: dict[str, Any] = {}
        for threshold in thresholds:
            times = [m for r in results if (m := r["minutes_to"][str(threshold)]) is not None]
            to[str(threshold)] = {"reached": len(times), "interval": _iv(times, (0.0, math.inf))}
        sides[side] = {
            "seeds": {str(s): r for s, r in per_seed.items()},
            "start": _iv([r["start"] for r in results if r["start"] is not None], (0.0, 1.0)),
            "final": _iv([r["final"] for r in results if r["final"] is not None], (0.0, 1.0)),
            "minutes_to": to,
        }
    ratios: dict[str, Any] = {}
    if "rollwise" in sides and "trl" in sides:
        ours, theirs = sides["rollwise"]["seeds"], sides["trl"]["seeds"]
        common = sorted(set(ours) & set(theirs), key=int)
        for threshold in thresholds:
            key = str(threshold)
            pairs = {s: (ours[s]["minutes_to"][key], theirs[s]["minutes_to"][key]) for s in common}
            both = [(a, b) for a, b in pairs.values() if a is not None and b is not None]
            ratios[key] = {
                "per_seed": {s: seed_ratio(a, b, minutes) for s, (a, b) in pairs.items()},
                "both_reached": len(both),
                # mean rollwise time / mean TRL time over the seeds where both reached the threshold
                "ratio_of_means": ((sum(a for a, _ in both) / sum(b for _, b in both)) if both else None),
            }
    return {
        "thresholds": list(thresholds),
        "minutes": minutes,
        "mode": "greedy",
        "interval": "two-sided 95% Student-t over seeds",
        "sides": sides,
        "ratio_rollwise_over_trl": ratios,
    }


def _minutes(value: float | None) -> str:
    return "not reached" if value is None else f"{value:.1f} min"


def _span(iv: dict[str, Any] | None, digits: int = 2) -> str:
    if iv is None:
        return "-"
    return f"{iv['mean']:.{digits}f} [{iv['low']:.{digits}f}, {iv['high']:.{digits}f}]"


def _ratio(r: dict[str, Any]) -> str:
    if "ratio" in r:
        return f"{r['ratio']:.2f}"
    if "below" in r:
        return f"< {r['below']:.2f} (TRL not reached)"
    if "above" in r:
        return f"> {r['above']:.2f} (rollwise not reached)"
    return "- (neither reached)"


def format_table(summary: dict[str, Any]) -> str:
    thresholds = [str(t) for t in summary["thresholds"]]
    span = f", {summary['minutes']:g} min per side per seed" if summary.get("minutes") else ""
    lines = [f"rollwise vs TRL GRPOTrainer (GSPO settings): held-out greedy success{span}"]
    head = f"{'side':<9} {'seed':>4}  {'start':>5}  " + "  ".join(f"{'to ' + t:>11}" for t in thresholds)
    lines.append(head + f"  {'final':>5}  {'steps':>5}  snapshots")
    for side, data in summary["sides"].items():
        for seed, r in data["seeds"].items():
            cells = "  ".join(f"{_minutes(r['minutes_to'][t]):>11}" for t in thresholds)
            start = "-" if r["start"] is None else f"{r['start']:.2f}"
            final = "-" if r["final"] is None else f"{r['final']:.2f}"
            steps = "-" if r["final_step"] is None else str(r["final_step"])
            row = f"{LABELS[side]:<9} {seed:>4}  {start:>5}  {cells}  {final:>5}  {steps:>5}"
            lines.append(f"{row}  {r['snapshots']:>9}")
    lines.append(f"mean over seeds ({summary['interval']}; times over the seeds that reached it):")
    for side, data in summary["sides"].items():
        n = len(data["seeds"])
        parts = [f"start {_span(data['start'])}"]
        for t in thresholds:
            to = data["minutes_to"][t]
            time_to = "not reached" if to["interval"] is None else f"{_span(to['interval'], 1)} min"
            parts.append(f"to {t} {time_to} ({to['reached']}/{n})")
        parts.append(f"final {_span(data['final'])}")
        lines.append(f"  {LABELS[side]:<9} " + "; ".join(parts))
    for t, r in summary["ratio_rollwise_over_trl"].items():
        seeds = ", ".join(f"seed {s} {_ratio(v)}" for s, v in r["per_seed"].items())
        mean = (
            f"{r['ratio_of_means']:.2f} over the {r['both_reached']} seed(s) where both reached it"
            if r["ratio_of_means"] is not None
            else "no seed where both reached it"
        )
        lines.append(f"time to {t}, rollwise/TRL: {mean} ({seeds})")
    for run, t in summary.get("timings", {}).items():
        lines.append(
            f"{run}: training {t['wall_s']:.0f} s wall (keeping snapshots {t['snapshot_save_s']:.1f} s, off "
            f"the clock), scoring {t['scoring_s']:.0f} s"
        )
    return "\n".join(lines)


# ---- the runs ----------------------------------------------------------------------------------------------
def training_prompts(cfg: Any, count: int) -> list[dict[str, Any]]:
    """The first `count` tasks of rollwise's training stream for `cfg` (the env's `tasks(run.seed)`
    without the held-out ones), each with the messages rollwise's runner sends for it. ValueError for an
    env that plays more than one turn (TRL's GRPOTrainer scores one completion per prompt)."""
    import asyncio
    import itertools

    from envs.api import Task
    from envs.discovery import resolve_env
    from envs.task_split import training_tasks
    from pipeline.supervisor.eval_schedule import training_holdout

    factory = resolve_env(cfg.env.name)
    options = dict(cfg.env.options)
    probe = factory(**options)
    if probe.spec.max_turns != 1:
        raise ValueError(
            f"{cfg.env.name} plays up to {probe.spec.max_turns} turns: the TRL side scores one completion "
            "per prompt, so it needs a single-turn env (for reasoning-gym: attempts = 1)"
        )
    stream = training_tasks(probe.tasks(cfg.run.seed), training_holdout(cfg))

    async def prompt(task: Task) -> dict[str, Any]:
        env = factory(**options)
        try:
            messages = list(await env.reset(task))
        finally:
            await env.close()
        if cfg.env.system_prompt is not None:  # as rollout.py's runner adds it
            messages = [{"role": "system", "content": cfg.env.system_prompt}, *messages]
        return {"prompt": messages, "task": {"id": task.id, "seed": task.seed, "data": dict(task.data)}}

    async def build() -> list[dict[str, Any]]:
        return [await prompt(task) for task in itertools.islice(stream, count)]

    return asyncio.run(build())


def _model_for_trl(cfg: Any, seed: int, target: Path) -> Path:
    """The HF directory the TRL side trains: `model.path`, else the preset built as the daemon builds it."""
    if cfg.model.path is not None:
        return Path(cfg.model.path)
    argv = ["--out", str(target), "--preset", cfg.model.preset, "--seed", str(seed), "--keep-existing"]
    done = subprocess.run(
        [sys.executable, "-m", "learner.model.model_init", *argv], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"building the {cfg.model.preset} model failed: {done.stderr.strip()[-2000:]}")
    return target


def run_trl(args: argparse.Namespace, cfg: Any, seed: int, out: Path) -> Path:
    """The TRL side of one seed into `out` (OUT/trl/seed<s>); returns its snapshot directory."""
    if (out / SNAPSHOTS).exists():
        raise RuntimeError(f"TRL seed {seed}: {out / SNAPSHOTS} exists already: pass a fresh --out")
    out.mkdir(parents=True, exist_ok=True)
    model = _model_for_trl(cfg, seed, out / "model")
    # Enough tasks for a step a second (one takes several here): the clock ends the run, not the data.
    count = max(64, math.ceil(args.minutes * 60)) * args.trl_prompts_per_step
    tasks = out / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(row) + "\n" for row in training_prompts(cfg, count)))
    argv = [
        args.trl_python, "-m", TRL_SCRIPT,
        "--model", str(model), "--tasks", str(tasks), "--out", str(out),
        "--env", cfg.env.name, "--env-options", json.dumps(dict(cfg.env.options)),
        "--minutes", str(args.minutes), "--snapshot-every-s", str(args.snapshot_every_s),
        "--seed", str(seed), "--max-new-tokens", str(args.max_new_tokens),
        "--threads", str(args.trl_threads), "--lr", str(args.trl_lr),
        "--prompts-per-step", str(args.trl_prompts_per_step), "--generations", str(args.trl_generations),
        "--temperature", str(args.trl_temperature),
    ]  # fmt: skip
    if args.trl_max_steps is not None:
        argv += ["--max-steps", str(args.trl_max_steps)]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    with (out / "trl.stdout").open("wb") as stdout, (out / "trl.stderr").open("wb") as stderr:
        argv += ["--launched-at", repr(time.time())]
        proc = subprocess.Popen(argv, stdout=stdout, stderr=stderr, cwd=REPO, env=env)
        try:
            # Its own clock stops it; this bound only catches a hung process (saving time is unbounded).
            code = proc.wait(timeout=args.minutes * 60.0 * 3 + 900)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"TRL seed {seed}: still running long after its minutes; killed") from None
    if code != 0:
        raise RuntimeError(f"TRL seed {seed}: exited {code}; see {out / 'trl.stderr'}")
    return out / SNAPSHOTS


def rollwise_overrides(args: argparse.Namespace) -> list[str]:
    return [*args.set, *evaluation_off(), f"sampling.max_new_tokens={args.max_new_tokens}"]


def run_rollwise(args: argparse.Namespace, cfg: Any, seed: int, out: Path) -> Path:
    """The rollwise side of one seed (its run directory: OUT/rollwise/seed<s>); returns its snapshots."""
    from pipeline.contracts.run_dir import RunDir

    run_dir = out / f"seed{seed}"
    if (run_dir / SNAPSHOTS).exists():
        raise RuntimeError(f"rollwise seed {seed}: {run_dir / SNAPSHOTS} exists already: pass a fresh --out")
    initial = RunDir.at(run_dir, cfg.model.path).initial_model
    snapshots = VersionSnapshots(run_dir, run_dir / SNAPSHOTS, args.snapshot_every_s, initial)
    config = str(Path(args.config).resolve())
    run_seed(
        config, seed, out, minutes=args.minutes, max_steps=None, overrides=rollwise_overrides(args),
        snapshots=snapshots,
    )  # fmt: skip
    return snapshots.dest


def score_side(args: argparse.Namespace, side: str, seed: int, snapshots: Path) -> list[dict[str, Any]]:
    """Every snapshot of one side's seed scored (learning_curve.score_snapshots) with that run's config."""
    from pipeline.contracts.config import load_config
    from pipeline.contracts.cpu_features import usable_cores
    from pipeline.contracts.run_dir import RunDir

    kept = read_manifest(snapshots)
    print(f"{LABELS[side]} seed {seed}: scoring {len(kept)} snapshots", file=sys.stderr, flush=True)
    if side == "rollwise":  # the daemon's resolved config; adapters are served over its initial model
        run_dir = snapshots.parent
        cfg_file = run_dir / "config.toml"
        overrides = [f"run.run_dir={json.dumps(str(run_dir))}"]
        base = RunDir.at(run_dir, load_config(cfg_file, overrides).model.path).initial_model
    else:  # full-weight snapshots; the first is the model it started from
        cfg_file = Path(args.config).resolve()
        overrides = [*rollwise_overrides(args), f"run.seed={seed}"]
        base = Path(kept[0].path) if kept else snapshots
    overrides.append(f"engine.dtype={args.eval_dtype}")  # the scoring engine's only
    threads = args.eval_threads if args.eval_threads is not None else usable_cores()
    rows = score_snapshots(
        cfg_file,
        overrides,
        kept,
        base,
        snapshots / SCORES,
        threads=threads,
        concurrency=args.eval_concurrency,
        log=sys.stderr,
    )
    if side == "trl" and not args.keep_snapshots:  # full weights: hundreds of MB each, their score is kept
        for snap in kept:
            if Path(snap.path).parent == snapshots:
                shutil.rmtree(snap.path, ignore_errors=True)
    return rows


def collect(out: Path) -> dict[str, dict[int, list[dict[str, Any]]]]:
    """side -> seed -> scored rows of every OUT/<side>/seed<s>/snapshots/scores.jsonl."""
    from pipeline.supervisor.eval_schedule import read_eval_log

    curves: dict[str, dict[int, list[dict[str, Any]]]] = {}
    for side in SIDES:
        for scores in sorted((out / side).glob(f"seed*/{SNAPSHOTS}/{SCORES}")):
            name = scores.parents[1].name.removeprefix("seed")
            if name.isdigit():
                curves.setdefault(side, {})[int(name)] = read_eval_log(scores)
    return curves


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="rollwise bench trl", description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, help="training minutes per side and seed")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="run.seed of each pair of runs")
    p.add_argument("--max-new-tokens", type=int, default=48, help="completion tokens, both sides")
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="the rollwise config: task, model, [eval]")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override (the task, model and [eval] are both sides')",
    )
    p.add_argument("--out", type=Path, help="directory of the runs (default: runs/bench-trl-<time>)")
    p.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    p.add_argument("--from", dest="from_dir", type=Path, metavar="OUT", help="report OUT; run nothing")
    p.add_argument("--thresholds", type=float, nargs="+", default=[0.7, 0.8])
    p.add_argument("--snapshot-every-s", type=float, default=30.0, help="snapshot cadence, training seconds")
    p.add_argument("--eval-threads", type=int, help="the scoring engine's threads (default: every core)")
    p.add_argument(
        "--eval-concurrency",
        type=int,
        default=8,
        help="episodes in flight while scoring, the same for every snapshot (default 8: greedy decoding "
        "in bf16 depends a little on the batch; fewer in flight keep a loaded CPU within the episode "
        "timeout)",
    )
    p.add_argument(
        "--eval-dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="the scoring engine's dtype (default float32: bf16 greedy replies change with the batch)",
    )
    p.add_argument("--keep-snapshots", action="store_true", help="keep TRL's full-weight snapshots")
    p.add_argument("--trl-python", default=sys.executable, help="the Python that runs TRL (has trl)")
    p.add_argument("--trl-threads", type=int, default=2, help="TRL's torch threads (default 2)")
    p.add_argument("--trl-lr", type=float, default=2e-6, help="TRL's learning rate (default 2e-6)")
    p.add_argument("--trl-prompts-per-step", type=int, default=2)
    p.add_argument("--trl-generations", type=int, default=8, help="completions per prompt (default 8)")
    p.add_argument("--trl-temperature", type=float, default=1.0)
    p.add_argument("--trl-max-steps", type=int, help="also stop TRL after this many steps (tests)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = p.parse_args(list(argv))
    if args.from_dir is None and (args.minutes is None or args.minutes <= 0):
        p.error("--minutes must be given and > 0 (or --from OUT to report finished runs)")
    if args.snapshot_every_s <= 0 or args.max_new_tokens < 1 or len(set(args.seeds)) != len(args.seeds):
        p.error("--snapshot-every-s must be > 0, --max-new-tokens >= 1, --seeds distinct")
    if args.eval_concurrency < 1:
        p.error("--eval-concurrency must be >= 1")
    if not all(0.0 < t <= 1.0 for t in args.thresholds):
        p.error("--thresholds must lie in (0, 1]")
    return args


def main(argv: Sequence[str]) -> int:
    from pipeline.contracts.config import ConfigError, load_config

    args = parse_args(argv)
    if args.from_dir is not None:
        finished = collect(args.from_dir)
        if not finished:
            print(f"rollwise bench trl: {args.from_dir} holds no <side>/seed<s>/snapshots/scores.jsonl",
                  file=sys.stderr)  # fmt: skip
            return 2
        return _report(args, finished, argv, args.from_dir)
    if "trl" in args.sides and (missing := trl_missing(args.trl_python)) is not None:
        print(f"rollwise bench trl: {missing}", file=sys.stderr)
        return 2
    try:  # checked once before anything runs
        configs = {
            s: load_config(args.config, [*rollwise_overrides(args), f"run.seed={s}"]) for s in args.seeds
        }
    except ConfigError as exc:
        print(f"rollwise bench trl: {exc}", file=sys.stderr)
        return 2
    out = (args.out or REPO / "runs" / f"bench-trl-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    curves: dict[str, dict[int, list[dict[str, Any]]]] = {}
    timings: dict[str, dict[str, float]] = {}
    for seed in args.seeds:
        kept: dict[str, Path] = {}
        try:
            for side in (s for s in SIDES if s in args.sides):
                print(f"{LABELS[side]} seed {seed}: training {args.minutes:g} min in {out / side}",
                      file=sys.stderr, flush=True)  # fmt: skip
                started = time.monotonic()
                if side == "rollwise":
                    kept[side] = run_rollwise(args, configs[seed], seed, out / side)
                else:
                    kept[side] = run_trl(args, configs[seed], seed, out / side / f"seed{seed}")
                save_s = sum(snap.save_s for snap in read_manifest(kept[side]))
                timings[f"{LABELS[side]} seed {seed}"] = {
                    "wall_s": time.monotonic() - started,
                    "snapshot_save_s": save_s,
                }
            for side, snapshots in kept.items():
                started = time.monotonic()
                curves.setdefault(side, {})[seed] = score_side(args, side, seed, snapshots)
                timings[f"{LABELS[side]} seed {seed}"]["scoring_s"] = time.monotonic() - started
        except (RuntimeError, ValueError) as exc:
            print(f"rollwise bench trl: {exc}", file=sys.stderr)
            return 1
    return _report(args, curves, argv, out, timings)


def _report(
    args: argparse.Namespace,
    curves: dict[str, dict[int, list[dict[str, Any]]]],
    argv: Sequence[str],
    out: Path,
    timings: dict[str, dict[str, float]] | None = None,
) -> int:
    summary = summarise(curves, thresholds=args.thresholds, minutes=args.minutes)
    summary["command"] = ["rollwise", "bench", "trl", *argv]
    if timings:
        summary["timings"] = timings
    if args.from_dir is None:
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary) if args.json else format_table(summary))
    return 0
