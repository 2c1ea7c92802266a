"""The soak's chaos: a default task whose environment misbehaves, and a plan of SIGKILLs.

`ChaosGuessNumber` is guess-number (the default task) whose `step` fails on `fault_rate` of its calls,
each failure one of: raise `EnvError`, hang past the step timeout, or return something that is not a
`StepResult`. The choice comes from a private RNG, so a run does not depend on global random state.
Use it as `env.name = "pipeline.tools.bench.chaos:ChaosGuessNumber"` with `env.options.fault_rate`.

`KillPlan` says when to SIGKILL which process: intervals uniform in [0.5, 1.5] x `every_s`, targets
in a shuffled round robin over engine, learner and supervisor (each is hit once in every three kills,
in an order the seed decides).
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections.abc import Sequence
from typing import Any

from envs.api import Action, EnvError, StepResult
from envs.guess_number import GuessNumberEnv

FAULTS = ("raise", "hang", "garbage")
TARGETS = ("engine", "learner", "supervisor")


class ChaosGuessNumber(GuessNumberEnv):
    """guess-number with `fault_rate` of its steps failing (module docstring). `step_timeout_s` bounds a
    hang: the runner ends that episode as `timeout` after it."""

    def __init__(self, fault_rate: float = 0.03, step_timeout_s: float = 1.0, **options: Any) -> None:
        if not 0.0 <= fault_rate <= 1.0:
            raise ValueError(f"fault_rate must be in [0, 1], got {fault_rate}")
        if not step_timeout_s > 0.0:
            raise ValueError(f"step_timeout_s must be > 0, got {step_timeout_s}")
        super().__init__(**options)
        self.spec = dataclasses.replace(self.spec, step_timeout_s=step_timeout_s)
        self.fault_rate = fault_rate
        self._rng = random.Random()

    async def step(self, action: Action) -> StepResult:
        if self._rng.random() < self.fault_rate:
            fault = self._rng.choice(FAULTS)
            if fault == "raise":
                raise EnvError("ChaosGuessNumber: injected failure")
            if fault == "hang":
                await asyncio.sleep(3600.0)  # cancelled by the runner's step timeout
            garbage: Any = {"not": "a StepResult"}
            return garbage
        return await super().step(action)


class KillPlan:
    """When to kill next and whom (module docstring). `every_s` = mean seconds between kills."""

    def __init__(self, every_s: float, seed: int, targets: Sequence[str] = TARGETS) -> None:
        if every_s <= 0:
            raise ValueError(f"every_s must be > 0, got {every_s}")
        self.every_s = every_s
        self.targets = tuple(targets)
        self._rng = random.Random(seed)
        self._round: list[str] = []

    def next_delay_s(self) -> float:
        return self._rng.uniform(0.5, 1.5) * self.every_s

    def next_target(self) -> str:
        if not self._round:
            self._round = list(self.targets)
            self._rng.shuffle(self._round)
        return self._round.pop()
