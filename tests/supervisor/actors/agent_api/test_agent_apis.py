"""The endpoint's three APIs (chat completions with stop sequences, the OpenAI Responses API, the Anthropic
Messages API), each driven by its real SDK against the SGLang fake (scripted ids and log-probs, decoded with
the tiny tokenizer): every turn is recorded token-exact, bad input is a 400 naming the field, and an agent
that loops on refused requests is stopped."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import anthropic
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from envs.agent import POLICY_MODEL, AgentEnvironment, AgentResult, anthropic_base_url
from envs.api import Task
from pipeline.contracts.schema import validate_segment
from pipeline.supervisor.actors.agent_api.openai_endpoint import OpenAIEndpoint
from pipeline.supervisor.actors.rollout import EpisodeOutcome, RolloutSettings
from pipeline.supervisor.engines.client import EngineClient
from pipeline.supervisor.engines.pool import EnginePool
from pipeline.supervisor.engines.protocol import SamplingParams
from pipeline.supervisor.observability.metrics import REGISTRY
from pipeline.tools.fake_sglang import FakeSGLang, GenerateCall, Plan

TASK = Task(id="t0", seed=3, data={"question": "What is 2 + 3?"})
CALL_TEXT = '<tool_call>{"name":"calculator","arguments":{"expression":"2+3"}}</tool_call>'
RESPONSES_TOOL = {
    "type": "function",
    "name": "calculator",
    "description": "Evaluate arithmetic.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
}
ANTHROPIC_TOOL = {
    "name": "calculator",
    "description": "Evaluate arithmetic.",
    "input_schema": {"type": "object", "properties": {"expression": {"type": "string"}}},
}


@pytest.fixture
async def fake(tok: Any) -> AsyncIterator[FakeSGLang]:
    server = FakeSGLang(tokenizer=tok)
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
async def endpoint(fake: FakeSGLang, tok: Any) -> AsyncIterator[OpenAIEndpoint]:
    pool = EnginePool([EngineClient(fake.base_url, retries=0)])
    settings = RolloutSettings(sampling=SamplingParams(max_new_tokens=48), max_context_tokens=1024)
    server = OpenAIEndpoint(engine=pool, tokenizer=tok, settings=settings)
    await server.start()
    yield server
    await server.close()
    await pool.close()


def enc(tok: Any, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def say(tok: Any, text: str, logprob: float = -0.5) -> Plan:
    ids = [*enc(tok, text), tok.eos_token_id]
    return Plan(ids, [logprob - 0.01 * i for i in range(len(ids))])


def script(fake: FakeSGLang, plans: dict[str, Plan]) -> None:
    def pick(call: GenerateCall) -> Plan:
        if call.rid not in plans:
            raise AssertionError(f"no scripted plan for rid {call.rid!r}")
        return plans[call.rid]

    fake.script = pick


def one_task(seed: int) -> Iterator[Task]:
    yield TASK


async def play(endpoint: OpenAIEndpoint, agent: Any, **options: Any) -> EpisodeOutcome:
    env = AgentEnvironment(agent, one_task, **options)
    return await endpoint.run_agent_episode(env, TASK, episode_id="ep", group_id="g", env_name="agent-apis")


def generated(outcome: EpisodeOutcome) -> list[tuple[list[int], list[float]]]:
    """Per turn, the ids and log-probs the rows record as generated (loss mask 1)."""
    turns: dict[int, tuple[list[int], list[float]]] = {}
    for row in outcome.rows:
        assert validate_segment(row) is None
        for token, mask, lp, turn in zip(
            row.token_ids, row.loss_mask, row.logprobs, row.turn_index, strict=True
        ):
            if mask:
                ids, lps = turns.setdefault(turn, ([], []))
                ids.append(token)
                lps.append(lp)
    return [turns[k] for k in sorted(turns)]


def assert_recorded_exactly(outcome: EpisodeOutcome, fake: FakeSGLang) -> None:
    """Each turn's recorded tokens and log-probs are what the fake sent for that turn's request."""
    sent = [plan_of(fake, r["rid"]) for r in fake.generate_requests()]
    assert generated(outcome) == [(ids, lps) for ids, lps in sent]


def plan_of(fake: FakeSGLang, rid: str) -> tuple[list[int], list[float]]:
    request = next(r for r in fake.generate_requests() if r["rid"] == rid)
    assert fake.script is not None
    plan = fake.script(GenerateCall(request["input_ids"], request["sampling_params"], rid, 0))
    cut = len(plan.output_ids)
    stops = request["sampling_params"].get("stop") or []
    for k in range(1, len(plan.output_ids)):  # where the fake's stop-string check ended it
        if any(s in fake._decode(plan.output_ids[:k]) for s in stops):
            cut = k
            break
    return plan.output_ids[:cut], (plan.logprobs or [])[:cut]


def counter(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


# ------------------------------------------------------------------------------- chat completions: stop
async def test_a_stop_sequence_cuts_the_reply_but_every_sampled_token_is_recorded(
    endpoint: OpenAIEndpoint, fake: FakeSGLang, tok: Any
) -> None:
    plans = {"ep-t0": say(tok, "Thought: add them\nObservation: 5 is it"), "ep-t1": say(tok, "Final: 5")}
    script(fake, plans)
    replies: list[Any] = []

    async def agent(client: openai.AsyncOpenAI, task: Task) -> float:
        messages: list[Any] = [{"role": "user", "content": task.data["question"]}]
        stop = ["Observation:", "Calling tools:"]
        first = await client.chat.completions.create(model=POLICY_MODEL, messages=messages, stop=stop)
        replies.append(first.choices[0])
        messages += [first.choices[0].message, {"role": "user", "content": "Observation: 5"}]
        second = await client.chat.completions.create(model=POLICY_MODEL, messages=messages, stop=stop)
        replies.append(second.choices[0])
        return 1.0

    result = await play(endpoint, agent)
    assert (result.finish_reason, result.error) == ("stop", None)
    assert replies[0].message.content == "Thought: add them\n" and replies[0].finish_reason == "stop"
    assert replies[1].message.content == "Final: 5"
    [first_request, _] = fake.generate_requests()
    assert first_request["sampling_params"]["stop"] == ["Observation:", "Calling tools:"]
    assert fake.ignored_fields == []
    [(ids0, lps0), (ids1, lps1)] = generated(result)
    assert tok.decode(ids0).endswith("Observation:") and ids0 == plans["ep-t0"].output_ids[: len(ids0)]
    assert lps0 == (plans["ep-t0"].logprobs or [])[: len(ids0)]
    assert (ids1, lps1) == (plans["ep-t1"].output_ids, plans["ep-t1"].logprobs)
    # The cut reply sent back maps to the recorded text: the conversation stays one segment.
    assert result.num_segments == 1


# ------------------------------------------------------------------------------------ the Responses API
async def test_responses_api_tool_round_trip_is_one_exact_trajectory(
    endpoint: OpenAIEndpoint, fake: FakeSGLang, tok: Any
) -> None:
    plans = {"ep-t0": say(tok, CALL_TEXT), "ep-t1": say(tok, "It is 5.")}
    script(fake, plans)
    seen: list[Any] = []

    async def agent(client: openai.AsyncOpenAI, task: Task) -> AgentResult:
        items: list[Any] = [{"role": "user", "content": task.data["question"]}]
        first = await client.responses.create(
            model=POLICY_MODEL, instructions="Use the tool.", input=items, tools=[RESPONSES_TOOL], store=False
        )
        seen.append(first)
        [call] = [item for item in first.output if item.type == "function_call"]
        items += [*(item.model_dump(exclude_none=True) for item in first.output)]
        items.append({"type": "function_call_output", "call_id": call.call_id, "output": "5"})
        second = await client.responses.create(
            model=POLICY_MODEL, instructions="Use the tool.", input=items, tools=[RESPONSES_TOOL]
        )
        seen.append(second)
        return AgentResult(outcome=1.0, turn_rewards=[0.5])

    result = await play(endpoint, agent)
    assert (result.finish_reason, result.error, result.num_segments) == ("stop", None, 1)
    first, second = seen
    assert first.status == "completed" and first.id == "resp_ep-t0"
    [call] = first.output
    assert (call.type, call.name, json.loads(call.arguments)) == (
        "function_call",
        "calculator",
        {"expression": "2+3"},
    )
    assert second.output_text == "It is 5." and second.usage is not None
    assert second.usage.output_tokens == len(plans["ep-t1"].output_ids)
    assert_recorded_exactly(result, fake)
    assert result.turn_rewards == [0.5, 0.0]
    assert counter("rollwise_openai_requests_total", route="episode", api="responses", status="ok") >= 2


async def test_responses_stream_is_the_real_event_sequence(
    endpoint: OpenAIEndpoint, fake: FakeSGLang, tok: Any
) -> None:
    plans = {"ep-t0": say(tok, "Let me think. " + CALL_TEXT)}
    script(fake, plans)
    events: list[Any] = []

    async def agent(client: openai.AsyncOpenAI, task: Task) -> float:
        stream = await client.responses.create(
            model=POLICY_MODEL, input="hi", tools=[RESPONSES_TOOL], stream=True
        )
        events.extend([event async for event in stream])
        return 1.0

    result = await play(endpoint, agent)
    assert result.finish_reason == "stop"
    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert final.output_text == "Let me think." and final.output[1].name == "calculator"
    assert_recorded_exactly(result, fake)


async def test_previous_response_id_continues_the_episodes_stored_conversation(
    endpoint: OpenAIEndpoint, fake: FakeSGLang, tok: Any
) -> None:
    script(fake, {"ep-t0": say(tok, "8"), "ep-t1": say(tok, "12"), "ep-t2": say(tok, "10")})
    refused: list[openai.BadRequestError] = []

    async def agent(client: openai.AsyncOpenAI, task: Task) -> float:
        first = await client.responses.create(model=POLICY_MODEL, input="Guess a number.")
        second = await client.responses.create(
            model=POLICY_MODEL, input="higher", previous_response_id=first.id
        )
        unstored = await client.responses.create(
            model=POLICY_MODEL, input="lower", previous_response_id=second.id, store=False
        )
        try:
            await client.responses.create(model=POLICY_MODEL, input="again", previous_response_id=unstored.id)
        except openai.BadRequestError as exc:
            refused.append(exc)
        return 1.0

    result = await play(endpoint, agent)
    assert (result.finish_reason, result.num_turns, result.num_segments) == ("stop", 3, 1)
    [error] = refused
    assert error.status_code == 400 and error.body["param"] == "previous_response_id"  # type: ignore[index]
    sent = fake.generate_requests()
    assert tok.decode(sent[2]["input_ids"]).count("<|im_start|>user") == 3  # the whole conversation


# ------------------------------------------------------------------------------ the Anthropic Messages API
async def test_messages_api_tool_use_and_stop_sequence_with_the_anthropic_sdk(
    endpoint: OpenAIEndpoint, fake: FakeSGLang, tok: Any
) -> None:
    plans = {"ep-t0": say(tok, CALL_TEXT), "ep-t1": say(tok, "The answer is 5. END and more")}
    script(fake, plans)
    replies: list[Any] = []

    async def agent(client: openai.AsyncOpenAI, task: Task) -> float:
        async with anthropic.AsyncAnthropic(
            base_url=anthropic_base_url(client), api_key=client.api_key, max_retries=0
        ) as claude:
            messages: list[Any] = [{"role": "user", "content": task.data["question"]}]
            first = await claude.messages.create(
                model=POLICY_MODEL,
                max_tokens=64,
                system="Use the tool.",
                messages=messages,
                tools=[ANTHROPIC_TOOL],
            )
            replies.append(first)
            [use] = [block for block in first.content if block.type == "tool_use"]
            messages += [
                {
                    "role": "assistant",
                    "content": [block.model_dump(exclude_none=True) for block in first.content],
                },
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "5"}]},
            ]
            async with claude.messages.stream(
                model=POLICY_MODEL,
                max_tokens=64,
                system="Use the tool.",
                messages=messages,
                tools=[ANTHROPIC_TOOL],
                stop_sequences=["END"],
            ) as stream:
                replies.append(await stream.get_final_message())
        return 1.0

    result = await play(endpoint, agent)
    assert (result.finish_reason, result.error, result.num_segments) == ("stop", None, 1)
    first, second = replies
    assert first.stop_reason == "tool_use" and first.content[0].type == "tool_use"
    assert (first.content[0].name, first.content[0].input) == ("calculator", {"expression": "2+3"})
    assert (second.stop_reason, second.stop_sequence) == ("stop_sequence", "END")
    assert second.content[0].text == "The answer is 5. "
    assert second.usage.input_tokens > 0 and second.usage.output_tokens > 0
    assert_recorded_exactly(result, fake)
    [_, (ids1, _)] = generated(result)
    assert tok.decode(ids1).endswith("END")


async def test_messages_api_errors_name_the_field_in_anthropics_shape(
    endpoint: OpenAIEndpoint, fake: FakeSGLang, tok: Any
) -> None:
    script(fake, {"ep-t0": say(tok, "ok")})
    errors: list[Any] = []

    async def agent(client: openai.AsyncOpenAI, task: Task) -> float:
        async with anthropic.AsyncAnthropic(
            base_url=anthropic_base_url(client), api_key=client.api_key, max_retries=0
        ) as claude:
            bad_image = {
                "type": "image",
                "source": {"type": "base64", "media_type": "image/png", "data": "AA"},
            }
            for messages in (
                [{"role": "user", "content": [bad_image]}],
                [{"role": "robot", "content": "hi"}],
            ):
                try:
                    await claude.messages.create(model=POLICY_MODEL, max_tokens=8, messages=messages)
                except anthropic.BadRequestError as exc:
                    errors.append(exc)
            await claude.messages.create(
                model=POLICY_MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}]
            )
        return 1.0

    result = await play(endpoint, agent)
    assert result.finish_reason == "stop" and result.num_turns == 1
    assert [e.status_code for e in errors] == [400, 400]
    assert errors[0].body["error"]["type"] == "invalid_request_error"
    assert "messages.0.content.0.type" in errors[0].message and "messages.0.role" in errors[1].message


async def test_the_key_is_accepted_as_x_api_key_and_must_match_the_base_url(
    endpoint: OpenAIEndpoint, fake: FakeSGLang, tok: Any
) -> None:
    script(fake, {"ep-t0": say(tok, "ok")})
    statuses: list[int] = []

    async def agent(client: openai.AsyncOpenAI, task: Task) -> float:
        url = anthropic_base_url(client) + "/v1/messages"
        body = {"model": POLICY_MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
        async with aiohttp.ClientSession() as http:
            for key in ("wrong", client.api_key):
                async with http.post(url, json=body, headers={"x-api-key": key}) as reply:
                    statuses.append(reply.status)
        return 1.0

    result = await play(endpoint, agent)
    assert statuses == [401, 200] and result.num_turns == 1


# ------------------------------------------------------------------------------------------- refusals
async def test_an_agent_looping_on_refused_requests_is_stopped_and_counted(
    endpoint: OpenAIEndpoint, fake: FakeSGLang, tok: Any
) -> None:
    attempts = {"n": 0}
    before = counter("rollwise_env_errors_total", env="agent-apis", kind="refused")

    async def agent(client: openai.AsyncOpenAI, task: Task) -> float:
        while True:  # retries a request the endpoint will never take
            attempts["n"] += 1
            try:
                await client.chat.completions.create(
                    model=POLICY_MODEL, messages=[{"role": "user", "content": "hi"}], n=3
                )
            except openai.BadRequestError:
                continue

    result = await play(endpoint, agent, max_refused_requests=5, episode_timeout_s=60.0)
    assert result.finish_reason == "env_error" and "refused" in (result.error or "")
    assert attempts["n"] == 5 and result.duration_s < 10
    assert counter("rollwise_env_errors_total", env="agent-apis", kind="refused") == before + 1
    assert fake.generate_requests() == []


FIELD_NAMES = [
    "model",
    "messages",
    "input",
    "role",
    "content",
    "type",
    "text",
    "tools",
    "max_tokens",
    "stop",
    "stop_sequences",
    "tool_choice",
    "system",
    "instructions",
    "name",
    "call_id",
    "output",
    "arguments",
    "tool_use_id",
    "input_schema",
    "parameters",
    "previous_response_id",
    "stream",
]
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(FIELD_NAMES), inner, max_size=5)
    ),
    max_leaves=12,
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(api=st.sampled_from(["chat/completions", "responses", "messages"]), body=JSON_VALUES)
async def test_malformed_bodies_are_4xx_never_5xx(endpoint: OpenAIEndpoint, api: str, body: Any) -> None:
    """Any JSON body to any route of the service key: a 4xx naming what is wrong (or, for the rare valid
    one, an answer), never a 500."""
    if isinstance(body, dict) and "model" in body:
        body["model"] = POLICY_MODEL
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            f"{endpoint.base_url}/{api}",
            json=body,
            headers={"Authorization": f"Bearer {endpoint.service_key}"},
        ) as reply,
    ):
        payload = await reply.json()
        assert reply.status < 500 or reply.status == 502, payload
        if reply.status >= 400:
            message = payload["error"]["message"]
            assert isinstance(message, str) and message
