"""`rollwise bench moe`: GSPO's own claim, measured on the MoE toy. Three variants, each over seeds:

    grpo           learner.loss.kind = grpo, clip 0.2 / 0.27 (the GSPO paper's GRPO band), no replay
    grpo-replay    the same with learner.moe.routing_replay (the engine's experts replayed in the learner)
    gspo           learner.loss.kind = gspo_token, clip 3e-4 / 4e-4 (the paper's GSPO band), no replay

    rollwise bench moe [--seeds 3] [--max-steps 60] [--minutes M] [--variants grpo,grpo-replay,gspo]
                       [--bucket-versions 10] [--out DIR] [--set K=V ...] [--json] [--short]
    rollwise bench moe --from OUT

Every run is `rollwise run` of the default task's config (examples/guess_number.toml) with
model.preset = moe-tiny (Qwen3-MoE, 8 experts, top-2), float32 engines, learner.mini_batches = 4 (the
paper's split of each rollout batch: 3 of 4 updates off-policy), the load-balancing loss at 0.1, 4 groups
of 16 episodes per step and guess-number on 1..8 in 4 turns (`BENCH_SETTINGS`: 3 x 3 runs of 60 steps
took 15 minutes on the loaded 2-core machine), plus the variant's keys, one after another in
OUT/<variant>/seed<s> (pipeline.tools.bench.learning_curve runs each). `--set` adds to all of them.
`--from OUT` reports runs already made.

Reported per variant, each as the mean over seeds and a two-sided 95% Student-t interval (a seed's value
is its mean over its steps): the expert-activation change after an update (moe_routing_change: share of
(token, layer) top-k sets that differ on the same inputs), the sequence and token clip fractions, the
spread (std) of the token and the sequence log-ratios, the expert load imbalance, the router's share of
the engine/learner mismatch (grpo-replay only: it records routing), and held-out greedy success per
`--bucket-versions` policy versions and at the last evaluation. Versions, not minutes: the variants do
different work per step (replay adds two forwards per mini-batch), minutes would compare machines.
`--short` (1 seed, 2 steps, a small batch) exercises the whole path for a test. The summary is also
written to OUT/summary.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pipeline.tools.bench.learning_curve import last_by, run_seed, success_of, t_interval

ROOT = Path(__file__).resolve().parents[3]  # the checkout: examples/, runs/
CONFIG = ROOT / "examples" / "guess_number.toml"
# What every variant shares on top of the default task's config (module docstring).
BENCH_SETTINGS = (
    "model.preset='moe-tiny'",
    # The learner trains in float32 (guess_number.toml pins it); the embedded engine's default is bfloat16
    # where the CPU has native bf16 matmuls. Pinned so that every machine measures the same thing
    # (docs/training_curve.md was measured with float32 engines); `--set engine.dtype='bfloat16'` adds
    # the precision mismatch.
    "engine.dtype='float32'",
    "learner.batch_groups=4",
    "learner.mini_batches=4",
    # Without a load-balancing loss the toy's routers send every token to the same 2 experts within a few
    # steps, after which no routing ever changes (docs/training_curve.md): nothing left to measure.
    "learner.moe.load_balance_coef=0.1",
    "env.options={low = 1, high = 8, max_turns = 4}",
    "eval.every_versions=10",
    "eval.tasks=32",
    # Its curves are by version: every 10th is scored, whatever it costs the engine (the daemon's default
    # budget, eval.max_engine_share, would space them by time instead).
    "eval.max_engine_share=1.0",
)
VARIANTS: dict[str, tuple[str, ...]] = {
    "grpo": ("learner.loss.kind='grpo'", "learner.loss.clip_low=0.2", "learner.loss.clip_high=0.27"),
    "grpo-replay": (
        "learner.loss.kind='grpo'",
        "learner.loss.clip_low=0.2",
        "learner.loss.clip_high=0.27",
        "learner.moe.routing_replay=true",
    ),
    "gspo": ("learner.loss.kind='gspo_token'", "learner.loss.clip_low=3e-4", "learner.loss.clip_high=4e-4"),
}
# A test's run: the whole path in seconds (2 steps of 2 small groups, an evaluation every version).
SHORT_SETTINGS = (
    "env.group_size=4",
    "learner.batch_groups=2",
    "eval.every_versions=1",
    "eval.tasks=4",
    "rollout.max_concurrent_groups=2",
)
# Step metrics (learner.trainer) reported per variant: name in steps.jsonl -> what the table calls it.
STEP_METRICS = {
    "moe_routing_change": "routing change / update",
    "clip_fraction": "clipped sequences",
    "clip_fraction_token": "clipped tokens",
    "ratio_spread_token": "std log r (token)",
    "ratio_spread_sequence": "std log s (sequence)",
    "moe_load_imbalance": "expert load max/mean",
    "moe_load_balance_loss": "load-balancing loss",
    "router_mismatch_share": "router share of mismatch",
}
MODE = "greedy"


def read_steps(path: Path) -> list[dict[str, Any]]:
    """The step metrics of a run's logs/steps.jsonl, oldest first (unreadable lines skipped)."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and isinstance(row.get("metrics"), dict):
            rows.append(row["metrics"])
    return rows


def seed_means(steps: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Each step metric's mean over the steps that report it (a finite number)."""
    out: dict[str, float] = {}
    for key in STEP_METRICS:
        values = [float(s[key]) for s in steps if isinstance(s.get(key), (int, float))]
        if values:
            out[key] = statistics.fmean(values)
    return out


def summarise_variant(
    runs: dict[int, tuple[list[dict[str, Any]], list[dict[str, Any]]]], *, bucket_versions: int
) -> dict[str, Any]:
    """seed -> (step metrics, eval rows) of one variant as plain data (module docstring)."""
    seeds = sorted(runs)
    per_seed = {s: seed_means(runs[s][0]) for s in seeds}
    metrics = {}
    for key in STEP_METRICS:
        values = [per_seed[s][key] for s in seeds if key in per_seed[s]]
        bounded = key.startswith(("clip", "moe_routing", "router"))  # shares stay in [0, 1]
        bounds = (0.0, 1.0) if bounded else None
        interval = t_interval(values, bounds=bounds)
        metrics[key] = asdict(interval) if interval is not None else None
    evals = {s: runs[s][1] for s in seeds}
    last_version = max((int(r["version"]) for rows in evals.values() for r in rows), default=0)
    curve = []
    for at in range(bucket_versions, last_version + 1, bucket_versions):
        values = [v for s in seeds if (v := last_by(evals[s], "version", float(at), MODE)) is not None]
        interval = t_interval(values, bounds=(0.0, 1.0))
        curve.append({"version": at, "interval": asdict(interval) if interval else None})
    finals = [v for s in seeds if evals[s] and (v := success_of(evals[s][-1], MODE)) is not None]
    final = t_interval(finals, bounds=(0.0, 1.0))
    steps = [len(runs[s][0]) for s in seeds]
    return {
        "seeds": seeds,
        "steps": steps,
        "metrics": metrics,
        "success_per_version": curve,
        "final_success": asdict(final) if final is not None else None,
        "final_version": [int(evals[s][-1]["version"]) if evals[s] else None for s in seeds],
    }


def _cell(interval: dict[str, Any] | None, digits: int) -> str:
    if interval is None:
        return "-"
    if interval["n"] == 1:
        return f"{interval['mean']:.{digits}f}"
    return f"{interval['mean']:.{digits}f} [{interval['low']:.{digits}f}, {interval['high']:.{digits}f}]"


def format_report(summary: dict[str, Any]) -> str:
    variants = summary["variants"]
    names = list(variants)
    lines = [
        f"rollwise bench moe: {', '.join(names)}; mean [95% t-interval] over seeds "
        "(a seed's value: its mean over steps)"
    ]
    width = 32
    header = f"{'':<26}" + "".join(f"{n:>{width}}" for n in names)
    lines.append(header)
    for key, label in STEP_METRICS.items():
        digits = 4 if key.startswith(("clip", "moe_routing", "router")) else 3
        row = f"{label:<26}" + "".join(
            f"{_cell(variants[n]['metrics'][key], digits):>{width}}" for n in names
        )
        lines.append(row)
    row = f"{'held-out success (last)':<26}" + "".join(
        f"{_cell(variants[n]['final_success'], 2):>{width}}" for n in names
    )
    lines.append(row)
    versions = sorted({p["version"] for n in names for p in variants[n]["success_per_version"]})
    if versions:
        lines.append(f"held-out {MODE} success by policy version:")
        for at in versions:
            cells = []
            for n in names:
                point = next((p for p in variants[n]["success_per_version"] if p["version"] == at), None)
                cells.append(_cell(point["interval"] if point else None, 2))
            lines.append(f"{'  v' + str(at):<26}" + "".join(f"{c:>{width}}" for c in cells))
    steps = "; ".join(f"{n}: {variants[n]['steps']}" for n in names)
    lines.append(f"steps per seed: {steps}")
    return "\n".join(lines)


def collect(
    out: Path, variants: Sequence[str]
) -> dict[str, dict[int, tuple[list[dict[str, Any]], list[dict[str, Any]]]]]:
    """variant -> seed -> (step metrics, eval rows) of the runs under OUT/<variant>/seed<s>."""
    from pipeline.supervisor.eval_schedule import read_eval_log

    found: dict[str, dict[int, tuple[list[dict[str, Any]], list[dict[str, Any]]]]] = {}
    for variant in variants:
        runs = {}
        for run_dir in sorted((out / variant).glob("seed*")):
            name = run_dir.name.removeprefix("seed")
            if run_dir.is_dir() and name.isdigit():
                logs = run_dir / "logs"
                runs[int(name)] = (read_steps(logs / "steps.jsonl"), read_eval_log(logs / "eval.jsonl"))
        if runs:
            found[variant] = runs
    return found


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="rollwise bench moe", description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=3, help="runs per variant, run.seed = 0 .. N - 1")
    p.add_argument("--max-steps", type=int, default=60, help="learner steps per run (default 60)")
    p.add_argument("--minutes", type=float, help="also stop a run after this many minutes")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {list(VARIANTS)}")
    p.add_argument("--bucket-versions", type=int, default=10, help="width of the success-by-version table")
    p.add_argument("--out", type=Path, help="directory for the runs (default: runs/bench-moe-<time>)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override, every run")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--short", action="store_true", help="1 seed, 2 steps, small batches: a smoke test")
    p.add_argument("--from", dest="from_dir", type=Path, metavar="OUT", help="report runs already in OUT")
    args = p.parse_args(list(argv))
    args.variant_names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(args.variant_names) - set(VARIANTS))
    if unknown or not args.variant_names:
        p.error(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
    if args.short:
        args.seeds, args.max_steps = 1, 2
    if args.seeds < 1 or args.max_steps < 1 or args.bucket_versions < 1:
        p.error("--seeds, --max-steps and --bucket-versions must be >= 1")
    if args.minutes is not None and args.minutes <= 0:
        p.error("--minutes must be > 0")
    return args


def overrides_for(variant: str, args: argparse.Namespace) -> list[str]:
    return [*BENCH_SETTINGS, *(SHORT_SETTINGS if args.short else ()), *VARIANTS[variant], *args.set]


def main(argv: Sequence[str]) -> int:
    from pipeline.contracts.config import ConfigError, load_config

    args = parse_args(argv)
    if args.from_dir is not None:
        out = args.from_dir.resolve()
    else:
        try:  # every variant's whole config is checked before the first run starts
            for variant in args.variant_names:
                load_config(CONFIG, [*overrides_for(variant, args), "run.seed=0"])
        except ConfigError as exc:
            print(f"rollwise bench moe: {exc}", file=sys.stderr)
            return 2
        out = (args.out or ROOT / "runs" / f"bench-moe-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
        for variant in args.variant_names:
            for seed in range(args.seeds):
                print(
                    f"{variant} seed {seed}: running in {out / variant / f'seed{seed}'}",
                    file=sys.stderr,
                    flush=True,
                )
                try:
                    run_seed(
                        str(CONFIG),
                        seed,
                        out / variant,
                        minutes=args.minutes,
                        max_steps=args.max_steps,
                        overrides=overrides_for(variant, args),
                    )
                except RuntimeError as exc:
                    print(f"rollwise bench moe: {variant}: {exc}", file=sys.stderr)
                    return 1
    found = collect(out, args.variant_names)
    if not found:
        print(f"rollwise bench moe: no runs under {out}", file=sys.stderr)
        return 2
    summary = {
        "command": ["rollwise", "bench", "moe", *argv],
        "out": str(out),
        "interval": "two-sided 95% Student-t over seeds",
        "variants": {
            name: summarise_variant(runs, bucket_versions=args.bucket_versions)
            for name, runs in found.items()
        },
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary) if args.json else format_report(summary))
    return 0
