"""When an evaluation starts (pure): the `[eval]` triggers and budget against what the schedule remembers.

`decide` is the rule pipeline.supervisor.eval_schedule's docstring states; `effective_interval` and
`describe_cadence` are what the daemon prints about it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

Decision = Literal["start", "wait", "running", "budget"]


@dataclass(frozen=True)
class Cadence:
    """The `[eval]` triggers and budget (0 = that trigger off; max_engine_share 1.0 = no budget)."""

    every_versions: int = 0
    every_minutes: float = 0.0
    max_engine_share: float = 1.0


@dataclass(frozen=True)
class EvalClock:
    """What the rule remembers. `version`/`since`: the version the triggers count from and when its
    evaluation started (None: nothing evaluated yet; a failed evaluation hands them back to the one
    before). `ran_at`/`ran_s`: start and wall seconds of the latest evaluation, ok or failed (`ran_s` None
    while it runs), for the budget."""

    version: int | None = None
    since: float | None = None
    ran_at: float | None = None
    ran_s: float | None = None


def decide(cadence: Cadence, clock: EvalClock, version: int, now: float) -> Decision:
    """Whether an evaluation of the served `version` starts at `now` (seconds, monotonic): "start";
    "wait" (no trigger is due); "running" (one runs: never two); "budget" (due, but the last evaluation's
    D seconds make the next wait until D / max_engine_share seconds after its start). See eval_schedule."""
    if clock.version is None:
        triggered = True
    else:
        by_versions = cadence.every_versions > 0 and version - clock.version >= cadence.every_versions
        by_minutes = (
            cadence.every_minutes > 0
            and version != clock.version
            and clock.since is not None
            and now - clock.since >= cadence.every_minutes * 60.0
        )
        triggered = by_versions or by_minutes
    if not triggered:
        return "wait"
    if clock.ran_at is not None and clock.ran_s is None:
        return "running"
    if now < budget_opens_at(cadence, clock):
        return "budget"
    return "start"


def budget_opens_at(cadence: Cadence, clock: EvalClock) -> float:
    """When the budget lets the next evaluation start: D / max_engine_share seconds after the start of
    the latest one, which ran D seconds (-inf: no budget, or none has finished)."""
    if cadence.max_engine_share >= 1.0 or clock.ran_at is None or clock.ran_s is None:
        return -math.inf
    return clock.ran_at + clock.ran_s / cadence.max_engine_share


def effective_interval(cadence: Cadence, eval_s: float, version_s: float) -> tuple[int, float]:
    """(versions, seconds) between evaluation starts that `decide` gives when an evaluation takes `eval_s`
    seconds and a version is served every `version_s` seconds: the first trigger due, no sooner than the
    budget (or the evaluation itself) allows, rounded up to a whole version (starts land on versions)."""
    triggers = []
    if cadence.every_versions > 0:
        triggers.append(cadence.every_versions * version_s)
    if cadence.every_minutes > 0:
        triggers.append(cadence.every_minutes * 60.0)
    trigger_s = min(triggers) if triggers else version_s
    cycle_s = max(trigger_s, eval_s / cadence.max_engine_share, version_s)
    versions = max(1, math.ceil(cycle_s / version_s - 1e-9))
    return versions, versions * version_s


def describe_cadence(cadence: Cadence, *, dedicated: bool) -> str:
    """The start line: triggers, and the budget or the dedicated engine."""
    triggers = []
    if cadence.every_versions > 0:
        triggers.append(f"{cadence.every_versions} version{'s' if cadence.every_versions > 1 else ''}")
    if cadence.every_minutes > 0:
        triggers.append(f"{cadence.every_minutes:g} min")
    when = " or ".join(triggers) or "never"
    if dedicated:
        return f"evaluation every {when} on a dedicated engine (one at a time; no budget)"
    if cadence.max_engine_share >= 1.0:
        return f"evaluation every {when} on the training engines, no budget (eval.max_engine_share = 1)"
    return (
        f"evaluation every {when} on the training engines, within {cadence.max_engine_share:.0%} of their "
        "time (eval.max_engine_share): the interval follows from the first evaluation's measured cost"
    )
