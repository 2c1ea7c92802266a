"""The embedded SGLang-compatible engine over real HTTP on 127.0.0.1 (server started in-process, port 0).

Log-prob parity is checked against the learner's own recomputation: `learner.model.model_io.load_policy` (the
same `from_pretrained` path) and `learner.logprobs.sampled_token_logprobs` on a full forward of
prompt + output, fp32.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import random
import signal
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from learner.logprobs import sampled_token_logprobs
from learner.model.model_init import init_model
from learner.model.model_io import load_policy
from pipeline.contracts.core_lease import CoreLease
from pipeline.engine.batcher import ContinuousBatcher
from pipeline.engine.engine_metrics import EngineMetrics
from pipeline.engine.engine_request import EngineRequest
from pipeline.engine.kv_batch import GrowableLayer, growable_cache
from pipeline.engine.model_forward import architecture_mismatch
from pipeline.engine.model_loading import load_model
from pipeline.engine.prefill import prefill_buckets
from pipeline.engine.routes import build_app
from pipeline.engine.sampling import RequestSampling
from pipeline.engine.serve import RunningServer, serve, start_server
from pipeline.engine.serve_flags import ServerConfig
from pipeline.supervisor.engines.client import EngineClient
from pipeline.supervisor.engines.protocol import SamplingParams

META_KEYS = [
    "id",
    "finish_reason",
    "prompt_tokens",
    "weight_version",
    "completion_tokens",
    "cached_tokens",
    "input_token_logprobs",
    "output_token_logprobs",
    "output_token_weight_versions",
    "e2e_latency",
]
SGLANG_METRICS = [
    "sglang:num_running_reqs",
    "sglang:num_queue_reqs",
    "sglang:gen_throughput",
    "sglang:prompt_tokens",
    "sglang:generation_tokens",
    "sglang:num_requests",
    "sglang:num_aborted_requests",
    "sglang:e2e_request_latency_seconds",
    "sglang:time_to_first_token_seconds",
]


# ---- fixtures and helpers -------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two tiny-preset models with different weights (policy v0 and v1)."""
    root = tmp_path_factory.mktemp("embedded-engine-models")
    return init_model(root / "v0", seed=0), init_model(root / "v1", seed=1)


@pytest.fixture(scope="session")
def learner_models(model_dirs: tuple[Path, Path]) -> dict[str, Any]:
    """The learner's view of each weight version (train mode, fp32, CPU)."""
    return {"0": load_policy(model_dirs[0])[0], "1": load_policy(model_dirs[1])[0]}


@asynccontextmanager
async def engine(model_dir: Path, **overrides: Any) -> AsyncIterator[RunningServer]:
    # float32 unless a test asks otherwise: the parity checks compare with the learner's fp32 forward.
    settings: dict[str, Any] = {"dtype": "float32", **overrides}
    config = ServerConfig(model=str(model_dir), port=0, weight_version="0", seed=0, **settings)
    server = await start_server(config)
    try:
        yield server
    finally:
        await server.close()


@pytest.fixture
async def server(model_dirs: tuple[Path, Path]) -> AsyncIterator[RunningServer]:
    async with engine(model_dirs[0], enable_metrics=True) as s:
        yield s


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        yield session


async def get_load(http: aiohttp.ClientSession, server: RunningServer) -> dict[str, Any]:
    """The one DP rank's entry of /get_load."""
    async with http.get(server.url + "/get_load") as response:
        [entry] = await response.json()
    assert entry["dp_rank"] == 0
    return dict(entry)


async def post(http: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    async with http.post(url, json=body) as response:
        text = await response.text()
        return response.status, (json.loads(text) if text else None)


def gen_body(
    prompt: list[int] | list[list[int]], *, max_new_tokens: int = 8, temperature: float = 1.0, **sampling: Any
) -> dict[str, Any]:
    params = {"max_new_tokens": max_new_tokens, "temperature": temperature, "ignore_eos": True, **sampling}
    return {"input_ids": prompt, "sampling_params": params, "return_logprob": True}


def recompute_logprobs(model: Any, prompt: list[int], output: list[int], temperature: float) -> list[float]:
    """The learner's log-probs of `output` given `prompt`: one full forward, fp32."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0]
    start = len(prompt) - 1
    at_outputs = logits[start : start + len(output)].float()
    values = sampled_token_logprobs(at_outputs, torch.tensor(output), temperature=temperature)
    return [float(v) for v in values]


def assert_parity(engine_lps: list[float], learner_lps: list[float]) -> None:
    assert len(engine_lps) == len(learner_lps) > 0
    diffs = [abs(a - b) for a, b in zip(engine_lps, learner_lps, strict=True)]
    assert sum(diffs) / len(diffs) <= 1e-5, f"mean |Δlogp| = {sum(diffs) / len(diffs):.3g}"
    assert max(diffs) <= 1e-4, f"max |Δlogp| = {max(diffs):.3g}"


def logprobs_of(obj: dict[str, Any]) -> list[float]:
    return [entry[0] for entry in obj["meta_info"]["output_token_logprobs"]]


async def sse_events(response: aiohttp.ClientResponse) -> AsyncIterator[Any]:
    """Decoded `data:` payloads of an SSE response ("[DONE]" is yielded as the string)."""
    async for raw in response.content:
        line = raw.decode().strip()
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            yield payload if payload == "[DONE]" else json.loads(payload)


async def wait_until(predicate: Any, limit_s: float = 20.0) -> None:
    deadline = time.monotonic() + limit_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.005)


def tokens_so_far(server: RunningServer, rid: str) -> int:
    tracked = server.state.inflight.get(rid)
    return len(tracked.request.output_ids) if tracked else -1


# ---- response shape ---------------------------------------------------------------------------------


async def test_generate_response_shape_key_order_and_compact_json(
    server: RunningServer, http: aiohttp.ClientSession
) -> None:
    body = {**gen_body([3, 4, 5], max_new_tokens=6), "rid": "shape-1"}
    async with http.post(server.url + "/generate", json=body) as response:
        assert response.status == 200
        raw = await response.text()
    obj = json.loads(raw)
    assert list(obj) == ["text", "output_ids", "meta_info"]
    meta = obj["meta_info"]
    assert list(meta) == META_KEYS
    assert meta["id"] == "shape-1"
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["prompt_tokens"] == 3 and meta["completion_tokens"] == 6 == len(obj["output_ids"])
    assert meta["cached_tokens"] == 0 and meta["weight_version"] == "0"
    assert meta["output_token_weight_versions"] == ["0"] * 6
    assert isinstance(meta["e2e_latency"], float) and meta["e2e_latency"] > 0
    for (logprob, token, text), out_id in zip(meta["output_token_logprobs"], obj["output_ids"], strict=True):
        assert isinstance(logprob, float) and logprob < 0 and token == out_id and text is None
    assert isinstance(obj["text"], str)
    assert ": " not in raw[raw.index('"meta_info"') :] and ", " not in raw[raw.index('"meta_info"') :]


async def test_without_return_logprob_there_are_no_logprob_lists(
    server: RunningServer, http: aiohttp.ClientSession
) -> None:
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}
    status, obj = await post(http, server.url + "/generate", body)
    assert status == 200
    assert "output_token_logprobs" not in obj["meta_info"]
    assert obj["meta_info"]["output_token_weight_versions"] == ["0", "0"]


async def test_batch_input_returns_array_in_order_with_expanded_rids(
    server: RunningServer, http: aiohttp.ClientSession
) -> None:
    body = {
        "input_ids": [[5, 6, 7], [8], [9, 10]],
        "sampling_params": [{"max_new_tokens": n, "ignore_eos": True} for n in (2, 3, 4)],
        "rid": "batch",
        "return_logprob": True,
    }
    status, objs = await post(http, server.url + "/generate", body)
    assert status == 200 and isinstance(objs, list)
    assert [o["meta_info"]["id"] for o in objs] == ["batch_0", "batch_1", "batch_2"]
    assert [o["meta_info"]["prompt_tokens"] for o in objs] == [3, 1, 2]
    assert [len(o["output_ids"]) for o in objs] == [2, 3, 4]


async def test_stream_sends_cumulative_chunks_then_done(
    server: RunningServer, http: aiohttp.ClientSession
) -> None:
    body = {**gen_body([[1, 2, 3], [4, 5]], max_new_tokens=5), "stream": True}
    by_index: dict[int, list[dict[str, Any]]] = {0: [], 1: []}
    events: list[Any] = []
    async with http.post(server.url + "/generate", json=body) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/event-stream")
        async for event in sse_events(response):
            events.append(event)
            if event != "[DONE]":
                by_index[event["index"]].append(event)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    for chunks in by_index.values():
        assert chunks, "each batch item streams at least its final chunk"
        for before, after in itertools.pairwise(chunks):
            assert after["output_ids"][: len(before["output_ids"])] == before["output_ids"]
            assert len(after["output_ids"]) > len(before["output_ids"])
        for chunk in chunks[:-1]:
            assert chunk["meta_info"]["finish_reason"] is None and "e2e_latency" not in chunk["meta_info"]
            assert len(chunk["meta_info"]["output_token_logprobs"]) == len(chunk["output_ids"])
        final = chunks[-1]
        assert final["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
        assert len(final["output_ids"]) == 5 and "e2e_latency" in final["meta_info"]


async def test_text_prompt_is_tokenised_and_n_expands_prompt_major(
    server: RunningServer, http: aiohttp.ClientSession
) -> None:
    tokenizer = server.state.tokenizer
    body = {"text": "hello world", "sampling_params": {"max_new_tokens": 3, "n": 2, "ignore_eos": True}}
    status, objs = await post(http, server.url + "/generate", body)
    assert status == 200 and len(objs) == 2
    assert all(o["meta_info"]["prompt_tokens"] == len(tokenizer.encode("hello world")) for o in objs)
    assert objs[0]["meta_info"]["id"] != objs[1]["meta_info"]["id"]


# ---- log-prob parity --------------------------------------------------------------------------------


async def test_logprob_parity_alone(
    server: RunningServer, http: aiohttp.ClientSession, learner_models: dict[str, Any]
) -> None:
    for temperature in (1.0, 0.7, 0.0):
        prompt = [11, 12, 13, 14, 15]
        status, obj = await post(
            http, server.url + "/generate", gen_body(prompt, max_new_tokens=12, temperature=temperature)
        )
        assert status == 200
        reference = recompute_logprobs(learner_models["0"], prompt, obj["output_ids"], temperature or 1.0)
        assert_parity(logprobs_of(obj), reference)


async def test_logprob_parity_in_a_batch_of_different_lengths_joining_mid_decode(
    server: RunningServer, http: aiohttp.ClientSession, learner_models: dict[str, Any]
) -> None:
    """Padding must not leak: rows prefilled together with different prompt lengths, and rows merged
    into a batch that is already decoding (different KV lengths), all match a solo full forward."""
    url = server.url + "/generate"
    long_body = {**gen_body(list(range(40, 70)), max_new_tokens=150, temperature=0.9), "rid": "long"}
    long_task = asyncio.create_task(post(http, url, long_body))
    await wait_until(lambda: tokens_so_far(server, "long") >= 5)
    prompts = [[1], [2, 3, 4, 5, 6, 7, 8], list(range(100, 117)), [9, 9]]
    together = {
        "input_ids": prompts,
        "sampling_params": {"max_new_tokens": 10, "temperature": 0.8, "ignore_eos": True},
        "return_logprob": True,
    }
    late = gen_body(list(range(200, 212)), max_new_tokens=10, temperature=1.3)
    (status, batch_objs), (late_status, late_obj) = await asyncio.gather(
        post(http, url, together), post(http, url, late)
    )
    long_status, long_obj = await long_task
    assert status == late_status == long_status == 200
    assert server.state.require_scheduler().peak_batch >= 5
    cases = [(p, o, 0.8) for p, o in zip(prompts, batch_objs, strict=True)]
    cases += [(late["input_ids"], late_obj, 1.3), (long_body["input_ids"], long_obj, 0.9)]
    for prompt, obj, temperature in cases:
        reference = recompute_logprobs(learner_models["0"], prompt, obj["output_ids"], temperature)
        assert_parity(logprobs_of(obj), reference)


async def test_far_apart_prompt_lengths_are_prefilled_in_separate_forwards_with_unchanged_numbers(
    server: RunningServer, http: aiohttp.ClientSession, learner_models: dict[str, Any]
) -> None:
    scheduler = server.state.require_scheduler()
    real_model = scheduler.model
    widths: list[tuple[int, int]] = []

    class RecordingModel:
        config = real_model.config

        def __call__(self, **kwargs: Any) -> Any:
            widths.append(tuple(kwargs["input_ids"].shape))
            return real_model(**kwargs)

    scheduler.model = RecordingModel()
    prompts = [[3, 4], list(range(10, 190)), [5, 6, 7], list(range(20, 200))]
    body = {
        "input_ids": prompts,
        "sampling_params": {"max_new_tokens": 3, "temperature": 0.9, "ignore_eos": True},
        "return_logprob": True,
    }
    try:
        status, objs = await post(http, server.url + "/generate", body)
    finally:
        scheduler.model = real_model
    assert status == 200
    # 4 rows x 180 in one forward would cost 720 token slots; 2 x 3 + 2 x 180 + one more call is less.
    assert sorted(w for w in widths if w[1] > 1) == [(2, 3), (2, 180)]
    for prompt, obj in zip(prompts, objs, strict=True):
        reference = recompute_logprobs(learner_models["0"], prompt, obj["output_ids"], 0.9)
        assert_parity(logprobs_of(obj), reference)


def _brute_force_cost(lengths: list[int], cost: int) -> int:
    distinct = sorted(set(lengths))
    rows = {n: lengths.count(n) for n in distinct}
    best = None
    for cuts in itertools.product([False, True], repeat=len(distinct) - 1):
        total, group = 0, [distinct[0]]
        for n, cut in zip(distinct[1:], cuts, strict=True):
            if cut:
                total += sum(rows[m] for m in group) * group[-1] + cost
                group = []
            group.append(n)
        total += sum(rows[m] for m in group) * group[-1] + cost
        best = total if best is None else min(best, total)
    assert best is not None
    return best


def test_prefill_buckets_split_multi_turn_lengths_and_are_optimal() -> None:
    turns = [19, 31, 43, 55, 67] * 12 + [19, 31, 43, 55]
    groups = prefill_buckets(turns, 128)
    assert [sorted({turns[i] for i in g}) for g in groups] == [[19], [31], [43], [55], [67]]
    assert sorted(i for g in groups for i in g) == list(range(len(turns)))
    assert prefill_buckets([19, 20, 21, 22], 128) == [[0, 1, 2, 3]], "a few tokens of padding: one call"
    assert prefill_buckets([300, 5, 5, 5], 128) == [[1, 2, 3], [0]]
    assert prefill_buckets([], 128) == []
    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.randint(1, 120) for _ in range(rng.randint(1, 9))]
        groups = prefill_buckets(lengths, 40)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        cost = sum(len(g) * max(lengths[i] for i in g) + 40 for g in groups)
        assert cost == _brute_force_cost(lengths, 40), lengths


# ---- seeds, stops, lengths ----------------------------------------------------------------------------


async def test_same_seed_gives_same_output_regardless_of_batch_composition(
    server: RunningServer, http: aiohttp.ClientSession
) -> None:
    url = server.url + "/generate"
    target = gen_body([7, 8, 9], max_new_tokens=16, temperature=1.0, sampling_seed=1234)
    _, alone = await post(http, url, target)
    others = [gen_body([i] * (i % 5 + 1), max_new_tokens=16 + i, sampling_seed=i) for i in range(6)]
    results = await asyncio.gather(*(post(http, url, b) for b in [*others[:3], target, *others[3:]]))
    together = results[3][1]
    assert together["output_ids"] == alone["output_ids"]
    assert logprobs_of(together) == pytest.approx(logprobs_of(alone), abs=1e-5)
    _, other_seed = await post(
        http, url, gen_body([7, 8, 9], max_new_tokens=16, temperature=1.0, sampling_seed=99)
    )
    assert other_seed["output_ids"] != alone["output_ids"]


async def test_stop_token_ids_finish_with_matched_id(
    server: RunningServer, http: aiohttp.ClientSession
) -> None:
    url = server.url + "/generate"
    _, free = await post(http, url, gen_body([21, 22, 23], max_new_tokens=10, temperature=0.0))
    stop_id = free["output_ids"][4]
    first = free["output_ids"].index(stop_id)
    status, stopped = await post(
        http, url, gen_body([21, 22, 23], max_new_tokens=10, temperature=0.0, stop_token_ids=[stop_id])
    )
    assert status == 200
    assert stopped["output_ids"] == free["output_ids"][: first + 1]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert len(stopped["meta_info"]["output_token_logprobs"]) == first + 1


async def test_stop_strings_finish_with_the_matched_string_and_every_sampled_token(
    server: RunningServer, http: aiohttp.ClientSession
) -> None:
    url = server.url + "/generate"
    tokenizer = server.state.tokenizer
    body = gen_body([21, 22, 23], max_new_tokens=24, sampling_seed=7, skip_special_tokens=False)
    _, free = await post(http, url, body)
    ids = free["output_ids"]
    texts = [tokenizer.decode(ids[: k + 1]) for k in range(len(ids))]
    # A stop string: the text of a token, from the 4th on, that the output has not written before it.
    pieces = [tokenizer.decode([t]) for t in ids]
    stop = next(p for k, p in enumerate(pieces) if k >= 3 and p.strip() and p not in texts[k - 1])
    first = next(k for k, t in enumerate(texts) if stop in t)
    status, stopped = await post(
        http, url, {**body, "sampling_params": {**body["sampling_params"], "stop": stop}}
    )
    assert status == 200
    assert stopped["output_ids"] == ids[: first + 1]  # untrimmed: the tokens that wrote the string too
    assert logprobs_of(stopped) == pytest.approx(logprobs_of(free)[: first + 1], abs=1e-6)
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stopped["text"] == texts[first][: texts[first].find(stop)]
    kept = {**body["sampling_params"], "stop": [stop], "no_stop_trim": True}
    _, untrimmed = await post(http, url, {**body, "sampling_params": kept})
    assert untrimmed["output_ids"] == ids[: first + 1] and untrimmed["text"] == texts[first]


async def test_max_new_tokens_zero_and_length_finish(
    server: RunningServer, http: aiohttp.ClientSession
) -> None:
    status, obj = await post(http, server.url + "/generate", gen_body([1, 2], max_new_tokens=0))
    assert status == 200
    assert obj["output_ids"] == [] and obj["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    _, obj = await post(http, server.url + "/generate", gen_body([1, 2], max_new_tokens=3))
    assert obj["meta_info"]["finish_reason"] == {"type": "length", "length": 3}


async def test_context_length_limits_prompt_and_generation(
    model_dirs: tuple[Path, Path], http: aiohttp.ClientSession
) -> None:
    async with engine(model_dirs[0], context_length=24) as server:
        url = server.url + "/generate"
        status, obj = await post(http, url, gen_body(list(range(1, 25)), max_new_tokens=4))
        assert status == 400 and "context length" in obj["error"]["message"]
        status, obj = await post(http, url, gen_body(list(range(1, 21)), max_new_tokens=24))
        assert status == 200
        assert len(obj["output_ids"]) == 4
        assert obj["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
        # max_new_tokens beyond the cap (default: the context length) is refused outright
        status, obj = await post(http, url, gen_body([1, 2], max_new_tokens=25))
        assert status == 400 and "exceeds this engine's cap of 24" in obj["error"]["message"]


async def test_scheduler_stops_on_eos_unless_ignore_eos(model_dirs: tuple[Path, Path]) -> None:
    model = load_model(str(model_dirs[0]), "cpu", "float32")
    probe = ContinuousBatcher(
        model, weight_version="0", eos_token_ids=frozenset(), context_length=512, metrics=EngineMetrics("t")
    )
    finished: list[EngineRequest] = []
    done = threading.Event()

    def notify(request: EngineRequest, is_finished: bool) -> None:
        if is_finished:
            finished.append(request)
            done.set()

    def run(scheduler: ContinuousBatcher, sampling: RequestSampling) -> EngineRequest:
        done.clear()
        scheduler.submit([EngineRequest(rid="r", prompt_ids=[5, 6], sampling=sampling, notify=notify)])
        assert done.wait(30)
        return finished[-1]

    greedy = RequestSampling(max_new_tokens=6, temperature=0.0)
    probe.start()
    first_token = run(probe, greedy).output_ids[0]
    probe.stop()
    eos = ContinuousBatcher(
        model,
        weight_version="0",
        eos_token_ids=frozenset({first_token}),
        context_length=512,
        metrics=EngineMetrics("t"),
    )
    eos.start()
    try:
        stopped = run(eos, greedy)
        assert stopped.output_ids == [first_token]
        assert stopped.finish_reason == {"type": "stop", "matched": first_token}
        ignoring = run(eos, RequestSampling(max_new_tokens=6, temperature=0.0, ignore_eos=True))
        assert len(ignoring.output_ids) == 6 and ignoring.finish_reason == {"type": "length", "length": 6}
    finally:
        eos.stop()


async def test_a_request_is_announced_finished_only_after_the_gauges_drop_it(
    model_dirs: tuple[Path, Path],
) -> None:
    # A client that reads /metrics right after its response must not see its request still running
    # (CI once read num_running_reqs == 3 after all three responses had arrived).
    model = load_model(str(model_dirs[0]), "cpu", "float32")
    metrics = EngineMetrics("t")
    scheduler = ContinuousBatcher(
        model, weight_version="0", eos_token_ids=frozenset(), context_length=512, metrics=metrics
    )
    seen: list[tuple[float, float]] = []
    done = threading.Event()

    def notify(request: EngineRequest, is_finished: bool) -> None:
        if is_finished:
            seen.append((metrics.num_running_reqs._value.get(), metrics.num_queue_reqs._value.get()))
            if len(seen) == 3:
                done.set()

    # Three requests of different lengths: the first two finish while others still run.
    requests = [
        EngineRequest(
            rid=f"r{n}",
            prompt_ids=[5, 6],
            sampling=RequestSampling(max_new_tokens=n, temperature=0.0, ignore_eos=True),
            notify=notify,
        )
        for n in (2, 4, 6)
    ]
    scheduler.start()
    try:
        scheduler.submit(requests)
        assert done.wait(30)
    finally:
        scheduler.stop()
    assert seen == [(2.0, 0.0), (1.0, 0.0), (0.0, 0.0)]


# ---- bad requests ------------------------------------------------------------------------------------


async def test_each_bad_request_is_400_and_the_server_keeps_serving(
    model_dirs: tuple[Path, Path], http: aiohttp.ClientSession
) -> None:
    async with engine(model_dirs[0], context_length=64) as server:
        vocab = server.state.require_scheduler().vocab_size
        url = server.url + "/generate"
        good = gen_body([1, 2, 3], max_new_tokens=2)
        bad_bodies: list[tuple[str, Any]] = [
            ("malformed json", b'{"input_ids": [1, 2'),
            ("not an object", [1, 2, 3]),
            ("empty input_ids", {"input_ids": []}),
            ("no prompt", {"sampling_params": {}}),
            ("both prompts", {"input_ids": [1], "text": "hi"}),
            ("negative id", {"input_ids": [1, -1]}),
            ("id beyond vocab", {"input_ids": [1, vocab]}),
            ("float id", {"input_ids": [1.5]}),
            ("string input_ids", {"input_ids": "abc"}),
            ("empty batch item", {"input_ids": [[1, 2], []]}),
            ("prompt at context length", {"input_ids": [1] * 64}),
            ("top_p zero", gen_body([1], top_p=0)),
            ("top_p above one", gen_body([1], top_p=1.5)),
            ("top_k zero", gen_body([1], top_k=0)),
            ("negative temperature", gen_body([1], temperature=-1.0)),
            ("negative max_new_tokens", gen_body([1], max_new_tokens=-1)),
            ("unknown sampling key", gen_body([1], temprature=0.5)),
            ("stop strings that are not strings", gen_body([1], stop=[1])),
            ("rid list length", {"input_ids": [[1], [2]], "rid": ["a"]}),
            ("duplicate rids in batch", {"input_ids": [[1], [2]], "rid": ["a", "a"]}),
            ("sampling_params list length", {"input_ids": [[1], [2]], "sampling_params": [{}]}),
            ("top_logprobs", {"input_ids": [1], "top_logprobs_num": 3}),
            ("string priority", {"input_ids": [1], "priority": "high"}),
        ]
        for what, body in bad_bodies:
            kwargs = {"data": body} if isinstance(body, bytes) else {"json": body}
            async with http.post(url, **kwargs) as response:
                assert response.status == 400, what
                payload = await response.json()
                assert isinstance(payload["error"]["message"], str) and payload["error"]["message"], what
            status, _ = await post(http, url, good)
            assert status == 200, f"server stopped serving after: {what}"


async def test_duplicate_rid_in_flight_is_400(server: RunningServer, http: aiohttp.ClientSession) -> None:
    url = server.url + "/generate"
    body = {**gen_body([1, 2], max_new_tokens=900), "rid": "dup", "stream": True}
    async with http.post(url, json=body) as response:
        events = sse_events(response)
        await events.__anext__()
        status, obj = await post(http, url, {**gen_body([3], max_new_tokens=2), "rid": "dup"})
        assert status == 400 and "dup" in obj["error"]["message"]
        async with http.post(server.url + "/abort_request", json={"rid": "dup"}) as abort:
            assert abort.status == 200 and await abort.read() == b""
        last = [e async for e in events][-2]
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    status, _ = await post(http, url, {**gen_body([3], max_new_tokens=2), "rid": "dup"})
    assert status == 200  # the rid is free again once the first request finished


# ---- abort and pause -----------------------------------------------------------------------------------


async def test_abort_all_returns_partial_outputs(server: RunningServer, http: aiohttp.ClientSession) -> None:
    url = server.url + "/generate"
    tasks = [
        asyncio.create_task(post(http, url, {**gen_body([i + 1], max_new_tokens=800), "rid": f"a{i}"}))
        for i in range(3)
    ]
    await wait_until(lambda: all(tokens_so_far(server, f"a{i}") >= 2 for i in range(3)))
    status, _ = await post(http, server.url + "/abort_request", {"abort_all": True})
    assert status == 200
    for status, obj in await asyncio.gather(*tasks):
        assert status == 200
        reason = obj["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and set(reason) == {"type", "message", "status_code", "err_type"}
        assert 2 <= len(obj["output_ids"]) < 800
        assert len(obj["meta_info"]["output_token_logprobs"]) == len(obj["output_ids"])


async def test_client_disconnect_aborts_the_request(
    server: RunningServer, http: aiohttp.ClientSession
) -> None:
    url = server.url + "/generate"
    task = asyncio.create_task(post(http, url, {**gen_body([1], max_new_tokens=1000), "rid": "gone"}))
    await wait_until(lambda: tokens_so_far(server, "gone") >= 2)
    plain = server.state.inflight["gone"].request
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    async with http.post(
        url, json={**gen_body([2], max_new_tokens=1000), "rid": "gone-sse", "stream": True}
    ) as r:
        await sse_events(r).__anext__()
        streamed = server.state.inflight["gone-sse"].request
    await wait_until(lambda: plain.finished and streamed.finished, limit_s=10)
    for request in (plain, streamed):
        assert request.finish_reason is not None and request.finish_reason["type"] == "abort"
        assert len(request.output_ids) < 1000


async def test_pause_abort_aborts_in_flight_and_holds_new_requests(
    server: RunningServer, http: aiohttp.ClientSession
) -> None:
    url = server.url + "/generate"
    running = asyncio.create_task(post(http, url, {**gen_body([4, 5], max_new_tokens=800), "rid": "p1"}))
    await wait_until(lambda: tokens_so_far(server, "p1") >= 2)
    status, reply = await post(http, server.url + "/pause_generation", {"mode": "abort"})
    assert status == 200 and reply == {"message": "Generation paused successfully.", "status": "ok"}
    status, obj = await running
    assert obj["meta_info"]["finish_reason"]["type"] == "abort" and 0 < len(obj["output_ids"]) < 800
    held = asyncio.create_task(post(http, url, gen_body([6], max_new_tokens=3)))
    await asyncio.sleep(0.3)
    assert not held.done(), "a request sent while paused must wait for continue_generation"
    status, reply = await post(http, server.url + "/continue_generation", {})
    assert status == 200 and reply == {"message": "Generation continued successfully.", "status": "ok"}
    status, obj = await held
    assert status == 200 and len(obj["output_ids"]) == 3


async def test_pause_in_place_then_update_stamps_old_and_new_versions(
    server: RunningServer, http: aiohttp.ClientSession, model_dirs: tuple[Path, Path]
) -> None:
    url = server.url + "/generate"
    task = asyncio.create_task(post(http, url, {**gen_body([8, 9], max_new_tokens=300), "rid": "ip"}))
    await wait_until(lambda: tokens_so_far(server, "ip") >= 3)
    status, _ = await post(http, server.url + "/pause_generation", {"mode": "in_place"})
    assert status == 200
    frozen = tokens_so_far(server, "ip")
    await asyncio.sleep(0.2)
    assert tokens_so_far(server, "ip") == frozen, "an in-place paused request must not advance"
    async with http.post(server.url + "/flush_cache") as flush:
        assert flush.status == 400 and flush.content_type == "text/plain"
    update = {"model_path": str(model_dirs[1]), "weight_version": "1"}
    status, reply = await post(http, server.url + "/update_weights_from_disk", update)
    assert status == 200 and reply["success"] is True and reply["num_paused_requests"] == 1
    status, _ = await post(http, server.url + "/continue_generation", {})
    status, obj = await task
    versions = obj["meta_info"]["output_token_weight_versions"]
    assert len(versions) == len(obj["output_ids"]) == 300
    assert versions == ["0"] * frozen + ["1"] * (300 - frozen)
    assert obj["meta_info"]["weight_version"] == "1"


async def test_a_held_core_lease_freezes_decoding_and_its_release_resumes_it(
    http: aiohttp.ClientSession, model_dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    lease = CoreLease.create(tmp_path / "cores.lease")
    async with engine(model_dirs[0], yield_to=str(lease.path), enable_metrics=True) as server:
        url = server.url + "/generate"
        task = asyncio.create_task(post(http, url, {**gen_body([8, 9], max_new_tokens=300), "rid": "cl"}))
        await wait_until(lambda: tokens_so_far(server, "cl") >= 3)
        lease.hold()  # the learner starts a step
        await asyncio.sleep(0.05)  # the decode step in progress ends
        frozen = tokens_so_far(server, "cl")
        await asyncio.sleep(0.3)
        assert tokens_so_far(server, "cl") == frozen, "a held lease must stop decoding"
        load = await get_load(http, server)  # the HTTP side still answers
        assert load["num_reqs"] == 1
        lease.release()
        status, obj = await task
        assert status == 200 and len(obj["output_ids"]) == 300
        async with http.get(server.url + "/metrics") as response:
            text = await response.text()
        [yielded] = [
            line for line in text.splitlines() if line.startswith("rollwise_engine_yielded_seconds_total")
        ]
        assert float(yielded.rsplit(" ", 1)[1]) >= 0.3
    lease.close()


async def test_pause_retract_recomputes_kv_with_new_weights(
    server: RunningServer,
    http: aiohttp.ClientSession,
    model_dirs: tuple[Path, Path],
    learner_models: dict[str, Any],
) -> None:
    url = server.url + "/generate"
    prompt = [30, 31, 32, 33]
    body = {**gen_body(prompt, max_new_tokens=200, temperature=0.9, sampling_seed=5), "rid": "rt"}
    task = asyncio.create_task(post(http, url, body))
    await wait_until(lambda: tokens_so_far(server, "rt") >= 3)
    running = await get_load(http, server)  # running: its prompt and its tokens so far are in the KV
    assert (running["num_reqs"], running["num_waiting_reqs"]) == (1, 0) and running["num_tokens"] >= 4 + 3
    status, _ = await post(http, server.url + "/pause_generation", {"mode": "retract"})
    assert status == 200
    async with http.get(server.url + "/get_server_info") as response:
        internal = (await response.json())["internal_states"][0]
    assert internal["num_running_reqs"] == 0 and internal["num_queue_reqs"] == 1
    retracted = await get_load(http, server)  # SGLang's /get_load: num_reqs counts the queue too
    assert (retracted["num_reqs"], retracted["num_waiting_reqs"], retracted["num_tokens"]) == (1, 1, 0)
    update = {"model_path": str(model_dirs[1]), "weight_version": "1"}
    status, _ = await post(http, server.url + "/update_weights_from_disk", update)
    assert status == 200
    await post(http, server.url + "/continue_generation", {})
    status, obj = await task
    output, lps = obj["output_ids"], logprobs_of(obj)
    versions = obj["meta_info"]["output_token_weight_versions"]
    split = versions.index("1")
    assert split >= 3 and versions == ["0"] * split + ["1"] * (200 - split)
    # Before the retraction the tokens came from v0; after it, from v1 on a KV recomputed with v1.
    old = recompute_logprobs(learner_models["0"], prompt, output, 0.9)[:split]
    new = recompute_logprobs(learner_models["1"], prompt, output, 0.9)[split:]
    assert_parity(lps[:split], old)
    assert_parity(lps[split:], new)


# ---- weight updates --------------------------------------------------------------------------------------


async def test_update_weights_changes_outputs_and_version(
    server: RunningServer,
    http: aiohttp.ClientSession,
    model_dirs: tuple[Path, Path],
    learner_models: dict[str, Any],
) -> None:
    url = server.url + "/generate"
    prompt = [50, 51, 52]
    seeded = gen_body(prompt, max_new_tokens=12, temperature=1.0, sampling_seed=3)
    _, before = await post(http, url, seeded)
    update = {"model_path": str(model_dirs[1]), "weight_version": "1", "abort_all_requests": False}
    status, reply = await post(http, server.url + "/update_weights_from_disk", update)
    assert status == 200
    assert reply == {"success": True, "message": reply["message"], "num_paused_requests": 0}
    assert list(reply) == ["success", "message", "num_paused_requests"]
    _, after = await post(http, url, seeded)
    assert after["output_ids"] != before["output_ids"]
    assert after["meta_info"]["weight_version"] == "1"
    assert after["meta_info"]["output_token_weight_versions"] == ["1"] * 12
    assert_parity(
        logprobs_of(after), recompute_logprobs(learner_models["1"], prompt, after["output_ids"], 1.0)
    )
    async with http.get(server.url + "/get_model_info") as response:
        info = await response.json()
    assert info["weight_version"] == "1" and info["model_path"] == str(model_dirs[1])

    status, reply = await post(
        http, server.url + "/update_weights_from_disk", {"model_path": "/no/such/dir", "weight_version": "2"}
    )
    assert status == 400 and reply["success"] is False and "/no/such/dir" in reply["message"]
    _, again = await post(http, url, seeded)
    assert again["meta_info"]["weight_version"] == "1" and again["output_ids"] == after["output_ids"]


def test_growable_layer_matches_concatenation_across_regrowth() -> None:
    torch.manual_seed(0)
    keys, values = torch.randn(2, 1, 3, 4), torch.randn(2, 1, 3, 4)
    layer = GrowableLayer(keys, values)
    ref_keys, ref_values = keys, values
    for _ in range(150):  # initial capacity is 3 + 64: crosses it and one regrowth
        new_keys, new_values = torch.randn(2, 1, 1, 4), torch.randn(2, 1, 1, 4)
        out_keys, out_values = layer.update(new_keys, new_values)
        ref_keys, ref_values = torch.cat([ref_keys, new_keys], 2), torch.cat([ref_values, new_values], 2)
        assert torch.equal(out_keys, ref_keys) and torch.equal(out_values, ref_values)
    assert layer.get_seq_length() == 153
    cache = growable_cache([(keys, values)])
    assert cache.get_seq_length() == 3


def test_architecture_mismatch_names_the_field() -> None:
    class Config:
        def __init__(self, layers: int) -> None:
            self.num_hidden_layers = layers
            self.num_key_value_heads = 2
            self.head_dim = 8
            self.hidden_size = 16
            self.vocab_size = 100

    assert architecture_mismatch(Config(2), Config(2)) is None
    message = architecture_mismatch(Config(2), Config(3))
    assert message is not None and "num_hidden_layers" in message


# ---- control, health, info, metrics ------------------------------------------------------------------------


async def test_health_info_and_flush(server: RunningServer, http: aiohttp.ClientSession) -> None:
    for path in ("/health", "/health_generate"):
        async with http.get(server.url + path) as response:
            assert response.status == 200 and await response.read() == b""
    for path in ("/get_model_info", "/model_info"):
        async with http.get(server.url + path) as response:
            info = await response.json()
        assert list(info)[:5] == [
            "model_path",
            "tokenizer_path",
            "is_generation",
            "preferred_sampling_params",
            "weight_version",
        ]
        assert info["is_generation"] is True and info["preferred_sampling_params"] is None
        assert info["weight_version"] == "0"
    async with http.get(server.url + "/get_server_info") as response:
        info = await response.json()
    assert info["max_running_requests"] == 64 and info["internal_states"][0]["num_running_reqs"] == 0
    idle = await get_load(http, server)
    assert (idle["num_reqs"], idle["num_waiting_reqs"], idle["num_tokens"]) == (0, 0, 0)
    for method in ("GET", "POST"):
        async with http.request(method, server.url + "/flush_cache") as response:
            assert response.status == 200 and response.content_type == "text/plain"
            assert (await response.text()).startswith("Cache flushed.")
    status, reply = await post(http, server.url + "/pause_generation", {"mode": "sideways"})
    assert status == 400 and "mode" in reply["error"]["message"]


@pytest.mark.parametrize(
    ("cpu", "served"),
    [
        (("bfloat16", "auto: CPU flags avx512_bf16"), torch.bfloat16),
        (("float32", "auto: none"), torch.float32),
    ],
)
async def test_auto_dtype_follows_the_cpu_and_server_info_says_why(
    model_dirs: tuple[Path, Path],
    http: aiohttp.ClientSession,
    monkeypatch: pytest.MonkeyPatch,
    cpu: tuple[str, str],
    served: torch.dtype,
) -> None:
    import pipeline.engine.model_loading as model_loading

    monkeypatch.setattr(model_loading, "auto_cpu_dtype", lambda: cpu)
    async with engine(model_dirs[0], dtype="auto") as server:
        async with http.get(server.url + "/server_info") as response:
            info = await response.json()
        assert (info["dtype"], info["dtype_reason"]) == cpu
        assert info["threads"] == torch.get_num_threads()
        assert next(server.state.require_scheduler().model.parameters()).dtype == served
        status, obj = await post(http, server.url + "/generate", gen_body([1, 2, 3], max_new_tokens=4))
        assert status == 200 and len(obj["output_ids"]) == 4
    assert model_loading.resolve_dtype("float16", "cpu") == ("float16", "--dtype given")
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        model_loading.resolve_dtype("fp8", "cpu")


def test_engine_flags_default_to_auto_dtype_all_cores_and_a_prefix_cache(tmp_path: Path) -> None:
    from pipeline.contracts.config import load_config
    from pipeline.engine.serve_flags import parse_args
    from pipeline.supervisor.fleet.engine_launch import engine_argv, engine_child_spec, plan_engines

    config = parse_args(["--model", "m"])
    assert (config.dtype, config.threads, config.prefix_cache_mb) == ("auto", None, 1024.0)
    assert parse_args(["--model", "m", "--disable-radix-cache"]).prefix_cache_mb == 0.0
    assert parse_args(["--model", "m", "--prefix-cache-mb", "64", "--threads", "3"]).prefix_cache_mb == 64.0
    # A config without engine.threads or engine.dtype passes neither and the engine picks (`rollwise run`
    # chooses the threads first: pipeline.supervisor.fleet.core_split).
    cfg = load_config(None, ["engine.port=0"])
    slot = plan_engines(cfg)[0]
    argv = engine_argv(cfg, slot, model_dir=tmp_path, version=0)
    assert "--threads" not in argv and "--dtype" not in argv
    spec = engine_child_spec(cfg, slot, model_dir=tmp_path, version=0, log_dir=tmp_path)
    assert int(spec.env["OMP_NUM_THREADS"]) >= 1


async def test_a_failing_model_step_aborts_its_requests_and_the_engine_survives(
    server: RunningServer, http: aiohttp.ClientSession
) -> None:
    scheduler = server.state.require_scheduler()
    real_model = scheduler.model

    class BrokenModel:
        config = real_model.config

        def __call__(self, **kwargs: Any) -> Any:
            raise RuntimeError("boom")

    scheduler.model = BrokenModel()
    status, obj = await post(http, server.url + "/generate", gen_body([1, 2], max_new_tokens=3))
    assert status == 200
    reason = obj["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "boom" in reason["message"] and obj["output_ids"] == []
    scheduler.model = real_model
    status, obj = await post(http, server.url + "/generate", gen_body([1, 2], max_new_tokens=3))
    assert status == 200 and len(obj["output_ids"]) == 3
    await asyncio.to_thread(scheduler.stop)
    async with http.get(server.url + "/health") as response:
        assert response.status == 503, "a dead worker thread must fail the health check"


async def test_a_failing_scoring_prefill_also_aborts_the_requests_admitted_with_it(
    server: RunningServer, http: aiohttp.ClientSession
) -> None:
    """One admission round holds a scoring request (max_new_tokens = 0 with prompt log-probs) and a
    generating one; when the scoring forward fails, both are answered (aborted), none is left waiting."""
    scheduler = server.state.require_scheduler()
    real_model = scheduler.model

    class BrokenModel:
        config = real_model.config

        def __call__(self, **kwargs: Any) -> Any:
            raise RuntimeError("boom")

    status, _ = await post(http, server.url + "/pause_generation", {"mode": "abort"})
    assert status == 200
    url = server.url + "/generate"
    scoring = {**gen_body([1, 2, 3], max_new_tokens=0), "logprob_start_len": 0}
    held = [
        asyncio.create_task(post(http, url, scoring)),
        asyncio.create_task(post(http, url, gen_body([4, 5], max_new_tokens=3))),
    ]
    await wait_until(lambda: server.state.require_scheduler().num_waiting() == 2)
    scheduler.model = BrokenModel()
    try:
        await post(http, server.url + "/continue_generation", {})
        replies = await asyncio.wait_for(asyncio.gather(*held), timeout=20)
    finally:
        scheduler.model = real_model
    for status, obj in replies:
        reason = obj["meta_info"]["finish_reason"]
        assert status == 200 and reason["type"] == "abort" and "boom" in reason["message"]


async def test_health_is_503_until_the_model_is_loaded(model_dirs: tuple[Path, Path]) -> None:
    app = build_app(ServerConfig(model=str(model_dirs[0]), port=0))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{port}/health") as response:
                assert response.status == 503
            async with http.post(f"http://127.0.0.1:{port}/generate", json={"input_ids": [1]}) as response:
                assert response.status == 503
    finally:
        await runner.cleanup()


async def test_metrics_use_sglang_names_and_count_exactly(
    server: RunningServer, http: aiohttp.ClientSession
) -> None:
    prompts = [[1, 2, 3], [4, 5], [6]]
    results = await asyncio.gather(
        *(post(http, server.url + "/generate", gen_body(p, max_new_tokens=4)) for p in prompts)
    )
    assert all(status == 200 for status, _ in results)
    async with http.get(server.url + "/metrics") as response:
        assert response.status == 200
        text = await response.text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in SGLANG_METRICS:
        assert name in families, name
        assert all(
            s.labels.get("model_name") == str(server.state.config.model) for s in families[name].samples
        )

    def value(family: str, sample: str) -> float:
        return next(s.value for s in families[family].samples if s.name == sample)

    # The warmup request (prompt [0], 2 tokens) is counted too.
    assert value("sglang:prompt_tokens", "sglang:prompt_tokens_total") == 1 + 6
    assert value("sglang:generation_tokens", "sglang:generation_tokens_total") == 2 + 12
    assert value("sglang:num_requests", "sglang:num_requests_total") == 1 + 3
    assert value("sglang:num_aborted_requests", "sglang:num_aborted_requests_total") == 0
    e2e = "sglang:e2e_request_latency_seconds"
    assert value(e2e, e2e + "_count") == 4
    assert value("sglang:num_running_reqs", "sglang:num_running_reqs") == 0
    assert value("rollwise_engine_weight_version", "rollwise_engine_weight_version") == 0


async def test_metrics_route_is_absent_without_the_flag(
    model_dirs: tuple[Path, Path], http: aiohttp.ClientSession
) -> None:
    async with engine(model_dirs[0]) as server, http.get(server.url + "/metrics") as response:
        assert response.status == 404


# ---- concurrency and the real client -----------------------------------------------------------------------


async def test_32_concurrent_requests_complete_correctly(
    server: RunningServer, http: aiohttp.ClientSession, learner_models: dict[str, Any]
) -> None:
    url = server.url + "/generate"
    bodies = [
        {**gen_body(list(range(1, 2 + i % 9)), max_new_tokens=8 + i % 5, sampling_seed=i), "rid": f"c{i}"}
        for i in range(32)
    ]
    results = await asyncio.gather(*(post(http, url, b) for b in bodies))
    assert server.state.require_scheduler().peak_batch >= 8
    for body, (status, obj) in zip(bodies, results, strict=True):
        assert status == 200
        expected = body["sampling_params"]["max_new_tokens"]
        assert obj["meta_info"]["id"] == body["rid"] and len(obj["output_ids"]) == expected
        assert obj["meta_info"]["finish_reason"] == {"type": "length", "length": expected}
        reference = recompute_logprobs(learner_models["0"], body["input_ids"], obj["output_ids"], 1.0)
        assert_parity(logprobs_of(obj), reference)
    for i in (0, 17):  # same seed alone -> same tokens as inside the 32-way batch
        _, alone = await post(http, url, {**bodies[i], "rid": f"alone{i}"})
        assert alone["output_ids"] == results[i][1]["output_ids"]


async def test_max_batch_and_prefill_budget_queue_the_rest(
    model_dirs: tuple[Path, Path], http: aiohttp.ClientSession, learner_models: dict[str, Any]
) -> None:
    async with engine(model_dirs[0], max_batch=2, max_prefill_tokens=8) as server:
        url = server.url + "/generate"
        prompts = [[i + 1] * (3 + i) for i in range(5)]
        results = await asyncio.gather(
            *(post(http, url, gen_body(p, max_new_tokens=6 + i)) for i, p in enumerate(prompts))
        )
        assert server.state.require_scheduler().peak_batch == 2
        for i, (prompt, (status, obj)) in enumerate(zip(prompts, results, strict=True)):
            assert status == 200 and len(obj["output_ids"]) == 6 + i
            assert_parity(
                logprobs_of(obj), recompute_logprobs(learner_models["0"], prompt, obj["output_ids"], 1.0)
            )
        async with http.put(url, json=gen_body([1], max_new_tokens=1)) as response:
            assert response.status == 200  # SGLang accepts PUT /generate too


async def test_api_key_guards_every_route_but_health(
    model_dirs: tuple[Path, Path], http: aiohttp.ClientSession
) -> None:
    async with engine(model_dirs[0], api_key="sekret") as server:
        async with http.get(server.url + "/health") as response:
            assert response.status == 200
        status, obj = await post(http, server.url + "/generate", gen_body([1], max_new_tokens=1))
        assert status == 401 and "API key" in obj["error"]["message"]
        async with EngineClient(server.url, api_key="sekret") as client:
            result = await client.generate([1], SamplingParams(max_new_tokens=1), rid="keyed")
            assert len(result.output_ids) == 1


async def test_engine_client_round_trip(server: RunningServer, model_dirs: tuple[Path, Path]) -> None:
    async with EngineClient(server.url) as client:
        assert await client.health()
        result = await client.generate([1, 2, 3], SamplingParams(max_new_tokens=5, seed=9), rid="client-1")
        assert result.rid == "client-1" and result.weight_version == "0"
        assert (
            result.completion_tokens
            == len(result.output_ids)
            == len(result.logprobs)
            == len(result.token_versions)
        )
        assert (await client.model_info())["weight_version"] == "0"
        await client.pause_generation("in_place")
        await client.update_weights_from_disk(str(model_dirs[1]), weight_version="7")
        await client.continue_generation()
        result = await client.generate([1, 2, 3], SamplingParams(max_new_tokens=3), rid="client-2")
        assert result.weight_version == "7" and result.token_versions == ["7"] * len(result.output_ids)


async def test_serve_returns_1_when_the_model_cannot_be_loaded(tmp_path: Path) -> None:
    assert await serve(ServerConfig(model=str(tmp_path / "missing"), port=0)) == 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
@pytest.mark.integration
async def test_cli_serves_and_exits_cleanly_on_sigterm(model_dirs: tuple[Path, Path]) -> None:
    port = _free_port()
    argv = ["engine", "serve", "--model", str(model_dirs[0]), "--port", str(port), "--weight-version", "3"]
    argv += ["--enable-metrics", "--threads", "1"]
    code = f"import sys; from pipeline.cli import main; sys.exit(main({argv!r}))"
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        code,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
        env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"},
    )
    try:
        url = f"http://127.0.0.1:{port}"
        async with EngineClient(url) as client:
            await client.wait_ready(60)
            result = await client.generate([4, 5], SamplingParams(max_new_tokens=2), rid="cli")
            assert result.weight_version == "3" and len(result.output_ids) == 2
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
