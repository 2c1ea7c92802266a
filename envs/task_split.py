"""Held-out tasks: what "disjoint from training" means for an evaluation task stream.

Two levels, both decided from the tasks alone (no environment has to cooperate):

- **stream-disjoint** (`fraction = 0`): eval draws `env.tasks(eval_seed)` with a seed that is not the
  training one. The built-in environments derive task i of seed s from `random.Random(f"{name}:{s}:{i}")`
  and put the seed in the task id, so no eval task id is a training task id and the two streams are
  independent draws of the same distribution. Task *contents* can repeat: guess-number has 16 secrets,
  so every secret it evaluates was also trained on; what is held out is the draw.
- **content-disjoint** (`fraction > 0`): a task is held out when the hash of its content (the canonical
  JSON of `task.data`, not its id or seed) falls below `fraction`. The training stream skips held-out
  tasks and the eval stream keeps only them, so no task content is ever both trained on and evaluated.
  On a small task space the held-out share is lumpy (guess-number at 0.25 holds out 1 of its 16
  secrets, at 0.5 four: tests/envs/test_task_split.py); a fraction that holds out nothing is an error, not
  an empty eval.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator

from envs.api import Environment, Task

# How far a stream is searched for held-out (or kept) tasks before the split is declared unusable.
MAX_DRAWS = 100_000


class TaskSplitError(ValueError):
    """A split that cannot produce the tasks asked for (e.g. a fraction that holds out nothing)."""


def task_content_key(task: Task) -> str:
    """The task's content as canonical JSON: equal for two tasks that pose the same problem."""
    return json.dumps(dict(task.data), sort_keys=True, separators=(",", ":"), default=str)


def content_hash_unit(task: Task) -> float:
    """A uniform number in [0, 1) fixed by the task's content (blake2b of `task_content_key`)."""
    digest = hashlib.blake2b(task_content_key(task).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


def is_held_out(task: Task, fraction: float) -> bool:
    return fraction > 0.0 and content_hash_unit(task) < fraction


def training_tasks(stream: Iterator[Task], fraction: float) -> Iterator[Task]:
    """The training stream without the held-out tasks (unchanged when `fraction` is 0)."""
    if fraction <= 0.0:
        yield from stream
        return
    skipped = 0
    for task in stream:
        if is_held_out(task, fraction):
            skipped += 1
            if skipped >= MAX_DRAWS:
                raise TaskSplitError(f"{MAX_DRAWS} tasks in a row are held out at fraction {fraction}")
            continue
        skipped = 0
        yield task


def eval_tasks(env: Environment, seed: int, count: int, fraction: float) -> list[Task]:
    """`count` eval tasks of `env.tasks(seed)`: the first ones (fraction 0) or the first held-out ones.

    Raises TaskSplitError when the first MAX_DRAWS tasks hold fewer than `count` held-out ones."""
    if count < 1:
        raise TaskSplitError(f"count must be >= 1, got {count}")
    found: list[Task] = []
    for drawn, task in enumerate(env.tasks(seed), start=1):
        if fraction <= 0.0 or is_held_out(task, fraction):
            found.append(task)
            if len(found) == count:
                return found
        if drawn >= MAX_DRAWS:
            break
    raise TaskSplitError(
        f"only {len(found)} of the first {MAX_DRAWS} tasks of {env.spec.name} (seed {seed}) are held out "
        f"at holdout_fraction {fraction}; {count} needed (raise the fraction or set it to 0)"
    )
