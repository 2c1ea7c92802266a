"""`rollwise bench actors`: episode-runner turns/s against a bare aiohttp request loop.

Both sides talk over real HTTP to the same *instant* SGLang-compatible server (it answers every
/generate with the same few tokens, no model), which runs in a child process pinned to its own core
so it does not share the event loop or the CPU with the measured side (pinned to another core).

- bare loop: E coroutines, each posting T /generate requests in sequence with payloads of the same
  sizes the episodes send, reading the reply and nothing else (one aiohttp session, C connections);
- transport loop: the same requests through rollwise's own HTTP client (engines/http1.py, what
  EngineClient sends with since 2026-11-27), so that runner minus transport loop is the runner's own
  CPU per turn, apart from the client it speaks HTTP with;
- runner: E concurrent episodes (groups of G, pipeline.supervisor.actors.rollout.run_group) of a T-turn echo
  environment through EnginePool/EngineClient (C connections), chat-template rendering, tool-call
  parsing, metrics and the Arrow record batch of every group included.

Reported: turns/s of each side and their ratio (goal >= 0.6), actor CPU time per turn (and the ratio
of the two, which is what turns/s would show if both sides were CPU-bound; unlike wall-clock rates it
hardly moves when other processes load the machine), and the per-turn overhead distribution (p50/p99
of a turn's wall time minus its /generate round trip). Twice: with the echo environment's replies
repeating (every episode says the same; the chat buffer's encode memo answers them) and with replies
that never repeat (a serial number in each: every reply is tokenized), each against its own bare loop.

Prefill: the tokens an engine must prefill per generated token for the runner's request stream, without
a prefix cache (every request's whole prompt) and with one (SGLang's radix cache, the embedded engine's
prefix cache): per group the shared first prompt once, then per turn what the environment appended
(a cached prefix still recomputes its last token). The pool sends a group's requests to one engine
(affinity by group id), which is what lets the cache see all of it.

`--agent` compares instead, in the same process and against the same instant server, the native runner with
agent-function episodes of the same conversation (pipeline.supervisor.actors.agent_api.openai_endpoint): an
echo agent that sends T chat completions through the in-process OpenAI endpoint, each one rendered, recorded
and generated like a native turn. Two agents: one calls `client.chat.completions.create` (the openai SDK:
its request building and response models run on the same core), one posts the same JSON with aiohttp to the
episode's base URL (what the endpoint itself costs). Goal: agent turns/s >= 0.5x native. Then the SDK agent
again in 1 and 2 agent worker processes (`[env] agent_workers`,
pipeline/supervisor/actors/agent_api/agent_workers.py; `--agent-workers`): the agent and its openai client
run there, on any core, and reach the endpoint over the worker's pipe; the actor's side keeps the endpoint's
work. With 2 cores, the instant server and the actor pinned one to each, the workers share both. The
workers' own CPU per turn (from /proc) is reported beside the actor's."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from envs.api import Action, Environment, EnvSpec, Message, StepResult, Task
from pipeline.supervisor.heap import freeze_startup_heap

GOAL_RATIO = 0.6  # the runner against the bare loop
GOAL_AGENT_RATIO = 0.5  # agent episodes through the endpoint against the native runner
AGENT_CLIENTS = ("sdk", "http", "none")  # agent_side's `client`
WORKER_AGENT = "pipeline.tools.bench.runner_overhead:sdk_echo_agent"
ECHO_PROMPT = "Repeat after me: hello there."
MODEL_TEXT = "hello there 12"
LOGPROB = -0.5  # every token the instant server "generates" gets this log-prob


_REPLY_NUMBERS = itertools.count()


class EchoEnv(Environment):
    """Trivial instant environment: echoes the assistant's text back for `turns` turns, then done; with
    `unique`, each reply carries a serial number, so no two replies of the process are the same text."""

    def __init__(self, turns: int = 8, unique: bool = False) -> None:
        self.unique = unique
        self.spec = EnvSpec(
            name="echo", version="1", max_turns=turns, step_timeout_s=60.0, episode_timeout_s=600.0
        )
        self._steps = 0

    def tasks(self, seed: int) -> Iterator[Task]:
        index = 0
        while True:
            yield Task(id=f"echo-{seed}-{index}", seed=seed, data={})
            index += 1

    async def reset(self, task: Task) -> list[Message]:
        self._steps = 0
        return [{"role": "user", "content": ECHO_PROMPT}]

    async def step(self, action: Action) -> StepResult:
        self._steps += 1
        done = self._steps >= self.spec.max_turns
        text = f"{action.text} #{next(_REPLY_NUMBERS)}" if self.unique else action.text
        return StepResult([{"role": "user", "content": text}], done=done, outcome=1.0 if done else None)


# --------------------------------------------------------------------------------------- the server
def serve_instant(core: int | None, output_ids: list[int]) -> None:
    """Child process body: pin to `core`, serve /generate instantly, print the port on stdout."""
    if core is not None:
        os.sched_setaffinity(0, {core})
    asyncio.run(_serve_async(output_ids))


async def _serve_async(output_ids: list[int]) -> None:
    entries = [[LOGPROB, t, None] for t in output_ids]
    finish = {"type": "stop", "matched": output_ids[-1]}

    async def generate(request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        meta = {
            "id": body.get("rid") or "x",
            "finish_reason": finish,
            "prompt_tokens": len(body["input_ids"]),
            "weight_version": "default",
            "completion_tokens": len(output_ids),
            "cached_tokens": 0,
            "output_token_logprobs": entries,
            "e2e_latency": 0.0,
        }
        payload = json.dumps({"output_ids": output_ids, "meta_info": meta}, separators=(",", ":"))
        return web.Response(text=payload, content_type="application/json")

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200)

    app = web.Application()
    app.router.add_post("/generate", generate)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, backlog=4096)  # 1,000 clients connect at once
    await site.start()
    print(int(runner.addresses[0][1]), flush=True)
    await asyncio.Event().wait()  # until the parent terminates this process


@contextmanager
def instant_server(output_ids: list[int], core: int | None) -> Iterator[str]:
    """Start the instant server as a child process; yields its base URL; terminates it by PID."""
    code = (
        "import sys, json; from pipeline.tools.bench.runner_overhead import serve_instant as s; "
        "s(*json.loads(sys.argv[1]))"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, json.dumps([core, output_ids])], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 60.0)
        line = proc.stdout.readline() if ready else ""
        if not line.strip().isdigit():
            raise RuntimeError(f"instant SGLang server (pid {proc.pid}) did not report its port: {line!r}")
        yield f"http://127.0.0.1:{int(line)}"
    finally:
        proc.terminate()
        try:
            proc.wait(5.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5.0)
        if proc.stdout is not None:
            proc.stdout.close()


@contextmanager
def pinned(core: int | None) -> Iterator[None]:
    """Pin this process to `core` for the block (restored afterwards)."""
    if core is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


# --------------------------------------------------------------------------------------- the two sides
@dataclass
class SideResult:
    turns: int
    seconds: float
    cpu_seconds: float

    @property
    def turns_per_s(self) -> float:
        return self.turns / self.seconds

    @property
    def cpu_us_per_turn(self) -> float:
        return 1e6 * self.cpu_seconds / self.turns


def _bare_body(index: int, turn: int, size: int) -> dict[str, Any]:
    return {
        "input_ids": list(range(size)),
        "sampling_params": {
            "max_new_tokens": 16,
            "stop_token_ids": [0],
            "skip_special_tokens": False,
            "no_stop_trim": True,
        },
        "return_logprob": True,
        "rid": f"bare-{index}-t{turn}",
    }


async def bare_loop(url: str, payload_sizes: Sequence[int], episodes: int, connections: int) -> SideResult:
    """`episodes` coroutines, each posting one request per entry of `payload_sizes` in sequence, through
    aiohttp (the baseline the goal is set against)."""
    connector = aiohttp.TCPConnector(limit=connections, limit_per_host=0)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=600)
    ) as session:

        async def one(index: int) -> int:
            for turn, size in enumerate(payload_sizes):
                async with session.post(f"{url}/generate", json=_bare_body(index, turn, size)) as resp:
                    resp.raise_for_status()
                    await resp.read()
            return len(payload_sizes)

        return await _timed_loops(one, episodes)


async def transport_loop(
    url: str, payload_sizes: Sequence[int], episodes: int, connections: int
) -> SideResult:
    """The bare loop through rollwise's own HTTP client (engines/http1.py, what EngineClient sends with),
    bodies encoded as EngineClient encodes them: runner minus this is the runner's own cost per turn."""
    from pipeline.supervisor.engines.client import encode_json_body
    from pipeline.supervisor.engines.http1 import Http1Pool

    http = Http1Pool(url, limit=connections, connect_timeout_s=60.0)
    headers = {"Content-Type": "application/json"}

    async def one(index: int) -> int:
        for turn, size in enumerate(payload_sizes):
            body = encode_json_body(_bare_body(index, turn, size))
            status, _ = await http.request("POST", "/generate", body, timeout_s=600.0, headers=headers)
            if status != 200:
                raise RuntimeError(f"instant server answered {status}")
        return len(payload_sizes)

    try:
        return await _timed_loops(one, episodes)
    finally:
        await http.close()


async def _timed_loops(one: Callable[[int], Awaitable[int]], episodes: int) -> SideResult:
    """Run `one(0) .. one(episodes - 1)` at once; the turns they return, wall time and this process's CPU."""
    cpu, start = time.process_time(), time.perf_counter()
    counts = await asyncio.gather(*(one(i) for i in range(episodes)))
    return SideResult(sum(counts), time.perf_counter() - start, time.process_time() - cpu)


@dataclass
class RunnerResult(SideResult):
    overhead_p50_us: float
    overhead_p99_us: float
    engine_p50_us: float
    payload_sizes: list[int]
    generated_tokens: int = 0
    prefill_uncached: int = 0  # tokens to prefill without a prefix cache
    prefill_cached: int = 0  # with a prefix cache that sees every request of a group
    worker_cpu_seconds: float = 0.0  # the agent worker processes' CPU over the measured window

    @property
    def worker_cpu_us_per_turn(self) -> float:
        return 1e6 * self.worker_cpu_seconds / self.turns


def prefill_tokens(groups: Sequence[Sequence[tuple[int, Sequence[int]]]]) -> tuple[int, int]:
    """(tokens to prefill without a prefix cache, with one) for groups of episodes, each episode given
    as (prompt_len, loss_mask) of its one segment: a request is sent where a generated run starts."""
    uncached = cached = 0
    for group in groups:
        for index, (prompt_len, mask) in enumerate(group):
            end_of_last = 0
            for i in range(1, len(mask)):
                if _turn_starts(mask, i):
                    uncached += i
                    # The first prompt is shared by the group (prefilled once); later, what the
                    # environment appended since the last reply. A cached prefix still recomputes its
                    # last token.
                    first = prompt_len if index == 0 else 0
                    cached += max(1, first if end_of_last == 0 else i - end_of_last)
                if mask[i] == 1 and (i + 1 == len(mask) or mask[i + 1] == 0):
                    end_of_last = i + 1
    return uncached, cached


async def runner_side(
    url: str,
    tokenizer: Any,
    episodes: int,
    turns: int,
    group_size: int,
    connections: int,
    *,
    unique: bool = False,
) -> RunnerResult:
    from pipeline.supervisor.actors.rollout import GroupOutcome, run_group

    settings = _echo_settings(tokenizer)
    pool = _bench_pool(url, connections)
    task = Task(id="echo-0", seed=0, data={})
    sizes = _group_sizes(episodes, group_size)

    async def group(index: int) -> GroupOutcome:
        outcome = await run_group(
            pool,
            tokenizer,
            EchoEnv,
            task,
            settings,
            group_size=sizes[index],
            group_id=f"g{index}",
            env_name="echo",
            env_options={"turns": turns, "unique": unique},
        )
        outcome.to_record_batch()
        return outcome

    try:
        cpu, start = time.process_time(), time.perf_counter()
        outcomes = await asyncio.gather(*(group(i) for i in range(len(sizes))))
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
    finally:
        await pool.close()
    eps = [ep for g in outcomes for ep in g.episodes]
    bad = [ep for ep in eps if ep.finish_reason != "stop"]
    if bad:
        first = f"{bad[0].finish_reason}: {bad[0].error}"
        raise RuntimeError(f"{len(bad)} bench episodes did not finish with 'stop'; first: {first}")
    # Sizes of the requests one episode sent: its prompt, then the buffer before each later turn.
    row = eps[0].rows[0]
    sizes = [i for i in range(1, len(row.loss_mask)) if _turn_starts(row.loss_mask, i)]
    result = _runner_result(eps, seconds, cpu_seconds, payload_sizes=sizes[:turns])
    shapes = [[(ep.rows[0].prompt_len, ep.rows[0].loss_mask) for ep in g.episodes] for g in outcomes]
    result.prefill_uncached, result.prefill_cached = prefill_tokens(shapes)
    result.generated_tokens = sum(sum(ep.rows[0].loss_mask) for ep in eps)
    return result


async def sdk_echo_agent(api: Any, task: Task) -> float:
    """The echo agent with the openai SDK, importable by an agent worker: `task.data["turns"]` turns."""
    from envs.agent import POLICY_MODEL

    messages = [{"role": "user", "content": ECHO_PROMPT}]
    for _ in range(task.data["turns"]):
        response = await api.chat.completions.create(model=POLICY_MODEL, messages=messages)
        text = str(response.choices[0].message.content)
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": text}]
    return 1.0


async def agent_side(
    url: str,
    tokenizer: Any,
    episodes: int,
    turns: int,
    group_size: int,
    connections: int,
    *,
    client: str,
    workers: int = 0,
    worker_cpus: set[int] | None = None,
) -> RunnerResult:
    """`episodes` echo-agent episodes (groups of `group_size`) through the OpenAI endpoint; `client` is
    "sdk" (the openai.AsyncOpenAI the episode is given: answered in-process), "http" (aiohttp posts to the
    episode's base URL over the socket) or "none" (the request's JSON handed to the endpoint directly: the
    endpoint's own cost, no client library and no transport). `workers` > 0: the SDK agent runs in that many
    agent worker processes (on `worker_cpus`), started before the clock."""
    from envs.agent import POLICY_MODEL, AgentEnvironment
    from pipeline.supervisor.actors.agent_api.agent_workers import AgentWorkerPool
    from pipeline.supervisor.actors.agent_api.openai_endpoint import OpenAIEndpoint
    from pipeline.supervisor.actors.rollout import GroupOutcome, run_group

    settings = _echo_settings(tokenizer)
    pool = _bench_pool(url, connections)
    agent_pool = None
    if workers > 0:
        agent_pool = AgentWorkerPool(workers, cpus=worker_cpus)
        await agent_pool.start()
    endpoint = OpenAIEndpoint(engine=pool, tokenizer=tokenizer, settings=settings, agent_pool=agent_pool)
    await endpoint.start()
    http = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=connections, limit_per_host=0),
        timeout=aiohttp.ClientTimeout(total=600),
    )

    async def complete(api: Any, messages: list[dict[str, str]]) -> str:
        if client == "sdk":
            response = await api.chat.completions.create(model=POLICY_MODEL, messages=messages)
            return str(response.choices[0].message.content)
        body = {"model": POLICY_MODEL, "messages": messages}
        if client == "none":
            answer = await endpoint.answer_chat(None, f"Bearer {api.api_key}", json.dumps(body).encode())
            if answer.status != 200:
                raise RuntimeError(f"the endpoint answered {answer.status}: {answer.body[:200]!r}")
            return str(json.loads(answer.body)["choices"][0]["message"]["content"])
        headers = {"Authorization": f"Bearer {api.api_key}"}
        async with http.post(f"{api.base_url}chat/completions", json=body, headers=headers) as reply:
            reply.raise_for_status()
            return str((await reply.json())["choices"][0]["message"]["content"])

    async def echo_agent(api: Any, task: Task) -> float:
        messages = [{"role": "user", "content": ECHO_PROMPT}]
        for _ in range(turns):
            text = await complete(api, messages)
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": text}]
        return 1.0

    def tasks(seed: int) -> Iterator[Task]:
        while True:
            yield Task(id="echo-0", seed=0, data={})

    task = Task(id="echo-0", seed=0, data={"turns": turns})
    sizes = _group_sizes(episodes, group_size)
    agent = WORKER_AGENT if workers > 0 else echo_agent

    async def group(index: int) -> GroupOutcome:
        outcome = await run_group(
            pool,
            tokenizer,
            lambda: AgentEnvironment(agent, tasks, max_turns=turns, episode_timeout_s=600.0),
            task,
            settings,
            group_size=sizes[index],
            group_id=f"a{index}",
            env_name="echo-agent",
            agent_runner=endpoint,
        )
        outcome.to_record_batch()
        return outcome

    pids = agent_pool.pids if agent_pool is not None else []
    try:
        cpu, start, worker_cpu = time.process_time(), time.perf_counter(), _processes_cpu_seconds(pids)
        outcomes = await asyncio.gather(*(group(i) for i in range(len(sizes))))
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
        worker_cpu = _processes_cpu_seconds(pids) - worker_cpu
    finally:
        await http.close()
        await endpoint.close()
        await pool.close()
    eps = [ep for g in outcomes for ep in g.episodes]
    bad = [ep for ep in eps if ep.finish_reason != "stop" or ep.num_segments != 1]
    if bad:
        first = f"{bad[0].finish_reason} ({bad[0].num_segments} segments): {bad[0].error}"
        raise RuntimeError(f"{len(bad)} agent bench episodes were not one clean trajectory; first: {first}")
    result = _runner_result(eps, seconds, cpu_seconds, payload_sizes=[])
    result.worker_cpu_seconds = worker_cpu
    return result


def _processes_cpu_seconds(pids: Sequence[int]) -> float:
    """User + system CPU seconds the processes `pids` have used so far (/proc/<pid>/stat)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / ticks


async def sdk_alone_cpu_us(turns: int, conversations: int) -> float:
    """CPU microseconds per `chat.completions.create` of the openai SDK alone: the echo conversation of
    `turns` turns (the same growing messages the agent sends), answered at once by an httpx transport
    that returns a fixed completion. No endpoint, no engine: what the client library costs by itself."""
    import httpx2
    import openai

    from envs.agent import POLICY_MODEL
    from pipeline.supervisor.actors.agent_api.openai_wire import Completion, chat_completion

    # The same response object the endpoint sends (pipeline.supervisor.actors.agent_api.openai_wire), so
    # the SDK parses alike.
    completion = Completion(MODEL_TEXT, (), (), "stop", prompt_tokens=1, completion_tokens=1)
    body = json.dumps(chat_completion(completion, completion_id="chatcmpl-0", model=POLICY_MODEL)).encode()

    class Instant(httpx2.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
            await request.aread()
            return httpx2.Response(200, headers={"content-type": "application/json"}, content=body)

    async with httpx2.AsyncClient(transport=Instant()) as http:
        api = openai.AsyncOpenAI(base_url="http://instant/v1", api_key="k", max_retries=0, http_client=http)
        calls = 0
        cpu = time.process_time()
        for _ in range(conversations):
            messages = [{"role": "user", "content": ECHO_PROMPT}]
            for _ in range(turns):
                reply = await api.chat.completions.create(model=POLICY_MODEL, messages=messages)  # type: ignore[arg-type]
                text = str(reply.choices[0].message.content)
                messages += [{"role": "assistant", "content": text}, {"role": "user", "content": text}]
                calls += 1
        return (time.process_time() - cpu) / calls * 1e6


def _echo_settings(tokenizer: Any) -> Any:
    from pipeline.supervisor.actors.rollout import RolloutSettings
    from pipeline.supervisor.engines.protocol import SamplingParams

    return RolloutSettings(
        sampling=SamplingParams(max_new_tokens=16, stop_token_ids=(int(tokenizer.eos_token_id),)),
        max_context_tokens=100_000,
    )


def _bench_pool(url: str, connections: int) -> Any:
    from pipeline.supervisor.engines.client import EngineClient
    from pipeline.supervisor.engines.pool import EnginePool

    # A generous connect timeout: 1,000 episodes starting at once can starve the loop for seconds.
    return EnginePool([EngineClient(url, max_connections=connections, retries=0, connect_timeout_s=60.0)])


def _group_sizes(episodes: int, group_size: int) -> list[int]:
    """Groups of `group_size`; the last one takes the remainder."""
    return [group_size] * (episodes // group_size) + (
        [episodes % group_size] if episodes % group_size else []
    )


def _runner_result(
    eps: Sequence[Any], seconds: float, cpu_seconds: float, *, payload_sizes: list[int]
) -> RunnerResult:
    overheads = sorted(
        wall - engine for ep in eps for wall, engine in zip(ep.turn_seconds, ep.engine_seconds, strict=True)
    )
    engine_times = sorted(s for ep in eps for s in ep.engine_seconds)
    return RunnerResult(
        turns=sum(ep.num_turns for ep in eps),
        seconds=seconds,
        cpu_seconds=cpu_seconds,
        overhead_p50_us=1e6 * _quantile(overheads, 0.5),
        overhead_p99_us=1e6 * _quantile(overheads, 0.99),
        engine_p50_us=1e6 * _quantile(engine_times, 0.5),
        payload_sizes=payload_sizes,
    )


def _turn_starts(loss_mask: Sequence[int], i: int) -> bool:
    """True where a generated run starts after context tokens (the request was sent with i tokens)."""
    return loss_mask[i] == 1 and loss_mask[i - 1] == 0


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    index = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[index]


# --------------------------------------------------------------------------------------- main
def load_tokenizer(model_dir: str | None) -> Any:
    """The tiny preset's tokenizer (built into a temp dir), or the tokenizer of `model_dir`."""
    from transformers import AutoTokenizer

    if model_dir is not None:
        return AutoTokenizer.from_pretrained(model_dir)
    from learner.model.model_init import build_tokenizer, vocab_hints, write_tokenizer

    with tempfile.TemporaryDirectory(prefix="rollwise-bench-tok-") as tmp:
        write_tokenizer(build_tokenizer(vocab_hints()), Path(tmp))
        return AutoTokenizer.from_pretrained(tmp)


def _cores(args: argparse.Namespace) -> tuple[int | None, int | None]:
    available = sorted(os.sched_getaffinity(0))
    if args.no_pin or len(available) < 2:
        return None, None
    actor = args.actor_core if args.actor_core is not None else available[0]
    server = args.server_core if args.server_core is not None else available[1]
    return actor, server


async def _measure(args: argparse.Namespace, url: str, tokenizer: Any) -> dict[str, Any]:
    """Alternate the sides `repeats` times, for repeating and for unique replies; each side reports its
    best round (least disturbed)."""
    # Warm-up: connections, template compilation, metric children.
    await runner_side(url, tokenizer, min(args.episodes, 16), 2, min(args.group_size, 16), args.connections)
    freeze_startup_heap()  # as the daemon does once it has started
    report: dict[str, Any] = {
        "episodes": args.episodes,
        "turns_per_episode": args.turns,
        "group_size": args.group_size,
        "connections": args.connections,
        "repeats": args.repeats,
        "goal_ratio": GOAL_RATIO,
    }
    for variant, unique in (("repeating", False), ("unique", True)):
        runners: list[RunnerResult] = []
        bares: list[SideResult] = []
        transports: list[SideResult] = []
        for _ in range(args.repeats):
            runners.append(
                await runner_side(
                    url,
                    tokenizer,
                    args.episodes,
                    args.turns,
                    args.group_size,
                    args.connections,
                    unique=unique,
                )
            )
            bares.append(await bare_loop(url, runners[-1].payload_sizes, args.episodes, args.connections))
            transports.append(
                await transport_loop(url, runners[-1].payload_sizes, args.episodes, args.connections)
            )
        runner = max(runners, key=lambda r: r.turns_per_s)
        bare = max(bares, key=lambda r: r.turns_per_s)
        transport = max(transports, key=lambda r: r.turns_per_s)
        ratio = runner.turns_per_s / bare.turns_per_s
        section = {
            "bare": asdict(bare) | {"turns_per_s": bare.turns_per_s, "cpu_us_per_turn": bare.cpu_us_per_turn},
            "transport": asdict(transport)
            | {"turns_per_s": transport.turns_per_s, "cpu_us_per_turn": transport.cpu_us_per_turn},
            "runner": asdict(runner)
            | {"turns_per_s": runner.turns_per_s, "cpu_us_per_turn": runner.cpu_us_per_turn},
            "rounds_turns_per_s": {
                "bare": [round(r.turns_per_s, 1) for r in bares],
                "transport": [round(r.turns_per_s, 1) for r in transports],
                "runner": [round(r.turns_per_s, 1) for r in runners],
            },
            "ratio": ratio,
            # What the ratio would be if both sides were CPU-bound on one core (insensitive to other load).
            "cpu_ratio": bare.cpu_us_per_turn / runner.cpu_us_per_turn,
            "prefill_per_generated_uncached": runner.prefill_uncached / runner.generated_tokens,
            "prefill_per_generated_cached": runner.prefill_cached / runner.generated_tokens,
        }
        if variant == "repeating":
            report |= section  # the top-level figures, as before
        else:
            report["unique"] = section
    report["meets_goal"] = min(report["ratio"], report["unique"]["ratio"]) >= GOAL_RATIO
    return report


async def _measure_agent(args: argparse.Namespace, url: str, tokenizer: Any) -> dict[str, Any]:
    """Native runner vs the echo agent through the endpoint (sdk and http clients), alternating rounds;
    each side reports its best round."""
    # Warm-up: connections, template compilation, the SDK's first-use costs.
    await runner_side(url, tokenizer, min(args.episodes, 16), 2, min(args.group_size, 16), args.connections)
    sides = [(kind, kind, 0) for kind in AGENT_CLIENTS]
    sides += [(f"sdk_{n}w", "sdk", n) for n in args.agent_workers]
    for _, kind, workers in sides:
        await agent_side(
            url, tokenizer, min(args.episodes, 16), 2, min(args.group_size, 16), args.connections,
            client=kind, workers=workers, worker_cpus=args.all_cpus,
        )  # fmt: skip
    freeze_startup_heap()  # as the daemon does once it has started
    rounds: dict[str, list[RunnerResult]] = {"native": [], **{name: [] for name, _, _ in sides}}
    for _ in range(args.repeats):
        rounds["native"].append(
            await runner_side(url, tokenizer, args.episodes, args.turns, args.group_size, args.connections)
        )
        for name, kind, workers in sides:
            rounds[name].append(
                await agent_side(
                    url,
                    tokenizer,
                    args.episodes,
                    args.turns,
                    args.group_size,
                    args.connections,
                    client=kind,
                    workers=workers,
                    worker_cpus=args.all_cpus,
                )
            )
    best = {side: max(results, key=lambda r: r.turns_per_s) for side, results in rounds.items()}
    report: dict[str, Any] = {
        "mode": "agent",
        "episodes": args.episodes,
        "turns_per_episode": args.turns,
        "group_size": args.group_size,
        "connections": args.connections,
        "repeats": args.repeats,
        "rounds_turns_per_s": {
            side: [round(r.turns_per_s, 1) for r in results] for side, results in rounds.items()
        },
        "goal_ratio": GOAL_AGENT_RATIO,
    }
    for side, result in best.items():
        report[side] = asdict(result) | {
            "turns_per_s": result.turns_per_s,
            "cpu_us_per_turn": result.cpu_us_per_turn,
            "worker_cpu_us_per_turn": result.worker_cpu_us_per_turn,
        }
    for side, _, _ in sides:
        report[f"ratio_{side}"] = best[side].turns_per_s / best["native"].turns_per_s
        report[f"cpu_ratio_{side}"] = best["native"].cpu_us_per_turn / best[side].cpu_us_per_turn
    report["agent_workers"] = list(args.agent_workers)
    await sdk_alone_cpu_us(args.turns, 2)  # warm-up
    report["sdk_alone_cpu_us_per_request"] = min(
        [await sdk_alone_cpu_us(args.turns, max(1, args.episodes // 8)) for _ in range(args.repeats)]
    )
    # The goal is the endpoint's own per-turn overhead (side "none"); the two client sides add what an
    # agent's HTTP client costs on the same core, reported beside it, never folded into the verdict.
    report["meets_goal"] = report["ratio_none"] >= GOAL_AGENT_RATIO
    return report


def format_agent_report(report: dict[str, Any]) -> str:
    lines = [
        f"rollwise bench actors --agent: {report['episodes']} concurrent episodes"
        f" x {report['turns_per_episode']} turns, groups of {report['group_size']}, instant fake SGLang"
        f" (server core {report.get('server_core')}, actor core {report.get('actor_core')})",
        "",
        f"{'side':<26}{'turns':>9}{'seconds':>10}{'turns/s':>11}{'CPU us/turn':>13}{'ovh p50 us':>12}"
        f"{'workers CPU us/turn':>21}",
    ]
    names = {
        "native": "native runner",
        "sdk": "agent, openai SDK client",
        "http": "agent, aiohttp client",
        "none": "agent, no client",
    }
    for workers in report.get("agent_workers", []):
        names[f"sdk_{workers}w"] = f"agent, SDK, {workers} worker{'s' if workers > 1 else ''}"
    for side, name in names.items():
        r = report[side]
        lines.append(
            f"{name:<26}{r['turns']:>9}{r['seconds']:>10.2f}{r['turns_per_s']:>11.0f}{r['cpu_us_per_turn']:>13.0f}"
            f"{r['overhead_p50_us']:>12.0f}"
            + (f"{r['worker_cpu_us_per_turn']:>21.0f}" if side.endswith("w") else f"{'-':>21}")
        )
    lines += [
        "",
        f"rounds (turns/s): {report['rounds_turns_per_s']}",
        f"agent/native turns/s: the endpoint alone {report['ratio_none']:.2f}"
        f" (goal >= {report['goal_ratio']}: {'met' if report['meets_goal'] else 'MISSED'});"
        f" with the agent's client on the same core: openai SDK {report['ratio_sdk']:.2f},"
        f" aiohttp over the socket {report['ratio_http']:.2f}",
        f"CPU-bound ratios (native CPU/turn / agent CPU/turn): endpoint alone {report['cpu_ratio_none']:.2f},"
        f" openai SDK {report['cpu_ratio_sdk']:.2f}, aiohttp {report['cpu_ratio_http']:.2f}",
        *(
            [
                "SDK agent in agent worker processes, turns/s against native: "
                + ", ".join(
                    f"{n} worker{'s' if n > 1 else ''} {report[f'ratio_sdk_{n}w']:.2f}"
                    for n in report["agent_workers"]
                )
                + f" (in the actor's own loop: {report['ratio_sdk']:.2f}); CPU us/turn is the actor's own,"
                " the workers' is beside it"
            ]
            if report.get("agent_workers")
            else []
        ),
        f"the openai SDK alone (same conversations, a transport that answers at once, no endpoint):"
        f" {report['sdk_alone_cpu_us_per_request']:.0f} CPU us per request",
        "sdk: the client each episode is given (answered in-process); http: posts to the episode's base URL;"
        " none: the request's JSON handed to the endpoint, no client or transport",
        "overhead = the endpoint's time for a request minus its /generate round trip (render, record, reply)",
    ]
    return "\n".join(lines)


def format_report(report: dict[str, Any]) -> str:
    lines = [
        f"rollwise bench actors: {report['episodes']} concurrent episodes"
        f" x {report['turns_per_episode']} turns,"
        f" groups of {report['group_size']}, {report['connections']} connections, instant fake SGLang"
        f" (server core {report.get('server_core')}, actor core {report.get('actor_core')})",
    ]
    for title, section in (("replies repeat", report), ("replies never repeat", report["unique"])):
        bare, transport, runner = section["bare"], section["transport"], section["runner"]
        lines += [
            "",
            f"{title}:",
            f"{'side':<12}{'turns':>9}{'seconds':>10}{'turns/s':>11}{'CPU us/turn':>13}",
            f"{'bare loop':<12}{bare['turns']:>9}{bare['seconds']:>10.2f}{bare['turns_per_s']:>11.0f}"
            f"{bare['cpu_us_per_turn']:>13.0f}",
            f"{'transport':<12}{transport['turns']:>9}{transport['seconds']:>10.2f}"
            f"{transport['turns_per_s']:>11.0f}{transport['cpu_us_per_turn']:>13.0f}",
            f"{'runner':<12}{runner['turns']:>9}{runner['seconds']:>10.2f}{runner['turns_per_s']:>11.0f}"
            f"{runner['cpu_us_per_turn']:>13.0f}",
            f"rounds (turns/s): bare {section['rounds_turns_per_s']['bare']}, "
            f"transport {section['rounds_turns_per_s']['transport']}, "
            f"runner {section['rounds_turns_per_s']['runner']}",
            f"runner's own CPU per turn above its transport (runner - transport loop): "
            f"{runner['cpu_us_per_turn'] - transport['cpu_us_per_turn']:.0f} us",
            f"ratio runner/bare = {section['ratio']:.2f} (goal >= {report['goal_ratio']}: "
            f"{'met' if section['ratio'] >= report['goal_ratio'] else 'MISSED'}); CPU-bound ratio "
            f"(bare CPU/turn / runner CPU/turn) = {section['cpu_ratio']:.2f}",
            f"per-turn overhead (turn wall time - engine round trip): p50 {runner['overhead_p50_us']:.0f}"
            f" us, p99 {runner['overhead_p99_us']:.0f} us; engine round trip p50"
            f" {runner['engine_p50_us']:.0f} us",
            f"prefill tokens per generated token: {section['prefill_per_generated_uncached']:.1f} without a "
            f"prefix cache, {section['prefill_per_generated_cached']:.2f} with one (group affinity)",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`rollwise bench actors`. Exit 0 on success; 1 if --require-goal and the goal is missed."""
    parser = argparse.ArgumentParser(prog="rollwise bench actors", description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=1000, help="concurrent episodes (E)")
    parser.add_argument("--turns", type=int, default=8, help="turns per episode (T)")
    parser.add_argument("--group-size", type=int, default=8, help="episodes per group (G)")
    parser.add_argument("--repeats", type=int, default=2, help="alternating rounds; best round per side")
    parser.add_argument("--connections", type=int, default=256, help="HTTP connections of each side")
    parser.add_argument("--model", default=None, help="HF dir whose tokenizer to use (default: tiny preset)")
    parser.add_argument("--actor-core", type=int, default=None, help="CPU for the measured side")
    parser.add_argument("--server-core", type=int, default=None, help="CPU for the instant server")
    parser.add_argument("--no-pin", action="store_true", help="do not pin processes to cores")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--require-goal", action="store_true", help="exit 1 when the ratio misses the goal")
    parser.add_argument(
        "--agent",
        action="store_true",
        help="native runner vs agent-function episodes through the OpenAI endpoint",
    )
    parser.add_argument(
        "--agent-workers",
        default="1,2",
        help="with --agent: also the SDK agent in this many agent worker processes (comma list; '' = none)",
    )
    args = parser.parse_args(argv)
    try:
        args.agent_workers = [int(n) for n in args.agent_workers.split(",") if n.strip()]
    except ValueError:
        parser.error(f"--agent-workers must be a comma list of integers, got {args.agent_workers!r}")
    if any(n < 1 for n in args.agent_workers):
        parser.error("--agent-workers counts must be >= 1")
    args.all_cpus = set(os.sched_getaffinity(0))
    if min(args.episodes, args.turns, args.group_size, args.repeats, args.connections) < 1:
        parser.error("--episodes, --turns, --group-size, --repeats and --connections must be >= 1")
    tokenizer = load_tokenizer(args.model)
    output_ids = [*tokenizer.encode(MODEL_TEXT, add_special_tokens=False), int(tokenizer.eos_token_id)]
    actor_core, server_core = _cores(args)
    measure = _measure_agent if args.agent else _measure
    with instant_server(output_ids, server_core) as url, pinned(actor_core):
        report = asyncio.run(measure(args, url, tokenizer))
    report |= {"actor_core": actor_core, "server_core": server_core}
    text = format_agent_report(report) if args.agent else format_report(report)
    print(json.dumps(report, indent=2) if args.json else text)
    return 1 if args.require_goal and not report["meets_goal"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
