"""The SGLang fake answers as SGLang 0.5.23 does where a client can see it (rollwise issue 29, problem 8:
each of these once differed between the real server and the fake). Raw HTTP, no rollwise client."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from pipeline.tools.fake_sglang import FakeSGLang, Plan
from pipeline.tools.fake_sglang.sglang_rules import FLUSH_CRASH, FLUSH_FAILED


@pytest.fixture
async def fake() -> AsyncIterator[FakeSGLang]:
    server = FakeSGLang(vocab_size=100, context_length=64, token_delay_s=0.005)
    await server.start()
    yield server
    await server.stop()


async def post(fake: FakeSGLang, path: str, body: object | bytes) -> tuple[int, str, Any]:
    """(status, content type, parsed JSON or text) of one POST; raises ClientError if the server died."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    async with (
        aiohttp.ClientSession() as http,
        http.post(fake.base_url + path, data=data, headers=headers) as resp,
    ):
        text = await resp.text()
        kind = resp.headers.get("Content-Type", "").split(";")[0]
        return resp.status, kind, json.loads(text) if kind == "application/json" else text


async def get(fake: FakeSGLang, path: str) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as http, http.get(fake.base_url + path) as resp:
        return resp.status, await resp.json(content_type=None) if resp.status != 404 else await resp.text()


def generate_body(rid: str, ids: list[int] | None = None, **sampling: Any) -> dict[str, Any]:
    params = {"max_new_tokens": 4, **sampling}
    return {"input_ids": ids or [1, 2, 3], "sampling_params": params, "return_logprob": True, "rid": rid}


async def test_a_token_id_outside_the_vocabulary_kills_the_server(fake: FakeSGLang) -> None:
    with pytest.raises(aiohttp.ClientError):
        await post(fake, "/generate", generate_body("r", [1, 100]))
    assert fake.crashed is not None and "outside the vocabulary" in fake.crashed
    with pytest.raises(aiohttp.ClientConnectorError):
        await get(fake, "/health")
    await fake.restart()  # a new process on the same port
    assert (await get(fake, "/health"))[0] == 200


async def test_an_unknown_sampling_key_is_a_500_whose_request_leaks(fake: FakeSGLang) -> None:
    status, kind, body = await post(fake, "/generate", generate_body("leaky", top_q=0.5))
    assert (status, kind, body) == (500, "text/plain", "Internal Server Error")
    status, _, body = await post(fake, "/generate", generate_body("leaky"))
    assert status == 400 and body["message"] == "Duplicate request ID detected: leaky"
    assert fake.leaked_rids == {"leaky"}


@pytest.mark.parametrize(
    "raw",
    [
        b'{"input_ids": [1], "sampling_params": {"temperature": NaN}}',
        b'{"input_ids": [1], "sampling_params": {"temperature": Infinity}}',
        b'{"input_ids": [1], "sampling_params": {"sampling_seed": 18446744073709551616}}',
    ],
    ids=["nan", "infinity", "seed-2**64"],
)
async def test_json_that_is_not_json_or_overflows_64_bits_is_a_400(fake: FakeSGLang, raw: bytes) -> None:
    status, kind, body = await post(fake, "/generate", raw)
    assert (status, kind) == (400, "application/json")
    assert body["object"] == "error" and body["code"] == 400 and body["type"] == "Bad Request"


async def test_validation_errors_have_the_error_response_shape(fake: FakeSGLang) -> None:
    status, _, body = await post(fake, "/generate", generate_body("t", temperature=-1.0))
    assert status == 400 and list(body) == ["object", "message", "type", "param", "code"]
    assert body["message"] == "temperature must be a non-negative finite number, got -1.0."


async def test_a_prompt_that_leaves_no_room_for_max_new_tokens_is_refused(fake: FakeSGLang) -> None:
    status, _, body = await post(
        fake, "/generate", generate_body("long", list(range(1, 61)), max_new_tokens=8)
    )
    assert status == 400
    assert body["message"].startswith(
        "Requested token count exceeds the model's maximum context length of 64"
    )
    assert "60 tokens from the input messages and 8 tokens for the completion" in body["message"]
    status, _, body = await post(fake, "/generate", generate_body("longer", list(range(1, 65))))
    assert body["message"] == "The input (64 tokens) is longer than the model's context length (64 tokens)."


async def test_an_unknown_top_level_field_is_ignored_and_recorded(fake: FakeSGLang) -> None:
    status, _, body = await post(fake, "/generate", {**generate_body("x"), "return_logprobs": True})
    assert status == 200 and body["meta_info"]["id"] == "x"
    assert fake.ignored_fields == [("/generate", "return_logprobs")]


async def test_default_input_logprobs_are_empty_and_a_start_lists_the_prompt(fake: FakeSGLang) -> None:
    _, _, body = await post(fake, "/generate", generate_body("a"))
    assert body["meta_info"]["input_token_logprobs"] == []
    _, _, body = await post(fake, "/generate", {**generate_body("b"), "logprob_start_len": 0})
    entries = body["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in entries] == [1, 2, 3] and entries[0][0] is None


async def test_duplicate_rids_in_flight_are_refused_and_unknown_aborts_are_fine(fake: FakeSGLang) -> None:
    running = asyncio.create_task(post(fake, "/generate", generate_body("dup", max_new_tokens=40)))
    await fake.wait_running(1)
    status, _, body = await post(fake, "/generate", generate_body("dup"))
    assert status == 400 and body["message"] == "Duplicate request ID detected: dup"
    assert (await post(fake, "/abort_request", {"rid": "nobody"}))[0] == 200
    await running


async def test_a_missing_weights_path_is_a_400_and_no_crash(fake: FakeSGLang) -> None:
    status, _, body = await post(fake, "/update_weights_from_disk", {"model_path": "/nowhere/v9"})
    assert status == 400
    assert body == {
        "success": False,
        "message": "Failed to get weights iterator: /nowhere/v9 (repository not found).",
        "num_paused_requests": 0,
    }
    assert fake.crashed is None and fake.weight_version == "default"


async def test_a_flushing_update_with_requests_held_by_a_pause_kills_the_server(
    fake: FakeSGLang, tmp_path: Path
) -> None:
    busy = asyncio.create_task(post(fake, "/generate", generate_body("held", max_new_tokens=40)))
    await fake.wait_running(1)
    await post(fake, "/pause_generation", {"mode": "retract"})
    status, kind, text = await post(fake, "/flush_cache", b"")
    assert (status, kind, text) == (400, "text/plain", FLUSH_FAILED)
    with pytest.raises(aiohttp.ClientError):
        await post(fake, "/update_weights_from_disk", {"model_path": str(tmp_path), "weight_version": "1"})
    with pytest.raises(aiohttp.ClientError):
        await busy
    assert fake.crashed == FLUSH_CRASH


async def test_an_update_without_flush_survives_and_an_idle_flush_is_fine(
    fake: FakeSGLang, tmp_path: Path
) -> None:
    busy = asyncio.create_task(post(fake, "/generate", generate_body("held", max_new_tokens=40)))
    await fake.wait_running(1)
    await post(fake, "/pause_generation", {"mode": "in_place"})
    body = {"model_path": str(tmp_path), "weight_version": "1", "flush_cache": False}
    assert (await post(fake, "/update_weights_from_disk", body))[0] == 200
    await post(fake, "/continue_generation", {})
    status, _, reply = await busy
    assert status == 200 and reply["meta_info"]["weight_version"] == "1" and fake.crashed is None
    assert (await post(fake, "/flush_cache", b""))[0] == 200


async def test_a_request_aborted_in_the_waiting_queue_has_a_shorter_meta_info(fake: FakeSGLang) -> None:
    fake.max_running_requests = 1
    first = asyncio.create_task(post(fake, "/generate", generate_body("first", max_new_tokens=40)))
    second = asyncio.create_task(post(fake, "/generate", generate_body("second", max_new_tokens=40)))
    await fake.wait_running(2)
    await post(fake, "/pause_generation", {"mode": "abort"})  # returns once both are gone
    (_, _, running), (_, _, queued) = await first, await second
    assert running["meta_info"]["finish_reason"] == {
        "type": "abort",
        "message": "Aborted",
        "status_code": None,
        "err_type": None,
    }
    assert running["output_ids"] and "prompt_tokens" in running["meta_info"]
    assert queued["meta_info"]["finish_reason"] == {"type": "abort", "message": "Abort in waiting queue"}
    assert queued["output_ids"] == []
    assert "prompt_tokens" not in queued["meta_info"] and "cached_tokens" not in queued["meta_info"]


async def test_a_paused_server_holds_new_requests_until_continue(fake: FakeSGLang) -> None:
    await post(fake, "/pause_generation", {"mode": "abort"})
    held = asyncio.create_task(post(fake, "/generate", generate_body("later")))
    await asyncio.sleep(0.05)
    assert not held.done() and fake.running_rids == []
    await post(fake, "/continue_generation", {})
    assert (await held)[0] == 200


async def test_retract_requeues_the_running_batch_and_it_continues_with_its_tokens(fake: FakeSGLang) -> None:
    fake.script = lambda call: Plan(list(range(10, 30)), finish="length")
    busy = asyncio.create_task(post(fake, "/generate", generate_body("r", max_new_tokens=20)))
    await fake.wait_running(1)
    await asyncio.sleep(0.03)
    await post(fake, "/pause_generation", {"mode": "retract"})
    await asyncio.sleep(0.03)
    await post(fake, "/continue_generation", {})
    _, _, body = await busy
    assert body["output_ids"] == list(range(10, 30))  # one continuous reply
    assert body["meta_info"]["num_retractions"] == 1


async def test_server_info_and_get_load_count_requests_where_sglang_does(fake: FakeSGLang) -> None:
    status, info = await get(fake, "/server_info")
    assert status == 200 and info["max_running_requests"] == 256 and info["context_length"] == 64
    [state] = info["internal_states"]
    assert "num_running_reqs" not in state and state["effective_max_running_requests_per_dp"] == 256
    busy = asyncio.create_task(post(fake, "/generate", generate_body("busy", max_new_tokens=40)))
    await fake.wait_running(1)
    status, loads = await get(fake, "/get_load")
    assert status == 200 and [(x["dp_rank"], x["num_reqs"], x["num_waiting_reqs"]) for x in loads] == [
        (0, 1, 0)
    ]
    await busy


async def test_routes_sglang_does_not_serve_are_404(fake: FakeSGLang) -> None:
    assert (await get(fake, "/metrics"))[0] == 404  # only with --enable-metrics
    status, body = await get(fake, "/get_weight_version")
    assert status == 404 and "deprecated. Please use '/model_info' instead." in body


# ------------------------------------------------------------------------------------------ stop strings
async def test_a_stop_string_ends_the_request_after_the_token_that_completes_it_untrimmed(
    fake: FakeSGLang,
) -> None:
    # The fake's own detokenizer writes "<id>" per token: the string "<7><8>" is complete after token 8.
    fake.script = lambda call: Plan([5, 7, 8, 9, 11], [-0.1, -0.2, -0.3, -0.4, -0.5], "length")
    body = generate_body("r", stop=["<8>", "<5><9>"], max_new_tokens=8)
    status, _, reply = await post(fake, "/generate", body)
    assert status == 200
    assert reply["output_ids"] == [5, 7, 8]  # every sampled token, the stop string's own included
    assert [e[0] for e in reply["meta_info"]["output_token_logprobs"]] == [-0.1, -0.2, -0.3]
    assert reply["meta_info"]["finish_reason"] == {"type": "stop", "matched": "<8>"}
    assert reply["text"] == "<5><7>"  # trim_matched_stop: the text is cut before the string


async def test_stop_strings_yield_to_the_length_limit_and_to_stop_tokens(fake: FakeSGLang) -> None:
    # check_finished's order: length first, then a stop token, then the strings.
    fake.script = lambda call: Plan([5, 7, 8], [-0.1] * 3, "length")
    status, _, reply = await post(fake, "/generate", generate_body("a", stop="<8>", max_new_tokens=3))
    assert (status, reply["meta_info"]["finish_reason"]) == (200, {"type": "length", "length": 3})
    fake.script = lambda call: Plan([5, 7, 8], [-0.1] * 3, "stop", 8)
    _, _, reply = await post(fake, "/generate", generate_body("b", stop="<8>", max_new_tokens=9))
    assert reply["meta_info"]["finish_reason"] == {"type": "stop", "matched": 8}


async def test_a_stop_string_decodes_with_the_given_tokenizer(tok: Any) -> None:
    ids = list(tok.encode("Thought: add them\nObservation: 5", add_special_tokens=False))
    server = FakeSGLang(tokenizer=tok, script=lambda call: Plan(ids, [-1.0] * len(ids), "length"))
    await server.start()
    try:
        status, _, reply = await post(
            server, "/generate", generate_body("r", stop=["Observation:"], max_new_tokens=64)
        )
    finally:
        await server.stop()
    assert status == 200
    out = reply["output_ids"]
    assert out == ids[: len(out)] and len(out) < len(ids)
    assert tok.decode(out).endswith("Observation:") or "Observation:" in tok.decode(out[-4:])
    assert "Observation:" not in tok.decode(out[:-1])  # it stopped at the first token that completed it
    assert reply["text"] == "Thought: add them\n"


async def test_a_server_without_a_tokenizer_refuses_stop_strings() -> None:
    server = FakeSGLang(skip_tokenizer_init=True)
    await server.start()
    try:
        status, _, reply = await post(server, "/generate", generate_body("r", stop=["x"]))
    finally:
        await server.stop()
    assert status == 400
    assert reply["message"].startswith("stop=['x'] is unavailable when skip_tokenizer_init=True")


# ------------------------------------------------------------------------------ routed experts (MoE)
async def test_routed_experts_come_back_only_from_a_server_launched_to_record_them(fake: FakeSGLang) -> None:
    import base64
    import struct

    fake.script = lambda call: Plan([7, 8, 9])
    body = {**generate_body("r0", [1, 2, 3, 4]), "return_routed_experts": True, "routed_experts_start_len": 1}
    status, _, reply = await post(fake, "/generate", body)
    assert status == 200 and "routed_experts" not in reply["meta_info"]  # no --enable-return-routed-experts
    fake.routed_experts = (2, 2, 8)
    status, _, reply = await post(fake, "/generate", {**body, "rid": "r1"})
    raw = base64.b64decode(reply["meta_info"]["routed_experts"])
    values = struct.unpack(f"<{len(raw) // 4}i", raw)
    assert len(values) == (4 + 3 - 1 - 1) * 2 * 2  # positions [1, prompt + completion - 1) x layers x k
    assert all(0 <= v < 8 for v in values)
    assert all(values[i] != values[i + 1] for i in range(0, len(values), 2))  # top-k ids are distinct


@pytest.mark.parametrize(("start", "ok"), [(0, True), (4, True), (5, False), (-1, False), ("1", False)])
async def test_routed_experts_start_len_must_lie_in_the_prompt(
    fake: FakeSGLang, start: object, ok: bool
) -> None:
    fake.routed_experts = (2, 2, 8)
    body = {
        **generate_body("r", [1, 2, 3, 4]),
        "return_routed_experts": True,
        "routed_experts_start_len": start,
    }
    status, _, reply = await post(fake, "/generate", body)
    assert (status == 200) == ok
    if not ok:
        assert "routed_experts_start_len must be in [0, prompt_tokens]" in reply["message"]
