"""The three budgets of a training run that a learning bench prints beside its curve (../DESIGN.md, "Speed
is the product"): how busy the learner was, how busy the engines were, and the learner's tokens/s.

- Learner: from `logs/steps.jsonl`, each step's `busy_s` (from taking its first group to its step event)
  and `idle_s` (waiting for groups before it). Idle is the share of waiting in their sum. A step whose
  groups were all dropped (no reward variance, stale) changes no weight; `updates` counts the others.
- Engines: the CPU seconds of each embedded engine process (utime + stime from /proc/<pid>/stat, its
  threads included) over the run's wall time and its torch threads: the share of its cores it computed
  on. On a GPU engine this says nothing (the work is the GPU's); it is meant for the embedded engine.
- Tokens/s: the learner's own figure (`tokens_per_s` of its steps), over every step but the first.
- The limit (`run_limit`, pipeline.tools.bench.bounds): which resource binds and at how many steps/h, the
  efficiency, and the generated tokens never trained, from the steps, the engines' CPU seconds over their
  threads (their busy seconds) and the daemon's last status line (its generated and wasted tokens).

`ChildCpu` samples the daemon's children by PID while the run goes on (a child that restarts is a new
PID; its seconds are added), so the engines' figure covers the whole run.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.contracts.run_dir import log_events
from pipeline.tools.bench.bounds import efficiency, run_bounds, waste_share

CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class LearnerBudget:
    steps: int
    busy_s: float
    idle_s: float
    tokens_per_s: float | None
    updates: int = 0

    @property
    def idle_fraction(self) -> float:
        total = self.busy_s + self.idle_s
        return self.idle_s / total if total > 0 else 0.0


def step_records(step_log: Path, keep: Callable[[dict[str, Any]], bool]) -> list[dict[str, Any]]:
    """The learner's step records in a run's `logs/steps.jsonl` that `keep` accepts, one per step number
    in step order (of a step a restarted learner trained twice, its last record); lines cut by a kill and
    a missing file give nothing; rotated copies are read first, oldest first."""
    steps: dict[int, dict[str, Any]] = {}
    for record in log_events(step_log, "step"):
        if keep(record):
            steps[int(record["step"])] = record
    return [steps[s] for s in sorted(steps)]


def learner_budget(step_log: Path) -> LearnerBudget:
    """The learner's busy and idle seconds and tokens/s from a run's step log (no steps: all zero)."""
    ordered = [
        {
            "busy": float(record.get("busy_s") or 0.0),
            "idle": float(record.get("idle_s") or 0.0),
            "tokens": float((record.get("metrics") or {}).get("tokens") or 0.0),
            "seconds": float((record.get("metrics") or {}).get("step_time_s") or 0.0),
            "trained": int(record.get("groups") or 0),
        }
        for record in step_records(step_log, lambda r: "busy_s" in r)
    ]
    timed = ordered[1:]
    seconds = sum(s["seconds"] for s in timed)
    return LearnerBudget(
        steps=len(ordered),
        busy_s=sum(s["busy"] for s in ordered),
        idle_s=sum(s["idle"] for s in ordered),
        tokens_per_s=sum(s["tokens"] for s in timed) / seconds if seconds > 0 else None,
        updates=sum(1 for s in ordered if s["trained"] > 0),
    )


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent PID, CPU seconds) of a live process; None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


@dataclass
class ChildCpu:
    """CPU seconds of a daemon's child processes whose command line holds `marker` (e.g. the embedded
    engine's `pipeline.engine`), summed over every PID seen."""

    parent: int
    marker: str
    seconds: dict[int, float] = field(default_factory=dict)

    def sample(self) -> None:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            pid = int(entry.name)
            stat = _stat(pid)
            if stat is None or stat[0] != self.parent or self.marker not in _cmdline(pid):
                continue
            self.seconds[pid] = stat[1]

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())


def engine_busy_fraction(cpu_s: float, wall_s: float, threads: int, engines: int = 1) -> float:
    """Share of the engines' cores they computed on: CPU seconds over wall seconds x threads x engines."""
    capacity = wall_s * max(threads, 1) * max(engines, 1)
    return min(1.0, cpu_s / capacity) if capacity > 0 else 0.0


def last_status(progress_log: Path) -> dict[str, Any] | None:
    """The last `status` event of a daemon's JSON progress log (None if it printed none)."""
    statuses = log_events(progress_log, "status")
    return statuses[-1] if statuses else None


def run_limit(
    step_log: Path, progress_log: Path, *, wall_s: float, engine_busy_s: float, batch_groups: int
) -> str | None:
    """The run's limit (pipeline.tools.bench.bounds) from its logs: the learner's median busy step, the
    tokens each group trained held, the engines' busy seconds and the generated and wasted tokens of the
    daemon's last status line. None when the run printed no status with them or trained nothing."""
    status = last_status(progress_log)
    steps = step_records(step_log, lambda r: "busy_s" in r)
    if status is None or status.get("generated_tokens") is None or not steps or wall_s <= 0:
        return None
    generated, wasted = int(status["generated_tokens"]), dict(status.get("wasted_tokens") or {})
    timed = steps[1:] or steps  # the first step pays the learner's warm-up
    bounds = run_bounds(
        step_s=statistics.median(float(r["busy_s"]) for r in timed),
        generated_tokens=generated,
        engine_busy_s=engine_busy_s,
        batch_groups=batch_groups,
        trained_tokens=sum(sum(int(n) for n in (r.get("staleness") or {}).values()) for r in steps),
        trained_groups=sum(len(r.get("group_ids") or []) for r in steps),
    )
    achieved = len(steps) * 3600.0 / wall_s
    eff, share = efficiency(achieved, bounds), waste_share(wasted, generated)
    causes = ", ".join(f"{cause} {n}" for cause, n in wasted.items() if n) or "none"
    return (
        f"limit: bound by the {bounds.binding or 'n/a'} at "
        f"{f'{bounds.bound:.0f}' if bounds.bound else 'n/a'} steps/h, achieved {achieved:.0f} "
        f"(efficiency {f'{eff:.0%}' if eff is not None else 'n/a'}); "
        f"{f'{share:.1%}' if share is not None else 'n/a'} of {generated} generated tokens never trained "
        f"({causes})"
    )


def render_budgets(learner: LearnerBudget, engine_busy: float | None) -> str:
    tokens = f"{learner.tokens_per_s:.1f}" if learner.tokens_per_s is not None else "n/a"
    line = (
        f"learner: {learner.steps} steps ({learner.updates} updated the weights), "
        f"idle {100 * learner.idle_fraction:.1f}% of its time "
        f"(busy {learner.busy_s:.0f} s, waiting {learner.idle_s:.0f} s), {tokens} tokens/s"
    )
    if engine_busy is not None:
        line += f"; engines: idle {100 * (1 - engine_busy):.1f}% of their cores (CPU time)"
    return line
