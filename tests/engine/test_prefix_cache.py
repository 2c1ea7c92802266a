"""The embedded engine's prefix cache: the radix tree alone, then the engine with it against the engine
without it (same seeds: same tokens, same log-probs), across turns, groups, weight updates and flushes.

Engines run the tiny preset in float32 on one torch thread; "without" is `prefix_cache_mb = 0`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from learner.logprobs import sampled_token_logprobs
from learner.model.model_init import init_model
from learner.model.model_io import load_policy
from pipeline.engine.prefix_cache import LayerKV, PrefixCache, kv_bytes
from pipeline.engine.serve import RunningServer, start_server
from pipeline.engine.serve_flags import ServerConfig

LAYERS, HEADS, DIM = 2, 2, 4


# ---- the tree alone ---------------------------------------------------------------------------------------


def _kv_of(tokens: list[int]) -> LayerKV:
    """Synthetic KV whose entries name their token and layer: token * 10 + layer (keys), negated (values)."""
    column = torch.tensor(tokens, dtype=torch.float32)[None, :, None]
    return [
        (
            (column * 10 + layer).expand(HEADS, -1, DIM).clone(),
            -(column * 10 + layer).expand(HEADS, -1, DIM).clone(),
        )
        for layer in range(LAYERS)
    ]


def _insert(cache: PrefixCache, tokens: list[int], namespace: Any = None) -> int:
    full = _kv_of(tokens)
    return cache.insert(
        namespace, tokens, lambda start, end: [(k[:, start:end], v[:, start:end]) for k, v in full]
    )


def _matched_kv(
    cache: PrefixCache, tokens: list[int], limit: int | None = None, namespace: Any = None
) -> LayerKV:
    match = cache.match(namespace, tokens, limit)
    keys = [torch.zeros(1, HEADS, match.length, DIM) for _ in range(LAYERS)]
    values = [torch.zeros(1, HEADS, match.length, DIM) for _ in range(LAYERS)]
    match.write(keys, values, 0)
    return [(k[0], v[0]) for k, v in zip(keys, values, strict=True)]


def test_match_returns_the_longest_cached_prefix_with_exactly_its_kv() -> None:
    cache = PrefixCache(budget_bytes=10**6)
    assert _insert(cache, [1, 2, 3, 4, 5]) == 5
    assert _insert(cache, [1, 2, 3, 9]) == 1  # splits the edge after 1, 2, 3
    assert _insert(cache, [1, 2, 3, 4, 5]) == 0
    assert cache.tokens == 6
    for query, length in [
        ([1, 2, 3, 4, 5, 6], 5),
        ([1, 2, 3, 9, 9], 4),
        ([1, 2, 7], 2),
        ([7], 0),
        ([1, 2, 3, 4], 4),
    ]:
        assert cache.match(None, query).length == length, query
        kv = _matched_kv(cache, query)
        expected = _kv_of(query[:length])
        assert all(
            torch.equal(a, b)
            for (k, v), (ek, ev) in zip(kv, expected, strict=True)
            for a, b in ((k, ek), (v, ev))
        )
    assert cache.match(None, [1, 2, 3, 4, 5], limit=3).length == 3
    assert cache.bytes == kv_bytes(_kv_of([0] * 6))


def test_least_recently_used_leaves_go_first_and_bytes_stay_within_budget() -> None:
    per_token = kv_bytes(_kv_of([0]))
    cache = PrefixCache(budget_bytes=8 * per_token)
    _insert(cache, [1, 2, 3, 4])  # shared stem 1, 2 then leaf 3, 4
    _insert(cache, [1, 2, 5, 6])
    cache.match(None, [1, 2, 3, 4])  # [1, 2, 3, 4] is now the most recent
    _insert(cache, [7, 8, 9])  # 9 tokens > 8: the least recent leaf, 5 6, goes
    assert cache.bytes <= cache.budget_bytes and cache.evicted_tokens == 2
    assert cache.match(None, [1, 2, 5, 6]).length == 2
    assert cache.match(None, [1, 2, 3, 4]).length == 4 and cache.match(None, [7, 8, 9]).length == 3
    _insert(cache, list(range(20, 40)))  # larger than the whole budget: everything goes, itself too
    assert cache.bytes == 0 and cache.tokens == 0 and cache.match(None, [1, 2]).length == 0


def test_namespaces_are_separate_and_clear_drops_them() -> None:
    cache = PrefixCache(budget_bytes=10**6)
    _insert(cache, [1, 2, 3], namespace="lora-a")
    assert cache.match(None, [1, 2, 3]).length == 0
    assert cache.match("lora-a", [1, 2, 3]).length == 3
    _insert(cache, [1, 2, 3])
    cache.clear_namespace("lora-a")
    assert cache.match("lora-a", [1, 2, 3]).length == 0 and cache.match(None, [1, 2, 3]).length == 3
    cache.clear()
    assert (cache.bytes, cache.tokens, cache.match(None, [1]).length) == (0, 0, 0)
    with pytest.raises(ValueError, match="budget_bytes"):
        PrefixCache(0)


# ---- the engine with and without it -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("prefix-cache-models")
    return init_model(root / "v0", seed=0), init_model(root / "v1", seed=1)


@pytest.fixture(scope="module")
def learner_v1(model_dirs: tuple[Path, Path]) -> Any:
    return load_policy(model_dirs[1])[0]


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread: None) -> Iterator[None]:
    yield


@asynccontextmanager
async def engine(model_dir: Path, **overrides: Any) -> AsyncIterator[RunningServer]:
    settings: dict[str, Any] = {"dtype": "float32", "enable_metrics": True, **overrides}
    server = await start_server(
        ServerConfig(model=str(model_dir), port=0, weight_version="0", seed=0, **settings)
    )
    try:
        yield server
    finally:
        await server.close()


@pytest.fixture
async def pair(model_dirs: tuple[Path, Path]) -> AsyncIterator[tuple[RunningServer, RunningServer]]:
    """(with the prefix cache, without it), both on v0."""
    async with engine(model_dirs[0]) as cached, engine(model_dirs[0], prefix_cache_mb=0) as plain:
        yield cached, plain


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        yield session


async def generate(http: aiohttp.ClientSession, server: RunningServer, body: dict[str, Any]) -> Any:
    async with http.post(server.url + "/generate", json=body) as response:
        text = await response.text()
        assert response.status == 200, text
        return json.loads(text)


async def post_json(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Any:
    async with http.post(url, json=body) as response:
        assert response.status == 200, await response.text()
        return await response.json()


def body(
    prompt: list[int] | list[list[int]], seed: int | None, *, temperature: float = 1.0, n: int = 8
) -> dict[str, Any]:
    params: dict[str, Any] = {"max_new_tokens": n, "temperature": temperature, "ignore_eos": True}
    if seed is not None:
        params["sampling_seed"] = seed
    return {"input_ids": prompt, "sampling_params": params, "return_logprob": True}


def logprobs(obj: dict[str, Any]) -> list[float]:
    return [entry[0] for entry in obj["meta_info"]["output_token_logprobs"]]


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Same tokens, log-probs equal to fp32 rounding of differently shaped forwards."""
    assert a["output_ids"] == b["output_ids"]
    assert logprobs(a) == pytest.approx(logprobs(b), abs=1e-5)


async def server_info(http: aiohttp.ClientSession, server: RunningServer) -> dict[str, Any]:
    async with http.get(server.url + "/server_info") as response:
        return dict(await response.json())


async def until_generated(server: RunningServer, rid: str, tokens: int, limit_s: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + limit_s
    while (tracked := server.state.inflight.get(rid)) is None or len(tracked.request.output_ids) < tokens:
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"{rid} did not reach {tokens} tokens in {limit_s} s")
        await asyncio.sleep(0.005)


PROMPT = list(range(40, 64))  # 24 tokens


async def test_a_groups_episodes_share_the_prompt_prefill_with_unchanged_outputs(
    pair: tuple[RunningServer, RunningServer], http: aiohttp.ClientSession
) -> None:
    cached, plain = pair
    for temperature, seeds in ((1.0, [11, 12, 13, 14]), (0.0, [None] * 4)):
        group = [body(PROMPT, seed, temperature=temperature) for seed in seeds]
        with_cache = await asyncio.gather(*(generate(http, cached, b) for b in group))
        without = await asyncio.gather(*(generate(http, plain, b) for b in group))
        for a, b in zip(with_cache, without, strict=True):
            assert_same(a, b)
        assert all(o["meta_info"]["cached_tokens"] == 0 for o in without)
        # Greedy: the second group finds the whole prompt (all but its last token) cached already.
        counts = sorted(o["meta_info"]["cached_tokens"] for o in with_cache)
        assert counts == ([0, 23, 23, 23] if temperature else [23] * 4), counts
    info = await server_info(http, cached)
    assert info["disable_radix_cache"] is False and info["prefix_cache"]["hits"] == 7


async def test_n_samples_of_one_prompt_share_its_prefill(
    pair: tuple[RunningServer, RunningServer], http: aiohttp.ClientSession
) -> None:
    cached, plain = pair
    request = body(PROMPT, 5)
    request["sampling_params"]["n"] = 3
    with_cache, without = await generate(http, cached, request), await generate(http, plain, request)
    for a, b in zip(with_cache, without, strict=True):
        assert_same(a, b)
    assert sorted(o["meta_info"]["cached_tokens"] for o in with_cache) == [0, 23, 23]


async def test_the_next_turn_prefills_only_what_the_previous_turn_did_not_see(
    pair: tuple[RunningServer, RunningServer], http: aiohttp.ClientSession
) -> None:
    cached, plain = pair
    for temperature, seed in ((1.0, 21), (0.0, None)):
        history = [*PROMPT, 1 if temperature else 2]  # a different conversation per mode
        expected_cached = 0 if temperature else len(PROMPT)  # the second finds the first's PROMPT
        for turn in range(4):
            a = await generate(http, cached, body(history, seed, temperature=temperature, n=6))
            b = await generate(http, plain, body(history, seed, temperature=temperature, n=6))
            assert_same(a, b)
            assert a["meta_info"]["cached_tokens"] == expected_cached, turn
            # Turn k + 1 = turn k's prompt + output + the environment's reply; all of it was cached but
            # the last sampled token, which was never fed back.
            expected_cached = len(history) + len(a["output_ids"]) - 1
            history = history + a["output_ids"] + [100 + turn, 101 + turn]
    info = await server_info(http, cached)
    stats = info["prefix_cache"]
    assert stats["cached_tokens"] > 0.5 * stats["prompt_tokens"] - 30  # three of four turns hit nearly all


async def test_a_weight_update_invalidates_the_cache(
    pair: tuple[RunningServer, RunningServer],
    http: aiohttp.ClientSession,
    model_dirs: tuple[Path, Path],
    learner_v1: Any,
) -> None:
    cached, _ = pair
    first = await generate(http, cached, body(PROMPT, 3))
    again = await generate(http, cached, body(PROMPT, 3))
    assert again["meta_info"]["cached_tokens"] == 23 and again["output_ids"] == first["output_ids"]
    epoch = (await server_info(http, cached))["prefix_cache"]["kv_epoch"]
    update = {"model_path": str(model_dirs[1]), "weight_version": "1"}
    assert (await post_json(http, cached.url + "/update_weights_from_disk", update))["success"] is True
    info = await server_info(http, cached)
    assert info["prefix_cache"]["kv_epoch"] == epoch + 1 and info["prefix_cache"]["tokens"] == 0
    # The freed KV's pages go back to the kernel: the first invalidation trims at once (at most once
    # a minute after that), on glibc.
    assert info["malloc_trim"]["available"] is True and info["malloc_trim"]["trims"] >= 1
    after = await generate(http, cached, body(PROMPT, 3))
    assert after["meta_info"]["cached_tokens"] == 0 and after["meta_info"]["weight_version"] == "1"
    with torch.no_grad():
        logits = learner_v1(torch.tensor([PROMPT + after["output_ids"]])).logits[0, len(PROMPT) - 1 : -1]
    reference = sampled_token_logprobs(logits.float(), torch.tensor(after["output_ids"]), temperature=1.0)
    assert logprobs(after) == pytest.approx(reference.tolist(), abs=1e-4)  # v1's numbers, not v0's KV


async def test_flush_cache_empties_it_when_idle(
    pair: tuple[RunningServer, RunningServer], http: aiohttp.ClientSession
) -> None:
    cached, _ = pair
    await generate(http, cached, body(PROMPT, 1))
    assert (await server_info(http, cached))["prefix_cache"]["tokens"] > 0
    async with http.post(cached.url + "/flush_cache") as response:
        assert response.status == 200
    assert (await server_info(http, cached))["prefix_cache"]["tokens"] == 0
    again = await generate(http, cached, body(PROMPT, 1))
    assert again["meta_info"]["cached_tokens"] == 0


async def test_prompt_logprobs_are_computed_not_reused(
    pair: tuple[RunningServer, RunningServer], http: aiohttp.ClientSession
) -> None:
    cached, plain = pair
    await generate(http, cached, body(PROMPT, 1))  # the prompt is cached now
    for start, n in ((0, 0), (10, 4)):
        request = {**body(PROMPT, 2, n=n), "logprob_start_len": start}
        a, b = await generate(http, cached, request), await generate(http, plain, request)
        assert a["meta_info"]["cached_tokens"] == (0 if n == 0 else start)
        ours = [e[0] for e in a["meta_info"]["input_token_logprobs"]]
        theirs = [e[0] for e in b["meta_info"]["input_token_logprobs"]]
        assert len(ours) == len(PROMPT) - start and ours[0] is None and theirs[0] is None
        assert ours[1:] == pytest.approx(theirs[1:], abs=1e-5)


async def test_metrics_count_cached_tokens_with_sglang_names(
    pair: tuple[RunningServer, RunningServer], http: aiohttp.ClientSession
) -> None:
    cached, _ = pair
    objs = await asyncio.gather(*(generate(http, cached, body(PROMPT, s)) for s in range(3)))
    reported = sum(o["meta_info"]["cached_tokens"] for o in objs)
    assert reported == 46
    async with http.get(cached.url + "/metrics") as response:
        families = {f.name: f for f in text_string_to_metric_families(await response.text())}

    def value(family: str, sample: str) -> float:
        return next(s.value for s in families[family].samples if s.name == sample)

    assert value("sglang:cached_tokens", "sglang:cached_tokens_total") == 46
    prompt_total = value("sglang:prompt_tokens", "sglang:prompt_tokens_total")
    assert value("sglang:cache_hit_rate", "sglang:cache_hit_rate") == pytest.approx(46 / prompt_total)
    assert value("rollwise_engine_prefix_cache_hits", "rollwise_engine_prefix_cache_hits_total") == 2
    assert value("rollwise_engine_prefix_cache_lookups", "rollwise_engine_prefix_cache_lookups_total") == 4
    info = (await server_info(http, cached))["prefix_cache"]
    assert info["cached_tokens"] == 46 and info["prompt_tokens"] == prompt_total and info["lookups"] == 4
    assert (
        value("rollwise_engine_prefix_cache_tokens", "rollwise_engine_prefix_cache_tokens")
        == info["tokens"]
        > 0
    )


async def test_a_retracted_request_resumes_from_its_cached_kv_with_unchanged_outputs(
    pair: tuple[RunningServer, RunningServer], http: aiohttp.ClientSession
) -> None:
    cached, plain = pair
    request = {**body(PROMPT, 8, n=60), "rid": "long"}
    task = asyncio.create_task(generate(http, cached, request))
    await until_generated(cached, "long", 5)
    await post_json(http, cached.url + "/pause_generation", {"mode": "retract"})
    before = (await server_info(http, cached))["prefix_cache"]["cached_tokens"]
    await post_json(http, cached.url + "/continue_generation", {})
    a = await task
    assert (await server_info(http, cached))["prefix_cache"][
        "cached_tokens"
    ] > before  # the resumed prefill hit
    assert_same(a, await generate(http, plain, request))


async def test_kv_kept_across_an_in_place_update_is_never_cached(
    pair: tuple[RunningServer, RunningServer], http: aiohttp.ClientSession, model_dirs: tuple[Path, Path]
) -> None:
    """An in-place pause keeps a row's v0 KV running on v1; when it finishes, that mixed KV must not be
    offered to the next turn."""
    cached, _ = pair
    task = asyncio.create_task(generate(http, cached, {**body(PROMPT, 4, n=80), "rid": "kept"}))
    await until_generated(cached, "kept", 5)
    await post_json(http, cached.url + "/pause_generation", {"mode": "in_place"})
    update = {"model_path": str(model_dirs[1]), "weight_version": "1"}
    assert (await post_json(http, cached.url + "/update_weights_from_disk", update))["success"] is True
    await post_json(http, cached.url + "/continue_generation", {})
    first = await task
    assert first["meta_info"]["output_token_weight_versions"][0] == "0"
    next_turn = await generate(http, cached, body(PROMPT + first["output_ids"] + [7], 4))
    assert next_turn["meta_info"]["cached_tokens"] == 0


@pytest.mark.slow  # its fixture loads SmolLM2
async def test_the_real_model_reuses_a_conversation_with_unchanged_outputs(
    smollm2_dir: Path, http: aiohttp.ClientSession
) -> None:
    """SmolLM2-135M-Instruct (30 layers, grouped KV heads), fp32: a chat turn, then the next one on top."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    messages = [{"role": "user", "content": "What is 7 + 12? Answer with a number."}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = tokenizer(text, add_special_tokens=False).input_ids
    async with engine(smollm2_dir) as cached, engine(smollm2_dir, prefix_cache_mb=0) as plain:
        first = await generate(http, cached, body(prompt, None, temperature=0.0, n=10))
        assert "19" in tokenizer.decode(first["output_ids"])
        assert_same(first, await generate(http, plain, body(prompt, None, temperature=0.0, n=10)))
        follow_up = tokenizer(
            "<|im_end|>\n<|im_start|>user\nAnd 19 + 1?<|im_end|>\n<|im_start|>assistant\n",
            add_special_tokens=False,
        ).input_ids
        history = prompt + first["output_ids"] + follow_up
        second = await generate(http, cached, body(history, 3, n=8))
        assert second["meta_info"]["cached_tokens"] == len(prompt) + 10 - 1
        assert_same(second, await generate(http, plain, body(history, 3, n=8)))
