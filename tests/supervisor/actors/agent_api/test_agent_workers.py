"""Agent functions in worker processes (pipeline/supervisor/actors/agent_api/agent_workers.py): each
worker runs episodes' agents with its own client, over HTTP to the endpoint, which records them as always."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator, Iterator
from typing import Any

import openai
import pytest

from envs.agent import POLICY_MODEL, AgentEnvironment, AgentResult
from envs.api import Task
from pipeline.supervisor.actors.agent_api.agent_workers import AgentWorkerPool
from pipeline.supervisor.actors.agent_api.openai_endpoint import OpenAIEndpoint
from pipeline.supervisor.actors.rollout import EpisodeOutcome, RolloutSettings
from pipeline.supervisor.engines.client import EngineClient
from pipeline.supervisor.engines.pool import EnginePool
from pipeline.supervisor.engines.protocol import SamplingParams
from pipeline.supervisor.observability.metrics import REGISTRY
from pipeline.tools.fake_sglang import FakeSGLang, Plan

ENV_NAME = "agent-workers-test"


async def two_turn_agent(client: openai.AsyncOpenAI, task: Task) -> AgentResult:
    """Runs in a worker: two chat completions; prints (stdout is not the protocol's)."""
    print("an agent's own output")
    messages: list[Any] = [{"role": "user", "content": task.data["question"]}]
    first = await client.chat.completions.create(model=POLICY_MODEL, messages=messages)
    messages += [first.choices[0].message, {"role": "user", "content": "sure?"}]
    second = await client.chat.completions.create(model=POLICY_MODEL, messages=messages)
    await client.close()  # must not close the worker's shared connection pool
    return AgentResult(
        outcome=1.0 if second.choices[0].message.content else 0.0,
        turn_rewards=[0.5],
        info={"pid": os.getpid()},
    )


async def three_apis_agent(client: openai.AsyncOpenAI, task: Task) -> float:
    """The client the worker gives (its requests over the worker's pipe): a streamed chat completion
    and a Responses call; then a client of its own from the base URL (over HTTP): an Anthropic message.
    Non-ASCII text both ways: the bytes must arrive as sent."""
    import anthropic

    question = task.data["question"] + " — é, 五"
    stream = await client.chat.completions.create(
        model=POLICY_MODEL, messages=[{"role": "user", "content": question}], stream=True
    )
    text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
    response = await client.responses.create(model=POLICY_MODEL, input=question, store=False)
    base = str(client.base_url).removesuffix("/").removesuffix("/v1")
    async with anthropic.AsyncAnthropic(base_url=base, api_key=client.api_key, max_retries=0) as own:
        message = await own.messages.create(
            model=POLICY_MODEL, max_tokens=8, messages=[{"role": "user", "content": question}]
        )
    answers = [text, response.output_text, message.content[0].text]  # type: ignore[union-attr]
    return 1.0 if answers == ["5", "5", "5"] else 0.0


async def looping_agent(client: openai.AsyncOpenAI, task: Task) -> float:
    """Retries, for ever, a request the endpoint refuses (n=3)."""
    while True:
        try:
            await client.chat.completions.create(
                model=POLICY_MODEL, messages=[{"role": "user", "content": "hi"}], n=3
            )
        except openai.BadRequestError:
            continue


async def failing_agent(client: openai.AsyncOpenAI, task: Task) -> float:
    await client.chat.completions.create(model=POLICY_MODEL, messages=[{"role": "user", "content": "hi"}])
    raise ValueError("the agent's own bug")


async def dying_agent(client: openai.AsyncOpenAI, task: Task) -> float:
    await client.chat.completions.create(model=POLICY_MODEL, messages=[{"role": "user", "content": "hi"}])
    os.kill(os.getpid(), signal.SIGKILL)
    return 1.0


def tasks(seed: int) -> Iterator[Task]:
    while True:
        yield Task(id="w0", seed=0, data={"question": "What is 2 + 3?"})


@pytest.fixture
async def fake(tok: Any) -> AsyncIterator[FakeSGLang]:
    def plan(call: Any) -> Plan:
        ids = [*tok.encode("5", add_special_tokens=False), tok.eos_token_id]
        return Plan(ids, [-0.3] * len(ids))

    server = FakeSGLang(tokenizer=tok, script=plan)
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
async def endpoint(fake: FakeSGLang, tok: Any) -> AsyncIterator[OpenAIEndpoint]:
    pool = EnginePool([EngineClient(fake.base_url, retries=0)])
    workers = AgentWorkerPool(2)
    await workers.start()
    settings = RolloutSettings(sampling=SamplingParams(max_new_tokens=16), max_context_tokens=512)
    server = OpenAIEndpoint(engine=pool, tokenizer=tok, settings=settings, agent_pool=workers)
    await server.start()
    yield server
    await server.close()  # closes the workers too
    await pool.close()


async def play(endpoint: OpenAIEndpoint, agent: str, episode: str) -> EpisodeOutcome:
    env = AgentEnvironment(agent, tasks, episode_timeout_s=60.0)
    task = next(tasks(0))
    return await endpoint.run_agent_episode(env, task, episode_id=episode, group_id="g", env_name=ENV_NAME)


async def test_episodes_run_in_the_workers_and_are_recorded(
    endpoint: OpenAIEndpoint, fake: FakeSGLang
) -> None:
    agent = f"{__name__}:two_turn_agent"
    results = await asyncio.gather(*(play(endpoint, agent, f"e{i}") for i in range(6)))
    for result in results:
        assert (result.finish_reason, result.error, result.outcome) == ("stop", None, 1.0)
        assert result.turn_rewards == [0.5, 0.0] and result.num_segments == 1
        [row] = result.rows
        assert [lp for lp, m in zip(row.logprobs, row.loss_mask, strict=True) if m] == [-0.3] * 4
    assert len(fake.generate_requests()) == 12


async def test_a_workers_given_client_and_its_own_http_client_both_reach_the_endpoint(
    endpoint: OpenAIEndpoint, fake: FakeSGLang, tok: Any
) -> None:
    pytest.importorskip("anthropic")
    result = await play(endpoint, f"{__name__}:three_apis_agent", "apis")
    assert (result.finish_reason, result.error, result.outcome) == ("stop", None, 1.0)
    assert result.num_turns == 3  # three requests, three APIs, each one recorded turn
    prompts = [tok.decode(call["input_ids"]) for call in fake.generate_requests()]
    assert len(prompts) == 3 and all("— é, 五" in prompt for prompt in prompts)


async def test_an_agent_looping_on_refused_requests_in_a_worker_is_stopped(
    endpoint: OpenAIEndpoint, fake: FakeSGLang
) -> None:
    labels = {"env": ENV_NAME, "kind": "refused"}
    before = REGISTRY.get_sample_value("rollwise_env_errors_total", labels) or 0
    result = await play(endpoint, f"{__name__}:looping_agent", "loops")
    assert result.finish_reason == "env_error" and "refused" in (result.error or ""), result.error
    assert result.duration_s < 30 and fake.generate_requests() == []
    assert REGISTRY.get_sample_value("rollwise_env_errors_total", labels) == before + 1
    # The worker cancelled that agent and goes on serving.
    again = await play(endpoint, f"{__name__}:two_turn_agent", "next")
    assert again.finish_reason == "stop", again.error


async def test_an_agent_error_in_a_worker_costs_its_episode(endpoint: OpenAIEndpoint) -> None:
    result = await play(endpoint, f"{__name__}:failing_agent", "bad")
    assert result.finish_reason == "env_error" and "the agent's own bug" in (result.error or "")


async def test_a_dead_worker_fails_its_episodes_counted_and_is_replaced(endpoint: OpenAIEndpoint) -> None:
    before = (
        REGISTRY.get_sample_value("rollwise_agent_failures_total", {"env": ENV_NAME, "reason": "worker"}) or 0
    )
    result = await play(endpoint, f"{__name__}:dying_agent", "dies")
    assert result.finish_reason == "env_error" and "died" in (result.error or "")
    after = REGISTRY.get_sample_value("rollwise_agent_failures_total", {"env": ENV_NAME, "reason": "worker"})
    assert after == before + 1
    for _ in range(100):  # the replacement starts in the background
        again = await play(endpoint, f"{__name__}:two_turn_agent", "after")
        if again.finish_reason == "stop":
            break
        await asyncio.sleep(0.05)
    assert again.finish_reason == "stop"


def test_the_pool_takes_only_importable_agent_functions() -> None:
    pool = AgentWorkerPool(1)

    async def local(client: Any, task: Task) -> float:
        return 1.0

    assert pool.accepts(AgentEnvironment(f"{__name__}:two_turn_agent", tasks))
    assert not pool.accepts(AgentEnvironment(local, tasks))  # a closure: nothing to import
