"""grid-nav: walk from a start cell to a goal cell on a ``size`` x ``size`` grid.

Observation: ``"pos X Y goal GX GY"`` (x = column, y = row, both 0-based; "up" is y + 1, "right" is
x + 1). Each turn the first of the words up/down/left/right in the text is the move. Shaping reward
(dense, to exercise per-turn advantages): +0.1 when the move brings the agent closer to the goal
(Manhattan distance), -0.1 otherwise (walking into a wall leaves it in place). Reaching the goal is
done with outcome 1.0; text without a move gets "invalid" and -0.1. After ``max_turns`` turns the
episode is truncated with outcome 0.0. The greedy gold policy needs at most 2 * (size - 1) turns.
"""

from __future__ import annotations

import itertools
import random
import re
from collections.abc import Iterator

from envs.api import Action, EnvError, Environment, EnvSpec, Message, StepResult, Task

CLOSER_REWARD = 0.1
NOT_CLOSER_PENALTY = -0.1
INVALID_PENALTY = -0.1
MOVES: dict[str, tuple[int, int]] = {"up": (0, 1), "down": (0, -1), "left": (-1, 0), "right": (1, 0)}
_MOVE = re.compile(r"\b(up|down|left|right)\b", re.IGNORECASE)

VOCAB_HINTS: list[str] = ["pos", "goal", *MOVES, "invalid", *(str(n) for n in range(0, 8))]


def observation(position: tuple[int, int], goal: tuple[int, int]) -> str:
    return f"pos {position[0]} {position[1]} goal {goal[0]} {goal[1]}"


def distance(a: tuple[int, int], b: tuple[int, int]) -> int:
    return abs(a[0] - b[0]) + abs(a[1] - b[1])


class GridNavEnv(Environment):
    """Deterministic grid navigation with a per-step shaping reward."""

    def __init__(self, size: int = 4, max_turns: int = 8) -> None:
        if size < 2:
            raise ValueError(f"size must be >= 2, got {size}")
        self.size = size
        # The four moves are every answer it accepts, so the learner's action prior can keep them in reach.
        self.spec = EnvSpec(name="grid-nav", version="1", max_turns=max_turns, action_hints=tuple(MOVES))
        self._position: tuple[int, int] | None = None
        self._goal = (0, 0)
        self._grid_size = size  # the task's size (reset), which may differ from the options' size
        self._turns = 0
        self._finished = False

    def tasks(self, seed: int) -> Iterator[Task]:
        cells = [(x, y) for x in range(self.size) for y in range(self.size)]
        for index in itertools.count():
            rng = random.Random(f"grid-nav:{seed}:{index}")
            start, goal = rng.sample(cells, 2)
            yield Task(
                id=f"grid-nav-{seed}-{index}",
                seed=rng.getrandbits(31),
                data={"size": self.size, "start": list(start), "goal": list(goal)},
            )

    async def reset(self, task: Task) -> list[Message]:
        try:
            size = int(task.data["size"])
            start = (int(task.data["start"][0]), int(task.data["start"][1]))
            goal = (int(task.data["goal"][0]), int(task.data["goal"][1]))
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise EnvError(f"grid-nav task {task.id!r} has bad data {dict(task.data)!r}: {exc}") from exc
        if not all(0 <= c < size for c in (*start, *goal)):
            raise EnvError(
                f"grid-nav task {task.id!r}: start {start} or goal {goal} off a {size}x{size} grid"
            )
        self._grid_size, self._position, self._goal = size, start, goal
        self._turns, self._finished = 0, False
        return [{"role": "user", "content": observation(start, goal)}]

    async def step(self, action: Action) -> StepResult:
        if self._position is None or self._finished:
            raise EnvError("grid-nav: step() called before reset() or after the episode ended")
        self._turns += 1
        match = _MOVE.search(action.text)
        if match is None:
            content, reward = "invalid", INVALID_PENALTY
        else:
            before = self._position
            dx, dy = MOVES[match.group(1).lower()]
            limit = self._grid_size - 1
            self._position = (min(max(before[0] + dx, 0), limit), min(max(before[1] + dy, 0), limit))
            closer = distance(self._position, self._goal) < distance(before, self._goal)
            content = observation(self._position, self._goal)
            reward = CLOSER_REWARD if closer else NOT_CLOSER_PENALTY
        solved = self._position == self._goal
        out_of_turns = not solved and self._turns >= self.spec.max_turns
        self._finished = solved or out_of_turns
        return StepResult(
            messages=[{"role": "user", "content": content}],
            reward=reward,
            done=solved,
            truncated=out_of_turns,
            outcome=1.0 if solved else (0.0 if out_of_turns else None),
            info={"distance": distance(self._position, self._goal)},
        )

    def gold_action(self) -> str | None:
        if self._position is None or self._finished:
            return None
        (x, y), (gx, gy) = self._position, self._goal
        if x != gx:
            return "right" if gx > x else "left"
        return "up" if gy > y else "down"
