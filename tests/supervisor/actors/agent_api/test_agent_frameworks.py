"""Agent frameworks trained unmodified: each one builds its own client from the episode's base URL and key
(as it would against any provider) and runs a calculator task through rollwise's endpoint. Covered: the
OpenAI Agents SDK with its Responses model and its chat-completions model, smolagents' ToolCallingAgent
(OpenAIServerModel: it sends stop sequences and tool_choice "required"), LangGraph's create_react_agent
on LangChain's ChatOpenAI, pydantic-ai's OpenAIChatModel, and the anthropic SDK.

Two engines: the SGLang fake with scripted turns decoded by the tiny preset's tokenizer (a tool call, then
the answer: the whole tool round trip), and the embedded engine serving the tiny preset itself (real
sampling: whatever the random model writes). Either way every engine call is recorded beside the
episode, and the test asserts that each turn's generated tokens and log-probs are in the trajectory rows
exactly as the engine returned them, after exactly the prompt it was sent; with the tiny model the
recorded log-probs are also recomputed by teacher forcing. A test skips, with the reason, when its
library cannot be imported (they are in the dev extras: pip install -e '.[dev]').
"""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import os
import subprocess
import sys
import time
import urllib.request
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest

from envs.agent import POLICY_MODEL, AgentEnvironment, anthropic_base_url
from envs.api import Task
from pipeline.contracts.schema import EpisodeSegment, validate_segment
from pipeline.supervisor.actors.agent_api.openai_endpoint import OpenAIEndpoint
from pipeline.supervisor.actors.rollout import EpisodeOutcome, RolloutSettings
from pipeline.supervisor.engines.client import EngineClient
from pipeline.supervisor.engines.pool import EnginePool
from pipeline.supervisor.engines.protocol import GenerateResult, SamplingParams
from pipeline.tools.fake_sglang import FakeSGLang, GenerateCall, Plan, free_port

QUESTION = "What is 2 + 3?"
TASK = Task(id="calc-0", seed=0, data={"question": QUESTION, "answer": 5})
SYSTEM = "Use the calculator tool, then answer with the number."
CALL = '<tool_call>{"name":"calculator","arguments":{"expression":"2+3"}}</tool_call>'
SMOL_FINAL = '<tool_call>{"name":"final_answer","arguments":{"answer":"5"}}</tool_call>'
ANSWER = "The answer is 5."
# The tiny preset says max_position_embeddings 1,024, but its rotary positions extend to any length (RoPE is
# computed per position, no learned table): the engine serves it with a 4,096-token context, so that a
# framework's own long system prompt (smolagents': ~2,500 tokens) fits, and teacher forcing reads the same.
TINY_CONTEXT = 4096


def calculate(expression: str) -> str:
    """The tool every framework gets: integers and + - * only (no eval of model output)."""
    total, sign, number = 0, 1, ""
    for char in expression.replace(" ", "") + "+":
        if char.isdigit():
            number += char
        elif char in "+-" and number:
            total, number, sign = total + sign * int(number), "", 1 if char == "+" else -1
        else:
            return f"error: cannot evaluate {expression!r}"
    return str(total)


def found_answer(text: Any) -> float:
    return 1.0 if "5" in str(text) else 0.0


# ------------------------------------------------------------------------------------------ the agents
# Each builds its own client from the episode's client: `str(client.base_url)` and `client.api_key`.
async def agents_sdk_agent(client: openai.AsyncOpenAI, task: Task, *, responses: bool) -> float:
    from agents import (
        Agent,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)  # no trace export to OpenAI's servers

    @function_tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression."""
        return calculate(expression)

    own = openai.AsyncOpenAI(base_url=str(client.base_url), api_key=client.api_key, max_retries=0)
    kind = OpenAIResponsesModel if responses else OpenAIChatCompletionsModel
    agent = Agent(
        name="calc",
        instructions=SYSTEM,
        tools=[calculator],
        model=kind(model=POLICY_MODEL, openai_client=own),
    )
    result = await Runner.run(agent, task.data["question"], max_turns=3)
    return found_answer(result.final_output)


async def agents_sdk_responses(client: openai.AsyncOpenAI, task: Task) -> float:
    return await agents_sdk_agent(client, task, responses=True)


async def agents_sdk_chat(client: openai.AsyncOpenAI, task: Task) -> float:
    return await agents_sdk_agent(client, task, responses=False)


async def smolagents_tool_calling(client: openai.AsyncOpenAI, task: Task) -> float:
    from smolagents import OpenAIServerModel, ToolCallingAgent, tool

    @tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: integers joined by + and -.
        """
        return calculate(expression)

    model = OpenAIServerModel(model_id=POLICY_MODEL, api_base=str(client.base_url), api_key=client.api_key)
    agent = ToolCallingAgent(tools=[calculator], model=model, max_steps=3, verbosity_level=0)
    # smolagents is synchronous: it runs in a thread, its HTTP requests reach the endpoint on this loop.
    try:
        return found_answer(await asyncio.to_thread(agent.run, task.data["question"]))
    finally:
        model.client.close()


async def langgraph_react(client: openai.AsyncOpenAI, task: Task) -> float:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    @tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression."""
        return calculate(expression)

    # Its own HTTP clients, closed here (LangChain's defaults are process-wide and stay open).
    http, async_http = openai.DefaultHttpxClient(), openai.DefaultAsyncHttpxClient()
    llm = ChatOpenAI(
        model=POLICY_MODEL,
        base_url=str(client.base_url),
        api_key=client.api_key,
        max_retries=0,
        http_client=http,
        http_async_client=async_http,
    )
    try:
        with warnings.catch_warnings():  # LangGraph 1.x points to langchain.agents.create_agent instead
            warnings.simplefilter("ignore", DeprecationWarning)
            graph = create_react_agent(llm, [calculator], prompt=SYSTEM)
        state = await graph.ainvoke({"messages": [("user", task.data["question"])]}, {"recursion_limit": 6})
    finally:
        await async_http.aclose()
        http.close()
    return found_answer(state["messages"][-1].content)


async def pydantic_ai_agent(client: openai.AsyncOpenAI, task: Task) -> float:
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    async with openai.AsyncOpenAI(
        base_url=str(client.base_url), api_key=client.api_key, max_retries=0
    ) as own:
        provider = OpenAIProvider(openai_client=own)
        agent = Agent(OpenAIChatModel(POLICY_MODEL, provider=provider), instructions=SYSTEM)

        @agent.tool_plain
        def calculator(expression: str) -> str:
            """Evaluate an arithmetic expression."""
            return calculate(expression)

        result = await agent.run(task.data["question"])
    return found_answer(result.output)


async def anthropic_sdk_loop(client: openai.AsyncOpenAI, task: Task) -> float:
    import anthropic

    tool = {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "input_schema": {"type": "object", "properties": {"expression": {"type": "string"}}},
    }
    async with anthropic.AsyncAnthropic(
        base_url=anthropic_base_url(client), api_key=client.api_key
    ) as claude:
        messages: list[Any] = [{"role": "user", "content": task.data["question"]}]
        for _ in range(3):
            reply = await claude.messages.create(
                model=POLICY_MODEL, max_tokens=48, system=SYSTEM, messages=messages, tools=[tool]
            )
            uses = [block for block in reply.content if block.type == "tool_use"]
            if not uses:
                return found_answer("".join(b.text for b in reply.content if b.type == "text"))
            messages.append(
                {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]}
            )
            results = [
                {
                    "type": "tool_result",
                    "tool_use_id": u.id,
                    "content": calculate(str(u.input.get("expression", ""))),
                }
                for u in uses
            ]
            messages.append({"role": "user", "content": results})
    return 0.0


@dataclass(frozen=True)
class Framework:
    name: str
    module: str  # what must import for the test to run
    agent: Callable[[openai.AsyncOpenAI, Task], Awaitable[float]]
    final: str = ANSWER  # the scripted last turn
    segments: int = 1  # smolagents sends its tool calls back as text ("Calling tools: ..."): a new segment


FRAMEWORKS = [
    Framework("openai-agents-responses", "agents", agents_sdk_responses),
    Framework("openai-agents-chat", "agents", agents_sdk_chat),
    Framework("smolagents", "smolagents", smolagents_tool_calling, final=SMOL_FINAL, segments=2),
    Framework("langgraph", "langgraph.prebuilt", langgraph_react),
    Framework("pydantic-ai", "pydantic_ai", pydantic_ai_agent),
    Framework("anthropic", "anthropic", anthropic_sdk_loop),
]


def requires(framework: Framework) -> None:
    try:
        found = importlib.util.find_spec(framework.module) is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        pytest.skip(f"{framework.module} is not installed (it is in the dev extras: pip install -e '.[dev]')")


# ------------------------------------------------------------------------------------ recording engine
@dataclass
class RecordingEngine:
    """The engine pool, with every /generate call it answered kept (prompt ids and the result)."""

    pool: EnginePool
    calls: list[tuple[list[int], SamplingParams, GenerateResult]] = field(default_factory=list)

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, rid: str, *, affinity_key: str
    ) -> GenerateResult:
        result = await self.pool.generate(input_ids, sampling, rid, affinity_key=affinity_key)
        self.calls.append((list(input_ids), sampling, result))
        return result


def assert_token_exact(outcome: EpisodeOutcome, engine: RecordingEngine) -> None:
    """Every engine call's output ids and log-probs are in the rows right after the ids it was sent, as
    generated tokens (loss mask 1), and the rows mark nothing else as generated."""
    rows = outcome.rows
    assert rows and engine.calls
    for row in rows:
        assert validate_segment(row) is None
    for prompt, _, result in engine.calls:
        n, m = len(prompt), len(result.output_ids)
        [row] = [r for r in rows if r.token_ids[:n] == prompt and len(r.token_ids) >= n + m][:1] or [None]
        assert row is not None, "a request's prompt is not the start of any recorded segment"
        assert row.token_ids[n : n + m] == result.output_ids
        assert row.loss_mask[n : n + m] == [1] * m
        assert row.logprobs[n : n + m] == result.logprobs
    assert sum(sum(r.loss_mask) for r in rows) == sum(len(r.output_ids) for _, _, r in engine.calls)


def one_task(seed: int) -> Iterator[Task]:
    while True:
        yield TASK


async def run_episode(endpoint: OpenAIEndpoint, framework: Framework, **options: Any) -> EpisodeOutcome:
    env = AgentEnvironment(framework.agent, one_task, max_turns=4, episode_timeout_s=120.0, **options)
    outcome = await endpoint.run_agent_episode(
        env, TASK, episode_id="ep", group_id="g", env_name=framework.name
    )
    # Some frameworks leave a pooled connection to the endpoint for the garbage collector (the Agents
    # SDK's client copies): collect it here, quietly, not during whichever test runs next.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()
    return outcome


def scripted(final: str, tok: Any) -> Callable[[GenerateCall], Plan]:
    """Turn 0 calls the calculator; every later turn is `final`, each closed by the eos token."""

    def plan(call: GenerateCall) -> Plan:
        text = CALL if call.rid.endswith("-t0") else final
        ids = [*tok.encode(text, add_special_tokens=False), tok.eos_token_id]
        return Plan(ids, [-0.1 - 0.01 * i for i in range(len(ids))])

    return plan


@asynccontextmanager
async def endpoint_on(
    url: str, tokenizer: Any, max_new_tokens: int, context: int = 4096
) -> AsyncIterator[tuple[OpenAIEndpoint, RecordingEngine]]:
    pool = EnginePool([EngineClient(url, retries=0)])
    engine = RecordingEngine(pool)
    settings = RolloutSettings(
        sampling=SamplingParams(max_new_tokens=max_new_tokens), max_context_tokens=context
    )
    endpoint = OpenAIEndpoint(engine=engine, tokenizer=tokenizer, settings=settings)
    await endpoint.start()
    try:
        yield endpoint, engine
    finally:
        await endpoint.close()
        await pool.close()


# ------------------------------------------------------------------------- scripted turns (the fake)
@pytest.mark.parametrize("framework", FRAMEWORKS, ids=[f.name for f in FRAMEWORKS])
async def test_framework_tool_round_trip_is_recorded_token_exact(framework: Framework, tok: Any) -> None:
    requires(framework)
    fake = FakeSGLang(tokenizer=tok, script=scripted(framework.final, tok))
    await fake.start()
    try:
        async with endpoint_on(fake.base_url, tok, 64) as (endpoint, engine):
            outcome = await run_episode(endpoint, framework)
    finally:
        await fake.stop()
    assert (outcome.finish_reason, outcome.error) == ("stop", None), outcome.error
    assert outcome.outcome == 1.0  # the tool ran, its result went back, the answer came out
    assert (outcome.num_turns, outcome.num_segments) == (2, framework.segments)
    assert_token_exact(outcome, engine)
    second_prompt = tok.decode(engine.calls[1][0])
    assert "5" in second_prompt.rsplit(QUESTION, 1)[1]  # the tool's result is in the next turn's context
    assert fake.ignored_fields == []


# ------------------------------------------------------------------------------------- the tiny model
@pytest.fixture(scope="module")
def tiny_engine(tiny_model_dir: Path) -> Iterator[str]:
    """The embedded engine serving the tiny preset, as the daemon starts it (its own process)."""
    port = free_port()
    argv = [sys.executable, "-m", "pipeline.engine", "--model", str(tiny_model_dir), "--port", str(port)]
    # float32: the recorded log-probs are checked against an fp32 teacher-forced forward (auto may pick bf16).
    argv += ["--threads", "1", "--seed", "0", "--context-length", str(TINY_CONTEXT), "--dtype", "float32"]
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error"}
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the embedded engine did not start (exit {proc.poll()})")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


@pytest.fixture(scope="module")
def tiny_policy(tiny_model_dir: Path) -> Any:
    from learner.model.model_io import load_policy

    return load_policy(tiny_model_dir)[0]


def recomputed(policy: Any, row: EpisodeSegment) -> list[float]:
    """The tiny model's log-prob of every recorded token given the tokens before it (teacher forcing)."""
    import torch

    from learner.logprobs import sampled_token_logprobs

    with torch.no_grad():
        logits = policy(torch.tensor([row.token_ids])).logits[0]
    values = sampled_token_logprobs(logits[:-1].float(), torch.tensor(row.token_ids[1:]), temperature=1.0)
    return [0.0, *(float(v) for v in values)]


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("framework", FRAMEWORKS, ids=[f.name for f in FRAMEWORKS])
async def test_framework_on_the_tiny_model_records_the_engines_tokens_and_logprobs(
    framework: Framework, tiny_engine: str, tiny_model_dir: Path, tiny_policy: Any, one_torch_thread: None
) -> None:
    requires(framework)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    async with endpoint_on(tiny_engine, tokenizer, 24, context=TINY_CONTEXT) as (endpoint, engine):
        outcome = await run_episode(endpoint, framework)
    # A random model rarely writes a valid tool call, so a framework may give up or fail: whatever the
    # episode's end, every turn it took is recorded exactly.
    assert outcome.num_turns >= 1, outcome.error
    assert_token_exact(outcome, engine)
    for row in outcome.rows:
        again = recomputed(tiny_policy, row)
        diffs = [abs(a - b) for a, b, m in zip(row.logprobs, again, row.loss_mask, strict=True) if m]
        assert diffs and max(diffs) < 1e-3, f"max |engine - recomputed| = {max(diffs):.2e}"
