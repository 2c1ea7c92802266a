"""Contract types of envs/api.py and the sync adapter of envs/sync_adapter.py."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import threading
import time
from collections.abc import Iterator

import pytest

from envs.api import Action, EnvError, Environment, EnvSpec, Message, StepResult, Task, ToolCall
from envs.sync_adapter import (
    THREAD_NAME_PREFIX,
    AsyncAdapter,
    SyncEnvironment,
    as_async_factory,
    shared_executor,
)

CALC_TOOL = {"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}


def test_env_spec_defaults_are_valid() -> None:
    spec = EnvSpec(name="guess-number", version="1", max_turns=5)
    assert spec.step_timeout_s == 10.0
    assert spec.episode_timeout_s == 120.0
    assert spec.tools == ()
    assert spec.action_hints == ()
    assert spec.validate() == []


@pytest.mark.parametrize(
    ("overrides", "field_name"),
    [
        ({"max_turns": 0}, "max_turns"),
        ({"max_turns": 2.5}, "max_turns"),
        ({"max_turns": True}, "max_turns"),
        ({"step_timeout_s": 0.0}, "step_timeout_s"),
        ({"step_timeout_s": float("nan")}, "step_timeout_s"),
        ({"episode_timeout_s": -1.0}, "episode_timeout_s"),
        ({"episode_timeout_s": float("inf")}, "episode_timeout_s"),
        ({"name": ""}, "name"),
        ({"version": "  "}, "version"),
        ({"tools": [CALC_TOOL]}, "tools"),
        ({"action_hints": ["1", "2"]}, "action_hints"),
        ({"action_hints": ("1", " ")}, "action_hints"),
    ],
)
def test_env_spec_rejects_nonsense_naming_the_field(overrides: dict[str, object], field_name: str) -> None:
    arguments: dict[str, object] = {"name": "x", "version": "1", "max_turns": 3, **overrides}
    with pytest.raises(ValueError, match=field_name):
        EnvSpec(**arguments)  # type: ignore[arg-type]


def test_env_spec_validate_reports_soft_problems() -> None:
    no_name = {"type": "function", "function": {"parameters": {"type": "object"}}}
    bad_params = {"type": "function", "function": {"name": "b", "parameters": {"type": "string"}}}
    spec = EnvSpec(
        name="has space",
        version="1",
        max_turns=2,
        step_timeout_s=30.0,
        episode_timeout_s=5.0,
        tools=(CALC_TOOL, CALC_TOOL, no_name, bad_params, {"type": "other"}),
    )
    problems = spec.validate()
    assert any(p.startswith("name 'has space'") for p in problems)
    assert any("episode_timeout_s (5.0) is shorter than step_timeout_s (30.0)" in p for p in problems)
    assert any("tools[1].function.name 'calc' is declared twice" in p for p in problems)
    assert any("tools[2].function.name" in p for p in problems)
    assert any("tools[3].function.parameters" in p for p in problems)
    assert any(p.startswith("tools[4]") for p in problems)
    assert len(problems) == 6


def test_action_and_tool_call_are_frozen_with_empty_defaults() -> None:
    action = Action("7")
    assert action.tool_calls == () and action.tool_call_errors == ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        action.text = "8"  # type: ignore[misc]
    call = ToolCall("calc", {"expression": "1+1"})
    assert Action("x", (call,)).tool_calls[0].arguments == {"expression": "1+1"}


def test_step_result_defaults_do_not_share_info() -> None:
    first, second = StepResult(messages=[]), StepResult(messages=[])
    first.info["k"] = 1
    assert second.info == {}
    assert (first.reward, first.done, first.truncated, first.outcome) == (0.0, False, False, None)


def test_environment_requires_the_abstract_methods() -> None:
    class Incomplete(Environment):
        async def step(self, action: Action) -> StepResult:
            return StepResult([])

    with pytest.raises(TypeError, match="abstract"):
        Incomplete()  # type: ignore[abstract]


class _Minimal(Environment):
    spec = EnvSpec(name="minimal", version="1", max_turns=1)

    def tasks(self, seed: int) -> Iterator[Task]:
        return (Task(str(i), i, {}) for i in itertools.count())

    async def reset(self, task: Task) -> list[Message]:
        return [{"role": "user", "content": task.id}]

    async def step(self, action: Action) -> StepResult:
        return StepResult([], done=True, outcome=1.0)


async def test_environment_defaults_no_gold_and_idempotent_close() -> None:
    env = _Minimal()
    assert env.gold_action() is None
    await env.close()
    await env.close()
    assert await env.reset(Task("t", 0, {})) == [{"role": "user", "content": "t"}]


class _SleepySync(SyncEnvironment):
    """Records the thread of every call; step blocks for ``delay_s`` like a slow C library would."""

    def __init__(self, delay_s: float = 0.0, word: str = "hi") -> None:
        self.spec = EnvSpec(name="sleepy", version="1", max_turns=2)
        self.delay_s = delay_s
        self.word = word
        self.threads: list[str] = []
        self.closes = 0

    def tasks(self, seed: int) -> Iterator[Task]:
        return (Task(f"{seed}-{i}", i, {}) for i in itertools.count())

    def reset(self, task: Task) -> list[Message]:
        self.threads.append(threading.current_thread().name)
        return [{"role": "user", "content": f"{self.word} {task.id}"}]

    def step(self, action: Action) -> StepResult:
        self.threads.append(threading.current_thread().name)
        time.sleep(self.delay_s)
        if action.text == "boom":
            raise EnvError("sync env failed")
        return StepResult([{"role": "user", "content": action.text.upper()}], done=True, outcome=1.0)

    def close(self) -> None:
        self.closes += 1

    def gold_action(self) -> str | None:
        return self.word


async def test_adapter_runs_sync_calls_in_pool_threads() -> None:
    sync_env = _SleepySync()
    env = AsyncAdapter(sync_env)
    assert env.spec is sync_env.spec
    assert await env.reset(Task("t0", 0, {})) == [{"role": "user", "content": "hi t0"}]
    result = await env.step(Action("ok"))
    assert result.messages == [{"role": "user", "content": "OK"}] and result.done
    assert env.gold_action() == "hi"
    assert [name.startswith(THREAD_NAME_PREFIX) for name in sync_env.threads] == [True, True]
    assert threading.current_thread().name not in sync_env.threads


async def test_adapter_does_not_block_the_event_loop() -> None:
    envs = [AsyncAdapter(_SleepySync(delay_s=0.3), shared_executor(4)) for _ in range(4)]
    for env in envs:
        await env.reset(Task("t", 0, {}))
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    ticking = asyncio.create_task(ticker())
    started = time.monotonic()
    await asyncio.gather(*(env.step(Action("x")) for env in envs))
    elapsed = time.monotonic() - started
    ticking.cancel()
    await asyncio.gather(ticking, return_exceptions=True)
    assert elapsed < 0.3 * 4 * 0.6  # four 0.3 s steps overlapped in four threads
    assert ticks >= 10  # the loop kept running while the threads slept


async def test_adapter_close_is_idempotent_and_errors_propagate() -> None:
    sync_env = _SleepySync()
    env = AsyncAdapter(sync_env)
    await env.reset(Task("t", 0, {}))
    with pytest.raises(EnvError, match="sync env failed"):
        await env.step(Action("boom"))
    await env.close()
    await env.close()
    assert sync_env.closes == 1


async def test_as_async_factory_passes_options_and_shares_the_pool() -> None:
    factory = as_async_factory(_SleepySync, max_workers=3)
    first, second = factory(word="yo"), factory()
    assert isinstance(first, AsyncAdapter) and isinstance(second, AsyncAdapter)
    assert await first.reset(Task("a", 0, {})) == [{"role": "user", "content": "yo a"}]
    assert first._executor is second._executor is shared_executor(3)
    assert shared_executor(3) is not shared_executor(4)
    with pytest.raises(ValueError, match="max_workers"):
        as_async_factory(_SleepySync, max_workers=0)
