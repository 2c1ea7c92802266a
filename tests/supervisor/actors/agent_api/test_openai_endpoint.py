"""The in-process OpenAI endpoint with the real `openai` SDK as the client, the SGLang fake as the engine
(scripted token ids and log-probs, so every recorded token can be checked exactly) and the tiny tokenizer."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import openai
import pytest

from envs.agent import POLICY_MODEL, AgentEnvironment, AgentResult
from envs.api import Task
from pipeline.contracts.schema import validate_segment
from pipeline.supervisor.actors.agent_api.openai_endpoint import OpenAIEndpoint
from pipeline.supervisor.actors.late_cut import GroupCut
from pipeline.supervisor.actors.rollout import EpisodeOutcome, RolloutSettings, run_group
from pipeline.supervisor.engines.client import EngineClient
from pipeline.supervisor.engines.pool import EnginePool
from pipeline.supervisor.engines.protocol import SamplingParams
from pipeline.supervisor.observability.metrics import REGISTRY
from pipeline.tools.fake_sglang import FakeSGLang, GenerateCall, Plan

TASK = Task(id="t0", seed=3, data={"question": "What is 2 + 3?"})
CALC = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate arithmetic.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
    },
}


def make_settings(**overrides: Any) -> RolloutSettings:
    sampling = SamplingParams(temperature=1.0, max_new_tokens=overrides.pop("max_new_tokens", 16))
    return RolloutSettings(sampling=sampling, max_context_tokens=overrides.pop("max_context_tokens", 512))


@pytest.fixture
async def endpoint(fake: FakeSGLang, tok: Any) -> AsyncIterator[OpenAIEndpoint]:
    pool = EnginePool([EngineClient(fake.base_url, retries=0)])
    server = OpenAIEndpoint(engine=pool, tokenizer=tok, settings=make_settings())
    await server.start()
    yield server
    await server.close()
    await pool.close()


def enc(tok: Any, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def say(tok: Any, text: str, logprob: float = -0.5) -> Plan:
    ids = [*enc(tok, text), tok.eos_token_id]
    return Plan(ids, [logprob] * len(ids))


def script(fake: FakeSGLang, plans: dict[str, Plan]) -> None:
    def pick(call: GenerateCall) -> Plan:
        if call.rid not in plans:
            raise AssertionError(f"no scripted plan for rid {call.rid!r}")
        return plans[call.rid]

    fake.script = pick


def one_task(seed: int) -> Iterator[Task]:
    yield TASK


def counter(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def play(
    endpoint: OpenAIEndpoint, env: AgentEnvironment, env_name: str = "agent-test"
) -> EpisodeOutcome:
    return await endpoint.run_agent_episode(env, TASK, episode_id="ep", group_id="g", env_name=env_name)


def chatml(*turns: tuple[str, str]) -> str:
    return "".join(f"<|im_start|>{role}\n{text}<|im_end|>\n" for role, text in turns)


# ---------------------------------------------------------------------------------------------- turns
async def test_multi_turn_agent_is_one_exact_trajectory(
    endpoint: OpenAIEndpoint, fake: FakeSGLang, tok: Any
) -> None:
    plans = {"ep-t0": say(tok, "8", -0.25), "ep-t1": say(tok, "12", -0.75), "ep-t2": say(tok, "10", -1.0)}
    script(fake, plans)
    seen: list[str | None] = []

    async def agent(client: openai.AsyncOpenAI, task: Task) -> float:
        messages: list[Any] = [{"role": "user", "content": task.data["question"]}]
        for feedback in ("higher", "lower", None):
            response = await client.chat.completions.create(model=POLICY_MODEL, messages=messages)
            seen.append(response.choices[0].message.content)
            if feedback is None:
                break
            messages += [response.choices[0].message, {"role": "user", "content": feedback}]
        return 1.0

    result = await play(endpoint, AgentEnvironment(agent, one_task))

    assert (result.finish_reason, result.outcome, result.error) == ("stop", 1.0, None)
    assert seen == ["8", "12", "10"]
    assert result.turn_rewards == [0.0, 0.0, 0.0]
    [row] = result.rows
    prompt = enc(tok, chatml(("user", TASK.data["question"])) + "<|im_start|>assistant\n")
    glue = [
        enc(tok, f"\n<|im_start|>user\n{word}<|im_end|>\n<|im_start|>assistant\n")
        for word in ("higher", "lower")
    ]
    outs = [plans[f"ep-t{k}"].output_ids for k in range(3)]
    assert row.token_ids == prompt + outs[0] + glue[0] + outs[1] + glue[1] + outs[2]
    pieces = [
        (prompt, 0, -1),
        (outs[0], 1, 0),
        (glue[0], 0, 0),
        (outs[1], 1, 1),
        (glue[1], 0, 1),
        (outs[2], 1, 2),
    ]
    assert row.loss_mask == [mask for ids, mask, _ in pieces for _ in ids]
    assert row.turn_index == [turn for ids, _, turn in pieces for _ in ids]
    assert [lp for lp, m in zip(row.logprobs, row.loss_mask, strict=True) if m] == [
        lp for k in range(3) for lp in plans[f"ep-t{k}"].logprobs or []
    ]
    assert row.versions == [0 if m else -1 for m in row.loss_mask]
    assert validate_segment(row) is None
    sent = fake.generate_requests()
    assert [r["rid"] for r in sent] == ["ep-t0", "ep-t1", "ep-t2"]
    assert sent[2]["input_ids"] == prompt + outs[0] + glue[0] + outs[1] + glue[1]


async def test_tool_calls_come_back_parsed_and_the_next_turn_still_extends_the_buffer(
    endpoint: OpenAIEndpoint, fake: FakeSGLang, tok: Any
) -> None:
    # Compact JSON without newlines: the template renders a parsed call differently (newlines, ", ").
    call_text = '<tool_call>{"name":"calculator","arguments":{"expression":"2+3"}}</tool_call>'
    plans = {"ep-t0": say(tok, call_text), "ep-t1": say(tok, "5")}
    script(fake, plans)
    responses: list[Any] = []

    async def agent(client: openai.AsyncOpenAI, task: Task) -> AgentResult:
        messages: list[Any] = [{"role": "user", "content": task.data["question"]}]
        first = await client.chat.completions.create(model=POLICY_MODEL, messages=messages, tools=[CALC])
        responses.append(first)
        message = first.choices[0].message
        call = message.tool_calls[0]
        messages += [message, {"role": "tool", "tool_call_id": call.id, "content": "5"}]
        second = await client.chat.completions.create(model=POLICY_MODEL, messages=messages, tools=[CALC])
        responses.append(second)
        return AgentResult(outcome=1.0, turn_rewards=[0.2])

    result = await play(endpoint, AgentEnvironment(agent, one_task))

    first = responses[0].choices[0]
    assert first.finish_reason == "tool_calls" and first.message.content is None
    [call] = first.message.tool_calls
    assert (call.type, call.function.name, json.loads(call.function.arguments)) == (
        "function",
        "calculator",
        {"expression": "2+3"},
    )
    assert responses[1].choices[0].finish_reason == "stop" and responses[1].choices[0].message.content == "5"
    # The SDK sent back the parsed call; the endpoint restored the model's own text, so the template
    # re-rendered exactly the tokens the engine produced and the conversation stayed one segment.
    assert result.finish_reason == "stop" and result.num_segments == 1
    assert result.turn_rewards == [0.2, 0.0] and result.outcome == 1.0
    [row] = result.rows
    sent = fake.generate_requests()
    tool_glue = enc(
        tok, "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert sent[1]["input_ids"] == sent[0]["input_ids"] + plans["ep-t0"].output_ids + tool_glue
    assert row.token_ids == sent[1]["input_ids"] + plans["ep-t1"].output_ids
    assert sum(row.loss_mask) == len(plans["ep-t0"].output_ids) + len(plans["ep-t1"].output_ids)


async def test_a_rewritten_history_starts_a_new_segment_and_is_counted(
    endpoint: OpenAIEndpoint, fake: FakeSGLang, tok: Any
) -> None:
    plans = {"ep-t0": say(tok, "8"), "ep-t1": say(tok, "12")}
    script(fake, plans)

    async def agent(client: openai.AsyncOpenAI, task: Task) -> float:
        first = await client.chat.completions.create(
            model=POLICY_MODEL, messages=[{"role": "user", "content": "Guess my number from 1 to 16."}]
        )
        assert first.choices[0].message.content == "8"
        # A summarising agent: it drops the exchange and writes its own note instead.
        note = [{"role": "user", "content": "You guessed 8: higher. Guess again."}]
        await client.chat.completions.create(model=POLICY_MODEL, messages=note)
        return 0.0

    before = counter("rollwise_agent_segments_total", env="agent-split")
    result = await play(endpoint, AgentEnvironment(agent, one_task), env_name="agent-split")

    assert result.finish_reason == "stop" and result.num_segments == 2
    assert counter("rollwise_agent_segments_total", env="agent-split") == before + 1
    seg0, seg1 = result.rows
    prompt0 = enc(tok, chatml(("user", "Guess my number from 1 to 16.")) + "<|im_start|>assistant\n")
    prompt1 = enc(tok, chatml(("user", "You guessed 8: higher. Guess again.")) + "<|im_start|>assistant\n")
    assert seg0.token_ids == prompt0 + plans["ep-t0"].output_ids  # never rewritten
    assert seg1.token_ids == prompt1 + plans["ep-t1"].output_ids and seg1.prompt_len == len(prompt1)
    assert seg1.loss_mask == [0] * len(prompt1) + [1] * len(plans["ep-t1"].output_ids)
    assert [validate_segment(r) for r in result.rows] == [None, None]
    assert seg0.num_turns == seg1.num_turns == 2


async def test_sampling_is_the_runs_and_max_tokens_is_capped(
    endpoint: OpenAIEndpoint, fake: FakeSGLang, tok: Any
) -> None:
    plans = {"ep-t0": say(tok, "8"), "ep-t1": say(tok, "9")}
    script(fake, plans)
    headers: list[str | None] = []

    async def agent(client: openai.AsyncOpenAI, task: Task) -> float:
        messages = [{"role": "user", "content": "hi"}]
        raw = await client.chat.completions.with_raw_response.create(
            model=POLICY_MODEL, messages=messages, temperature=0.2, top_p=0.5, seed=7, max_tokens=1000
        )
        headers.append(raw.headers.get("x-rollwise-clamped"))
        await client.chat.completions.create(model=POLICY_MODEL, messages=messages, max_completion_tokens=3)
        return 1.0

    result = await play(endpoint, AgentEnvironment(agent, one_task))
    assert result.finish_reason == "stop"  # the second request re-sent the first prompt: a new segment
    first, second = (r["sampling_params"] for r in fake.generate_requests())
    assert (first["temperature"], first["top_p"], first["max_new_tokens"]) == (1.0, 1.0, 16)
    assert "sampling_seed" not in first
    assert second["max_new_tokens"] == 3
    assert headers == ["temperature,top_p,seed"]


async def test_logprobs_usage_and_length_finish(endpoint: OpenAIEndpoint, fake: FakeSGLang, tok: Any) -> None:
    ids = enc(tok, "I say 12 or 13")
    script(fake, {"ep-t0": Plan(ids[:3], [-0.1, -0.2, -0.3], finish="length")})
    responses: list[Any] = []

    async def agent(client: openai.AsyncOpenAI, task: Task) -> float:
        responses.append(
            await client.chat.completions.create(
                model=POLICY_MODEL, messages=[{"role": "user", "content": "hi"}], logprobs=True, max_tokens=3
            )
        )
        return 0.5

    result = await play(endpoint, AgentEnvironment(agent, one_task))
    choice = responses[0].choices[0]
    assert choice.finish_reason == "length" and result.finish_reason == "length"
    assert [t.logprob for t in choice.logprobs.content] == [-0.1, -0.2, -0.3]
    assert "".join(t.token for t in choice.logprobs.content) == tok.decode(ids[:3])
    prompt_len = len(enc(tok, chatml(("user", "hi")) + "<|im_start|>assistant\n"))
    usage = responses[0].usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
        prompt_len,
        3,
        prompt_len + 3,
    )
    assert responses[0].system_fingerprint == "rollwise-v0"


async def test_streaming_sends_the_same_completion_as_chunks(
    endpoint: OpenAIEndpoint, fake: FakeSGLang, tok: Any
) -> None:
    call_text = '7 <tool_call>\n{"name": "calculator", "arguments": {"expression": "3+4"}}\n</tool_call>'
    script(fake, {"ep-t0": say(tok, call_text)})
    collected: dict[str, Any] = {}

    async def agent(client: openai.AsyncOpenAI, task: Task) -> float:
        stream = await client.chat.completions.create(
            model=POLICY_MODEL,
            messages=[{"role": "user", "content": "hi"}],
            tools=[CALC],
            stream=True,
            stream_options={"include_usage": True},
        )
        content, calls, finish, usage = "", [], None, None
        async for chunk in stream:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                content += choice.delta.content or ""
                calls += choice.delta.tool_calls or []
                finish = choice.finish_reason or finish
        collected.update(content=content, calls=calls, finish=finish, usage=usage)
        return 1.0

    result = await play(endpoint, AgentEnvironment(agent, one_task))
    assert result.finish_reason == "stop"
    assert collected["content"] == "7" and collected["finish"] == "tool_calls"
    [call] = collected["calls"]
    assert call.function.name == "calculator" and json.loads(call.function.arguments) == {"expression": "3+4"}
    assert collected["usage"].completion_tokens == len(enc(tok, call_text)) + 1


# ---------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"stop": ["", "\n"]}, "stop"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"n": 2}, "n"),
        ({"tool_choice": {"type": "function", "function": {"name": "calculator"}}}, "tool_choice"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"top_logprobs": 3, "logprobs": True}, "top_logprobs"),
        ({"extra_body": {"guided_regex": "a+"}}, "guided_regex"),
    ],
)
async def test_unsupported_parameters_get_a_400_naming_them_and_the_episode_goes_on(
    endpoint: OpenAIEndpoint, fake: FakeSGLang, tok: Any, kwargs: dict[str, Any], named: str
) -> None:
    script(fake, {"ep-t0": say(tok, "8")})
    errors: list[openai.BadRequestError] = []

    async def agent(client: openai.AsyncOpenAI, task: Task) -> float:
        messages = [{"role": "user", "content": "hi"}]
        try:
            await client.chat.completions.create(model=POLICY_MODEL, messages=messages, **kwargs)
        except openai.BadRequestError as exc:
            errors.append(exc)
        await client.chat.completions.create(model=POLICY_MODEL, messages=messages)
        return 1.0

    result = await play(endpoint, AgentEnvironment(agent, one_task))
    [error] = errors
    assert error.status_code == 400 and named in error.message
    assert result.finish_reason == "stop" and result.num_turns == 1


async def test_models_route_and_unknown_model(endpoint: OpenAIEndpoint, fake: FakeSGLang, tok: Any) -> None:
    script(fake, {})
    found: dict[str, Any] = {}

    async def agent(client: openai.AsyncOpenAI, task: Task) -> float:
        found["models"] = [m.id async for m in client.models.list()]
        with pytest.raises(openai.NotFoundError, match="'policy'"):
            await client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
        return 1.0

    result = await play(endpoint, AgentEnvironment(agent, one_task))
    assert found["models"] == [POLICY_MODEL]
    assert result.finish_reason == "env_error" and "without requesting a chat completion" in (
        result.error or ""
    )
    assert fake.generate_requests() == []


async def test_turn_limit_ends_the_episode_truncated(
    endpoint: OpenAIEndpoint, fake: FakeSGLang, tok: Any
) -> None:
    script(fake, {"ep-t0": say(tok, "8"), "ep-t1": say(tok, "9")})

    async def agent(client: openai.AsyncOpenAI, task: Task) -> float:
        messages: list[Any] = [{"role": "user", "content": "hi"}]
        while True:  # an agent that never stops on its own
            response = await client.chat.completions.create(model=POLICY_MODEL, messages=messages)
            messages += [response.choices[0].message, {"role": "user", "content": "again"}]

    result = await play(endpoint, AgentEnvironment(agent, one_task, max_turns=2))
    assert result.finish_reason == "truncated" and result.num_turns == 2 and result.outcome == 0.0
    assert "max_turns=2" in (result.error or "") and "BadRequestError" in (result.error or "")
    assert len(fake.generate_requests()) == 2


async def test_agent_that_raises_or_hangs_costs_one_episode_counted(
    endpoint: OpenAIEndpoint, fake: FakeSGLang, tok: Any
) -> None:
    eos = tok.eos_token_id
    fake.script = lambda call: Plan([*enc(tok, "8"), eos])

    async def agent(client: openai.AsyncOpenAI, task: Task) -> float:
        index = int(task.data["index"])
        await client.chat.completions.create(model=POLICY_MODEL, messages=[{"role": "user", "content": "hi"}])
        if index == 1:
            raise RuntimeError("the agent's tool crashed")
        if index == 2:
            await asyncio.sleep(3600)
        return 1.0

    def tasks(seed: int) -> Iterator[Task]:
        yield Task("t", 0, {"index": 0})

    names = ("agent-ok", "agent-raises", "agent-hangs")
    before = {
        "raises": counter("rollwise_env_errors_total", env="agent-raises", kind="agent"),
        "hangs": counter("rollwise_env_errors_total", env="agent-hangs", kind="timeout"),
    }
    env = AgentEnvironment(agent, tasks, episode_timeout_s=1.0)
    outcomes = await asyncio.gather(
        *(
            endpoint.run_agent_episode(
                env, Task(f"t{i}", 0, {"index": i}), episode_id=f"e{i}", group_id="g", env_name=name
            )
            for i, name in enumerate(names)
        )
    )
    assert [o.finish_reason for o in outcomes] == ["stop", "env_error", "timeout"]
    assert "the agent's tool crashed" in (outcomes[1].error or "")
    assert outcomes[0].outcome == 1.0 and outcomes[1].outcome is None and outcomes[2].outcome is None
    assert all(len(o.rows) == 1 for o in outcomes)  # kept for accounting, never trained
    assert counter("rollwise_env_errors_total", env="agent-raises", kind="agent") == before["raises"] + 1
    assert counter("rollwise_env_errors_total", env="agent-hangs", kind="timeout") == before["hangs"] + 1


async def test_an_engine_failure_is_an_engine_error_episode(
    endpoint: OpenAIEndpoint, fake: FakeSGLang, tok: Any
) -> None:
    fake.queue_faults("http_500")
    statuses: list[int] = []

    async def agent(client: openai.AsyncOpenAI, task: Task) -> float:
        try:
            await client.chat.completions.create(
                model=POLICY_MODEL, messages=[{"role": "user", "content": "hi"}]
            )
        except openai.APIStatusError as exc:
            statuses.append(exc.status_code)
        return 1.0  # the agent swallowed it: the episode is still not trainable

    result = await play(endpoint, AgentEnvironment(agent, one_task))
    assert statuses == [502] and result.finish_reason == "engine_error"


async def test_invalid_agent_results_are_env_errors(
    endpoint: OpenAIEndpoint, fake: FakeSGLang, tok: Any
) -> None:
    eos = tok.eos_token_id
    fake.script = lambda call: Plan([*enc(tok, "8"), eos])

    def returning(value: Any) -> Any:
        async def agent(client: openai.AsyncOpenAI, task: Task) -> Any:
            await client.chat.completions.create(
                model=POLICY_MODEL, messages=[{"role": "user", "content": "hi"}]
            )
            return value

        return agent

    for value, reason in [
        (float("nan"), "finite number"),
        ("yes", "finite number"),
        (AgentResult(outcome=1.0, turn_rewards=[0.1, 0.2]), "2 entries for 1 turns"),
    ]:
        result = await play(endpoint, AgentEnvironment(returning(value), one_task))
        assert result.finish_reason == "env_error" and reason in (result.error or ""), result.error


# ---------------------------------------------------------------------------------------------- isolation
async def test_concurrent_episodes_of_a_group_never_mix(
    endpoint: OpenAIEndpoint, fake: FakeSGLang, tok: Any
) -> None:
    eos = tok.eos_token_id
    fake.token_delay_s = 0.002  # generations overlap in time
    fake.script = lambda call: Plan([*enc(tok, call.rid.split("-t")[0][-1]), eos])  # episode g-3 says "3"
    keys: set[str] = set()

    async def agent(client: openai.AsyncOpenAI, task: Task) -> float:
        keys.add(client.api_key)
        messages: list[Any] = [{"role": "user", "content": f"task {task.id}"}]
        said = []
        for _ in range(3):
            response = await client.chat.completions.create(model=POLICY_MODEL, messages=messages)
            said.append(response.choices[0].message.content)
            messages += [response.choices[0].message, {"role": "user", "content": "more"}]
        return float(len(set(said)) == 1)  # 1.0 when every reply came from this episode's own stream

    env = AgentEnvironment(agent, one_task)
    cut = GroupCut(6)
    cut.fire("a cut that cannot stop an agent function's episode")
    group = await run_group(
        endpoint.engine,
        endpoint.tokenizer,
        lambda: env,
        TASK,
        endpoint.settings,
        group_size=6,
        group_id="g",
        env_name="agent-group",
        agent_runner=endpoint,
        cut=cut,
    )
    assert len(keys) == 6
    assert [ep.finish_reason for ep in group.episodes] == ["stop"] * 6  # the cut left them alone
    assert (cut.finished, cut.uncuttable, cut.unfinished) == (6, True, 0)  # so the scheduler never cuts it
    assert [ep.outcome for ep in group.episodes] == [1.0] * 6
    for index, episode in enumerate(group.episodes):
        [row] = episode.rows
        generated = [t for t, m in zip(row.token_ids, row.loss_mask, strict=True) if m]
        assert generated == [*enc(tok, str(index)), eos] * 3
    batch = group.to_record_batch()
    assert batch.num_rows == 6


async def test_a_key_from_another_episode_or_an_ended_one_is_refused(
    endpoint: OpenAIEndpoint, fake: FakeSGLang, tok: Any
) -> None:
    script(fake, {"ep-t0": say(tok, "8")})
    stolen: dict[str, str] = {}

    async def agent(client: openai.AsyncOpenAI, task: Task) -> float:
        stolen["url"], stolen["key"] = str(client.base_url), client.api_key
        await client.chat.completions.create(model=POLICY_MODEL, messages=[{"role": "user", "content": "hi"}])
        return 1.0

    await play(endpoint, AgentEnvironment(agent, one_task))
    body = {"model": POLICY_MODEL, "messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession() as http:
        url = stolen["url"].rstrip("/") + "/chat/completions"
        async with http.post(
            url, json=body, headers={"Authorization": f"Bearer {stolen['key']}"}
        ) as response:
            assert response.status == 404 and (await response.json())["error"]["code"] == "episode_ended"
        async with http.post(url, json=body, headers={"Authorization": "Bearer someone-else"}) as response:
            assert response.status == 401
        async with http.post(endpoint.base_url + "/chat/completions", json=body) as response:
            assert response.status == 401


async def test_the_agents_client_skips_the_socket_and_answers_as_the_socket_does(
    endpoint: OpenAIEndpoint, fake: FakeSGLang, tok: Any
) -> None:
    """The episode's own client is answered in-process; any other client on its base URL goes through the
    HTTP server. Both must see the same completions, errors and model list."""
    import httpx2

    plans = {f"ep-t{k}": say(tok, "8", -0.25) for k in range(4)}
    script(fake, plans)
    assert endpoint._runner is not None
    served = endpoint._runner.server
    assert served is not None
    seen: dict[str, list[Any]] = {"in-process": [], "socket": []}
    sockets_used: dict[str, int] = {}

    async def agent(client: openai.AsyncOpenAI, task: Task) -> float:
        async with httpx2.AsyncClient() as plain:
            socket_client = openai.AsyncOpenAI(
                base_url=client.base_url, api_key=client.api_key, max_retries=0, http_client=plain
            )
            messages: list[Any] = [{"role": "user", "content": "hi"}]  # each turn a new segment: fine here
            for name, api in (("in-process", client), ("socket", socket_client)):
                before = served.requests_count
                reply = await api.chat.completions.create(
                    model=POLICY_MODEL, messages=messages, logprobs=True
                )
                chunks = await api.chat.completions.create(model=POLICY_MODEL, messages=messages, stream=True)
                text = "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])
                with pytest.raises(openai.BadRequestError) as refused:
                    await api.chat.completions.create(model=POLICY_MODEL, messages=messages, n=2)
                models = [m.id async for m in api.models.list()]
                sockets_used[name] = served.requests_count - before
                seen[name] = [reply.model_dump(exclude={"id", "created"}), text, refused.value.body, models]
        return 1.0

    result = await play(endpoint, AgentEnvironment(agent, one_task))
    assert result.finish_reason == "stop" and result.num_turns == 4
    assert sockets_used == {"in-process": 0, "socket": 4}
    assert seen["in-process"] == seen["socket"]
    assert seen["socket"][1] == "8" and seen["socket"][3] == [POLICY_MODEL]


async def test_agent_environment_without_a_runner_fails_as_env_error(fake: FakeSGLang, tok: Any) -> None:
    async def agent(client: openai.AsyncOpenAI, task: Task) -> float:
        return 1.0

    pool = EnginePool([EngineClient(fake.base_url, retries=0)])
    try:
        group = await run_group(
            pool,
            tok,
            lambda: AgentEnvironment(agent, one_task),
            TASK,
            make_settings(),
            group_size=2,
            group_id="g",
            env_name="agent-none",
        )
    finally:
        await pool.close()
    assert [ep.finish_reason for ep in group.episodes] == ["env_error", "env_error"]
    assert "needs an OpenAI endpoint" in (group.episodes[0].error or "")


# ---------------------------------------------------------------------------------------------- service
async def test_service_requests_are_not_recorded_and_honour_their_sampling(
    endpoint: OpenAIEndpoint, fake: FakeSGLang, tok: Any
) -> None:
    eos = tok.eos_token_id
    fake.script = lambda call: Plan([*enc(tok, "Score: 7"), eos])
    client = openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.service_key, max_retries=0)
    try:
        response = await client.chat.completions.create(
            model=POLICY_MODEL,
            messages=[{"role": "system", "content": "Judge."}, {"role": "user", "content": "2+3=5?"}],
            temperature=0.0,
            seed=11,
            max_tokens=64,
        )
    finally:
        await client.close()
    assert response.choices[0].message.content == "Score: 7"
    [sent] = fake.generate_requests()
    params = sent["sampling_params"]
    assert (params["temperature"], params["sampling_seed"], params["max_new_tokens"]) == (0.0, 11, 64)
    assert sent["rid"].startswith("svc-")
