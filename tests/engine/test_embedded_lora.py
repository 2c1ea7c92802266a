"""The embedded engine's prompt log-probs and LoRA adapters, over real HTTP, against the learner's own
computation: `input_token_logprobs` as SGLang defines them, /load_lora_adapter and /unload_lora_adapter,
`lora_path` per request (a batch mixing adapters gives each request its own adapter's log-probs), and the
fault-injection switch the served-policy check is tested with."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch

from learner.model.lora import LoraPolicy, apply_lora
from learner.model.model_init import init_model
from learner.model.model_io import load_policy
from learner.served_probe import probe_logprobs
from pipeline.contracts.learner_config import LoraConfig
from pipeline.engine.serve import RunningServer, start_server
from pipeline.engine.serve_flags import ServerConfig, parse_args
from pipeline.supervisor.engines.client import EngineClient
from pipeline.supervisor.engines.protocol import EngineHTTPError
from tests.engine.test_embedded_engine import assert_parity, post, recompute_logprobs, wait_until

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LORA = LoraConfig(enabled=True, rank=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
PROMPT = [3, 17, 29, 41, 5, 8, 13, 21, 34, 55]


def _adapter(model_dir: Path, out: Path, seed: int) -> LoraPolicy:
    """A LoRA policy whose B matrices are random (a trained adapter stand-in), published at `out`."""
    model, _ = load_policy(model_dir)
    policy = apply_lora(model, LORA, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    policy.publish_adapter(out, seed)
    policy.model.eval()
    return policy


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("embedded-lora")
    base_dir = init_model(root / "v0", seed=0)
    other_dir = init_model(root / "v1", seed=1)
    a = _adapter(base_dir, root / "adapter-a", seed=1)
    b = _adapter(base_dir, root / "adapter-b", seed=2)
    base = load_policy(base_dir)[0].eval()
    return {
        "base_dir": base_dir,
        "other_dir": other_dir,
        "root": root,
        "A": a.model,
        "B": b.model,
        "base": base,
    }


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
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        yield session


def _prompt_values(obj: dict[str, Any]) -> list[float]:
    entries = obj["meta_info"]["input_token_logprobs"]
    assert entries[0][0] is None
    return [e[0] for e in entries[1:]]


def _close(a: list[float], b: list[float], atol: float = 2e-5) -> None:
    assert len(a) == len(b) > 0
    assert max(abs(x - y) for x, y in zip(a, b, strict=True)) <= atol


# ---- prompt log-probs ---------------------------------------------------------------------------------


async def test_input_token_logprobs_are_sglangs_teacher_forced_logprobs(
    setup: dict[str, Any], http: aiohttp.ClientSession
) -> None:
    expected = probe_logprobs(setup["base"], PROMPT)
    async with engine(setup["base_dir"]) as server:
        url = server.url + "/generate"
        score = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True}
        status, obj = await post(http, url, {**score, "logprob_start_len": 0})
        assert status == 200
        entries = obj["meta_info"]["input_token_logprobs"]
        assert [e[1] for e in entries] == PROMPT and entries[0][0] is None
        assert obj["output_ids"] == [] and obj["meta_info"]["finish_reason"] == {
            "type": "length",
            "length": 0,
        }
        _close(_prompt_values(obj), expected)
        # From position 4, while generating: the same values for the positions after it.
        gen = {
            "input_ids": PROMPT,
            "sampling_params": {"max_new_tokens": 3, "ignore_eos": True},
            "return_logprob": True,
            "logprob_start_len": 4,
        }
        status, obj = await post(http, url, gen)
        assert status == 200 and [e[1] for e in obj["meta_info"]["input_token_logprobs"]] == PROMPT[4:]
        _close(_prompt_values(obj), expected[4:])
        assert len(obj["output_ids"]) == 3
        # Default (-1): one null entry for the last prompt token, as SGLang returns it.
        status, obj = await post(http, url, {**gen, "logprob_start_len": -1})
        assert obj["meta_info"]["input_token_logprobs"] == [[None, PROMPT[-1], None]]
        status, obj = await post(http, url, {**score, "logprob_start_len": len(PROMPT)})
        assert status == 400 and "less than the input length" in obj["error"]["message"]
        async with EngineClient(server.url) as client:
            _close(await client.prompt_logprobs(PROMPT, rid="probe-1"), expected)


# ---- LoRA ---------------------------------------------------------------------------------------------


async def test_a_batch_mixing_adapters_gives_each_request_its_own_adapters_logprobs(
    setup: dict[str, Any], http: aiohttp.ClientSession
) -> None:
    root = setup["root"]
    flags = {"enable_lora": True, "max_lora_rank": 8, "lora_target_modules": tuple(LORA.target_modules)}
    paths = (("A", str(root / "adapter-a")),)
    async with (
        engine(setup["base_dir"], **flags, lora_paths=paths) as server,
        EngineClient(server.url) as client,
    ):
        reply = await client.load_lora_adapter("B", str(root / "adapter-b"))
        assert reply["loaded_adapters"] == {"A": str(root / "adapter-a"), "B": str(root / "adapter-b")}
        names = ["A", None, "B", "A"]
        body = {
            "input_ids": [PROMPT] * 4,
            "sampling_params": {"max_new_tokens": 5, "ignore_eos": True, "temperature": 1.0},
            "return_logprob": True,
            "logprob_start_len": 0,
            "lora_path": names,
        }
        status, objs = await post(http, server.url + "/generate", body)
        assert status == 200 and len(objs) == 4
        models = {"A": setup["A"], None: setup["base"], "B": setup["B"]}
        for name, obj in zip(names, objs, strict=True):
            model = models[name]
            _close(_prompt_values(obj), probe_logprobs(model, PROMPT))
            output = obj["output_ids"]
            engine_lps = [e[0] for e in obj["meta_info"]["output_token_logprobs"]]
            assert_parity(engine_lps, recompute_logprobs(model, PROMPT, output, 1.0))
        # The adapters really differ from each other and from the base on this prompt.
        assert abs(_prompt_values(objs[0])[3] - _prompt_values(objs[1])[3]) > 1e-3
        assert abs(_prompt_values(objs[0])[3] - _prompt_values(objs[2])[3]) > 1e-3
        _close(
            await client.prompt_logprobs(PROMPT, rid="p-b", lora_path="B"),
            probe_logprobs(setup["B"], PROMPT),
        )


async def test_lora_requests_and_loads_are_refused_as_sglang_refuses_them(
    setup: dict[str, Any], http: aiohttp.ClientSession
) -> None:
    root = setup["root"]
    async with engine(setup["base_dir"]) as plain:
        status, obj = await post(
            http, plain.url + "/generate", {"input_ids": PROMPT, "lora_path": "A", "sampling_params": {}}
        )
        assert status == 400 and "LoRA is not enabled" in obj["error"]["message"]
        status, obj = await post(
            http, plain.url + "/load_lora_adapter", {"lora_name": "A", "lora_path": str(root / "adapter-a")}
        )
        assert status == 400 and obj["success"] is False and "--enable-lora" in obj["error_message"]
    async with engine(setup["base_dir"], enable_lora=True, max_lora_rank=2) as server:
        async with EngineClient(server.url) as client:
            with pytest.raises(EngineHTTPError, match="rank 4 > --max-lora-rank 2"):
                await client.load_lora_adapter("A", str(root / "adapter-a"))
            with pytest.raises(EngineHTTPError, match="Failed to load LoRA adapter C"):
                await client.load_lora_adapter("C", str(root / "missing"))
            with pytest.raises(EngineHTTPError, match="'A' is not loaded"):
                await client.unload_lora_adapter("A")
        status, obj = await post(
            http, server.url + "/generate", {"input_ids": PROMPT, "lora_path": ["A"], "sampling_params": {}}
        )
        assert status == 400 and "not loaded: A" in obj["error"]["message"]


async def test_unload_waits_for_the_requests_naming_the_adapter(
    setup: dict[str, Any], http: aiohttp.ClientSession
) -> None:
    root = setup["root"]
    async with (
        engine(setup["base_dir"], enable_lora=True, lora_paths=(("A", str(root / "adapter-a")),)) as server,
        EngineClient(server.url) as client,
    ):
        await client.pause_generation("in_place")
        body = {"input_ids": PROMPT, "lora_path": "A", "sampling_params": {"max_new_tokens": 3}}
        held = asyncio.ensure_future(post(http, server.url + "/generate", body))
        await wait_until(lambda: server.state.adapters.loaded["A"].holders > 0)
        unload = asyncio.ensure_future(client.unload_lora_adapter("A"))
        await asyncio.sleep(0.3)
        assert not unload.done()  # a request still names A
        status, obj = await post(http, server.url + "/generate", body)
        assert status == 400 and "not loaded: A" in obj["error"]["message"]  # no new request may
        await client.continue_generation()
        status, obj = await held
        assert status == 200 and len(obj["output_ids"]) == 3
        assert (await unload)["loaded_adapters"] == {}
        _close(await client.prompt_logprobs(PROMPT, rid="after"), probe_logprobs(setup["base"], PROMPT))
        # The next adapter of the same shape reuses A's slot: its tensors are copied in, nothing injected.
        assert server.state.adapters.free == [("slot0", server.state.adapters.free[0][1])]
        await client.load_lora_adapter("B", str(root / "adapter-b"))
        assert server.state.adapters.loaded["B"].peft_name == "slot0" and server.state.adapters.free == []
        _close(
            await client.prompt_logprobs(PROMPT, rid="b", lora_path="B"), probe_logprobs(setup["B"], PROMPT)
        )
        _close(await client.prompt_logprobs(PROMPT, rid="base"), probe_logprobs(setup["base"], PROMPT))


async def test_fault_switch_acknowledges_updates_but_keeps_the_start_weights(setup: dict[str, Any]) -> None:
    root = setup["root"]
    base_lps = probe_logprobs(setup["base"], PROMPT)
    stale = engine(setup["base_dir"], enable_lora=True, fault_stale_weights=True)
    async with stale as server, EngineClient(server.url) as client:
        await client.update_weights_from_disk(str(setup["other_dir"]), weight_version="1")
        assert (await client.model_info())["weight_version"] == "1"  # the label says v1 ...
        _close(await client.prompt_logprobs(PROMPT, rid="f1"), base_lps)  # ... the weights are v0
        await client.load_lora_adapter("A", str(root / "adapter-a"))
        _close(await client.prompt_logprobs(PROMPT, rid="f2", lora_path="A"), base_lps)
    async with (
        engine(setup["base_dir"], enable_lora=True, lora_paths=(("A", str(root / "adapter-a")),)) as server,
        EngineClient(server.url) as client,
    ):
        with pytest.raises(EngineHTTPError, match="while LoRA adapters are loaded"):
            await client.update_weights_from_disk(str(setup["other_dir"]), weight_version="1")


def test_server_flags_are_sglangs() -> None:
    config = parse_args(
        ["--model", "m", "--max-lora-rank", "8", "--lora-target-modules", "q_proj", "v_proj",
         "--lora-paths", "rollwise-v3=/w/v3", "--fault-stale-weights"]
    )  # fmt: skip
    assert config.enable_lora and config.max_lora_rank == 8
    assert config.lora_target_modules == ("q_proj", "v_proj")
    assert config.lora_paths == (("rollwise-v3", "/w/v3"),) and config.fault_stale_weights
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "--lora-paths", "no-equals-sign"])


def test_an_adapter_is_read_whole_with_pefts_tensors_and_nothing_kept(setup: dict[str, Any]) -> None:
    """The engine reads an adapter per version: from bytes, the same tensors as peft's own (memory-mapped)
    read, which keeps two Python ints per tensor."""
    import gc
    import tracemalloc

    from peft.utils import load_peft_weights

    from pipeline.engine.lora_slots import read_adapter

    path = str(setup["root"] / "adapter-a")
    config, weights = read_adapter(path, "cpu")
    reference = load_peft_weights(path, device="cpu")
    assert config.r == LORA.rank and sorted(weights) == sorted(reference)
    assert all(torch.equal(weights[k], reference[k]) for k in reference)
    tracemalloc.start()
    try:
        read_adapter(path, "cpu")
        gc.collect()
        before = tracemalloc.take_snapshot()
        for _ in range(20):
            read_adapter(path, "cpu")
        gc.collect()
        kept = sum(s.count_diff for s in tracemalloc.take_snapshot().compare_to(before, "filename"))
    finally:
        tracemalloc.stop()
    # peft's read keeps 2 per tensor per read (480 here); what is left is ~1 per read of the config's.
    assert kept / 20 < len(weights) / 2, (kept, len(weights))
