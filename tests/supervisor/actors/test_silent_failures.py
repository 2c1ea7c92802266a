"""The runner counts what a policy can get wrong without failing an episode: tool calls, call markup that
does not parse, tool-using episodes without a call, answers in the wrong format (StepResult.info)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from envs.api import FORMAT_ERROR, Action, Environment, EnvSpec, Message, StepResult, Task
from envs.calculator import CalculatorEnv
from envs.guess_number import GuessNumberEnv
from envs.toolcalls import parse_hermes
from pipeline.supervisor.actors.rollout import RolloutSettings, run_episode
from pipeline.supervisor.engines.protocol import GenerateResult, SamplingParams
from pipeline.supervisor.observability.metrics import REGISTRY

TASK = Task(id="t", seed=0, data={})
TOOL = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
GOOD_CALL = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
BAD_CALL = "<tool_call>{not json}</tool_call>"


class TextEngine:
    """Answers the k-th /generate with texts[k] (tokenised), all at version 1."""

    def __init__(self, tok: Any, texts: list[str]) -> None:
        self.tok = tok
        self.texts = texts
        self.calls = 0

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, rid: str, *, affinity_key: str
    ) -> GenerateResult:
        ids = [*self.tok.encode(self.texts[self.calls], add_special_tokens=False), self.tok.eos_token_id]
        self.calls += 1
        return GenerateResult(
            rid=rid,
            output_ids=ids,
            logprobs=[-0.5] * len(ids),
            finish_reason="stop",
            weight_version="1",
            token_versions=["1"] * len(ids),
            prompt_tokens=len(input_ids),
            completion_tokens=len(ids),
            cached_tokens=0,
        )


class TurnsEnv(Environment):
    """Ends after `turns` steps (done, outcome 1); step k reports infos[k] as its info."""

    def __init__(self, turns: int, *, tools: bool = False, infos: list[Any] | None = None) -> None:
        self.spec = EnvSpec(name="turns", version="1", max_turns=turns, tools=(TOOL,) if tools else ())
        self.turns = turns
        self.infos = infos or [{}] * turns
        self.steps = 0

    def tasks(self, seed: int) -> Iterator[Task]:
        yield TASK

    async def reset(self, task: Task) -> list[Message]:
        return [{"role": "user", "content": "go"}]

    async def step(self, action: Action) -> StepResult:
        info = self.infos[self.steps]
        self.steps += 1
        done = self.steps >= self.turns
        return StepResult(
            [{"role": "user", "content": "ok"}], done=done, outcome=1.0 if done else None, info=info
        )


def count(metric: str, env: str) -> float:
    return REGISTRY.get_sample_value(metric, {"env": env}) or 0.0


def settings() -> RolloutSettings:
    return RolloutSettings(sampling=SamplingParams(max_new_tokens=64), max_context_tokens=1024)


async def play(tok: Any, env: Environment, texts: list[str], env_name: str, **kwargs: Any) -> str:
    outcome = await run_episode(
        TextEngine(tok, texts),
        tok,
        env,
        TASK,
        settings(),
        episode_id="e",
        group_id="g",
        env_name=env_name,
        **kwargs,
    )
    return outcome.finish_reason


async def test_tool_calls_and_unparsable_call_markup_are_counted_per_env(tok: Any) -> None:
    env_name = "silent-tools"
    before = {m: count(m, env_name) for m in ("rollwise_tool_calls_total", "rollwise_tool_call_errors_total")}
    texts = [f"{GOOD_CALL}{GOOD_CALL}", BAD_CALL, "done"]
    assert await play(tok, TurnsEnv(3, tools=True), texts, env_name) == "stop"
    assert count("rollwise_tool_calls_total", env_name) == before["rollwise_tool_calls_total"] + 2
    assert count("rollwise_tool_call_errors_total", env_name) == before["rollwise_tool_call_errors_total"] + 1
    # it called a tool, so it is not an episode without tool calls
    assert count("rollwise_episodes_without_tool_calls_total", env_name) == 0


async def test_an_episode_without_a_tool_call_counts_only_where_the_env_declares_tools(tok: Any) -> None:
    await play(tok, TurnsEnv(2, tools=True), [BAD_CALL, "just text"], "silent-no-calls")
    assert count("rollwise_episodes_without_tool_calls_total", "silent-no-calls") == 1
    await play(tok, TurnsEnv(2, tools=False), ["a", "b"], "silent-toolless")
    assert count("rollwise_episodes_without_tool_calls_total", "silent-toolless") == 0


@pytest.mark.parametrize(
    ("infos", "expected"),
    [
        ([{FORMAT_ERROR: True}, {FORMAT_ERROR: "no <answer> tag"}, {}], 2),
        ([{FORMAT_ERROR: False}, {FORMAT_ERROR: ""}, {"other": 1}], 0),
        ([None, ["not", "a", "dict"], {FORMAT_ERROR: None}], 0),  # a plugin's odd info is no crash
    ],
    ids=["true-and-reason", "false-values", "not-dicts"],
)
async def test_answer_format_errors_are_counted_from_step_info(
    tok: Any, infos: list[Any], expected: int, request: pytest.FixtureRequest
) -> None:
    env_name = f"silent-format-{request.node.callspec.id}"
    assert await play(tok, TurnsEnv(3, infos=infos), ["a", "b", "c"], env_name) == "stop"
    assert count("rollwise_answer_format_errors_total", env_name) == expected


async def test_evaluation_episodes_count_none_of_it(tok: Any) -> None:
    env = TurnsEnv(2, tools=True, infos=[{FORMAT_ERROR: True}, {}])
    await play(tok, env, [BAD_CALL, "x"], "silent-eval", record_metrics=False)
    for metric in (
        "rollwise_tool_call_errors_total",
        "rollwise_answer_format_errors_total",
        "rollwise_episodes_without_tool_calls_total",
    ):
        assert count(metric, "silent-eval") == 0


async def test_the_built_in_envs_report_answers_in_the_wrong_format() -> None:
    guess = GuessNumberEnv()
    await guess.reset(next(guess.tasks(0)))
    assert (await guess.step(Action("no number here"))).info[FORMAT_ERROR] == "no integer"
    assert FORMAT_ERROR not in (await guess.step(Action("8"))).info

    calc = CalculatorEnv()
    await calc.reset(next(calc.tasks(0)))
    # the answer turn is judged only after a successful call
    await calc.step(
        parse_hermes('<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>')
    )
    assert (await calc.step(Action("the answer is seven"))).info[FORMAT_ERROR] == "no integer in the answer"


def test_reasoning_gym_reports_a_missing_answer_tag() -> None:
    pytest.importorskip("reasoning_gym")
    from envs.reasoning_gym_tasks import ReasoningGymEnv

    env = ReasoningGymEnv("basic_arithmetic", size=4, attempts=2)
    env.reset(next(env.tasks(0)))
    assert env.step(Action("I think 12")).info[FORMAT_ERROR] == "no <answer> tag"
    assert FORMAT_ERROR not in env.step(Action("<answer>12</answer>")).info
