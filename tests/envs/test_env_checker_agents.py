"""`rollwise env check` on agent environments: their random phase is played as agent episodes against env
check's own endpoint (envs/check_endpoint.py), whose replies are the random policy's.

The agents are real programs against a real (loopback) server: agent functions with the openai client,
a stdlib script as an agent-process command in the sandbox (through its relay under bubblewrap), and
verifiers' own rollout loop (skipped, naming `make env-verifiers`, where its venv is missing).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, ClassVar

import aiohttp
import openai
import pytest

from envs.agent import AgentEnvironment, AgentFunction, AgentResult
from envs.api import Task
from envs.check_endpoint import CheckEndpoint
from envs.check_report import CRITERIA, CheckReport
from envs.checker import check_env, format_report, main

ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}},
    },
}
SKIP_NOTES = {
    "deterministic_reset": "agent environment (never reset: its agent holds the conversation): skipped",
    "observations_well_formed": "agent environment (its agent writes the messages): skipped",
    "gold_policy_scores": "agent environment (no gold policy): skipped",
    "forks_independent": "agent environment (an agent run is not forked): skipped",
}


def tasks(seed: int) -> Iterator[Task]:
    return (Task(f"sum-{seed}-{i}", i, {"question": f"What is {i} + 2?"}) for i in itertools.count())


async def ask(client: openai.AsyncOpenAI, task: Task, **extra: Any) -> Any:
    messages: Any = [{"role": "user", "content": task.data["question"]}]
    return await client.chat.completions.create(model="policy", messages=messages, **extra)


async def plays_twice(client: openai.AsyncOpenAI, task: Task) -> AgentResult:
    """A correct agent: a plain turn, then a streamed one with a tool offered; it scores 0.25."""
    plain = await ask(client, task)
    stream = await ask(client, task, stream=True, tools=[ADD_TOOL])
    chunks = [chunk async for chunk in stream]
    info = {"first": plain.choices[0].message.content, "chunks": len(chunks)}
    return AgentResult(outcome=0.25, turn_rewards=[0.0, 0.5], info=info)


async def raises(client: openai.AsyncOpenAI, task: Task) -> float:
    await ask(client, task)
    raise RuntimeError("the tool server crashed")


async def returns_nan(client: openai.AsyncOpenAI, task: Task) -> float:
    await ask(client, task)
    return float("nan")


async def rewards_every_turn_twice(client: openai.AsyncOpenAI, task: Task) -> AgentResult:
    await ask(client, task)
    return AgentResult(outcome=0.0, turn_rewards=[0.1, 0.1])


async def asks_until_refused(client: openai.AsyncOpenAI, task: Task) -> float:
    while True:
        try:
            await ask(client, task)
        except openai.BadRequestError:
            return 0.0


async def asks_until_it_raises(client: openai.AsyncOpenAI, task: Task) -> float:
    while True:
        await ask(client, task)


async def asks_another_model(client: openai.AsyncOpenAI, task: Task) -> float:
    await client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    return 0.0


async def retries_past_the_limit(client: openai.AsyncOpenAI, task: Task) -> float:
    while True:
        try:
            await ask(client, task)
        except openai.BadRequestError:
            continue


async def retries_another_model(client: openai.AsyncOpenAI, task: Task) -> float:
    while True:
        try:
            await asks_another_model(client, task)
        except openai.NotFoundError:
            continue


async def keeps_a_handle_in_info(client: openai.AsyncOpenAI, task: Task) -> AgentResult:
    await ask(client, task)
    return AgentResult(outcome=0.0, info={"handle": object()})


async def never_asks(client: openai.AsyncOpenAI, task: Task) -> float:
    return 0.0


async def sleeps(client: openai.AsyncOpenAI, task: Task) -> float:
    await asyncio.sleep(30)
    return 0.0


async def blocks(client: openai.AsyncOpenAI, task: Task) -> float:
    time.sleep(0.4)  # noqa: ASYNC251 - deliberately holds the event loop
    await ask(client, task)
    return 0.0


BACKGROUND: set[asyncio.Task[None]] = set()


async def leaves_a_task(client: openai.AsyncOpenAI, task: Task) -> float:
    BACKGROUND.add(asyncio.create_task(asyncio.sleep(30)))
    await ask(client, task)
    return 0.0


class ClosesOnce(AgentEnvironment):
    closed: ClassVar[set[int]] = set()

    async def close(self) -> None:
        if id(self) in self.closed:
            raise RuntimeError("already closed")
        self.closed.add(id(self))


def agent_env(
    agent: AgentFunction, env_class: type[AgentEnvironment] = AgentEnvironment, **options: Any
) -> Any:
    settings = {"name": "sum", "max_turns": 3, "episode_timeout_s": 5.0, **options}
    return functools.partial(env_class, agent, tasks, **settings)


def failed(report: CheckReport) -> set[str]:
    return {criterion.name for criterion in report.failures()}


async def test_an_agent_function_environment_passes_with_notes_for_what_does_not_apply() -> None:
    report = await check_env(agent_env(plays_twice), episodes=4, seed=5)
    assert report.passed, format_report(report)
    assert [c.name for c in report.criteria] == list(CRITERIA)
    details = {c.name: c.detail for c in report.criteria}
    assert {name: details[name] for name in SKIP_NOTES} == SKIP_NOTES
    assert details["survives_random_actions"] == "4 agent episodes against env check's random-policy endpoint"
    assert details["ends_within_max_turns"] == "at most 2 chat completions per episode (max_turns=3)"
    assert details["step_timeout_enforced"].endswith("(episode_timeout_s=5.0)")
    assert report.stats == {"random_mean_outcome": 0.25, "random_success_rate": 0.0, "random_mean_turns": 2.0}
    assert (report.env, report.episodes, report.seed) == ("sum", 4, 5)


@pytest.mark.parametrize(
    ("agent", "options", "criterion", "detail"),
    [
        (raises, {}, "survives_random_actions", "the agent raised RuntimeError('the tool server crashed')"),
        (returns_nan, {}, "rewards_finite", "the agent returned nan; expected a finite number"),
        (rewards_every_turn_twice, {}, "rewards_finite", "turn_rewards has 2 entries for 1 chat completions"),
        (asks_until_refused, {}, "ends_within_max_turns", "asked for chat completion 4 > max_turns=3"),
        (asks_until_it_raises, {}, "ends_within_max_turns", "asked for chat completion 4 > max_turns=3"),
        (
            asks_another_model,
            {},
            "survives_random_actions",
            "(the endpoint refused 1: HTTP 404 model_not_found",
        ),
        (retries_past_the_limit, {}, "ends_within_max_turns", "asked for chat completion 4 > max_turns=3"),
        (
            retries_another_model,
            {"max_refused_requests": 3},
            "survives_random_actions",
            "the agent was stopped after 3 refused requests in a row (the endpoint refused 3: HTTP 404",
        ),
        (keeps_a_handle_in_info, {}, "info_json_serializable", "is not JSON serializable"),
        (never_asks, {}, "survives_random_actions", "the agent returned without a chat completion"),
        (sleeps, {"episode_timeout_s": 0.3}, "step_timeout_enforced", "> episode_timeout_s=0.3"),
        (
            blocks,
            {"episode_timeout_s": 0.2},
            "step_timeout_enforced",
            "without yielding (> step_timeout_s=0.2)",
        ),
        (leaves_a_task, {}, "no_leaked_tasks", "outlived its episode"),
    ],
)
async def test_a_broken_agent_fails_exactly_the_named_criterion(
    agent: AgentFunction, options: dict[str, Any], criterion: str, detail: str
) -> None:
    report = await check_env(agent_env(agent, **options), episodes=2)
    assert failed(report) == {criterion}, format_report(report)
    assert detail in report.failures()[0].detail
    if criterion != "no_leaked_tasks":
        assert report.failures()[0].detail.startswith("random episode 0 (sum-0-0): ")


async def test_closing_an_agent_environment_twice_must_work() -> None:
    report = await check_env(agent_env(plays_twice, ClosesOnce), episodes=2)
    assert failed(report) == {"close_idempotent"}
    assert "second close() raised RuntimeError('already closed')" in report.failures()[0].detail


@pytest.fixture
async def endpoint() -> AsyncIterator[CheckEndpoint]:
    server = CheckEndpoint()
    await server.start()
    yield server
    await server.close()


def streamed_turn(chunks: list[Any]) -> tuple[str | None, list[tuple[str, str]], str | None]:
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [
        (call.function.name, call.function.arguments)
        for c in chunks
        if c.choices
        for call in c.choices[0].delta.tool_calls or []
    ]
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return (None if calls else content), calls, finish[0] if len(finish) == 1 else None


async def test_the_endpoint_streams_the_same_random_turns_it_answers_plainly(endpoint: CheckEndpoint) -> None:
    env = AgentEnvironment(plays_twice, tasks, max_turns=40)
    plain_line, plain = endpoint.open(env, "plain", "3:random:0")
    _, streamed = endpoint.open(env, "streamed", "3:random:0")  # same seed: same turns
    plain_client, stream_client = plain.client(), streamed.client()
    task = next(tasks(0))
    finishes, contents, names = set(), [], set()
    for _ in range(40):
        reply = await ask(plain_client, task, tools=[ADD_TOOL], tool_choice="auto")
        stream = await ask(
            stream_client, task, tools=[ADD_TOOL], stream=True, stream_options={"include_usage": True}
        )
        chunks = [chunk async for chunk in stream]
        message, choice = reply.choices[0].message, reply.choices[0]
        calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
        assert streamed_turn(chunks) == (message.content, calls, choice.finish_reason)
        assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
        assert chunks[-1].choices == [] and chunks[-1].usage == reply.usage
        assert reply.usage is not None and reply.usage.prompt_tokens == 5  # words of "What is 0 + 2?"
        for name, arguments in calls:  # the offered tool, or one that does not exist
            assert isinstance(json.loads(arguments), dict)
            names.add(name)
        assert (choice.finish_reason == "tool_calls") == bool(calls)
        finishes.add(choice.finish_reason)
        contents.append(message.content)
    assert finishes == {"stop", "tool_calls"} and plain_line.requests == 40
    assert "add" in names and names - {"add"}
    assert "" in contents and any(c and len(c) > 1000 for c in contents)
    assert any(c and c.startswith("<tool_call>") for c in contents)  # markup the run's parser would refuse
    models = await plain_client.models.list()
    assert [model.id for model in models.data] == ["policy"]


async def test_the_endpoint_never_returns_tool_calls_when_tool_choice_is_none(
    endpoint: CheckEndpoint,
) -> None:
    _, episode = endpoint.open(AgentEnvironment(plays_twice, tasks, max_turns=30), "e", "0")
    client, task = episode.client(), next(tasks(0))
    replies = [
        await ask(client, task, tools=[ADD_TOOL], tool_choice="none", logprobs=True) for _ in range(30)
    ]
    assert {r.choices[0].finish_reason for r in replies} == {"stop"}
    assert all(r.choices[0].message.tool_calls is None for r in replies)
    for reply in replies:
        content = reply.choices[0].message.content
        tokens = reply.choices[0].logprobs.content if content else None
        assert "".join(t.token for t in tokens or []) == content or (not content and tokens is None)


async def test_the_endpoint_refuses_what_the_run_endpoint_refuses_and_records_it(
    endpoint: CheckEndpoint,
) -> None:
    env = AgentEnvironment(plays_twice, tasks, max_turns=2)
    line, episode = endpoint.open(env, "e", "0")
    other, _ = endpoint.open(env, "other", "0")
    client, task = episode.client(), next(tasks(0))
    with pytest.raises(openai.NotFoundError) as wrong_model:
        await client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert wrong_model.value.code == "model_not_found"
    await ask(client, task)
    await ask(client, task, stream=True)
    with pytest.raises(openai.BadRequestError) as past_the_limit:
        await ask(client, task)
    assert past_the_limit.value.code == "max_turns_exceeded" and line.past_max_turns == 3
    connector = aiohttp.UnixConnector(path=str(endpoint.unix_socket))
    async with aiohttp.ClientSession(connector=connector) as http:  # the sandbox's way in
        base = f"http://localhost/e/{line.key}/v1"
        async with http.post(f"{base}/responses", json={"model": "policy", "input": "hi"}) as reply:
            assert reply.status == 404
            assert (await reply.json())["error"]["code"] == "unsupported_route"
        headers = {"Authorization": f"Bearer {other.key}"}
        async with http.get(f"{base}/models", headers=headers) as reply:
            assert reply.status == 401  # another episode's key on this episode's URL
        await endpoint.end(line)
        async with http.get(f"{base}/models") as reply:
            assert reply.status == 404 and (await reply.json())["error"]["code"] == "episode_ended"
    assert [refusal.split(":")[0] for refusal in line.refusals] == [
        "HTTP 404 model_not_found",
        "HTTP 400 max_turns_exceeded",
        "HTTP 404 unsupported_route",
        "HTTP 404 episode_ended",
    ]
    assert line.requests == 2 and other.requests == 0
    assert "does not serve POST /e/<key>/v1/responses" in line.refusals[2]


# A stdlib agent-process command: one plain and one streamed chat completion through OPENAI_BASE_URL
# (under bubblewrap, the relay to the endpoint's Unix socket), then its outcome on stdout.
PROCESS_AGENT = r"""
import json, os, sys, urllib.request

task = json.load(sys.stdin)

def post(extra):
    messages = [{"role": "user", "content": task["id"]}]
    body = json.dumps({"model": os.environ["ROLLWISE_MODEL"], "messages": messages, **extra}).encode()
    headers = {"content-type": "application/json", "authorization": "Bearer " + os.environ["OPENAI_API_KEY"]}
    url = os.environ["OPENAI_BASE_URL"] + "/chat/completions"
    request = urllib.request.Request(url, body, headers)
    with urllib.request.urlopen(request, timeout=30) as reply:
        return reply.read().decode()

plain = json.loads(post({}))["choices"][0]["message"]
events = [line[6:] for line in post({"stream": True}).splitlines() if line.startswith("data: ")]
assert events[-1] == "[DONE]", events[-1]
chunks = [json.loads(event) for event in events[:-1]]
print(json.dumps({"outcome": 0.5, "turn_rewards": [0.0, 0.1], "info": {"chunks": len(chunks)}}))
"""


def process_tasks(seed: int) -> Iterator[Task]:
    return (Task(f"p-{seed}-{i}", i, {}) for i in itertools.count())


def test_the_cli_checks_an_agent_process_environment(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "agent.py").write_text(PROCESS_AGENT)
    options = [
        "--option",
        f"tasks={__name__}:process_tasks",
        "--option",
        f'files={{"agent.py": "{tmp_path / "agent.py"}"}}',
        "--option",
        "max_turns=2",
    ]
    assert (
        main(["agent-process", "--episodes", "2", "--option", 'command=["python3", "agent.py"]', *options])
        == 0
    )
    table = capsys.readouterr().out
    assert (
        "PASS  survives_random_actions   2 agent episodes against env check's random-policy endpoint" in table
    )
    assert "random policy: mean outcome 0.500, success 0%, mean turns 2.00" in table
    assert table.rstrip().endswith("all criteria passed")
    assert main(["agent-process", "--episodes", "2", "--option", "command=exit 3", *options]) == 1
    table = capsys.readouterr().out
    assert (
        "FAIL  survives_random_actions   random episode 0 (p-0-0): the agent failed (exit): the agent "
        "exited with 3" in table
    )
    assert table.rstrip().endswith("FAILED: survives_random_actions")


@pytest.mark.integration
@pytest.mark.slow
def test_env_check_passes_the_verifiers_adapter(capsys: pytest.CaptureFixture[str]) -> None:
    from tests.envs.test_verifiers_env import readable_fixtures, verifiers_problem

    problem = verifiers_problem()
    if problem:
        pytest.skip(problem)
    options = [
        f"taskset={readable_fixtures() / 'arith_taskset.py'}",
        "harness=null",
        "max_tasks=3",
    ]  # task 3 scores badly
    argv = ["verifiers/arith", "--episodes", "1", "--json"]
    assert main([*argv, *itertools.chain.from_iterable(("--option", o) for o in options)]) == 0
    report = json.loads(capsys.readouterr().out)
    details = {c["name"]: c["detail"] for c in report["criteria"]}
    assert report["passed"] and report["env"] == "verifiers/arith"
    assert details["spec_valid"] == "verifiers/arith v0.4.0, max_turns=16"
    assert details["ends_within_max_turns"] == "at most 1 chat completions per episode (max_turns=16)"
    assert {name: details[name] for name in SKIP_NOTES} == SKIP_NOTES
    assert report["stats"]["random_mean_turns"] == 1.0  # one chat completion per single-turn episode
