"""Property-based tests (hypothesis) of the parsers that take outside input: the engine protocol parser,
the embedded engine's sampling-params parser, the trajectory schema validator, config overrides and the
tool-call parsers. Whatever the input, each either returns its result or raises its one documented error
type with a message; valid inputs round-trip."""

from __future__ import annotations

import contextlib
import json
import math
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from envs.toolcalls import parse_hermes, parse_none
from pipeline.contracts.config import ConfigError, load_config
from pipeline.contracts.schema import EpisodeSegment, batch_to_segments, segments_to_batch, validate_segment
from pipeline.engine.sampling import parse_sampling_params
from pipeline.supervisor.engines.protocol import EngineProtocolError, GenerateResult, parse_generate_response

FAST = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=20,
)


# --- the engine protocol ---------------------------------------------------------------------------------
def _reply(ids: list[int], logprobs: list[float], finish: str, rid: str) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": {"type": finish, **({"message": "x"} if finish == "abort" else {})},
        "prompt_tokens": 3,
        "weight_version": "2",
        "completion_tokens": len(ids),
        "cached_tokens": 0,
        "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, ids, strict=True)],
    }
    return {"output_ids": ids, "meta_info": meta}


@st.composite
def replies(draw: st.DrawFn) -> tuple[dict[str, Any], list[int], list[float], str]:
    n = draw(st.integers(0, 12))
    ids = draw(st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n))
    logprobs = draw(st.lists(st.floats(-50.0, 0.0), min_size=n, max_size=n))
    finish = draw(st.sampled_from(["stop", "length", "abort"]))
    return _reply(ids, logprobs, finish, "r"), ids, logprobs, finish


@FAST
@given(replies())
def test_a_valid_reply_parses_to_exactly_its_tokens(
    case: tuple[dict[str, Any], list[int], list[float], str],
) -> None:
    reply, ids, logprobs, finish = case
    result = parse_generate_response(json.loads(json.dumps(reply)), expected_rid="r")
    assert isinstance(result, GenerateResult)
    assert (result.output_ids, result.logprobs, result.finish_reason) == (ids, logprobs, finish)
    assert result.token_versions == ["2"] * len(ids)


@FAST
@given(
    replies(),
    st.lists(st.sampled_from(["output_ids", "meta_info", "id", "finish_reason", "lp", "n"])),
    json_values,
)
def test_any_damaged_reply_raises_only_a_protocol_error(
    case: tuple[dict[str, Any], list[int], list[float], str], damage: list[str], junk: Any
) -> None:
    reply = case[0]
    for what in damage:  # replace a part of a valid reply with arbitrary JSON
        if what in ("output_ids", "meta_info"):
            reply[what] = junk
        elif isinstance(reply.get("meta_info"), dict):
            meta = reply["meta_info"]
            key = {"lp": "output_token_logprobs", "n": "completion_tokens"}.get(what, what)
            meta[key] = junk
    try:
        parse_generate_response(reply, expected_rid="r")
    except EngineProtocolError as exc:
        assert exc.defect


@FAST
@given(json_values)
def test_arbitrary_json_is_a_protocol_error_not_a_crash(obj: Any) -> None:
    try:
        parse_generate_response(obj, expected_rid=None)
    except EngineProtocolError as exc:
        assert "rid" in str(exc)


@FAST
@given(
    st.dictionaries(
        st.sampled_from(
            [
                "max_new_tokens",
                "temperature",
                "top_p",
                "top_k",
                "min_p",
                "n",
                "stop_token_ids",
                "sampling_seed",
                "ignore_eos",
                "stop",
                "x",
            ]
        ),
        json_values,
    )
    | json_values
)
def test_sampling_params_of_any_shape_parse_or_raise_value_error(raw: Any) -> None:
    try:
        parsed = parse_sampling_params(raw, vocab_size=100)
    except ValueError as exc:
        assert str(exc)
    else:
        assert parsed.max_new_tokens >= 0 and parsed.n >= 1 and 0.0 < parsed.top_p <= 1.0


# --- the trajectory schema -------------------------------------------------------------------------------
@st.composite
def valid_segments(draw: st.DrawFn) -> EpisodeSegment:
    prompt = draw(st.integers(1, 6))
    turns = draw(st.integers(1, 3))
    token_ids = draw(st.lists(st.integers(0, 1000), min_size=prompt, max_size=prompt))
    mask, logprobs, turn_index, versions = [0] * prompt, [0.0] * prompt, [-1] * prompt, [-1] * prompt
    for turn in range(turns):
        generated = draw(st.integers(1, 4))
        token_ids += draw(st.lists(st.integers(0, 1000), min_size=generated, max_size=generated))
        mask += [1] * generated
        logprobs += draw(st.lists(st.floats(-20.0, 0.0, width=32), min_size=generated, max_size=generated))
        turn_index += [turn] * generated
        versions += [draw(st.integers(0, 50))] * generated
        if turn < turns - 1:
            token_ids += [7, 8]
            mask += [0, 0]
            logprobs += [0.0, 0.0]
            turn_index += [turn, turn]
            versions += [-1, -1]
    rewards = draw(st.lists(st.floats(-5.0, 5.0, width=32), min_size=turns, max_size=turns))
    return EpisodeSegment(
        episode_id="e",
        group_id="g",
        task_id="t",
        env="env",
        token_ids=token_ids,
        prompt_len=prompt,
        loss_mask=mask,
        logprobs=logprobs,
        turn_index=turn_index,
        versions=versions,
        turn_rewards=rewards,
        outcome=draw(st.none() | st.floats(0.0, 1.0, width=32)),
        num_turns=turns,
        finish_reason=draw(st.sampled_from(["stop", "length", "truncated", "timeout"])),
    )


@FAST
@given(valid_segments())
def test_valid_rows_validate_and_round_trip_through_arrow(row: EpisodeSegment) -> None:
    assert validate_segment(row) is None
    rows, rejected = batch_to_segments(segments_to_batch([row]))
    assert rejected == [] and rows == [row]


@FAST
@given(
    valid_segments(),
    st.sampled_from(
        [
            "loss_mask",
            "logprobs",
            "turn_index",
            "versions",
            "prompt_len",
            "num_turns",
            "turn_rewards",
            "outcome",
        ]
    ),
    st.integers(-3, 3) | st.floats(allow_nan=True) | st.lists(st.integers(-2, 2), max_size=3),
)
def test_a_broken_row_is_named_by_the_validator_never_a_crash(
    row: EpisodeSegment, field: str, value: Any
) -> None:
    try:
        setattr(row, field, value)
        reason = validate_segment(row)
    except (TypeError, ValueError):
        return  # a value of the wrong Python type: Arrow would refuse it before the validator runs
    if reason is not None:
        assert isinstance(reason, str) and reason


# --- config overrides ------------------------------------------------------------------------------------
keys = st.sampled_from(
    [
        "learner.optim.lr",
        "learner.batch_groups",
        "env.group_size",
        "async.max_staleness",
        "run.seed",
        "sampling.top_p",
        "engine.port",
        "env.options",
        "learner.mismatch.reject_band",
        "nope.key",
        "learner",
        "run.run_dir.x",
        "",
    ]
)


@FAST
@given(
    keys,
    st.text(max_size=20) | st.sampled_from(["1e-3", "-1", "true", "[1, 2]", "{a = 1}", "nan", "inf", "0"]),
)
def test_any_override_loads_or_raises_config_error_naming_a_key(key: str, value: str) -> None:
    try:
        cfg = load_config(None, [f"{key}={value}"])
    except ConfigError as exc:
        assert str(exc)
    else:
        assert cfg.learner.optim.lr > 0 and cfg.learner.batch_groups >= 1


@FAST
@given(st.text(max_size=30))
def test_an_override_without_equals_or_any_text_is_a_config_error(item: str) -> None:
    with contextlib.suppress(ConfigError):
        load_config(None, [item])


# --- tool-call parsers -----------------------------------------------------------------------------------
@FAST
@given(st.text(max_size=200) | st.text(alphabet='<>/{}":, tool_calnme[]', max_size=200))
def test_the_tool_call_parsers_never_raise_and_keep_the_text(text: str) -> None:
    for parse in (parse_hermes, parse_none):
        action = parse(text)
        assert action.text == text
        assert all(call.name.strip() for call in action.tool_calls)


@FAST
@given(
    st.lists(
        st.tuples(
            st.text(alphabet=st.characters(blacklist_characters="<>"), min_size=1, max_size=10).filter(
                str.strip
            ),
            st.dictionaries(
                st.text(max_size=5), st.integers() | st.text(max_size=5) | st.booleans(), max_size=3
            ),
        ),
        max_size=3,
    ),
    st.text(alphabet=st.characters(blacklist_characters="<>"), max_size=20),
)
def test_well_formed_tool_calls_parse_back_exactly(
    calls: list[tuple[str, dict[str, Any]]], prose: str
) -> None:
    text = prose + "".join(
        f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>" for name, args in calls
    )
    action = parse_hermes(text)
    assert [(c.name, c.arguments) for c in action.tool_calls] == calls
    assert action.tool_call_errors == ()
    assert not any(math.isnan(v) for _, a in calls for v in a.values() if isinstance(v, float))
