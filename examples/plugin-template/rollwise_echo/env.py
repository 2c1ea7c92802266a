"""echo-count: the user asks "say cat 3 times"; the assistant must answer "cat cat cat".

A deliberately tiny environment showing every part of the rollwise plugin contract: a seeded task
stream, a reset that depends only on the task, agent mistakes answered as observations, an outcome
on the last step, and a gold policy for `rollwise env check`.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator

from envs.api import Action, EnvError, Environment, EnvSpec, Message, StepResult, Task

WORDS = ("cat", "dog", "sun", "owl")


class EchoCountEnv(Environment):
    """Repeat a word a given number of times; two attempts by default."""

    def __init__(self, max_count: int = 3, max_turns: int = 2) -> None:
        self.max_count = max_count
        self.spec = EnvSpec(name="echo-count", version="0.1.0", max_turns=max_turns)
        self._answer: str | None = None
        self._turns = 0
        self._finished = False

    def tasks(self, seed: int) -> Iterator[Task]:
        # One Random per task, seeded from (seed, index): the stream is the same on every run.
        for index in itertools.count():
            rng = random.Random(f"echo-count:{seed}:{index}")
            data = {"word": rng.choice(WORDS), "count": rng.randint(1, self.max_count)}
            yield Task(id=f"echo-count-{seed}-{index}", seed=rng.getrandbits(31), data=data)

    async def reset(self, task: Task) -> list[Message]:
        word, count = task.data.get("word"), task.data.get("count")
        if not isinstance(word, str) or not isinstance(count, int) or count < 1:
            raise EnvError(f"echo-count task {task.id!r} has bad data {dict(task.data)!r}")
        self._answer = " ".join([word] * count)
        self._turns, self._finished = 0, False
        return [{"role": "user", "content": f"say {word} {count} times"}]

    async def step(self, action: Action) -> StepResult:
        if self._answer is None or self._finished:
            raise EnvError("echo-count: step() called before reset() or after the episode ended")
        self._turns += 1
        solved = action.text.strip().lower() == self._answer
        out_of_turns = not solved and self._turns >= self.spec.max_turns
        self._finished = solved or out_of_turns
        return StepResult(
            messages=[{"role": "user", "content": "correct" if solved else "wrong"}],
            reward=0.0 if solved else -0.1,  # a wrong attempt is an observation with a small penalty
            done=solved,
            truncated=out_of_turns,
            outcome=1.0 if solved else (0.0 if out_of_turns else None),
            info={"attempt": self._turns},
        )

    async def close(self) -> None:
        self._answer = None  # nothing to release; must stay safe to call twice

    def gold_action(self) -> str | None:
        return None if self._finished else self._answer
