"""guess-number: find a secret integer in [low, high] from "higher"/"lower" feedback (the default task).

Turn: the assistant's first integer is its guess. Feedback is one word as a user message:
"higher" (the secret is larger), "lower", or "correct" (done, outcome 1.0). Text without an integer
gets "invalid" and reward -0.1; the turn still counts. After ``max_turns`` turns without success the
episode is truncated with outcome 0.0. Bisection (the gold policy) always wins when
``max_turns >= ceil(log2(high - low + 2))``: 5 turns for 1..16.

Turn reward (a process reward for the per-turn advantages): ``info_reward`` times the expected number of
bits the feedback to a valid guess reveals, given what the earlier feedback already ruled out
(``expected_information_bits``). It is the expectation of a potential-based shaping (the potential
being log2 of the number of values still possible), taken over the secrets the agent cannot tell apart,
so it depends only on what the agent has seen: peers of a group that share a secret get no noise from
it. A guess outside the remaining interval earns 0, the midpoint the most; bisection maximises it on
every turn. ``info_reward = 0`` leaves only the outcome and the format penalty.
"""

from __future__ import annotations

import copy
import itertools
import math
import random
import re
from collections.abc import Iterator

from envs.api import FORMAT_ERROR, Action, EnvError, Environment, EnvSpec, Message, StepResult, Task

INVALID_PENALTY = -0.1
INFO_REWARD = 0.1  # per expected bit: an episode that finds the secret in 1..16 earns 0.4 on average (4 bits)
_INTEGER = re.compile(r"-?\d+")

VOCAB_HINTS: list[str] = [
    "Guess",
    "my",
    "number",
    "from",
    "to",
    "higher",
    "lower",
    "correct",
    "invalid",
    *(str(n) for n in range(1, 17)),
]


def first_integer(text: str) -> int | None:
    """The first (optionally negative) integer written in ``text``, or None."""
    match = _INTEGER.search(text)
    if match is None or len(match.group()) > 18:  # absurdly long digit runs are not a guess
        return None
    return int(match.group())


def expected_information_bits(guess: int, low: int, high: int) -> float:
    """Entropy in bits of the feedback (lower / correct / higher) to ``guess`` when the secret is uniform
    over [low, high]; 0.0 for a guess outside that interval or an interval of one value (nothing to learn).

    >>> expected_information_bits(2, 1, 3)  # three equally likely answers
    1.584962500721156
    """
    size = high - low + 1
    if size <= 1 or not low <= guess <= high:
        return 0.0
    counts = (guess - low, 1, high - guess)
    return -math.fsum(c / size * math.log2(c / size) for c in counts if c)


class GuessNumberEnv(Environment):
    """Guess a secret number in [low, high] within ``max_turns`` turns."""

    def __init__(
        self, low: int = 1, high: int = 16, max_turns: int = 5, info_reward: float = INFO_REWARD
    ) -> None:
        if low >= high:
            raise ValueError(f"low ({low}) must be smaller than high ({high})")
        if not (math.isfinite(info_reward) and info_reward >= 0.0):
            raise ValueError(f"info_reward must be a finite number >= 0, got {info_reward}")
        self.low = low
        self.high = high
        self.info_reward = info_reward
        # Every valid answer is a number in range: few enough for the learner's action prior to cover.
        hints = tuple(str(n) for n in range(low, high + 1)) if high - low < 1024 else ()
        self.spec = EnvSpec(name="guess-number", version="1", max_turns=max_turns, action_hints=hints)
        self._secret: int | None = None
        self._bounds = (low, high)  # what the feedback so far says the secret can be
        self._turns = 0
        self._finished = False

    def tasks(self, seed: int) -> Iterator[Task]:
        for index in itertools.count():
            rng = random.Random(f"guess-number:{seed}:{index}")
            yield Task(
                id=f"guess-number-{seed}-{index}",
                seed=rng.getrandbits(31),
                data={"secret": rng.randint(self.low, self.high), "low": self.low, "high": self.high},
            )

    async def reset(self, task: Task) -> list[Message]:
        try:
            low, high, secret = int(task.data["low"]), int(task.data["high"]), int(task.data["secret"])
        except (KeyError, TypeError, ValueError) as exc:
            raise EnvError(f"guess-number task {task.id!r} has bad data {dict(task.data)!r}: {exc}") from exc
        if not low <= secret <= high:
            raise EnvError(f"guess-number task {task.id!r}: secret {secret} outside [{low}, {high}]")
        self._secret, self._bounds = secret, (low, high)
        self._turns, self._finished = 0, False
        return [{"role": "user", "content": f"Guess my number from {low} to {high}."}]

    async def step(self, action: Action) -> StepResult:
        if self._secret is None or self._finished:
            raise EnvError("guess-number: step() called before reset() or after the episode ended")
        self._turns += 1
        guess = first_integer(action.text)
        if guess is None:
            feedback, reward, solved = "invalid", INVALID_PENALTY, False
        else:
            reward = self.info_reward * expected_information_bits(guess, *self._bounds)
            solved = guess == self._secret
            feedback = "correct" if solved else ("higher" if guess < self._secret else "lower")
            if not solved:
                self._narrow(guess)
        out_of_turns = not solved and self._turns >= self.spec.max_turns
        self._finished = solved or out_of_turns
        return StepResult(
            messages=[{"role": "user", "content": feedback}],
            reward=reward,
            done=solved,
            truncated=out_of_turns,
            outcome=1.0 if solved else (0.0 if out_of_turns else None),
            info={"valid": guess is not None, **({FORMAT_ERROR: "no integer"} if guess is None else {})},
        )

    def _narrow(self, guess: int) -> None:
        low, high = self._bounds
        if self._secret is not None and guess < self._secret:
            self._bounds = (max(low, guess + 1), high)
        else:
            self._bounds = (low, min(high, guess - 1))

    async def fork(self) -> GuessNumberEnv:
        """Its state is immutable values (the secret, the bounds, counters): a shallow copy is a fork."""
        return copy.copy(self)

    def gold_action(self) -> str | None:
        if self._secret is None or self._finished:
            return None
        low, high = self._bounds
        return str((low + high) // 2)
