import math
import re

import pyarrow as pa
import pytest

from pipeline.contracts.schema import (
    ROUTED_EXPERTS_FIELD,
    SCHEMA_VERSION_KEY,
    TRAJECTORY_SCHEMA,
    EpisodeSegment,
    InvalidSegmentError,
    RoutedExperts,
    batch_to_segments,
    segments_to_batch,
    validate_segment,
)


def make_episode(**overrides: object) -> EpisodeSegment:
    # prompt of 3 tokens, turn 0 generates 2 tokens, env replies with 2, turn 1 generates 1.
    fields: dict[str, object] = dict(
        episode_id="e0",
        group_id="g0",
        task_id="t0",
        env="guess-number",
        token_ids=[10, 11, 12, 20, 21, 30, 31, 22],
        prompt_len=3,
        loss_mask=[0, 0, 0, 1, 1, 0, 0, 1],
        logprobs=[0.0, 0.0, 0.0, -0.5, -1.25, 0.0, 0.0, -0.125],  # float32-exact
        turn_index=[-1, -1, -1, 0, 0, 0, 0, 1],
        versions=[-1, -1, -1, 3, 3, -1, -1, 4],
        turn_rewards=[0.0, -0.25],
        outcome=1.0,
        num_turns=2,
        finish_reason="stop",
    )
    fields.update(overrides)
    return EpisodeSegment(**fields)  # type: ignore[arg-type]


def test_roundtrip_preserves_every_field_and_schema_version() -> None:
    eps = [make_episode(), make_episode(episode_id="e1", outcome=None, segment=1)]
    batch = segments_to_batch(eps)
    assert batch.schema.metadata[SCHEMA_VERSION_KEY] == b"1"
    decoded, rejected = batch_to_segments(batch)
    assert rejected == []
    assert decoded[0] == eps[0]
    assert decoded[1].outcome is None and decoded[1].segment == 1
    assert decoded[0].logprobs[4] == pytest.approx(-1.25)


def test_valid_episode_helpers() -> None:
    ep = make_episode()
    assert validate_segment(ep) is None
    assert ep.min_version() == 3
    assert ep.num_generated == 3
    assert ep.success and ep.trainable
    assert not make_episode(outcome=0.5).success
    assert not make_episode(finish_reason="env_error").trainable


@pytest.mark.parametrize(
    ("overrides", "reason_part"),
    [
        (dict(loss_mask=[0, 0, 0, 1, 1, 0, 0]), "len(loss_mask)=7 != len(token_ids)=8"),
        (
            dict(loss_mask=[1, 0, 0, 1, 1, 0, 0, 1], turn_index=[0, -1, -1, 0, 0, 0, 0, 1]),
            "inside the prompt",
        ),
        (dict(logprobs=[0.0, 0.0, 0.0, math.nan, -1.0, 0.0, 0.0, -0.1]), "logprobs[3]=nan"),
        (dict(logprobs=[0.0, 0.0, 0.0, -0.5, -1.0, 0.0, 0.0, 0.3]), "logprobs[7]=0.3"),
        (
            dict(versions=[-1, -1, -1, -1, 3, -1, -1, 4]),
            "versions[3]=-1: generated token without a policy version",
        ),
        (dict(versions=[-1, -1, -1, 3, 3, 3, -1, 4]), "versions[5]=3 on a non-generated token"),
        (
            dict(logprobs=[0.0, 0.0, 0.0, -0.5, -1.0, -2.0, 0.0, -0.1]),
            "logprobs[5]=-2.0 on a non-generated token",
        ),
        (dict(turn_rewards=[0.0]), "len(turn_rewards)=1 != num_turns=2"),
        (dict(turn_rewards=[0.0, math.inf]), "turn_rewards[1]=inf"),
        (dict(finish_reason="crashed"), "finish_reason 'crashed'"),
        (dict(turn_index=[-1, -1, -1, 0, 0, 0, 0, 2]), "turn_index[7]=2 outside"),
        (dict(prompt_len=9), "prompt_len=9 outside"),
        (dict(outcome=math.nan), "outcome=nan"),
    ],
)
def test_each_invariant_is_rejected_with_its_reason(overrides: dict[str, object], reason_part: str) -> None:
    ep = make_episode(**overrides)
    reason = validate_segment(ep)
    assert reason is not None and reason_part in reason
    with pytest.raises(InvalidSegmentError, match="episode 'e0'"):
        segments_to_batch([ep])


def test_invalid_row_in_a_batch_is_rejected_not_fixed() -> None:
    good = make_episode()
    batch = segments_to_batch([good, make_episode(episode_id="e1")])
    # Corrupt row 1 after encoding, as a buggy writer or a damaged file could.
    cols = batch.to_pydict()
    cols["logprobs"][1] = [0.0, 0.0, 0.0, float("nan"), -1.0, 0.0, 0.0, -0.1]
    bad = pa.RecordBatch.from_pydict(cols, schema=TRAJECTORY_SCHEMA)
    decoded, rejected = batch_to_segments(bad)
    assert [e.episode_id for e in decoded] == ["e0"]
    assert len(rejected) == 1 and rejected[0].episode_id == "e1" and "logprobs[3]=nan" in rejected[0].reason


def test_foreign_schema_is_refused() -> None:
    batch = pa.RecordBatch.from_pydict({"x": [1]})
    with pytest.raises(InvalidSegmentError, match=r"lacks rollwise\.schema_version"):
        batch_to_segments(batch)
    old = segments_to_batch([make_episode()])
    old = old.replace_schema_metadata({SCHEMA_VERSION_KEY: b"0"})
    with pytest.raises(InvalidSegmentError, match="schema version '0'"):
        batch_to_segments(old)


def first_bad_position(ep: EpisodeSegment) -> int | None:
    """The per-token invariants of a row, position by position (an oracle independent of
    pipeline.contracts.schema):
    the first position that breaks one, or None."""
    for t, (m, turn, lp, v) in enumerate(
        zip(ep.loss_mask, ep.turn_index, ep.logprobs, ep.versions, strict=True)
    ):
        in_prompt = t < ep.prompt_len
        if m not in (0, 1) or not -1 <= turn < max(ep.num_turns, 1) or (in_prompt and (m or turn != -1)):
            return t
        generated_ok = turn >= 0 and math.isfinite(lp) and lp <= 0.0 and v >= 0
        if (m == 1 and not generated_ok) or (m == 0 and (v != -1 or lp != 0.0)):
            return t
    return None


def test_random_per_token_corruptions_are_rejected_at_their_first_position() -> None:
    import random

    rng = random.Random(0)
    values = {
        "loss_mask": [0, 1, 2, -1],
        "turn_index": [-2, -1, 0, 1, 2],
        "versions": [-2, -1, 0, 3],
        "logprobs": [0.0, -0.5, 0.5, -math.inf, math.nan, math.inf],
    }
    seen_valid = seen_invalid = 0
    for _ in range(3000):
        ep = make_episode()
        for _ in range(rng.randint(0, 2)):
            name = rng.choice(list(values))
            column = list(getattr(ep, name))
            column[rng.randrange(len(column))] = rng.choice(values[name])
            setattr(ep, name, column)
        bad = first_bad_position(ep)
        reason = validate_segment(ep)
        if bad is None:
            assert reason is None, (ep, reason)
            assert batch_to_segments(segments_to_batch([ep])) == ([ep], [])
            seen_valid += 1
        else:
            assert reason is not None and f"[{bad}]" in reason, (ep, bad, reason)
            with pytest.raises(InvalidSegmentError, match=re.escape(f"[{bad}]")):
                segments_to_batch([ep])
            seen_invalid += 1
    assert seen_valid > 100 and seen_invalid > 1000


# --- optional columns: added after version 1 without breaking either side ----------------------------
TRACE = "0af7651916cd43dd8448eb211c80319c"


def test_the_trace_id_column_round_trips_and_is_null_without_a_trace() -> None:
    batch = segments_to_batch([make_episode(trace_id=TRACE), make_episode(episode_id="e1")])
    assert batch.schema.field("trace_id").nullable
    decoded, rejected = batch_to_segments(batch)
    assert rejected == [] and [e.trace_id for e in decoded] == [TRACE, None]


def test_a_file_written_before_the_trace_id_column_still_reads() -> None:
    new = segments_to_batch([make_episode(trace_id=TRACE)])
    old = new.select([name for name in TRAJECTORY_SCHEMA.names if name != "trace_id"])
    assert old.schema.metadata == new.schema.metadata  # same schema version: "1"
    [decoded], rejected = batch_to_segments(old)
    assert rejected == [] and decoded.trace_id is None
    assert decoded == make_episode()


def test_a_reader_that_predates_the_column_reads_a_new_file() -> None:
    """An older build validates the columns it knows and reads only those (what check_schema and
    batch_to_segments did before): the extra column is ignored."""
    new = segments_to_batch([make_episode(trace_id=TRACE)])
    known = [f for f in TRAJECTORY_SCHEMA if f.name != "trace_id"]
    assert all(new.schema.field(f.name).type == f.type for f in known)
    columns = new.to_pydict()
    row = {f.name: columns[f.name][0] for f in known}
    assert EpisodeSegment(**row) == make_episode()


def test_an_optional_column_of_the_wrong_type_is_refused() -> None:
    good = segments_to_batch([make_episode(trace_id=TRACE)])
    arrays = [good.column(i) for i in range(good.num_columns - 1)] + [pa.array([1], type=pa.int64())]
    fields = [*list(good.schema)[:-1], pa.field("trace_id", pa.int64())]
    bad = pa.RecordBatch.from_arrays(arrays, schema=pa.schema(fields, metadata=good.schema.metadata))
    with pytest.raises(InvalidSegmentError, match="column 'trace_id' has type int64"):
        batch_to_segments(bad)


# ---------------------------------------------------------------- routed_experts (optional, MoE)
def _routed(positions: int, *, width: int = 1, base: int = 0) -> RoutedExperts:
    values = [(base + i) % 8 for i in range(positions * 2 * 2)]
    return RoutedExperts(2, 2, width, RoutedExperts.encode(values, layers=2, topk=2, width=width))


def test_routed_experts_pack_one_byte_per_id_below_257_experts_else_two() -> None:
    assert RoutedExperts.width_for(8) == 1 and RoutedExperts.width_for(256) == 1
    assert RoutedExperts.width_for(257) == 2 and RoutedExperts.width_for(384) == 2
    small = RoutedExperts(1, 2, 1, RoutedExperts.encode([3, 7, 0, 255], layers=1, topk=2, width=1))
    assert small.ids == bytes([3, 7, 0, 255]) and small.positions == 2 and small.values() == [3, 7, 0, 255]
    wide = RoutedExperts(1, 2, 2, RoutedExperts.encode([300, 1], layers=1, topk=2, width=2))
    assert wide.ids == bytes([44, 1, 1, 0]) and wide.values() == [300, 1]  # little endian
    with pytest.raises(ValueError, match="does not fit 1 byte"):
        RoutedExperts.encode([256, 0], layers=1, topk=2, width=1)
    with pytest.raises(ValueError, match="not a whole number"):
        RoutedExperts.encode([1, 2, 3], layers=1, topk=2, width=1)
    with pytest.raises(ValueError, match="num_experts must be in"):
        RoutedExperts.width_for(0)


def test_rows_with_routing_records_round_trip_in_their_own_column() -> None:
    eps = [make_episode(routed_experts=_routed(7)), make_episode(episode_id="e1")]
    batch = segments_to_batch(eps)
    assert batch.schema.field(ROUTED_EXPERTS_FIELD.name).type == ROUTED_EXPERTS_FIELD.type
    assert batch.schema.metadata[SCHEMA_VERSION_KEY] == b"1"
    decoded, rejected = batch_to_segments(batch)
    assert rejected == [] and decoded == eps
    assert decoded[0].routed_experts is not None and decoded[0].routed_experts.positions == 7


def test_a_batch_without_records_has_no_column_and_old_files_read_as_none() -> None:
    batch = segments_to_batch([make_episode()])
    assert batch.schema.get_field_index(ROUTED_EXPERTS_FIELD.name) < 0
    assert batch.schema == TRAJECTORY_SCHEMA  # byte for byte what readers before the column wrote
    decoded, _ = batch_to_segments(batch)
    assert decoded[0].routed_experts is None
    # A reader that predates the column reads the trajectory columns of a new batch.
    new = segments_to_batch([make_episode(routed_experts=_routed(3))])
    old_view = new.select(TRAJECTORY_SCHEMA.names)
    assert batch_to_segments(old_view)[0][0].routed_experts is None


@pytest.mark.parametrize(
    ("record", "reason"),
    [
        (RoutedExperts(2, 2, 1, bytes(9 * 4)), "covers 9 positions of a row of 8 tokens"),
        (RoutedExperts(2, 2, 1, bytes(5)), "not a whole number of positions"),
        (RoutedExperts(0, 2, 1, b""), "layers=0, topk=2; both must be >= 1"),
        (RoutedExperts(2, 2, 3, bytes(12)), "width=3, expected 1 or 2 bytes"),
    ],
)
def test_a_routing_record_that_does_not_fit_its_row_rejects_it(record: RoutedExperts, reason: str) -> None:
    assert reason in str(validate_segment(make_episode(routed_experts=record)))


def test_a_routed_experts_column_of_another_type_refuses_the_batch() -> None:
    batch = segments_to_batch([make_episode()])
    column = pa.array([[1, 2]], type=pa.list_(pa.int32()))
    wrong = batch.append_column(pa.field("routed_experts", pa.list_(pa.int32())), column)
    with pytest.raises(InvalidSegmentError, match="column 'routed_experts' has type list<item: int32>"):
        batch_to_segments(wrong)
