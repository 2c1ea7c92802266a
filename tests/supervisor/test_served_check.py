"""The served-policy check and LoRA adapter serving through a real EnginePool against strict SGLang fakes:
the client sends only fields SGLang 0.5.x defines, a stale engine is named and stops the daemon after N
consecutive mismatches, adapters are loaded under versioned names and unloaded after their requests."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from pipeline.contracts import events
from pipeline.contracts.config import load_config
from pipeline.contracts.cpu_features import auto_cpu_dtype
from pipeline.supervisor.engine_launch import engine_argv, plan_engines
from pipeline.supervisor.engines.adapters import AdapterRegistry, AdapterRouting, lora_launch_flags, unloader
from pipeline.supervisor.engines.client import EngineClient
from pipeline.supervisor.engines.pool import EnginePool
from pipeline.supervisor.engines.protocol import (
    EngineHTTPError,
    EngineProtocolError,
    SamplingParams,
    parse_input_logprobs,
)
from pipeline.supervisor.engines.served_check import Probe, ServedPolicyCheck, mean_abs_diff, tolerance_for
from pipeline.supervisor.engines.weightsync import sync_weights
from pipeline.supervisor.observability import metrics
from tests.fakes.sglang_fake import FakeSGLang, free_port, prompt_logprobs

IDS = [11, 12, 13, 14, 15, 16, 17]


def _pool(urls: list[str]) -> EnginePool:
    return EnginePool([EngineClient(u, retries=0, request_timeout_s=10.0) for u in urls])


def _probe(identity: str) -> Probe:
    """What the learner would send for weights the fakes identify as `identity`."""
    return Probe(IDS, prompt_logprobs(identity, IDS))


@pytest.fixture
async def fakes() -> AsyncIterator[list[FakeSGLang]]:
    servers = [
        FakeSGLang(enable_lora=True, token_delay_s=0.01),
        FakeSGLang(enable_lora=True, token_delay_s=0.01, ignore_updates=True),
    ]
    for s in servers:
        await s.start()
    yield servers
    for s in servers:
        await s.stop()


# ---- the wire -------------------------------------------------------------------------------------------


async def test_client_sends_only_fields_sglang_defines(fakes: list[FakeSGLang]) -> None:
    fake = fakes[0]
    async with EngineClient(fake.base_url, retries=0) as client:
        await client.load_lora_adapter("rollwise-v1", "/w/v1")
        result = await client.generate(
            IDS, SamplingParams(max_new_tokens=3, seed=1), "r1", lora_path="rollwise-v1"
        )
        assert result.output_ids
        assert await client.prompt_logprobs(IDS, rid="p1", lora_path="rollwise-v1") == prompt_logprobs(
            "/w/v1", IDS
        )
        await client.pause_generation("in_place")
        await client.update_weights_from_disk("/w/v2", weight_version="2")
        await client.continue_generation()
        await client.abort_request(abort_all=True)
        await client.unload_lora_adapter("rollwise-v1")
    bodies = {r.path: r.json() for r in fake.requests if r.body}
    assert bodies["/load_lora_adapter"] == {"lora_name": "rollwise-v1", "lora_path": "/w/v1", "pinned": False}
    assert bodies["/unload_lora_adapter"] == {"lora_name": "rollwise-v1"}
    probe = [r.json() for r in fake.requests if r.path == "/generate"][-1]
    assert probe == {
        "input_ids": IDS,
        "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True,
        "logprob_start_len": 0,
        "rid": "p1",
        "lora_path": "rollwise-v1",
    }
    # The fake's strictness can fail: a field SGLang does not define is a 400 naming it.
    async with aiohttp.ClientSession() as http:
        body = {"input_ids": IDS, "sampling_params": {"max_new_tokens": 1, "top_q": 1}, "lora": "x"}
        async with http.post(fake.base_url + "/generate", json=body) as resp:
            assert resp.status == 400
            message = (await resp.json())["error"]["message"]
    assert "'lora'" in message and "sampling_params.top_q" in message


def test_prompt_logprob_replies_that_break_the_contract_are_named() -> None:
    def reply(entries: object) -> dict[str, object]:
        return {"meta_info": {"input_token_logprobs": entries}}

    good = [[None, 1, None], [-0.5, 2, None], [-1.5, 3, None]]
    assert parse_input_logprobs(reply(good), [1, 2, 3], start=0, rid="r") == [-0.5, -1.5]
    assert parse_input_logprobs(reply(good[1:]), [1, 2, 3], start=1, rid="r") == [-1.5]
    bad = {
        "has 2 entries, expected 3": good[:2],
        r"\[1\] is \[-0.5, 9, None\]": [good[0], [-0.5, 9, None], good[2]],
        "logprob nan is not a finite": [good[0], [math.nan, 2, None], good[2]],
        "logprob None is not a finite": [good[0], [None, 2, None], good[2]],
    }
    for defect, entries in bad.items():
        with pytest.raises(EngineProtocolError, match=defect):
            parse_input_logprobs(reply(entries), [1, 2, 3], start=0, rid="r")
    with pytest.raises(EngineProtocolError, match="no meta_info"):
        parse_input_logprobs({"error": {"message": "x"}}, [1, 2], start=0, rid="r")


def test_published_event_carries_the_probe_through_json() -> None:
    event = events.Published(
        version=3, path="/w/v3", bytes=4096, probe_ids=[1, 2, 3], probe_logprobs=[-0.5, -1]
    )
    decoded = events.decode(json.loads(events.encode(event)))
    assert decoded == events.Published(3, "/w/v3", 4096, [1, 2, 3], [-0.5, -1.0])
    with pytest.raises(ValueError, match=r"published.probe_ids"):
        events.decode({**json.loads(events.encode(event)), "probe_ids": ["a"]})


# ---- the check ------------------------------------------------------------------------------------------


async def test_a_stale_engine_is_named_and_stops_the_daemon_after_n_consecutive_mismatches(
    fakes: list[FakeSGLang],
) -> None:
    healthy, stale = fakes
    failures: list[str] = []
    pool = _pool([f.base_url for f in fakes])
    check = ServedPolicyCheck(pool, tolerance=1e-3, max_failures=2, fail=failures.append)
    try:
        await sync_weights(pool, model_path="/w/v1", version=1, mode="in_place")
        first = {v.engine: v for v in await check.run(1, _probe("/w/v1"))}
        assert stale.weight_version == "1"  # the version string says it loaded v1 ...
        assert first[healthy.base_url].status == "ok" and first[healthy.base_url].diff == 0.0
        assert first[stale.base_url].status == "mismatch"  # ... its log-probs say otherwise
        assert first[stale.base_url].diff == pytest.approx(
            mean_abs_diff(_probe("fake/model").logprobs, _probe("/w/v1").logprobs)
        )
        assert failures == [] and check.consecutive == {healthy.base_url: 0, stale.base_url: 1}
        assert metrics.SERVED_CHECK_FAILURES.labels(engine=stale.base_url)._value.get() == 1
        await sync_weights(pool, model_path="/w/v2", version=2, mode="in_place")
        await check.run(2, _probe("/w/v2"))
        assert len(failures) == 1 and stale.base_url in failures[0] and healthy.base_url not in failures[0]
        assert "2 consecutive served-policy checks failed" in failures[0]
    finally:
        await pool.close()


async def test_a_passing_check_resets_the_count_and_an_unreachable_engine_is_no_mismatch(
    fakes: list[FakeSGLang],
) -> None:
    healthy = fakes[0]
    down = f"http://127.0.0.1:{free_port()}"
    failures: list[str] = []
    pool = _pool([healthy.base_url, down])
    check = ServedPolicyCheck(pool, tolerance=1e-3, max_failures=2, fail=failures.append)
    try:
        await sync_weights(pool, model_path="/w/v1", version=1, mode="in_place")
        verdicts = {v.engine: v for v in await check.run(1, _probe("/w/v0-wrong"))}
        assert verdicts[healthy.base_url].status == "mismatch" and check.consecutive[healthy.base_url] == 1
        assert verdicts[down].status == "error" and check.consecutive[down] == 0
        await check.run(1, _probe("/w/v1"))
        assert check.consecutive[healthy.base_url] == 0
        await check.run(1, _probe("/w/v0-wrong"))
        assert failures == []  # mismatch, ok, mismatch: never two in a row
    finally:
        await pool.close()


def test_tolerance_follows_the_engine_dtype_unless_set() -> None:
    # embedded, the engine's own choice: bf16 where this CPU multiplies it natively (cpu_features)
    assert tolerance_for(load_config(None, [])) == (1e-3 if auto_cpu_dtype()[0] == "float32" else 5e-2)
    assert tolerance_for(load_config(None, ["engine.dtype=float32"])) == 1e-3
    assert tolerance_for(load_config(None, ["engine.dtype=bfloat16"])) == 5e-2
    assert tolerance_for(load_config(None, ["engine.kind=sglang"])) == 5e-2  # SGLang's auto dtype
    assert tolerance_for(load_config(None, ["async.served_check.tolerance=0.2"])) == 0.2
    with pytest.raises(ValueError, match="one log-prob per id after the first"):
        Probe([1, 2, 3], [-1.0])


# ---- LoRA adapters --------------------------------------------------------------------------------------


async def test_adapters_load_under_versioned_names_and_the_old_one_unloads_after_its_requests(
    fakes: list[FakeSGLang],
) -> None:
    healthy = fakes[0]
    pool = _pool([healthy.base_url])
    registry = AdapterRegistry(0, unloader(pool))
    routing = AdapterRouting(pool, registry)
    sampling = SamplingParams(max_new_tokens=20, seed=3)
    try:
        base = await routing.generate(IDS, sampling, "base-1", affinity_key="e")
        assert base.weight_version == "0" and "lora_path" not in healthy.generate_requests()[-1]
        await sync_weights(pool, model_path="/w/v1", version=1, mode="in_place", adapter=registry)
        assert healthy.adapters == {"rollwise-v1": "/w/v1"}
        slow = asyncio.ensure_future(routing.generate(IDS, sampling, "slow-1", affinity_key="e"))
        await healthy.wait_running(1)
        await sync_weights(pool, model_path="/w/v2", version=2, mode="in_place", adapter=registry)
        assert healthy.adapters == {"rollwise-v1": "/w/v1", "rollwise-v2": "/w/v2"}  # v1 still in use
        fresh = await routing.generate(IDS, SamplingParams(max_new_tokens=2), "fresh", affinity_key="f")
        assert healthy.generate_requests()[-1]["lora_path"] == "rollwise-v2" and fresh.weight_version == "2"
        old = await slow
        # Every token of the in-flight request came from the adapter it named.
        assert old.weight_version == "1" and set(old.token_versions) == {"1"}
        await registry.drain()
        assert healthy.adapters == {"rollwise-v2": "/w/v2"}
        assert [call for call, _ in healthy.lora_calls] == ["load", "load", "unload"]
        check = ServedPolicyCheck(pool, tolerance=1e-3, max_failures=1, fail=pytest.fail)
        [verdict] = await check.run(2, _probe("/w/v2"), lora_path="rollwise-v2")
        assert verdict.status == "ok" and verdict.base_diff is not None and verdict.base_diff > 0.1
    finally:
        await pool.close()


async def test_an_adapter_the_engine_refuses_is_a_mismatch(fakes: list[FakeSGLang]) -> None:
    healthy = fakes[0]
    pool = _pool([healthy.base_url])
    failures: list[str] = []
    check = ServedPolicyCheck(pool, tolerance=1e-3, max_failures=1, fail=failures.append)
    try:
        [verdict] = await check.run(4, _probe("/w/v4"), lora_path="rollwise-v4")  # never loaded
        assert verdict.status == "mismatch" and "not loaded: rollwise-v4" in verdict.detail
        assert failures and healthy.base_url in failures[0]
        with pytest.raises(EngineHTTPError, match="already loaded"):
            async with EngineClient(healthy.base_url) as client:
                await client.load_lora_adapter("x", "/w/x")
                await client.load_lora_adapter("x", "/w/x")
    finally:
        await pool.close()


def test_engines_are_launched_with_sglangs_lora_flags(tmp_path: Path) -> None:
    lora = [
        "learner.lora.enabled=true",
        "learner.lora.rank=8",
        "learner.lora.target_modules=['q_proj','v_proj']",
    ]
    adapter = tmp_path / "weights" / "v3"
    expected = ["--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "q_proj", "v_proj"]
    for kind in ("embedded", "sglang"):
        cfg = load_config(None, ["engine.port=0", f"engine.kind={kind}", *lora])
        argv = engine_argv(
            cfg, plan_engines(cfg)[0], model_dir=tmp_path / "model", version=3, adapter=adapter
        )
        at = argv.index("--enable-lora")
        assert argv[at : at + 6] == expected
        assert argv[at + 6 : at + 8] == ["--lora-paths", f"rollwise-v3={adapter}"]
        assert argv[argv.index("--weight-version") + 1] == "3"
    merged = load_config(None, [*lora, "learner.lora.serving=merged"])
    assert lora_launch_flags(merged.learner.lora, version=3, adapter=adapter) == []
    assert lora_launch_flags(load_config(None, lora).learner.lora, version=0, adapter=None) == expected
