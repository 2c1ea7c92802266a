"""The embedded engine serving the Qwen3-MoE preset over real HTTP: log-prob parity with the learner,
routed experts as SGLang returns them (`--enable-return-routed-experts`, base64 int32 (positions, layers,
topk)), recorded the same way whether a position was prefilled or decoded, alone or batched, the weight
swap of an MoE checkpoint, and LoRA adapters on its attention."""

from __future__ import annotations

import asyncio
import base64
import struct
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch

from learner.model.lora import apply_lora
from learner.model.model_init import init_model
from learner.model.model_io import load_policy
from pipeline.contracts.learner_config import LoraConfig
from pipeline.engine.serve_flags import parse_args
from pipeline.supervisor.engines.client import EngineClient
from pipeline.supervisor.engines.protocol import RoutedExpertsRequest, SamplingParams
from tests.engine.test_embedded_engine import assert_parity, engine, gen_body, post, recompute_logprobs

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = [5, 6, 7, 8, 9, 10, 11]
PER_POSITION = 2 * 2  # moe-tiny: 2 layers x top-2


def _routes(obj: dict[str, Any]) -> list[list[int]]:
    raw = base64.b64decode(obj["meta_info"]["routed_experts"])
    values = struct.unpack(f"<{len(raw) // 4}i", raw)
    return [list(values[i : i + PER_POSITION]) for i in range(0, len(values), PER_POSITION)]


def _routed_body(prompt: list[int], max_new_tokens: int, start: int = 0) -> dict[str, Any]:
    return {
        **gen_body(prompt, max_new_tokens=max_new_tokens),
        "return_routed_experts": True,
        "routed_experts_start_len": start,
    }


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("embedded-moe")
    return init_model(root / "v0", preset="moe-tiny", seed=0), init_model(
        root / "v1", preset="moe-tiny", seed=1
    )


@pytest.fixture
async def http() -> Any:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        yield session


async def test_moe_logprobs_match_the_learners_recomputation(
    moe_dirs: tuple[Path, Path], http: aiohttp.ClientSession
) -> None:
    learner = load_policy(moe_dirs[0])[0]
    async with engine(moe_dirs[0]) as server:
        status, obj = await post(http, server.url + "/generate", gen_body(PROMPT, max_new_tokens=8))
    assert status == 200
    engine_lps = [entry[0] for entry in obj["meta_info"]["output_token_logprobs"]]
    assert_parity(engine_lps, recompute_logprobs(learner, PROMPT, obj["output_ids"], 1.0))


async def test_routed_experts_cover_prompt_plus_completion_minus_one_from_the_start(
    moe_dirs: tuple[Path, Path], http: aiohttp.ClientSession
) -> None:
    async with engine(moe_dirs[0], enable_return_routed_experts=True) as server:
        _, whole = await post(http, server.url + "/generate", _routed_body(PROMPT, 6))
        output = whole["output_ids"]
        # The same positions scored by one prefill (max_new_tokens 0) route the same: decode steps with the
        # KV cache record what a forward over the whole sequence records.
        _, scored = await post(http, server.url + "/generate", _routed_body(PROMPT + output, 0))
        _, tail = await post(http, server.url + "/generate", _routed_body(PROMPT + output, 0, start=4))
    routes = _routes(whole)
    assert len(routes) == len(PROMPT) + len(output) - 1
    assert all(0 <= e < 8 for row in routes for e in row)
    assert all(row[0] != row[1] and row[2] != row[3] for row in routes)  # distinct top-k per layer
    assert _routes(scored) == routes
    assert _routes(tail) == routes[4:]


async def test_the_prefix_cache_never_stands_in_for_positions_whose_routing_is_returned(
    moe_dirs: tuple[Path, Path], http: aiohttp.ClientSession
) -> None:
    """A later turn reuses the cached KV of the positions recorded before its start and computes the rest;
    a new episode on the same prompt (start 0) computes every position: the routing each returns is a
    cold forward's."""
    async with engine(moe_dirs[0], enable_return_routed_experts=True) as server:
        url = server.url + "/generate"
        _, first = await post(http, url, _routed_body(PROMPT, 6))
        turn2 = PROMPT + first["output_ids"] + [50, 51, 52]
        start = len(PROMPT) + len(first["output_ids"]) - 1  # what the client has recorded so far
        _, second = await post(http, url, _routed_body(turn2, 4, start=start))
        _, again = await post(http, url, _routed_body(PROMPT, 3))
        _, cold = await post(http, url, _routed_body(turn2 + second["output_ids"], 0))
    assert second["meta_info"]["cached_tokens"] > 0  # the prefix cache was used ...
    assert _routes(second) == _routes(cold)[start:]  # ... and the positions returned were computed
    assert again["meta_info"]["cached_tokens"] == 0
    assert _routes(again)[: len(PROMPT)] == _routes(first)[: len(PROMPT)]


async def test_batched_requests_record_what_each_records_alone(
    moe_dirs: tuple[Path, Path], http: aiohttp.ClientSession
) -> None:
    prompts = [PROMPT, PROMPT[:3], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49]]
    async with engine(moe_dirs[0], enable_return_routed_experts=True) as server:
        url = server.url + "/generate"
        together = await asyncio.gather(
            *(post(http, url, {**_routed_body(p, 5), "rid": f"b{i}"}) for i, p in enumerate(prompts))
        )
        alone = []
        for i, p in enumerate(prompts):
            _, obj = await post(
                http, url, {**_routed_body(p + together[i][1]["output_ids"], 0), "rid": f"a{i}"}
            )
            alone.append(obj)
    for (status, obj), single in zip(together, alone, strict=True):
        assert status == 200
        assert _routes(obj) == _routes(single)


async def test_without_the_flag_no_routed_experts_come_back(
    moe_dirs: tuple[Path, Path], http: aiohttp.ClientSession
) -> None:
    async with engine(moe_dirs[0]) as server:
        status, obj = await post(http, server.url + "/generate", _routed_body(PROMPT, 3))
        async with EngineClient(server.url) as client:
            with pytest.raises(Exception, match="--enable-return-routed-experts"):
                await client.generate(
                    PROMPT, SamplingParams(max_new_tokens=2), "c", routed_experts=RoutedExpertsRequest(0, 4)
                )
    assert status == 200 and "routed_experts" not in obj["meta_info"]


async def test_a_start_outside_the_prompt_is_a_400(
    moe_dirs: tuple[Path, Path], http: aiohttp.ClientSession
) -> None:
    async with engine(moe_dirs[0], enable_return_routed_experts=True) as server:
        status, obj = await post(
            http, server.url + "/generate", _routed_body(PROMPT, 2, start=len(PROMPT) + 1)
        )
    assert status == 400
    assert "routed_experts_start_len must be an int in [0, 7]" in obj["error"]["message"]


async def test_the_flag_with_a_dense_model_refuses_to_start(tiny_model_dir: Path) -> None:
    with pytest.raises(RuntimeError, match="--enable-return-routed-experts needs a Mixture-of-Experts model"):
        async with engine(tiny_model_dir, enable_return_routed_experts=True):
            pass
    assert parse_args(["--model", "m", "--enable-return-routed-experts"]).enable_return_routed_experts


async def test_an_moe_weight_update_is_served_and_a_dense_one_refused(
    moe_dirs: tuple[Path, Path], tiny_model_dir: Path, http: aiohttp.ClientSession
) -> None:
    learner_v1 = load_policy(moe_dirs[1])[0]
    overrides = {"enable_return_routed_experts": True, "allowed_weights_dirs": (str(moe_dirs[0].parent), "/")}
    async with engine(moe_dirs[0], **overrides) as server:
        _, before = await post(http, server.url + "/generate", _routed_body(PROMPT, 0))
        update = {"model_path": str(moe_dirs[1]), "weight_version": "1"}
        status, _ = await post(http, server.url + "/update_weights_from_disk", update)
        assert status == 200
        _, after = await post(http, server.url + "/generate", _routed_body(PROMPT, 4))
        dense = {"model_path": str(tiny_model_dir), "weight_version": "2"}
        refused, reply = await post(http, server.url + "/update_weights_from_disk", dense)
    assert after["meta_info"]["weight_version"] == "1"
    assert _routes(after)[: len(PROMPT) - 1] != _routes(before)  # other weights, other routing
    engine_lps = [entry[0] for entry in after["meta_info"]["output_token_logprobs"]]
    assert_parity(engine_lps, recompute_logprobs(learner_v1, PROMPT, after["output_ids"], 1.0))
    assert refused == 400 and "num_experts" in reply["message"]


async def test_a_lora_adapter_on_the_attention_of_an_moe_model_is_served(
    moe_dirs: tuple[Path, Path], tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    lora = LoraConfig(enabled=True, rank=4, alpha=8, target_modules=["q_proj", "v_proj"])
    policy = apply_lora(load_policy(moe_dirs[0])[0], lora, seed=1)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    policy.publish_adapter(tmp_path / "adapter", 1)
    policy.model.eval()
    flags = {"enable_lora": True, "max_lora_rank": 8, "lora_target_modules": ("q_proj", "v_proj")}
    async with engine(moe_dirs[0], **flags, lora_paths=(("A", str(tmp_path / "adapter")),)) as server:
        status, obj = await post(
            http, server.url + "/generate", {**gen_body(PROMPT, max_new_tokens=6), "lora_path": "A"}
        )
    assert status == 200
    engine_lps = [entry[0] for entry in obj["meta_info"]["output_token_logprobs"]]
    assert_parity(engine_lps, recompute_logprobs(policy.model, PROMPT, obj["output_ids"], 1.0))
