"""`rollwise bench learner --replay RUN_DIR`: the daemon's own learner steps run again, alone.

    rollwise bench learner --replay RUN_DIR [--steps N] [--threads T] [--json]

A learner's tokens/s inside a daemon and in a benchmark are comparable only on the same shapes, options
and threads. This replays a run's first N learner steps from its spool, in order, on a learner built
from the run's resolved config (`learner.policy_setup.build_policy`, as the learner process builds it)
and the run's initial model, and prints for each step the daemon's seconds (`logs/steps.jsonl`) beside
the replay's, then the ratio of their tokens/s over the steps after the first (which pays for warm-up
in both). Nothing else runs beside the replay, so the ratio is what the daemon's surroundings cost the
learner: the engine and supervisor on the same cores, evaluation, waiting for data inside a step.

The replay takes the groups each step trained (`group_ids` of its step record) and triages them at the
replay's own version, which is the daemon's: the same batch, the same shuffle (the run's seed), the same
updates. Its loss matching the daemon's to the last bit shows the replayed step is the same computation;
a different loss means the code or the options differ from the run's (the table says so).

`--threads` replays with another torch thread count (default: the run's `learner.threads`),
`--attention` with another attention implementation (`sdpa` against the CPU learner's own,
learner.model.cpu_attention: the losses then differ from the daemon's by float rounding). The groups
must still be in the spool: the learner deletes groups every retained checkpoint has consumed, so a long
run can be replayed only over its first steps while they are kept (the error names the first missing).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pipeline.contracts.config import load_config
from pipeline.contracts.run_dir import RunDir
from pipeline.tools.bench.run_budgets import step_records


class ReplayError(RuntimeError):
    """The run cannot be replayed; the message says why."""


@dataclass(frozen=True)
class DaemonStep:
    """One learner step as the daemon logged it."""

    step: int
    group_ids: tuple[str, ...]
    seconds: float
    tokens: float
    loss: float | None


@dataclass(frozen=True)
class StepPair:
    """A daemon step and its replay."""

    step: int
    tokens: float
    daemon_s: float
    replay_s: float
    daemon_loss: float | None
    replay_loss: float | None

    @property
    def same_numbers(self) -> bool:
        return self.daemon_loss is not None and self.daemon_loss == self.replay_loss


def daemon_steps(step_log: Path) -> list[DaemonStep]:
    """The learner's step records of `logs/steps.jsonl`, by step number (the last record of a step a
    restarted learner trained twice is the one kept)."""
    if not step_log.is_file():
        raise ReplayError(f"{step_log} does not exist: not a run directory, or no learner step yet")

    def trained(record: dict[str, Any]) -> bool:
        # A step that dropped its groups (no update) trained nothing.
        metrics = record.get("metrics") or {}
        return "group_ids" in record and bool(record.get("groups")) and metrics.get("step_time_s") is not None

    return [
        DaemonStep(
            step=int(record["step"]),
            group_ids=tuple(record["group_ids"]),
            seconds=float(record["metrics"]["step_time_s"]),
            tokens=float(record["metrics"].get("tokens") or 0.0),
            loss=record["metrics"].get("loss"),
        )
        for record in step_records(step_log, trained)
    ]


def spool_files(spool: Path) -> dict[str, Path]:
    """Group id -> its spool file."""
    from pipeline.transport.spool import read_group_file

    found = {}
    for path in sorted(spool.glob("g*.arrow")):
        group_id, _ = read_group_file(path)
        found[group_id] = path
    return found


def replay(
    run_dir: Path, steps: int, threads: int | None = None, attention: str | None = None
) -> list[StepPair]:
    """Replay the first `steps` trained steps of the run in `run_dir` (module docstring), with the
    attention implementation `attention` when given (else the learner's own choice)."""
    from learner.groups import triage_group
    from learner.policy_setup import build_policy
    from pipeline.contracts.schema import batch_to_segments
    from pipeline.transport.spool import read_group_file

    run = RunDir.at(run_dir)
    cfg = load_config(run.config_file)
    if threads is not None:
        cfg = cfg.model_copy(update={"learner": cfg.learner.model_copy(update={"threads": threads})})
    logged = daemon_steps(run.step_log)
    if not logged:
        raise ReplayError(f"{run.step_log} holds no trained learner step")
    if logged[0].step != 1:
        raise ReplayError(f"{run.step_log} starts at step {logged[0].step}: a replay starts at step 1")
    wanted = logged[:steps]
    files = spool_files(run.spool)
    for record in wanted:
        missing = [g for g in record.group_ids if g not in files]
        if missing:
            raise ReplayError(
                f"step {record.step}'s group {missing[0]} is no longer in {run.spool} (the learner deletes "
                f"groups its checkpoints consumed): replay fewer steps (--steps {record.step - 1})"
            )
    policy = build_policy(cfg, run.initial_model)
    trainer = policy.trainer
    if attention is not None:
        trainer.model.set_attn_implementation(attention)
    pairs = []
    for record in wanted:
        groups = []
        for group_id in record.group_ids:
            _, batch = read_group_file(files[group_id])
            rows, rejected = batch_to_segments(batch)
            verdict = triage_group(
                group_id,
                rows,
                learner_version=trainer.policy_version,
                max_staleness=cfg.async_.max_staleness,
                rejected=rejected,
            )
            if isinstance(verdict, str):
                raise ReplayError(
                    f"step {record.step}: group {group_id} triages as {verdict!r} in the replay"
                )
            groups.append(verdict)
        started = time.perf_counter()
        metrics = trainer.step(groups)
        seconds = time.perf_counter() - started
        pairs.append(
            StepPair(
                step=record.step,
                tokens=record.tokens,
                daemon_s=record.seconds,
                replay_s=seconds,
                daemon_loss=record.loss,
                replay_loss=metrics.get("loss"),
            )
        )
    return pairs


def summary(pairs: list[StepPair]) -> dict[str, Any]:
    """Tokens/s of the daemon and of the replay over the steps after the first, and their ratio."""
    timed = pairs[1:] if len(pairs) > 1 else pairs
    tokens = sum(p.tokens for p in timed)
    daemon = tokens / sum(p.daemon_s for p in timed)
    alone = tokens / sum(p.replay_s for p in timed)
    return {
        "timed_steps": len(timed),
        "daemon_tokens_per_s": daemon,
        "replay_tokens_per_s": alone,
        "ratio": daemon / alone,
        "median_step_ratio": statistics.median(p.replay_s / p.daemon_s for p in timed),
        "same_numbers": all(p.same_numbers for p in pairs),
    }


def render(pairs: list[StepPair], threads: int) -> str:
    lines = [
        f"learner steps of the daemon against the same steps replayed alone ({threads} torch thread(s))",
        f"{'step':>4}  {'tokens':>6}  {'daemon s':>8}  {'replay s':>8}  same loss",
    ]
    for p in pairs:
        same = "yes" if p.same_numbers else f"no ({p.daemon_loss!r} vs {p.replay_loss!r})"
        lines.append(f"{p.step:>4}  {p.tokens:>6.0f}  {p.daemon_s:>8.2f}  {p.replay_s:>8.2f}  {same}")
    s = summary(pairs)
    lines.append(
        f"tokens/s over steps {pairs[-s['timed_steps']].step}-{pairs[-1].step}: "
        f"daemon {s['daemon_tokens_per_s']:.1f}, alone {s['replay_tokens_per_s']:.1f}: "
        f"the daemon's learner at {s['ratio']:.2f}x its own speed alone"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rollwise bench learner --replay", description=__doc__.splitlines()[0])
    p.add_argument(
        "--replay", required=True, type=Path, metavar="RUN_DIR", help="the run directory to replay"
    )
    p.add_argument("--steps", type=int, default=5, help="learner steps to replay from step 1 (default 5)")
    p.add_argument("--threads", type=int, help="torch threads (default: the run's learner.threads)")
    p.add_argument(
        "--attention",
        help="replay with this transformers attention implementation instead of the learner's own "
        "(sdpa: the one before learner.model.cpu_attention)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be >= 1")
    if args.threads is not None and args.threads < 1:
        p.error("--threads must be >= 1")
    try:
        pairs = replay(args.replay, args.steps, args.threads, args.attention)
    except ReplayError as exc:
        print(f"rollwise bench learner --replay: {exc}", file=sys.stderr)
        return 1
    threads = args.threads or load_config(RunDir.at(args.replay).config_file).learner.threads
    if args.json:
        print(json.dumps({"pairs": [asdict(p) for p in pairs], **summary(pairs), "threads": threads}))
    else:
        print(render(pairs, threads))
    return 0


if __name__ == "__main__":
    sys.exit(main())
