"""The environment checker: passes the built-ins, fails broken environments on the named criterion."""

from __future__ import annotations

import asyncio
import copy
import itertools
import json
import random
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

from envs.api import Action, Environment, EnvSpec, Message, StepResult, Task, ToolCall
from envs.check_policies import gold_policy_action, random_action
from envs.checker import CRITERIA, check_env, format_report, main
from envs.discovery import resolve_env
from envs.sync_adapter import SyncEnvironment, as_async_factory, is_pool_thread

BUILTIN_NAMES = ["guess-number", "calculator", "grid-nav", "word-guess"]


class DigitEnv(Environment):
    """A correct little environment: guess the task's digit in 3 turns. Broken variants override it."""

    step_timeout_s = 10.0
    has_gold = True

    def __init__(self) -> None:
        self.spec = EnvSpec(name="digit", version="1", max_turns=3, step_timeout_s=self.step_timeout_s)
        self.digit: int | None = None
        self.turns = 0

    def tasks(self, seed: int) -> Iterator[Task]:
        return (Task(f"digit-{seed}-{i}", i, {"digit": (seed + i) % 10}) for i in itertools.count())

    async def reset(self, task: Task) -> list[Message]:
        self.digit, self.turns = int(task.data["digit"]), 0
        return [{"role": "user", "content": "pick a digit"}]

    async def step(self, action: Action) -> StepResult:
        self.turns += 1
        solved = action.text.strip() == str(self.digit)
        out_of_turns = not solved and self.turns >= self.spec.max_turns
        return StepResult(
            [{"role": "user", "content": "yes" if solved else "no"}],
            reward=self.reward(),
            done=solved,
            truncated=out_of_turns,
            outcome=1.0 if solved else (0.0 if out_of_turns else None),
            info=self.info(),
        )

    def reward(self) -> float:
        return 0.0

    def info(self) -> dict[str, Any]:
        return {"turn": self.turns}

    def gold_action(self) -> str | None:
        return str(self.digit) if self.has_gold and self.digit is not None else None


class NaNRewardEnv(DigitEnv):
    def reward(self) -> float:
        return float("nan") if self.turns == 2 else 0.0


class NeverDoneEnv(DigitEnv):
    has_gold = False

    async def step(self, action: Action) -> StepResult:
        return StepResult([{"role": "user", "content": "again"}])


class RandomResetEnv(DigitEnv):
    counter = itertools.count()

    async def reset(self, task: Task) -> list[Message]:
        await super().reset(task)
        return [{"role": "user", "content": f"pick a digit ({next(self.counter)})"}]


class HangingStepEnv(DigitEnv):
    step_timeout_s = 0.05
    has_gold = False  # a gold policy could not score either; keep the failure to one criterion

    async def step(self, action: Action) -> StepResult:
        await asyncio.sleep(30)
        return await super().step(action)


class BlockingStepEnv(DigitEnv):
    step_timeout_s = 0.05
    has_gold = False

    async def step(self, action: Action) -> StepResult:
        time.sleep(0.08)  # noqa: ASYNC251 - deliberately blocks the loop: wait_for cannot interrupt it
        return await super().step(action)


class LeakyTaskEnv(DigitEnv):
    background: ClassVar[set[asyncio.Task[None]]] = set()

    async def reset(self, task: Task) -> list[Message]:
        self.background.add(asyncio.create_task(asyncio.sleep(30)))
        return await super().reset(task)


class LeakyThreadEnv(DigitEnv):
    stop = threading.Event()

    async def reset(self, task: Task) -> list[Message]:
        if task.id.endswith("-0"):
            threading.Thread(target=self.stop.wait, args=(10,), name="stray-worker").start()
        return await super().reset(task)


class NonJsonInfoEnv(DigitEnv):
    def info(self) -> dict[str, Any]:
        return {"turn": self.turns, "handle": object()}


class CrashesOnGarbageEnv(DigitEnv):
    async def step(self, action: Action) -> StepResult:
        if not action.text.strip().isdigit():
            raise ValueError(f"cannot parse {action.text[:10]!r}")
        return await super().step(action)


class NotAsyncStepEnv(DigitEnv):
    has_gold = False

    def step(self, action: Action) -> StepResult:  # type: ignore[override]
        return StepResult([{"role": "user", "content": "no"}], done=True, outcome=0.0)


class CloseTwiceFailsEnv(DigitEnv):
    closed = False

    async def close(self) -> None:
        if self.closed:
            raise RuntimeError("already closed")
        self.closed = True


class WrongGoldEnv(DigitEnv):
    def gold_action(self) -> str | None:
        return "x" if self.digit is not None else None


class FiniteTaskStreamEnv(DigitEnv):
    def tasks(self, seed: int) -> Iterator[Task]:
        return itertools.islice(super().tasks(seed), 2)


class BadToolSchemaEnv(DigitEnv):
    def __init__(self) -> None:
        super().__init__()
        self.spec = EnvSpec(name="digit", version="1", max_turns=3, tools=({"type": "function"},))


class ForkingDigitEnv(DigitEnv):
    async def fork(self) -> DigitEnv:
        return copy.copy(self)


class SharedForkEnv(DigitEnv):
    async def fork(self) -> DigitEnv:
        return self  # not a copy: stepping the "fork" moves the original on


class FailingForkEnv(DigitEnv):
    async def fork(self) -> DigitEnv:
        raise OSError("no space left for a snapshot")


def _failed(report: Any) -> set[str]:
    return {criterion.name for criterion in report.failures()}


async def test_a_correct_environment_passes_every_criterion() -> None:
    report = await check_env(DigitEnv, episodes=6)
    assert report.passed, format_report(report)
    assert [criterion.name for criterion in report.criteria] == list(CRITERIA)
    assert report.stats["gold_mean_outcome"] == 1.0
    assert 0.0 <= report.stats["random_mean_outcome"] < 1.0


@pytest.mark.parametrize(
    ("env_class", "criterion", "detail"),
    [
        (NaNRewardEnv, "rewards_finite", "step 2: reward nan"),
        (NeverDoneEnv, "ends_within_max_turns", "not done after max_turns=3"),
        (RandomResetEnv, "deterministic_reset", "first observation"),
        (HangingStepEnv, "step_timeout_enforced", "step 1 exceeded step_timeout_s=0.05"),
        (BlockingStepEnv, "step_timeout_enforced", "random episode 0 (digit-0-0) step 1"),
        (LeakyTaskEnv, "no_leaked_tasks", "outlived its episode"),
        (LeakyThreadEnv, "no_leaked_threads", "'stray-worker'"),
        (NonJsonInfoEnv, "info_json_serializable", "not JSON serializable"),
        (CrashesOnGarbageEnv, "survives_random_actions", "raised ValueError"),
        (NotAsyncStepEnv, "survives_random_actions", "step() returned StepResult, not an awaitable"),
        (CloseTwiceFailsEnv, "close_idempotent", "second close() raised RuntimeError"),
        (WrongGoldEnv, "gold_policy_scores", "gold policy mean outcome 0.000"),
        (FiniteTaskStreamEnv, "deterministic_tasks", "ended after 2 tasks"),
        (BadToolSchemaEnv, "spec_valid", "tools[0]"),
    ],
)
async def test_broken_environment_fails_exactly_the_named_criterion(
    env_class: type[DigitEnv], criterion: str, detail: str
) -> None:
    LeakyThreadEnv.stop.clear()
    try:
        report = await check_env(env_class, episodes=4)
    finally:
        LeakyThreadEnv.stop.set()
    assert _failed(report) == {criterion}, format_report(report)
    failure = report.failures()[0]
    assert detail in failure.detail
    assert not report.passed
    if criterion in (
        "rewards_finite",
        "ends_within_max_turns",
        "step_timeout_enforced",
        "survives_random_actions",
    ):
        assert "episode" in failure.detail or "task digit-" in failure.detail


async def test_a_fork_must_continue_in_the_same_state_and_apart() -> None:
    report = await check_env(ForkingDigitEnv, episodes=2)
    assert report.passed, format_report(report)
    [fork] = [c for c in report.criteria if c.name == "forks_independent"]
    assert fork.detail == "fork after turn 1, 2 turns compared"
    plain = await check_env(DigitEnv, episodes=2)
    assert [c.detail for c in plain.criteria if c.name == "forks_independent"] == [
        "no fork(): skipped (tree rollouts need it)"
    ]
    shared = await check_env(SharedForkEnv, episodes=2)
    assert _failed(shared) == {"forks_independent"}
    assert "answered differently at turn 2" in shared.failures()[0].detail
    failing = await check_env(FailingForkEnv, episodes=2)
    assert _failed(failing) == {"forks_independent"}
    assert failing.failures()[0].detail == "fork check: fork() raised OSError('no space left for a snapshot')"


async def test_leaked_tasks_are_cancelled_by_the_checker() -> None:
    LeakyTaskEnv.background.clear()
    await check_env(LeakyTaskEnv, episodes=2)
    await asyncio.sleep(0)
    assert LeakyTaskEnv.background and all(task.cancelled() for task in LeakyTaskEnv.background)


async def test_factory_that_cannot_build_aborts_with_spec_valid_failure() -> None:
    def factory(**options: Any) -> Environment:
        raise RuntimeError("no GPU")

    report = await check_env(factory, episodes=2, name="broken")
    assert report.env == "broken"
    assert _failed(report) == set(CRITERIA)
    assert "no GPU" in report.criteria[0].detail


@pytest.mark.parametrize("name", BUILTIN_NAMES)
async def test_every_builtin_passes(name: str) -> None:
    report = await check_env(resolve_env(name), episodes=8, seed=3)
    assert report.passed, format_report(report)
    assert report.stats["gold_success_rate"] == 1.0


def test_cli_json_report_and_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["guess-number", "--episodes", "3", "--json", "--option", "high=8"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] is True and report["env"] == "guess-number"
    assert {c["name"] for c in report["criteria"]} == set(CRITERIA)
    assert main(["check", "grid-nav", "--episodes", "2"]) == 0
    table = capsys.readouterr().out
    assert "PASS  spec_valid" in table and table.rstrip().endswith("all criteria passed")
    assert main(["no-such-env"]) == 2
    assert "no environment named 'no-such-env'" in capsys.readouterr().err


def test_cli_exits_one_and_names_failures(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([f"{__name__}:NeverDoneEnv", "--episodes", "2"]) == 1
    out = capsys.readouterr().out
    assert "FAIL  ends_within_max_turns" in out
    assert out.rstrip().endswith("FAILED: ends_within_max_turns")


def test_gold_policy_parses_tool_calls_with_the_hermes_parser() -> None:
    class Gold:
        def gold_action(self) -> str:
            return (
                'a <tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call>'
                '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>'
                "<tool_call>{oops</tool_call>"
            )

    action = gold_policy_action(Gold(), random.Random(0), EnvSpec(name="g", version="1", max_turns=1))  # type: ignore[arg-type]
    assert action.tool_calls == (ToolCall("calculator", {"expression": "1+2"}), ToolCall("f", {"x": 1}))
    assert len(action.tool_call_errors) == 1 and "tool call 2: invalid JSON" in action.tool_call_errors[0]
    assert action.text == Gold().gold_action()


def test_random_policy_mixes_text_and_tool_calls() -> None:
    import random

    spec = EnvSpec(
        name="t",
        version="1",
        max_turns=1,
        tools=(
            {
                "type": "function",
                "function": {
                    "name": "calc",
                    "parameters": {"type": "object", "properties": {"e": {"type": "string"}, "n": {}}},
                },
            },
        ),
    )
    rng = random.Random(0)
    actions = [random_action(DigitEnv(), rng, spec) for _ in range(300)]
    assert all(isinstance(a.text, str) for a in actions)
    assert any(a.tool_calls and a.tool_calls[0].name == "calc" for a in actions)
    assert any(a.tool_call_errors for a in actions)
    assert any(a.text.strip().lstrip("-").isdigit() for a in actions)
    assert any(a.text == "" for a in actions) and any(len(a.text) > 1000 for a in actions)


GUIDE = Path(__file__).resolve().parents[2] / "docs" / "plugins.md"


async def test_the_plugin_guide_example_passes_the_checker() -> None:
    guide = GUIDE.read_text()
    source = guide.split("## 2. Write the environment", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    module = types.ModuleType("plugin_guide_example")
    exec(compile(source, "docs/plugins.md", "exec"), module.__dict__)
    report = await check_env(module.MyEnv, episodes=6)
    assert report.passed, format_report(report)
    assert report.stats["gold_mean_outcome"] == 1.0


class SyncDigitEnv(SyncEnvironment):
    """The synchronous twin of DigitEnv, run through the adapter's thread pool."""

    def __init__(self) -> None:
        self.spec = EnvSpec(name="sync-digit", version="1", max_turns=2)
        self.digit: int | None = None

    def tasks(self, seed: int) -> Iterator[Task]:
        return (Task(f"sync-digit-{seed}-{i}", i, {"digit": i % 10}) for i in itertools.count())

    def reset(self, task: Task) -> list[Message]:
        self.digit = int(task.data["digit"])
        return [{"role": "user", "content": "pick a digit"}]

    def step(self, action: Action) -> StepResult:
        time.sleep(0.001)  # blocking is fine here: it runs in a pool thread
        solved = action.text.strip() == str(self.digit)
        return StepResult([], done=solved, truncated=not solved, outcome=1.0 if solved else 0.0)

    def gold_action(self) -> str | None:
        return None if self.digit is None else str(self.digit)


async def test_sync_environment_through_the_adapter_passes_with_pool_threads_allowed() -> None:
    report = await check_env(as_async_factory(SyncDigitEnv, max_workers=2), episodes=6)
    assert report.passed, format_report(report)
    assert report.stats["gold_mean_outcome"] == 1.0
    assert any(is_pool_thread(thread) for thread in threading.enumerate())
