"""Built-in environments: exact feedback, determinism, gold policies, random-policy robustness."""

from __future__ import annotations

import itertools
import json
import math
import random
import string
from collections.abc import Callable
from fractions import Fraction

import pytest

from envs import builtin_vocab_hints
from envs.api import Action, Environment, Task, ToolCall
from envs.calculator import CalculatorEnv, CalculatorError, evaluate, format_value
from envs.check_policies import random_action
from envs.grid_nav import GridNavEnv
from envs.guess_number import GuessNumberEnv, expected_information_bits, first_integer
from envs.toolcalls import parse_hermes
from envs.word_guess import WORDS, WordGuessEnv, feedback

Policy = Callable[[Environment, random.Random], Action]
BUILTINS: list[type[Environment]] = [GuessNumberEnv, CalculatorEnv, GridNavEnv, WordGuessEnv]


def _texts(messages: list[dict[str, object]]) -> list[object]:
    return [message["content"] for message in messages]


# --- guess-number ---------------------------------------------------------------------------------


def test_guess_number_declares_every_number_in_range_as_an_action_hint() -> None:
    assert GuessNumberEnv(low=3, high=6).spec.action_hints == ("3", "4", "5", "6")
    assert len(GuessNumberEnv().spec.action_hints) == 16


async def test_guess_number_feedback_sequence() -> None:
    env = GuessNumberEnv()
    assert await env.reset(Task("t", 0, {"secret": 11, "low": 1, "high": 16})) == [
        {"role": "user", "content": "Guess my number from 1 to 16."}
    ]
    replies = []
    for text in ("8", "  14\n", "no idea", "12 or 13"):
        result = await env.step(Action(text))
        replies.append((result.messages[0]["content"], result.reward, result.done, result.outcome))
    # Turn rewards: 0.1 x the entropy (bits) of the answer, the secret uniform over what is still possible.
    assert replies == [
        ("higher", pytest.approx(0.1 * _bits(7, 1, 8)), False, None),  # 8 in 1..16
        ("lower", pytest.approx(0.1 * _bits(5, 1, 2)), False, None),  # 14 in 9..16
        ("invalid", -0.1, False, None),
        ("lower", pytest.approx(0.1 * _bits(3, 1, 1)), False, None),  # 12 in 9..13
    ]
    last = await env.step(Action("11"))  # 11 in 9..11
    assert (last.messages[0]["content"], last.done, last.truncated, last.outcome) == (
        "correct",
        True,
        False,
        1.0,
    )
    assert last.reward == pytest.approx(0.1 * _bits(2, 1, 0))


def _bits(*counts: int) -> float:
    total = sum(counts)
    return -sum(c / total * math.log2(c / total) for c in counts if c)


def test_expected_information_bits_values() -> None:
    assert expected_information_bits(8, 1, 16) == pytest.approx(_bits(7, 1, 8))
    assert expected_information_bits(2, 1, 3) == pytest.approx(math.log2(3))
    assert expected_information_bits(1, 1, 2) == pytest.approx(1.0)
    assert expected_information_bits(0, 1, 16) == 0.0  # outside what is still possible
    assert expected_information_bits(17, 1, 16) == 0.0
    assert expected_information_bits(5, 5, 5) == 0.0  # the answer is already known


def test_expected_information_is_largest_at_the_midpoints() -> None:
    values = {g: expected_information_bits(g, 1, 16) for g in range(1, 17)}
    assert max(values, key=values.__getitem__) in (8, 9)
    assert values[8] == pytest.approx(values[9])  # mirror images
    assert values[1] < values[4] < values[8]


async def test_guess_number_repeated_or_outside_guess_earns_no_information() -> None:
    env = GuessNumberEnv()
    await env.reset(Task("t", 0, {"secret": 3, "low": 1, "high": 16}))
    await env.step(Action("8"))  # lower: 1..7 remain
    again = await env.step(Action("8"))
    assert (again.messages[0]["content"], again.reward) == ("lower", 0.0)


async def test_guess_number_info_reward_zero_gives_only_the_format_penalty() -> None:
    env = GuessNumberEnv(info_reward=0.0)
    await env.reset(Task("t", 0, {"secret": 3, "low": 1, "high": 16}))
    assert (await env.step(Action("8"))).reward == 0.0
    assert (await env.step(Action("what"))).reward == -0.1


@pytest.mark.parametrize("bad", [-0.1, math.inf, math.nan])
def test_guess_number_rejects_bad_info_reward(bad: float) -> None:
    with pytest.raises(ValueError, match="info_reward"):
        GuessNumberEnv(info_reward=bad)


async def test_guess_number_truncates_after_max_turns_with_outcome_zero() -> None:
    env = GuessNumberEnv(max_turns=2)
    await env.reset(Task("t", 0, {"secret": 3, "low": 1, "high": 16}))
    first = await env.step(Action("9"))
    second = await env.step(Action("9"))
    assert (first.done, first.truncated) == (False, False)
    assert (second.done, second.truncated, second.outcome) == (False, True, 0.0)


async def test_guess_number_gold_is_bisection() -> None:
    env = GuessNumberEnv()
    await env.reset(Task("t", 0, {"secret": 16, "low": 1, "high": 16}))
    guesses = []
    for _ in range(5):
        gold = env.gold_action()
        assert gold is not None
        guesses.append(gold)
        if (await env.step(Action(gold))).done:
            break
    assert guesses == ["8", "12", "14", "15", "16"]
    assert env.gold_action() is None


def test_first_integer_parsing() -> None:
    assert first_integer(" 7 ") == 7
    assert first_integer("maybe -3 or 4") == -3
    assert first_integer("none") is None
    assert first_integer("9" * 40) is None


# --- calculator -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("37+48", "85"),
        ("2*(3+4)", "14"),
        (" 7 / 2 ", "3.5"),
        ("-3+1", "-2"),
        ("10-2-3", "5"),
        ("1/3", "0.333333"),
    ],
)
def test_calculator_evaluates_exactly(expression: str, value: str) -> None:
    assert format_value(evaluate(expression)) == value


@pytest.mark.parametrize(
    ("expression", "reason"),
    [
        ("1/0", "division by zero"),
        ("__import__('os')", "unsupported character"),
        ("2**3", "unexpected '\\*'"),
        ("1+", "ends early"),
        ("(1+2", "missing"),
        ("", "empty"),
        ("1" * 13, "longer than 12 digits"),
        ("1+" * 40 + "1", "longer than 64"),
        ("(" * 20 + "1" + ")" * 20, "nesting"),
    ],
)
def test_calculator_rejects_unsafe_or_malformed_expressions(expression: str, reason: str) -> None:
    with pytest.raises(CalculatorError, match=reason):
        evaluate(expression)


def test_evaluate_uses_fractions_not_floats() -> None:
    assert evaluate("1/3*3") == Fraction(1)


async def test_calculator_episode_call_then_answer() -> None:
    env = CalculatorEnv()
    assert env.spec.tools[0]["function"]["name"] == "calculator"
    assert await env.reset(Task("t", 0, {"a": 7, "b": 12, "op": "+"})) == [
        {"role": "user", "content": "What is 7 + 12?"}
    ]
    call = await env.step(
        Action("<tool_call>...</tool_call>", (ToolCall("calculator", {"expression": "7+12"}),))
    )
    assert call.messages == [{"role": "tool", "name": "calculator", "content": "19"}]
    assert (call.reward, call.done) == (0.2, False)
    answer = await env.step(Action("19"))
    assert (answer.messages[0]["content"], answer.done, answer.outcome) == ("correct", True, 1.0)


async def test_calculator_mistakes_are_penalised_observations() -> None:
    env = CalculatorEnv(max_turns=3)
    await env.reset(Task("t", 0, {"a": 9, "b": 4, "op": "-"}))
    early = await env.step(Action("5"))
    assert (early.messages[0]["content"], early.reward, early.done) == ("use the calculator", -0.1, False)
    bad = await env.step(
        Action(
            "x", (ToolCall("calc", {}), ToolCall("calculator", {"expression": 5})), ("bad JSON in call 3",)
        )
    )
    assert _texts(bad.messages) == [
        "error: bad JSON in call 3",
        "error: unknown tool 'calc'",
        'error: "expression" must be a string',
    ]
    assert bad.reward == -0.1
    last = await env.step(Action("x", (ToolCall("calculator", {"expression": "9-4"}),)))
    assert (last.reward, last.truncated, last.outcome) == (0.2, True, 0.0)


async def test_calculator_first_success_only_is_rewarded_and_wrong_answer_ends() -> None:
    env = CalculatorEnv()
    await env.reset(Task("t", 0, {"a": 2, "b": 3, "op": "+"}))
    calls = (ToolCall("calculator", {"expression": "2+3"}),)
    assert (await env.step(Action("c", calls))).reward == 0.2
    assert (await env.step(Action("c", calls))).reward == 0.0
    env = CalculatorEnv()
    await env.reset(Task("t", 0, {"a": 2, "b": 3, "op": "+"}))
    await env.step(Action("c", calls))
    wrong = await env.step(Action("6"))
    assert (wrong.messages[0]["content"], wrong.done, wrong.outcome) == ("wrong", True, 0.0)


# --- grid-nav -------------------------------------------------------------------------------------


async def test_grid_nav_shaping_rewards_and_goal() -> None:
    env = GridNavEnv()
    assert env.spec.action_hints == ("up", "down", "left", "right")
    assert await env.reset(Task("t", 0, {"size": 4, "start": [0, 0], "goal": [1, 1]})) == [
        {"role": "user", "content": "pos 0 0 goal 1 1"}
    ]
    steps = []
    for text in ("left", "Right!", "go down", "hmm", "up"):
        result = await env.step(Action(text))
        steps.append((result.messages[0]["content"], result.reward, result.done, result.outcome))
    assert steps == [
        ("pos 0 0 goal 1 1", -0.1, False, None),  # wall: stays, not closer
        ("pos 1 0 goal 1 1", 0.1, False, None),
        ("pos 1 0 goal 1 1", -0.1, False, None),  # wall at y = 0
        ("invalid", -0.1, False, None),
        ("pos 1 1 goal 1 1", 0.1, True, 1.0),
    ]


# --- word-guess -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("guess", "secret", "marks"),
    [("cat", "cat", "G G G"), ("cat", "act", "Y Y G"), ("egg", "gum", "- Y -"), ("egg", "leg", "Y - G"),
     ("dog", "sun", "- - -")],
)  # fmt: skip
def test_word_guess_feedback(guess: str, secret: str, marks: str) -> None:
    assert feedback(guess, secret) == marks


async def test_word_guess_episode() -> None:
    env = WordGuessEnv()
    await env.reset(Task("t", 0, {"secret": "cow"}))
    replies = []
    for text in ("cat", "zzz", "!!", "COW"):
        result = await env.step(Action(text))
        replies.append((result.messages[0]["content"], result.reward, result.done))
    assert replies == [
        ("G - -", 0.0, False),
        ("unknown", -0.1, False),
        ("invalid", -0.1, False),
        ("G G G", 0.0, True),
    ]


async def test_word_guess_gold_solves_every_word_within_max_turns() -> None:
    turns_needed = []
    for secret in WORDS:
        outcome, turns = await _play(WordGuessEnv(), Task("t", 0, {"secret": secret}), _gold)
        assert outcome == 1.0, secret
        turns_needed.append(turns)
    assert max(turns_needed) <= 6
    assert len(set(WORDS)) == len(WORDS) >= 50


# --- every built-in -------------------------------------------------------------------------------


def _gold(env: Environment, _rng: random.Random) -> Action:
    return parse_hermes(env.gold_action() or "")


def _random(env: Environment, rng: random.Random) -> Action:
    return random_action(env, rng, env.spec)


async def _play(env: Environment, task: Task, policy: Policy, seed: int = 0) -> tuple[float | None, int]:
    """Play one episode; (outcome, turns). Fails if the episode outlives max_turns or info is not JSON."""
    rng = random.Random(seed)
    await env.reset(task)
    for turn in range(1, env.spec.max_turns + 1):
        result = await env.step(policy(env, rng))
        json.dumps(result.info, allow_nan=False)
        if result.done or result.truncated:
            await env.close()
            return result.outcome, turn
    raise AssertionError(f"{env.spec.name}: episode did not end within max_turns")


@pytest.mark.parametrize("env_class", BUILTINS)
def test_task_streams_are_deterministic_per_seed(env_class: type[Environment]) -> None:
    def head(seed: int) -> list[tuple[str, int, str]]:
        return [
            (t.id, t.seed, json.dumps(dict(t.data), sort_keys=True))
            for t in itertools.islice(env_class().tasks(seed), 30)
        ]

    assert head(3) == head(3)
    assert head(3) != head(4)
    assert len({data for _, _, data in head(3)}) > 5  # the stream varies


@pytest.mark.parametrize("env_class", BUILTINS)
async def test_reset_is_a_pure_function_of_the_task(env_class: type[Environment]) -> None:
    for task in itertools.islice(env_class().tasks(7), 10):
        assert await env_class().reset(task) == await env_class().reset(task)


@pytest.mark.parametrize("env_class", BUILTINS)
async def test_gold_policy_solves_every_task(env_class: type[Environment]) -> None:
    tasks = list(itertools.islice(env_class().tasks(1), 60))
    outcomes = [(await _play(env_class(), task, _gold))[0] for task in tasks]
    assert outcomes == [1.0] * len(tasks)


@pytest.mark.parametrize("env_class", BUILTINS)
async def test_random_policy_never_crashes_and_always_ends(env_class: type[Environment]) -> None:
    outcomes = []
    for index, task in enumerate(itertools.islice(env_class().tasks(2), 150)):
        outcome, _ = await _play(env_class(), task, _random, seed=index)
        assert outcome in (0.0, 1.0)
        outcomes.append(outcome)
    assert sum(o == 1.0 for o in outcomes) < len(outcomes) / 2  # random play mostly fails


@pytest.mark.parametrize("env_class", BUILTINS)
async def test_step_after_the_end_is_an_env_error(env_class: type[Environment]) -> None:
    from envs.api import EnvError

    env = env_class()
    task = next(env.tasks(0))
    await _play(env, task, _gold)
    with pytest.raises(EnvError, match="after the episode ended"):
        await env.step(Action("1"))


async def test_builtin_vocab_hints_cover_what_gold_play_sees() -> None:
    hints = builtin_vocab_hints()
    assert len(hints) == len(set(hints))
    assert {"higher", "lower", "correct", "calculator", "up", "goal", "G", "cat"} <= set(hints)
    assert {str(n) for n in range(1, 17)} <= set(hints)
    seen: set[str] = set()
    for env_class in BUILTINS:
        for task in itertools.islice(env_class().tasks(5), 40):
            env = env_class()
            texts = [m["content"] for m in await env.reset(task)]
            while (gold := env.gold_action()) is not None:
                result = await env.step(_gold(env, random.Random(0)))
                texts += [m["content"] for m in result.messages if m["role"] == "user"]
                if "<tool_call>" not in gold:
                    texts.append(gold)
                if result.done or result.truncated:
                    break
            seen |= {word.strip(".?" + string.whitespace) for text in texts for word in text.split()}
    assert seen - set(hints) == set()
