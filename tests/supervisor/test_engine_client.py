"""EngineClient and the /generate protocol, against the fake SGLang server over real HTTP (127.0.0.1)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from pipeline.supervisor.engines.client import EngineClient
from pipeline.supervisor.engines.protocol import (
    EngineHTTPError,
    EngineProtocolError,
    EngineUnavailable,
    GenerateResult,
    SamplingParams,
    parse_generate_response,
    version_to_int,
)
from pipeline.tools.fake_sglang import FakeSGLang, GenerateCall, Plan, free_port
from pipeline.tools.fake_sglang.sglang_rules import FLUSH_OK

FAST_BACKOFF: dict[str, Any] = {"backoff_base_s": 0.001, "backoff_max_s": 0.004}


def scripted(ids: list[int], logprobs: list[float], finish: str = "stop") -> Any:
    def script(call: GenerateCall) -> Plan:
        return Plan(list(ids), list(logprobs), finish)

    return script


@pytest.fixture
async def client(fake: FakeSGLang) -> AsyncIterator[EngineClient]:
    async with EngineClient(fake.base_url, **FAST_BACKOFF) as c:
        yield c


def valid_response(rid: str = "r1") -> dict[str, Any]:
    return {
        "text": " Paris.",
        "output_ids": [12366, 13, 151645],
        "meta_info": {
            "id": rid,
            "finish_reason": {"type": "stop", "matched": 151645},
            "prompt_tokens": 7,
            "weight_version": "4",
            "completion_tokens": 3,
            "cached_tokens": 2,
            "input_token_logprobs": [[None, 1234, None]],
            "output_token_logprobs": [[-0.012, 12366, None], [-0.21, 13, None], [-0.0009, 151645, None]],
            "e2e_latency": 0.183,
            "some_future_field": {"x": 1},
        },
    }


# ---------------------------------------------------------------------------- protocol (pure)


def test_sampling_params_wire_form_has_exactly_sglang_keys() -> None:
    assert SamplingParams(max_new_tokens=64, stop_token_ids=(7, 9)).to_wire() == {
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "min_p": 0.0,
        "max_new_tokens": 64,
        "stop_token_ids": [7, 9],
        "skip_special_tokens": False,
        "no_stop_trim": True,
    }
    assert SamplingParams(seed=11).to_wire()["sampling_seed"] == 11
    assert SamplingParams(stop=("Observation:",)).to_wire()["stop"] == ["Observation:"]
    assert "stop" not in SamplingParams().to_wire()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"top_p": 0.0}, "top_p"), ({"temperature": -1.0}, "temperature"), ({"top_k": 0}, "top_k"),
     ({"max_new_tokens": -1}, "max_new_tokens"), ({"min_p": 1.5}, "min_p"), ({"stop": ("",)}, "stop")],
)  # fmt: skip
def test_sampling_params_reject_out_of_range_values_naming_the_field(
    kwargs: dict[str, Any], field: str
) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_version_to_int_maps_default_and_decimals_and_rejects_others() -> None:
    assert version_to_int("default") == 0
    assert version_to_int("0") == 0
    assert version_to_int("17") == 17
    for bad in ["v3", "-1", "", "1.5", " 2"]:
        with pytest.raises(EngineProtocolError, match="weight_version"):
            version_to_int(bad)


def test_parse_valid_response_reads_every_field_and_ignores_unknown_ones() -> None:
    result = parse_generate_response(valid_response(), expected_rid="r1")
    assert result.rid == "r1"
    assert result.output_ids == [12366, 13, 151645]
    assert result.logprobs == [-0.012, -0.21, -0.0009]
    assert result.finish_reason == "stop"
    assert result.weight_version == "4"
    assert result.token_versions == ["4", "4", "4"]
    assert (result.prompt_tokens, result.completion_tokens, result.cached_tokens) == (7, 3, 2)
    assert result.abort_message is None


def test_parse_defaults_missing_weight_version_and_cached_tokens() -> None:
    obj = valid_response()
    del obj["meta_info"]["weight_version"]
    del obj["meta_info"]["cached_tokens"]
    result = parse_generate_response(obj, expected_rid="r1")
    assert result.weight_version == "default"
    assert result.token_versions == ["default"] * 3
    assert result.cached_tokens == 0


def test_parse_uses_per_token_versions_extension() -> None:
    obj = valid_response()
    obj["meta_info"]["output_token_weight_versions"] = ["3", "3", "4"]
    assert parse_generate_response(obj, expected_rid="r1").token_versions == ["3", "3", "4"]
    obj["meta_info"]["output_token_weight_versions"] = ["3", "4"]
    with pytest.raises(EngineProtocolError, match="output_token_weight_versions has 2 entries for 3"):
        parse_generate_response(obj, expected_rid="r1")


def test_parse_accepts_abort_from_waiting_queue_without_tokens() -> None:
    obj = {
        "output_ids": [],
        "meta_info": {
            "id": "r1",
            "finish_reason": {"type": "abort", "message": "Abort in waiting queue", "status_code": None},
            "prompt_tokens": 5,
            "completion_tokens": 0,
        },
    }
    result = parse_generate_response(obj, expected_rid="r1")
    assert result.finish_reason == "abort"
    assert result.output_ids == [] and result.logprobs == []
    assert result.abort_message == "Abort in waiting queue"


@pytest.mark.parametrize(
    ("mutate", "defect"),
    [
        (lambda o: o.__setitem__("meta_info", None), "no meta_info"),
        (lambda o: o["meta_info"].__setitem__("prompt_tokens", "7"), "meta_info.prompt_tokens"),
        (lambda o: o["meta_info"]["output_token_logprobs"][1].__setitem__(1, "13"), r"\[1\] token id"),
        (lambda o: o["meta_info"]["output_token_logprobs"].__setitem__(0, -0.1), r"\[0\] is -0.1"),
        (lambda o: o.__setitem__("output_ids", [1, "2", 3]), "output_ids is not a list of ints"),
        (lambda o: o["meta_info"].__setitem__("weight_version", 3), "weight_version 3 is not a string"),
        (lambda o: o["meta_info"]["output_token_logprobs"][2].__setitem__(0, True), "not a finite number"),
    ],
)
def test_parse_rejects_malformed_fields(mutate: Any, defect: str) -> None:
    obj = valid_response()
    mutate(obj)
    with pytest.raises(EngineProtocolError, match=defect):
        parse_generate_response(obj, expected_rid="r1")


def test_parse_accepts_integer_logprobs_as_floats() -> None:
    obj = valid_response()
    obj["meta_info"]["output_token_logprobs"][0][0] = 0  # a serializer may write 0.0 as 0
    result = parse_generate_response(obj, expected_rid="r1")
    assert result.logprobs == [0.0, -0.21, -0.0009]
    assert all(type(lp) is float for lp in result.logprobs)


PARSED = GenerateResult(
    rid="r1",
    output_ids=[12366, 13, 151645],
    logprobs=[-0.012, -0.21, -0.0009],
    finish_reason="stop",
    weight_version="4",
    token_versions=["4", "4", "4"],
    prompt_tokens=7,
    completion_tokens=3,
    cached_tokens=2,
)


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (lambda o: None, PARSED),  # the common reply (parsed in one pass)
        (
            lambda o: o["meta_info"].__setitem__("finish_reason", {"type": "length"}),
            dataclasses.replace(PARSED, finish_reason="length"),
        ),
        (
            lambda o: o["meta_info"].pop("weight_version"),
            dataclasses.replace(PARSED, weight_version="default", token_versions=["default"] * 3),
        ),
        (lambda o: o["meta_info"].pop("cached_tokens"), dataclasses.replace(PARSED, cached_tokens=0)),
        # Replies the one-pass parse leaves to the field-by-field checks, with the same results:
        (lambda o: o.pop("output_ids"), PARSED),  # ids from the log-prob entries
        (lambda o: o["meta_info"].__setitem__("output_token_weight_versions", None), PARSED),
        (
            lambda o: o["meta_info"]["output_token_logprobs"][0].__setitem__(0, 0),  # an int log-prob
            dataclasses.replace(PARSED, logprobs=[0.0, -0.21, -0.0009]),
        ),
    ],
    ids=[
        "common",
        "length",
        "no-weight-version",
        "no-cached-tokens",
        "no-output-ids",
        "null-versions",
        "int",
    ],
)
def test_valid_replies_parse_to_exactly_their_fields(mutate: Any, expected: GenerateResult) -> None:
    obj = valid_response()
    mutate(obj)
    result = parse_generate_response(obj, expected_rid="r1")
    assert result == expected
    assert all(type(lp) is float for lp in result.logprobs)
    assert all(type(t) is int for t in result.output_ids)


@pytest.mark.parametrize(
    ("mutate", "defect"),
    [
        (lambda o: o.__setitem__("output_ids", [12366, True, 151645]), "output_ids is not a list of ints"),
        (lambda o: o.__setitem__("output_ids", [12366, 13.0, 151645]), "output_ids is not a list of ints"),
        (lambda o: o.__setitem__("output_ids", [12366, 14, 151645]), r"output_ids\[1\]=14 but"),
        (lambda o: o["meta_info"].__setitem__("completion_tokens", 2), "completion_tokens=2 but 3"),
        (lambda o: o["meta_info"].__setitem__("completion_tokens", 3.0), "completion_tokens is 3.0"),
        (lambda o: o["meta_info"].__setitem__("cached_tokens", None), "cached_tokens is None"),
        (lambda o: o["meta_info"].__setitem__("id", "r2"), "differs from the request's rid"),
        (
            lambda o: o["meta_info"]["output_token_logprobs"][0].__setitem__(0, math.nan),
            "not a finite number",
        ),
    ],
)
def test_replies_with_one_defect_raise_it(mutate: Any, defect: str) -> None:
    obj = valid_response()
    mutate(obj)
    with pytest.raises(EngineProtocolError, match=defect):
        parse_generate_response(obj, expected_rid="r1")


async def test_generate_keeps_its_request_timeout_after_health_probes_and_follows_changes(
    fake: FakeSGLang,
) -> None:
    lengths = {"quick": 4, "slow": 40, "medium": 20}  # at 0.02 s a token: 0.08 s, 0.8 s, 0.4 s
    fake.token_delay_s = 0.02
    fake.script = lambda call: Plan(list(range(5, 5 + lengths[call.rid])), [-0.1] * lengths[call.rid])
    async with EngineClient(fake.base_url, request_timeout_s=0.3, retries=0, **FAST_BACKOFF) as c:
        quick = await c.generate([1, 2], SamplingParams(max_new_tokens=50), "quick")
        assert quick.output_ids == [5, 6, 7, 8]
        assert await c.health(timeout_s=25.0) is True  # a probe's own, longer limit
        started = time.monotonic()
        with pytest.raises(EngineUnavailable, match=r"no complete reply within 0.3 s"):
            await c.generate([1, 2], SamplingParams(max_new_tokens=50), "slow")
        assert time.monotonic() - started < 0.7  # the 0.3 s limit held, not the probe's 25 s
        c.request_timeout_s = 5.0
        medium = await c.generate([1, 2], SamplingParams(max_new_tokens=50), "medium")
        assert medium.output_ids == list(range(5, 25))  # 0.4 s: longer than the old limit
    assert fake.count("/generate") == 3


def test_parse_rejects_a_json_array() -> None:
    with pytest.raises(EngineProtocolError, match="JSON list, expected an object"):
        parse_generate_response([valid_response()], expected_rid="r1")


# ---------------------------------------------------------------------------- generate


async def test_generate_sends_exactly_the_reference_request_and_parses_the_reply(
    fake: FakeSGLang, client: EngineClient
) -> None:
    fake.vocab_size = 151_936  # Qwen3's ids
    fake.script = scripted([5, 6, 151645], [-0.25, -1.5, -0.125])
    sampling = SamplingParams(max_new_tokens=1024, stop_token_ids=(151645,))
    result = await client.generate([151644, 872, 198], sampling, "step12-group3-sample0")

    [recorded] = [r for r in fake.requests if r.path == "/generate"]
    assert recorded.method == "POST"
    assert recorded.headers["Content-Type"].startswith("application/json")
    assert "Authorization" not in recorded.headers
    assert recorded.json() == {
        "input_ids": [151644, 872, 198],
        "sampling_params": {
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": -1,
            "min_p": 0.0,
            "max_new_tokens": 1024,
            "stop_token_ids": [151645],
            "skip_special_tokens": False,
            "no_stop_trim": True,
        },
        "return_logprob": True,
        "rid": "step12-group3-sample0",
    }
    assert result.rid == "step12-group3-sample0"
    assert result.output_ids == [5, 6, 151645]
    assert result.logprobs == [-0.25, -1.5, -0.125]
    assert result.finish_reason == "stop"
    assert (result.prompt_tokens, result.completion_tokens, result.cached_tokens) == (3, 3, 0)
    assert result.weight_version == "default"


async def test_default_fake_completion_is_deterministic_and_stops_on_stop_token(client: EngineClient) -> None:
    sampling = SamplingParams(max_new_tokens=200, stop_token_ids=(3,))
    first = await client.generate([10, 11, 12], sampling, "a")
    again = await client.generate([10, 11, 12], sampling, "b")
    other = await client.generate([10, 11, 13], sampling, "c")
    assert first.output_ids == again.output_ids and first.logprobs == again.logprobs
    assert other.output_ids != first.output_ids
    for result in (first, other):
        assert all(-5.0 < lp < 0.0 for lp in result.logprobs)
        if result.finish_reason == "stop":
            assert result.output_ids[-1] == 3 and 3 not in result.output_ids[:-1]
        else:
            assert result.finish_reason == "length" and len(result.output_ids) == 200
    # The second identical prompt hits the prefix cache (all but the last prompt token).
    assert again.cached_tokens == 2


async def test_sampling_seed_is_sent_only_when_set(fake: FakeSGLang, client: EngineClient) -> None:
    await client.generate([1, 2], SamplingParams(max_new_tokens=2, seed=5), "s1")
    await client.generate([1, 2], SamplingParams(max_new_tokens=2), "s2")
    with_seed, without = fake.generate_requests()
    assert with_seed["sampling_params"]["sampling_seed"] == 5
    assert "sampling_seed" not in without["sampling_params"]


async def test_stop_strings_are_sent_and_the_matched_string_comes_back(
    fake: FakeSGLang, client: EngineClient
) -> None:
    fake.script = lambda call: Plan([5, 7, 8, 9], [-0.1, -0.2, -0.3, -0.4], "length")
    result = await client.generate([1, 2], SamplingParams(max_new_tokens=8, stop=("<7>",)), "s1")
    assert (result.output_ids, result.logprobs) == ([5, 7], [-0.1, -0.2])
    assert (result.finish_reason, result.matched) == ("stop", "<7>")
    [sent] = fake.generate_requests()
    assert sent["sampling_params"]["stop"] == ["<7>"] and fake.ignored_fields == []
    fake.script = lambda call: Plan([5, 6], [-0.1, -0.2], "stop", 6)
    token_stop = await client.generate([1, 2], SamplingParams(max_new_tokens=8, stop=("<7>",)), "s2")
    assert (token_stop.finish_reason, token_stop.matched) == ("stop", None)


MALFORMED = [
    ("missing_logprobs", "output_token_logprobs is missing"),
    ("null_logprob", r"output_token_logprobs\[0\] logprob is null"),
    ("nan_logprob", r"output_token_logprobs\[0\] logprob nan is not a finite number"),
    ("inf_logprob", r"output_token_logprobs\[0\] logprob -inf is not a finite number"),
    ("length_mismatch", "output_token_logprobs has 2 entries for 3 output_ids"),
    ("id_mismatch", r"output_ids\[0\]=7 but meta_info.output_token_logprobs\[0\] is for token 8"),
    ("unknown_finish", "finish_reason.type 'cancelled' is not one of"),
    ("missing_finish_reason", "finish_reason is None"),
    ("wrong_completion_tokens", "completion_tokens=4 but 3 output_ids"),
    ("wrong_rid", "differs from the request's rid"),
    ("bad_token_versions", "output_token_weight_versions has 4 entries for 3 output tokens"),
    ("not_json", "non-JSON body"),
]


@pytest.mark.parametrize(("fault", "defect"), MALFORMED)
async def test_malformed_response_raises_protocol_error_naming_defect_and_rid(
    fake: FakeSGLang, client: EngineClient, fault: str, defect: str
) -> None:
    fake.script = scripted([7, 8, 9], [-0.5, -0.25, -0.125])
    fake.queue_faults(fault)
    with pytest.raises(EngineProtocolError, match=defect) as info:
        await client.generate([1, 2, 3], SamplingParams(max_new_tokens=3), "bad-1")
    assert "rid='bad-1'" in str(info.value)
    assert fake.count("/generate") == 1  # a protocol error is not retried


async def test_missing_output_ids_falls_back_to_logprob_ids(fake: FakeSGLang, client: EngineClient) -> None:
    fake.script = scripted([7, 8, 9], [-0.5, -0.25, -0.125])
    fake.queue_faults("missing_output_ids")
    result = await client.generate([1], SamplingParams(max_new_tokens=3), "r")
    assert result.output_ids == [7, 8, 9]


async def test_http_400_raises_with_server_message_and_is_not_retried(
    fake: FakeSGLang, client: EngineClient
) -> None:
    with pytest.raises(EngineHTTPError) as info:
        await client.generate([], SamplingParams(), "empty")
    assert info.value.status == 400
    assert info.value.message == "input_ids cannot be empty."
    assert info.value.url == fake.base_url + "/generate"
    assert fake.count("/generate") == 1


async def test_generate_retries_503_but_not_500(fake: FakeSGLang, client: EngineClient) -> None:
    fake.queue_faults("http_503", "http_503")
    result = await client.generate([1, 2], SamplingParams(max_new_tokens=4), "r503")
    assert len(result.output_ids) == 4
    assert fake.count("/generate") == 3

    fake.queue_faults("http_500")
    with pytest.raises(EngineHTTPError) as info:
        await client.generate([1, 2], SamplingParams(max_new_tokens=4), "r500")
    assert info.value.status == 500
    assert fake.count("/generate") == 4  # a generate that may have run is never resent


async def test_control_call_500_then_success_is_retried(fake: FakeSGLang, client: EngineClient) -> None:
    fake.fail_next("/model_info", 500, 502)
    info = await client.model_info()
    assert info["model_path"] == "fake/model"
    assert fake.count("/model_info") == 3


async def test_retries_give_up_after_the_configured_number(fake: FakeSGLang) -> None:
    fake.fail_next("/model_info", 500, 500, 500)
    async with EngineClient(fake.base_url, retries=2, **FAST_BACKOFF) as c:
        with pytest.raises(EngineHTTPError) as info:
            await c.model_info()
    assert info.value.status == 500
    assert fake.count("/model_info") == 3


async def test_connection_dropped_mid_generate_is_not_resent(fake: FakeSGLang, client: EngineClient) -> None:
    fake.queue_faults("drop_connection")
    with pytest.raises(EngineUnavailable) as info:
        await client.generate([1, 2], SamplingParams(max_new_tokens=4), "drop")
    assert info.value.maybe_sent
    assert fake.count("/generate") == 1


async def test_generate_times_out_without_retry(fake: FakeSGLang) -> None:
    fake.token_delay_s = 0.1
    async with EngineClient(fake.base_url, request_timeout_s=0.2, **FAST_BACKOFF) as c:
        started = time.monotonic()
        with pytest.raises(EngineUnavailable, match=r"no complete reply within 0.2 s") as info:
            await c.generate([1, 2], SamplingParams(max_new_tokens=50), "slow")
    assert time.monotonic() - started < 1.0
    assert info.value.maybe_sent
    assert fake.count("/generate") == 1


async def test_waiting_for_a_pooled_connection_does_not_count_as_a_connect_timeout(fake: FakeSGLang) -> None:
    # One connection, three requests of ~0.2 s each: the last waits ~0.4 s for the pool, longer than the
    # 0.1 s connect timeout. Only opening the socket is bounded by it, so all three succeed.
    fake.token_delay_s = 0.05
    fake.script = scripted([5, 6, 7, 8], [-0.1] * 4)
    async with EngineClient(
        fake.base_url, max_connections=1, connect_timeout_s=0.1, retries=0, **FAST_BACKOFF
    ) as c:
        started = time.monotonic()
        results = await asyncio.gather(
            *(c.generate([1, 2], SamplingParams(max_new_tokens=4), f"pool-{i}") for i in range(3))
        )
    assert time.monotonic() - started > 0.3  # the requests really were serialised on one connection
    assert [r.output_ids for r in results] == [[5, 6, 7, 8]] * 3
    assert fake.count("/generate") == 3


async def test_connection_refused_is_retried_then_reported_as_not_sent() -> None:
    async with EngineClient(f"http://127.0.0.1:{free_port()}", retries=2, **FAST_BACKOFF) as c:
        with pytest.raises(EngineUnavailable, match="cannot connect") as info:
            await c.generate([1], SamplingParams(), "r")
        assert not info.value.maybe_sent
        assert c.breaker.consecutive_failures == 3  # first attempt + 2 retries


async def test_circuit_opens_after_consecutive_failures_fails_fast_then_half_opens() -> None:
    port = free_port()
    async with EngineClient(
        f"http://127.0.0.1:{port}", retries=0, circuit_failures=3, circuit_reset_s=0.3, **FAST_BACKOFF
    ) as c:
        for _ in range(3):
            with pytest.raises(EngineUnavailable, match="cannot connect"):
                await c.generate([1], SamplingParams(max_new_tokens=1), "r")
        assert c.breaker.is_open
        started = time.monotonic()
        with pytest.raises(EngineUnavailable, match="circuit open after 3 consecutive") as info:
            await c.generate([1], SamplingParams(max_new_tokens=1), "r")
        assert time.monotonic() - started < 0.5
        assert not info.value.maybe_sent

        # Half-open: one trial goes through; it fails again, so the circuit re-opens at once.
        await asyncio.sleep(0.35)
        with pytest.raises(EngineUnavailable, match="cannot connect"):
            await c.generate([1], SamplingParams(max_new_tokens=1), "r")
        with pytest.raises(EngineUnavailable, match="circuit open"):
            await c.generate([1], SamplingParams(max_new_tokens=1), "r")

        # The server comes up: after the reset time the trial succeeds and closes the circuit.
        server = FakeSGLang()
        await server.start(port=port)
        try:
            await asyncio.sleep(0.35)
            result = await c.generate([1], SamplingParams(max_new_tokens=2), "r")
            assert len(result.output_ids) == 2
            assert c.breaker.opened_at is None and c.breaker.consecutive_failures == 0
        finally:
            await server.stop()


def test_client_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="must start with http"):
        EngineClient("127.0.0.1:30000")
    with pytest.raises(ValueError, match="retries >= 0"):
        EngineClient("http://127.0.0.1:1", retries=-1)
    with pytest.raises(ValueError, match="credentials, a query or a fragment"):
        EngineClient("http://user:secret@127.0.0.1:30000")


async def test_closed_client_raises_unavailable(fake: FakeSGLang) -> None:
    c = EngineClient(fake.base_url)
    await c.close()
    with pytest.raises(EngineUnavailable, match="client is closed"):
        await c.generate([1], SamplingParams(), "r")


async def test_many_concurrent_generates_run_at_once_on_one_client(
    fake: FakeSGLang, client: EngineClient
) -> None:
    results = await asyncio.gather(
        *(client.generate([i, i + 1], SamplingParams(max_new_tokens=3), f"c{i}") for i in range(64))
    )
    assert [r.rid for r in results] == [f"c{i}" for i in range(64)]
    assert all(len(r.output_ids) == 3 for r in results)
    assert fake.peak_running > 1


async def test_max_connections_bounds_concurrent_requests(fake: FakeSGLang) -> None:
    fake.token_delay_s = 0.01
    async with EngineClient(fake.base_url, max_connections=2) as c:
        results = await asyncio.gather(
            *(c.generate([i], SamplingParams(max_new_tokens=5), f"m{i}") for i in range(6))
        )
    assert len(results) == 6
    assert fake.peak_running == 2


async def test_update_reporting_success_false_with_200_raises(fake: FakeSGLang, client: EngineClient) -> None:
    fake.fail_next(
        "/update_weights_from_disk", (200, {"success": False, "message": "shape mismatch: lm_head"})
    )
    with pytest.raises(EngineHTTPError, match="shape mismatch: lm_head") as info:
        await client.update_weights_from_disk("/w/v1", weight_version="1")
    assert info.value.status == 200


async def test_health_is_false_on_server_errors(fake: FakeSGLang, client: EngineClient) -> None:
    fake.fail_next("/health", 500)
    assert await client.health() is False
    assert await client.health() is True


# ---------------------------------------------------------------------------- health and info


async def test_health_is_false_while_503_and_true_once_ready(fake: FakeSGLang, client: EngineClient) -> None:
    fake.ready = False
    assert await client.health() is False
    fake.ready = True
    assert await client.health() is True


async def test_health_is_false_when_nothing_listens() -> None:
    async with EngineClient(f"http://127.0.0.1:{free_port()}") as c:
        assert await c.health() is False


async def test_wait_ready_returns_once_server_is_warm_and_times_out_otherwise() -> None:
    server = FakeSGLang(ready_after_s=0.3)
    await server.start()
    try:
        async with EngineClient(server.base_url) as c:
            started = time.monotonic()
            await c.wait_ready(5.0, poll_interval_s=0.05)
            assert 0.25 <= time.monotonic() - started < 2.0
            server.ready = False
            with pytest.raises(EngineUnavailable, match=r"not ready after 0.2 s"):
                await c.wait_ready(0.2, poll_interval_s=0.05)
    finally:
        await server.stop()


async def test_model_info_falls_back_to_get_model_info_on_old_servers() -> None:
    server = FakeSGLang(has_model_info_route=False, weight_version="2")
    await server.start()
    try:
        async with EngineClient(server.base_url, **FAST_BACKOFF) as c:
            info = await c.model_info()
        assert info == {
            "model_path": "fake/model",
            "tokenizer_path": "fake/model",
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "2",
        }
        assert [r.path for r in server.requests] == ["/model_info", "/get_model_info"]
    finally:
        await server.stop()


async def test_api_key_is_sent_as_bearer_and_a_401_is_not_retried() -> None:
    server = FakeSGLang(api_key="sekrit")
    await server.start()
    try:
        async with EngineClient(server.base_url, api_key="sekrit") as good:
            await good.generate([1], SamplingParams(max_new_tokens=1), "r")
            assert server.requests[-1].headers["Authorization"] == "Bearer sekrit"
        async with EngineClient(server.base_url, **FAST_BACKOFF) as anonymous:
            with pytest.raises(EngineHTTPError) as info:
                await anonymous.model_info()
            assert (info.value.status, info.value.message) == (401, "Unauthorized")
            with pytest.raises(EngineHTTPError, match="401"):
                await anonymous.health()
        assert server.count("/model_info") == 1
    finally:
        await server.stop()


# ---------------------------------------------------------------------------- weights and control


async def test_update_weights_changes_the_version_of_later_responses(
    fake: FakeSGLang, client: EngineClient, tmp_path: Path
) -> None:
    weights = tmp_path / "weights" / "v3"
    weights.mkdir(parents=True)
    before = await client.generate([1, 2], SamplingParams(max_new_tokens=2), "before")
    reply = await client.update_weights_from_disk(str(weights), weight_version="3")
    after = await client.generate([1, 2], SamplingParams(max_new_tokens=2), "after")
    assert reply == {
        "success": True,
        "message": "Succeeded to update model weights. Weight version updated to 3.",
        "num_paused_requests": 0,
    }
    assert fake.update_calls == [
        {
            "model_path": str(weights),
            "weight_version": "3",
            "abort_all_requests": False,
            "flush_cache": True,
        }
    ]
    assert before.weight_version == "default" and version_to_int(before.weight_version) == 0
    assert after.weight_version == "3" and after.token_versions == ["3", "3"]
    assert (await client.model_info())["weight_version"] == "3"


async def test_failed_weight_update_raises_with_server_message_without_retry(
    fake: FakeSGLang, client: EngineClient
) -> None:
    with pytest.raises(EngineHTTPError) as info:
        await client.update_weights_from_disk("/missing/v9", weight_version="9")
    assert info.value.status == 400
    assert "/missing/v9" in info.value.message
    assert fake.count("/update_weights_from_disk") == 1
    assert fake.weight_version == "default"


async def test_pause_holds_new_generate_until_continue(fake: FakeSGLang, client: EngineClient) -> None:
    reply = await client.pause_generation("in_place")
    assert reply == {"message": "Generation paused successfully.", "status": "ok"}
    assert fake.requests[-1].json() == {"mode": "in_place"}
    task = asyncio.create_task(client.generate([4, 5], SamplingParams(max_new_tokens=3), "held"))
    await asyncio.sleep(0.1)
    # Held by the tokenizer before it is registered (tokenizer_manager: is_pause_cond).
    assert not task.done() and fake.running_rids == []
    assert await client.continue_generation() == {
        "message": "Generation continued successfully.",
        "status": "ok",
    }
    result = await asyncio.wait_for(task, 2.0)
    assert result.finish_reason == "length" and len(result.output_ids) == 3


async def test_in_place_pause_and_update_stamp_tokens_with_their_true_versions(
    fake: FakeSGLang, tmp_path: Path
) -> None:
    """The embedded engine's per-token extension; a paused in-place update must not flush (see
    test_weightsync: that kills SGLang)."""
    fake.weight_version = "0"
    fake.report_token_versions = True
    fake.token_delay_s = 0.01
    fake.script = scripted(list(range(100, 160)), [-0.1] * 60, "length")
    async with EngineClient(fake.base_url) as c:
        task = asyncio.create_task(c.generate([1, 2], SamplingParams(max_new_tokens=60), "straddle"))
        await fake.wait_running(1)
        await asyncio.sleep(0.05)
        await c.pause_generation("in_place")
        await c.update_weights_from_disk(str(tmp_path), weight_version="1", flush_cache=False)
        await c.continue_generation()
        result = await asyncio.wait_for(task, 5.0)
    switch = result.token_versions.index("1")
    assert 0 < switch < 60
    assert result.token_versions == ["0"] * switch + ["1"] * (60 - switch)
    assert result.weight_version == "1"
    assert result.output_ids == list(range(100, 160))


async def test_abort_request_returns_partial_output_with_abort_finish(
    fake: FakeSGLang, client: EngineClient
) -> None:
    fake.token_delay_s = 0.005
    task = asyncio.create_task(client.generate([1, 2, 3], SamplingParams(max_new_tokens=1000), "victim"))
    await fake.wait_running(1)
    await asyncio.sleep(0.05)
    await client.abort_request("victim")
    assert fake.requests[-1].json() == {"rid": "victim"}
    result = await asyncio.wait_for(task, 2.0)
    assert result.finish_reason == "abort"
    assert result.abort_message == "Aborted"  # FINISH_ABORT()'s default message
    assert 0 < len(result.output_ids) < 1000
    assert len(result.logprobs) == len(result.output_ids) == result.completion_tokens


async def test_pause_in_abort_mode_aborts_running_and_holds_new_requests(
    fake: FakeSGLang, client: EngineClient
) -> None:
    fake.token_delay_s = 0.005
    running = asyncio.create_task(client.generate([1], SamplingParams(max_new_tokens=1000), "running"))
    await fake.wait_running(1)
    await client.pause_generation("abort")
    aborted = await asyncio.wait_for(running, 2.0)
    assert aborted.finish_reason == "abort" and aborted.abort_message == "Aborted"
    held = asyncio.create_task(client.generate([1], SamplingParams(max_new_tokens=2), "held"))
    await asyncio.sleep(0.05)
    assert not held.done()
    await client.continue_generation()
    assert (await asyncio.wait_for(held, 2.0)).finish_reason == "length"


async def test_abort_all_request_body(fake: FakeSGLang, client: EngineClient) -> None:
    await client.abort_request(abort_all=True)
    assert fake.requests[-1].json() == {"abort_all": True}
    with pytest.raises(ValueError, match="exactly one"):
        await client.abort_request()
    with pytest.raises(ValueError, match="exactly one"):
        await client.abort_request("r", abort_all=True)


async def test_a_generate_past_its_request_timeout_is_aborted_on_the_server(fake: FakeSGLang) -> None:
    fake.token_delay_s = 0.01
    async with EngineClient(fake.base_url, retries=0, request_timeout_s=0.2) as slow:
        with pytest.raises(EngineUnavailable, match="no complete reply"):
            await slow.generate([1, 2], SamplingParams(max_new_tokens=1000), "late")
        await fake.wait_idle(5.0)
    assert fake.running_rids == []
    assert [r.json() for r in fake.requests if r.path == "/abort_request"] == [{"rid": "late"}]


async def test_fake_abort_request_rejects_fields_of_the_wrong_type(fake: FakeSGLang) -> None:
    # SGLang's AbortReq: rid (str | list[str] | None), abort_all (bool), finished_reason, abort_message.
    async with aiohttp.ClientSession() as http:
        for body in ({"rid": 5}, {"abort_all": "yes"}, {"rid": ["a", 1]}):
            async with http.post(fake.base_url + "/abort_request", json=body) as r:
                assert r.status == 400, body
        async with http.post(fake.base_url + "/abort_request", json={"rid": "nobody"}) as r:
            assert r.status == 200  # an unknown rid is a no-op, as in SGLang


async def test_flush_cache_returns_plain_text_and_fails_while_requests_run(
    fake: FakeSGLang, client: EngineClient
) -> None:
    assert await client.flush_cache() == FLUSH_OK
    fake.token_delay_s = 0.01
    task = asyncio.create_task(client.generate([1], SamplingParams(max_new_tokens=20), "busy"))
    await fake.wait_running(1)
    with pytest.raises(EngineHTTPError) as info:
        await client.flush_cache()
    assert info.value.status == 400 and info.value.message == "Flush cache failed."
    await task


# ---------------------------------------------------------------------------- raw wire shapes of the fake


async def post_generate(base_url: str, body: dict[str, Any]) -> tuple[int, str, bytes]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(base_url + "/generate", json=body) as resp,
    ):
        return resp.status, resp.headers["Content-Type"], await resp.read()


async def test_single_response_is_compact_json_in_sglang_key_order(fake: FakeSGLang) -> None:
    body = {
        "input_ids": [1, 2, 3],
        "sampling_params": {"max_new_tokens": 2},
        "return_logprob": True,
        "rid": "k",
    }
    status, ctype, raw = await post_generate(fake.base_url, body)
    assert (status, ctype) == (200, "application/json")
    assert b", " not in raw and b'": ' not in raw
    obj = json.loads(raw)
    assert list(obj) == ["text", "output_ids", "meta_info"]
    assert list(obj["meta_info"]) == [
        "id",
        "finish_reason",
        "prompt_tokens",
        "weight_version",
        "num_retractions",
        "completion_tokens",
        "cached_tokens",
        "input_token_logprobs",
        "output_token_logprobs",
        "e2e_latency",
    ]
    assert obj["meta_info"]["input_token_logprobs"] == []  # observed with logprob_start_len's default
    assert obj["meta_info"]["finish_reason"] == {"type": "length", "length": 2}


async def test_nan_logprob_is_serialized_as_a_bare_nan_literal(fake: FakeSGLang) -> None:
    fake.queue_faults("nan_logprob")
    _, _, raw = await post_generate(fake.base_url, {"input_ids": [1], "return_logprob": True, "rid": "n"})
    assert b"[NaN," in raw
    assert math.isnan(json.loads(raw)["meta_info"]["output_token_logprobs"][0][0])


async def test_without_return_logprob_no_logprob_fields(fake: FakeSGLang) -> None:
    _, _, raw = await post_generate(
        fake.base_url, {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}}
    )
    meta = json.loads(raw)["meta_info"]
    assert "output_token_logprobs" not in meta and "input_token_logprobs" not in meta
    assert re.fullmatch(r"[0-9a-f]{32}", meta["id"])


async def test_batch_input_returns_an_array_with_expanded_rids(fake: FakeSGLang) -> None:
    body = {
        "input_ids": [[1, 2], [3, 4, 5]],
        "sampling_params": {"max_new_tokens": 2},
        "return_logprob": True,
        "rid": "b",
    }
    _, _, raw = await post_generate(fake.base_url, body)
    items = json.loads(raw)
    assert isinstance(items, list) and len(items) == 2
    parsed = [parse_generate_response(o, expected_rid=f"b_{i}") for i, o in enumerate(items)]
    assert [p.prompt_tokens for p in parsed] == [2, 3]


async def test_n_greater_than_one_returns_prompt_major_samples_with_fresh_rids(fake: FakeSGLang) -> None:
    body = {
        "input_ids": [[1, 2], [3, 4, 5]],
        "sampling_params": {"max_new_tokens": 4, "n": 2},
        "return_logprob": True,
        "rid": "mine",
    }
    _, _, raw = await post_generate(fake.base_url, body)
    items = json.loads(raw)
    assert [o["meta_info"]["prompt_tokens"] for o in items] == [2, 2, 3, 3]
    rids = [o["meta_info"]["id"] for o in items]
    assert len(set(rids)) == 4 and all(re.fullmatch(r"[0-9a-f]{32}", r) for r in rids)
    assert items[0]["output_ids"] != items[1]["output_ids"]  # samples of one prompt differ

    single = {"input_ids": [7], "sampling_params": {"max_new_tokens": 1, "n": 3}, "rid": "x"}
    _, _, raw = await post_generate(fake.base_url, single)
    assert len(json.loads(raw)) == 3


async def test_invalid_sampling_params_give_400_error_object(fake: FakeSGLang) -> None:
    for sampling, message in [({"top_p": 0.0}, "top_p"), ({"max_new_tokens": -2}, "max_new_tokens")]:
        status, _, raw = await post_generate(fake.base_url, {"input_ids": [1], "sampling_params": sampling})
        error = json.loads(raw)
        assert status == 400 and list(error) == ["object", "message", "type", "param", "code"]
        assert error["object"] == "error" and message in error["message"] and error["code"] == 400
    status, _, raw = await post_generate(fake.base_url, {"input_ids": [[1], [2]], "rid": ["d", "d"]})
    assert status == 400 and "Duplicate request IDs" in json.loads(raw)["message"]


async def test_stream_sends_cumulative_sse_chunks_then_done(fake: FakeSGLang) -> None:
    fake.script = scripted([11, 12, 13], [-0.5, -0.25, -0.125])
    body = {"input_ids": [1, 2], "return_logprob": True, "stream": True, "rid": "s"}
    status, ctype, raw = await post_generate(fake.base_url, body)
    assert (status, ctype) == (200, "text/event-stream")
    events = raw.decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert [c["output_ids"] for c in chunks] == [[11], [11, 12], [11, 12, 13]]
    assert [len(c["meta_info"]["output_token_logprobs"]) for c in chunks] == [1, 2, 3]
    assert [c["meta_info"]["finish_reason"] for c in chunks[:-1]] == [None, None]
    assert all("e2e_latency" not in c["meta_info"] for c in chunks[:-1])
    final = parse_generate_response(chunks[-1], expected_rid="s")
    assert final.output_ids == [11, 12, 13] and final.finish_reason == "stop"
    assert "e2e_latency" in chunks[-1]["meta_info"]


async def test_batch_stream_chunks_carry_their_index(fake: FakeSGLang) -> None:
    body = {"input_ids": [[1], [2]], "sampling_params": {"max_new_tokens": 2}, "stream": True, "rid": "bs"}
    _, _, raw = await post_generate(fake.base_url, body)
    chunks = [json.loads(e.removeprefix("data: ")) for e in raw.decode().split("\n\n")[:-2]]
    finals = {c["index"]: c for c in chunks if c["meta_info"]["finish_reason"] is not None}
    assert sorted(finals) == [0, 1]
    assert [finals[i]["meta_info"]["id"] for i in (0, 1)] == ["bs_0", "bs_1"]


def test_a_reply_aborted_in_the_waiting_queue_parses_without_prompt_or_cached_tokens() -> None:
    """tokenizer_manager._handle_abort_req: a queued request's reply has a shorter meta_info."""
    reply = {
        "output_ids": [],
        "meta_info": {
            "id": "q",
            "finish_reason": {"type": "abort", "message": "Abort in waiting queue"},
            "weight_version": "4",
            "completion_tokens": 0,
            "input_token_logprobs": [],
            "output_token_logprobs": [],
            "e2e_latency": 0.01,
        },
    }
    result = parse_generate_response(reply, expected_rid="q")
    assert (result.finish_reason, result.abort_message) == ("abort", "Abort in waiting queue")
    assert (result.prompt_tokens, result.cached_tokens, result.output_ids) == (None, 0, [])
    finished = {
        **reply,
        "meta_info": {**reply["meta_info"], "finish_reason": {"type": "length", "length": 0}},
    }
    with pytest.raises(EngineProtocolError, match=r"meta_info\.prompt_tokens is None"):
        parse_generate_response(finished, expected_rid="q")  # only an abort may leave it out


def test_weight_version_spans_become_per_token_versions_and_bad_spans_are_named() -> None:
    meta = {
        "id": "s",
        "finish_reason": {"type": "length", "length": 3},
        "prompt_tokens": 2,
        "weight_version": "2",
        "weight_versions": [{"version": "1", "start": 0, "end": 1}, {"version": "2", "start": 1, "end": 3}],
        "completion_tokens": 3,
        "cached_tokens": 0,
        "output_token_logprobs": [[-0.1, 5, None], [-0.2, 6, None], [-0.3, 7, None]],
    }
    result = parse_generate_response({"output_ids": [5, 6, 7], "meta_info": meta}, expected_rid="s")
    assert result.token_versions == ["1", "2", "2"] and result.versions_exact
    gap = [{"version": "1", "start": 0, "end": 1}, {"version": "2", "start": 2, "end": 3}]
    with pytest.raises(EngineProtocolError, match=r"weight_versions\[1\]"):
        parse_generate_response(
            {"output_ids": [5, 6, 7], "meta_info": {**meta, "weight_versions": gap}}, expected_rid="s"
        )


@pytest.mark.parametrize("temperature", [math.nan, math.inf])
def test_a_temperature_sglang_would_refuse_never_leaves_the_client(temperature: float) -> None:
    with pytest.raises(ValueError, match="finite number"):
        SamplingParams(temperature=temperature)


# ------------------------------------------------------------------------------ routed experts (MoE)
def _reply_with_routing(values: list[int] | None, *, prompt: int = 4, finish: str = "stop") -> dict[str, Any]:
    import base64
    import struct

    meta: dict[str, Any] = {
        "id": "r",
        "finish_reason": {"type": finish},
        "prompt_tokens": prompt,
        "completion_tokens": 2,
        "cached_tokens": 0,
        "output_token_logprobs": [[-0.5, 7, None], [-0.25, 8, None]],
    }
    if values is not None:
        meta["routed_experts"] = base64.b64encode(struct.pack(f"<{len(values)}i", *values)).decode()
    return {"output_ids": [7, 8], "meta_info": meta}


def _parse_routing(obj: dict[str, Any], start: int) -> list[int] | None:
    from pipeline.supervisor.engines.protocol import RoutedExpertsRequest, parse_generate_response

    result = parse_generate_response(obj, expected_rid="r", routed_experts=RoutedExpertsRequest(start, 4))
    return None if result.routed_experts is None else list(result.routed_experts)


def test_routed_experts_cover_the_asked_positions_and_decode_as_int32() -> None:
    # prompt 4 + completion 2 - 1 = positions 0..4; asked from 2: 3 positions x (2 layers x top-2)
    values = list(range(12))
    assert _parse_routing(_reply_with_routing(values), start=2) == values


def test_a_server_that_lists_every_position_is_cut_to_the_asked_start() -> None:
    values = list(range(20))  # 5 positions x 4: an SGLang without routed_experts_start_len
    assert _parse_routing(_reply_with_routing(values), start=2) == values[8:]


@pytest.mark.parametrize(
    ("obj", "defect"),
    [
        (_reply_with_routing(None), "meta_info.routed_experts is missing"),
        (_reply_with_routing(list(range(8))), "holds 8 ids; positions [2, 5) x 4 per position make 12"),
        (_reply_with_routing([0] * 11 + [-1]), "negative expert id"),
    ],
)
def test_routed_experts_that_break_the_contract_name_the_defect(obj: dict[str, Any], defect: str) -> None:
    with pytest.raises(EngineProtocolError, match=re.escape(defect)):
        _parse_routing(obj, start=2)


def test_routed_experts_that_are_not_base64_int32_are_a_protocol_error() -> None:
    obj = _reply_with_routing(list(range(12)))
    obj["meta_info"]["routed_experts"] = "not base64!"
    with pytest.raises(EngineProtocolError, match="not base64 of int32"):
        _parse_routing(obj, start=2)


def test_an_abort_may_carry_no_routed_experts() -> None:
    assert _parse_routing(_reply_with_routing(None, finish="abort"), start=2) is None


async def test_the_client_asks_for_routed_experts_with_sglangs_fields(fake: FakeSGLang) -> None:
    from pipeline.supervisor.engines.protocol import RoutedExpertsRequest

    fake.routed_experts = (2, 2, 8)
    fake.script = lambda call: Plan([7, 8, 9])
    async with EngineClient(fake.base_url) as client:
        result = await client.generate(
            [1, 2, 3, 4],
            SamplingParams(),
            "r",
            routed_experts=RoutedExpertsRequest(start_len=4, per_position=4),
        )
    assert result.routed_experts is not None and len(result.routed_experts) == (4 + 3 - 1 - 4) * 4
    body = fake.generate_requests()[0]
    assert (body["return_routed_experts"], body["routed_experts_start_len"]) == (True, 4)
    assert fake.ignored_fields == []
