"""What "held out" means for each built-in environment (envs.task_split)."""

from __future__ import annotations

import itertools

import pytest

from envs.api import Environment, Task
from envs.calculator import CalculatorEnv
from envs.grid_nav import GridNavEnv
from envs.guess_number import GuessNumberEnv
from envs.task_split import (
    TaskSplitError,
    eval_tasks,
    is_held_out,
    task_content_key,
    training_tasks,
)
from envs.word_guess import WordGuessEnv

BUILT_IN = [GuessNumberEnv, CalculatorEnv, GridNavEnv, WordGuessEnv]
TRAIN_SEED, EVAL_SEED = 0, 1_000_003


def first(stream: object, n: int) -> list[Task]:
    return list(itertools.islice(stream, n))  # type: ignore[call-overload]


@pytest.mark.parametrize("factory", BUILT_IN)
def test_eval_stream_shares_no_task_id_with_the_training_stream(factory: type[Environment]) -> None:
    env = factory()
    train_ids = {t.id for t in first(env.tasks(TRAIN_SEED), 2000)}
    chosen = eval_tasks(env, EVAL_SEED, 64, 0.0)
    assert len(chosen) == 64 and not train_ids & {t.id for t in chosen}
    # The same seed gives the same eval set every time (every evaluation scores the same tasks).
    assert [t.id for t in eval_tasks(factory(), EVAL_SEED, 64, 0.0)] == [t.id for t in chosen]


@pytest.mark.parametrize("factory", BUILT_IN)
def test_content_holdout_keeps_every_eval_problem_out_of_training(factory: type[Environment]) -> None:
    env = factory()
    trained = {task_content_key(t) for t in first(training_tasks(env.tasks(TRAIN_SEED), 0.5), 3000)}
    evaluated = {task_content_key(t) for t in eval_tasks(env, EVAL_SEED, 64, 0.5)}
    assert evaluated and not trained & evaluated
    # Without the holdout the training stream does pose the eval problems (the holdout is what removes them).
    unfiltered = {task_content_key(t) for t in first(env.tasks(TRAIN_SEED), 3000)}
    assert unfiltered & evaluated


def test_guess_number_holdouts_are_whole_secrets() -> None:
    """guess-number's task space is its 16 secrets: a holdout removes whole secrets from training, and a
    fraction-0 eval can only re-draw secrets that training also sees."""

    def secrets(tasks: list[Task]) -> set[int]:
        return {int(t.data["secret"]) for t in tasks}

    env = GuessNumberEnv()
    assert secrets(eval_tasks(env, EVAL_SEED, 64, 0.25)) == {4}
    assert secrets(eval_tasks(env, EVAL_SEED, 64, 0.5)) == {4, 6, 10, 11}
    assert secrets(first(training_tasks(env.tasks(TRAIN_SEED), 0.5), 500)) == set(range(1, 17)) - {
        4,
        6,
        10,
        11,
    }
    assert secrets(eval_tasks(env, EVAL_SEED, 64, 0.0)) <= secrets(first(env.tasks(TRAIN_SEED), 500))


def test_content_key_ignores_id_and_seed_and_orders_keys() -> None:
    a = Task(id="a", seed=1, data={"x": 1, "y": [2, 3]})
    b = Task(id="b", seed=2, data={"y": [2, 3], "x": 1})
    assert task_content_key(a) == task_content_key(b) == '{"x":1,"y":[2,3]}'
    assert is_held_out(a, 0.999999) == is_held_out(b, 0.999999) and not is_held_out(a, 0.0)


def test_a_holdout_too_small_to_find_tasks_is_an_error_naming_the_fix() -> None:
    with pytest.raises(TaskSplitError, match=r"only 0 of the first 100000 tasks of guess-number .*raise the"):
        eval_tasks(GuessNumberEnv(), EVAL_SEED, 4, 0.01)
    with pytest.raises(TaskSplitError, match="count must be >= 1"):
        eval_tasks(GuessNumberEnv(), EVAL_SEED, 0, 0.0)
