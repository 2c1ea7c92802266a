"""The physical limit of a run and how close it came (docs/design/asynchrony_at_the_limit.md).

Two resources can bind an asynchronous run: the learner, which cannot step faster than its own step
time, and the engines, which cannot generate the tokens a step trains faster than their busy token rate.
The bound is the lower of the two; the efficiency is the steps per hour achieved over it. Pure functions,
shared by `rollwise bench async` (a modelled learner, the SGLang fake) and `rollwise bench learn` (a
real run's logs: pipeline.tools.bench.run_budgets.run_limit).

The engines' rate is their generated tokens over the seconds they were busy (at least one request in
flight): at the concurrency the run admitted. An engine that could batch more than it was given reads
lower than its capacity, so the engine bound is conservative wherever admission, not the engine, held
generation back.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

LEARNER, ENGINES = "learner", "engines"


@dataclass(frozen=True)
class Bounds:
    """Steps per hour each resource allows; None where it cannot be known (no busy time, nothing
    trained)."""

    learner_steps_per_hour: float | None
    engine_steps_per_hour: float | None

    @property
    def binding(self) -> str | None:
        """The resource with the lower bound (the learner on a tie): what the run cannot go faster than."""
        known = self._known()
        return min(known, key=known.__getitem__) if known else None

    @property
    def bound(self) -> float | None:
        known = self._known()
        return min(known.values()) if known else None

    def _known(self) -> dict[str, float]:
        named = {LEARNER: self.learner_steps_per_hour, ENGINES: self.engine_steps_per_hour}
        return {name: value for name, value in named.items() if value is not None}


def run_bounds(
    *,
    step_s: float | None,
    generated_tokens: int,
    engine_busy_s: float,
    batch_groups: int,
    trained_tokens: int,
    trained_groups: int,
) -> Bounds:
    """The two bounds: the learner's `3600 / step_s`; the engines' `3600 · rate / (B · tokens per trained
    group)`, with rate = generated tokens over engine busy seconds."""
    learner = 3600.0 / step_s if step_s else None
    engines = None
    if engine_busy_s > 0 and trained_groups > 0 and trained_tokens > 0:
        rate = generated_tokens / engine_busy_s
        engines = 3600.0 * rate / (batch_groups * trained_tokens / trained_groups)
    return Bounds(learner, engines)


def efficiency(steps_per_hour: float, bounds: Bounds) -> float | None:
    """Achieved over the bound: 1.0 means the binding resource never waited and nothing was thrown away."""
    bound = bounds.bound
    return steps_per_hour / bound if bound else None


def waste_share(wasted: Mapping[str, int], generated_tokens: int) -> float | None:
    """The share of the generated tokens that were never trained."""
    return sum(wasted.values()) / generated_tokens if generated_tokens else None
