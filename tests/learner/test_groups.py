"""Train or drop, and why (learner.groups), and the run directory's layout (pipeline.contracts.run_dir)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from learner.groups import TrainGroup, token_staleness, token_staleness_split, triage_group
from pipeline.contracts import events
from pipeline.contracts.run_dir import (
    RunDir,
    checkpointed_version,
    latest_checkpoint_dir,
    prune_weights,
    published_version,
)
from pipeline.contracts.schema import EpisodeSegment, RejectedRow
from pipeline.contracts.staleness import WRITTEN_AT_KEY, split_staleness, written_at
from tests.helpers.train_groups import one_turn_row


def row(index: int, version: int, *, finish: str = "stop", episode: str | None = None) -> EpisodeSegment:
    return one_turn_row("g", index, version, finish=finish, episode_id=episode)


def verdict(rows: list[EpisodeSegment], version: int, eta: int, vocab: int | None = None) -> str | None:
    result = triage_group("g", rows, learner_version=version, max_staleness=eta, vocab_size=vocab)
    return result if isinstance(result, str) else None


def test_drop_reason_rules() -> None:
    ok = [row(0, 3), row(1, 3)]
    assert verdict(ok, version=3, eta=0) is None
    assert verdict(ok, version=4, eta=0) == "stale"
    assert verdict(ok, version=5, eta=2) is None
    assert verdict([row(0, 3), row(1, 3, finish="engine_error")], version=3, eta=0) == "too_few_members"
    assert verdict([], version=0, eta=0) == "too_few_members"
    # two rows of one episode (segments) are one member
    assert verdict([row(0, 3), row(1, 3, episode="g-0")], version=3, eta=0) == "too_few_members"
    assert verdict(ok, version=3, eta=0, vocab=51) is None
    assert verdict(ok, version=3, eta=0, vocab=50) == "invalid_tokens"
    # an untrainable old episode does not make the group stale
    assert verdict([*ok, row(2, 0, finish="timeout")], version=3, eta=0) is None


def test_a_trainable_group_keeps_its_episodes_segments_and_counts_the_rest() -> None:
    second_segment = row(0, 3, episode="g-0")
    second_segment.segment = 1
    bad = RejectedRow(index=4, episode_id="g-9", reason="logprobs[5]=nan")
    group = triage_group(
        "g",
        [row(0, 3), row(1, 3), second_segment, row(2, 3, finish="env_error")],
        learner_version=3,
        max_staleness=0,
        rejected=[bad],
    )
    assert isinstance(group, TrainGroup)
    assert [[r.segment for r in segments] for segments in group.episodes] == [[0, 1], [0]]
    assert [r.episode_id for r in group.first_segments] == ["g-0", "g-1"]
    assert (group.untrainable_rows, group.rejected) == (1, [bad])


def test_staleness_splits_at_the_version_the_group_was_written() -> None:
    assert split_staleness(3, 5, 6) == (2, 1)
    assert split_staleness(3, None, 6) == (0, 3)  # an older spool file: all of it waiting
    assert split_staleness(3, 1, 6) == (0, 3)  # heard late: never before the token itself
    assert split_staleness(3, 9, 6) == (3, 0)  # a restart redoes versions: never after the training
    assert [written_at(m) for m in (None, {}, {WRITTEN_AT_KEY: b"7"}, {WRITTEN_AT_KEY: b"x"})] == [
        None,
        None,
        7,
        None,
    ]
    group = triage_group("g", [row(0, 1), row(1, 3)], learner_version=4, max_staleness=5)
    assert isinstance(group, TrainGroup)
    in_flight, in_queue = token_staleness_split([(group, 2), (group, None)], learner_version=4)
    # written at 2: row 0's tokens (v1) 1 in flight + 2 queued, row 1's (v3) 0 + 1; unknown: all queued
    assert dict(in_flight) == {1: 3, 0: 9} and dict(in_queue) == {2: 3, 1: 6, 3: 3}
    assert (
        sum(in_flight.values()) == sum(in_queue.values()) == sum(token_staleness([group, group], 4).values())
    )


def test_token_staleness_counts_generated_tokens_of_trained_rows() -> None:
    group = triage_group(
        "g", [row(0, 1), row(1, 3), row(2, 0, finish="env_error")], learner_version=3, max_staleness=5
    )
    assert isinstance(group, TrainGroup)
    assert dict(token_staleness([group], learner_version=3)) == {2: 3, 0: 3}


# --- the run directory ------------------------------------------------------------------------------------
def test_layout_paths(tmp_path: Path) -> None:
    run = RunDir.at(tmp_path)
    root = tmp_path.resolve()
    assert (run.spool, run.weights, run.checkpoints, run.logs) == (
        root / "spool",
        root / "weights",
        root / "checkpoints",
        root / "logs",
    )
    assert run.weights_of(3) == root / "weights" / "v3" and run.weights_of(0) == root / "model"
    assert run.log_file("learner") == root / "logs" / "learner.log"
    assert RunDir.at(tmp_path, "/models/qwen").weights_of(0) == Path("/models/qwen")


def test_prune_weights_keeps_the_newest_three(tmp_path: Path) -> None:
    for v in range(1, 6):
        (tmp_path / f"v{v}").mkdir()
    (tmp_path / "notes").mkdir()
    assert prune_weights(tmp_path, newest=5) == [1, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes", "v3", "v4", "v5"]


def _checkpoint(run: RunDir, step: int, state: dict[str, object]) -> Path:
    path = run.checkpoints / f"step{step}"
    path.mkdir(parents=True)
    (path / "state.json").write_text(json.dumps(state))
    return path


def test_the_version_a_checkpoint_published_is_read_in_one_place(tmp_path: Path) -> None:
    run = RunDir.at(tmp_path)
    assert checkpointed_version(run) == 0  # no checkpoint
    old = _checkpoint(run, 2, {"counters": {"policy_version": 2}, "extra": {}})
    new = _checkpoint(run, 4, {"counters": {"policy_version": 4}, "extra": {"published_version": 3}})
    assert published_version(old) == 2  # written before it was recorded: its own version
    assert published_version(new) == 3
    (run.checkpoints / "latest").write_text("step2\n")
    assert latest_checkpoint_dir(run.checkpoints) == old
    (run.checkpoints / "latest").write_text("step4\n")
    assert checkpointed_version(run) == 0  # weights/v3 is not on disk (pruned): the initial model
    (run.weights / "v3").mkdir(parents=True)
    (run.weights / "v3" / "config.json").write_text("{}")
    assert checkpointed_version(run) == 3
    (new / "state.json").write_text("{not json")
    assert published_version(new) == 0


# --- learner events ----------------------------------------------------------------------------------------
def test_every_event_survives_encode_and_decode() -> None:
    samples: list[events.LearnerEvent] = [
        events.Ready(version=2, step=5, consumed_seq=9, path="/r/weights/v2"),
        events.Dropped(seq=4, group_id="g4", reason="stale", tokens=12),
        events.Step(
            step=1,
            version=1,
            groups=2,
            group_ids=["a", "b"],
            consumed_seq=2,
            metrics={"loss": 0.5, "grad_norm": None},
            staleness={0: 6, 2: 1},
            idle_s=0.25,
            busy_s=1.0,
            spool_read_s=0.01,
            spool_depth_groups=3,
            spool_depth_bytes=100,
            staleness_in_flight={0: 5, 1: 2},
            staleness_in_queue={0: 1, 1: 6},
        ),
        events.Published(version=1, path="/r/weights/v1"),
        events.CheckpointSaved(step=1, path="/r/checkpoints/step1", consumed_seq=2, seconds=0.5),
        events.Quarantined(seq=7, file="g7.arrow", kind="unreadable", reason="not arrow"),
        events.StorageFault(component="checkpoint", blocked=True, kind="ENOSPC", message="disk full"),
        events.Unreachable(what="spool", blocked=True, message="the spool service grpc://b:1 is unreachable"),
        events.Finished(step=3, reason="run.max_steps = 3"),
        events.Error(message="boom"),
    ]
    assert set(events.EVENT_TYPES) == {type(e).name for e in samples}
    for event in samples:
        assert events.decode(json.loads(events.encode(event))) == event


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        ([1], "must be a JSON object"),
        ({"event": "nope"}, "unknown learner event 'nope'"),
        ({"event": "published", "version": 1}, "lacks field 'path'"),
        ({"event": "published", "version": "1", "path": "p"}, r"published\.version has '1'"),
        ({"event": "dropped", "seq": True, "group_id": "g", "reason": "stale"}, r"dropped\.seq"),
    ],
)
def test_a_malformed_event_names_what_is_wrong(obj: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        events.decode(obj)


def test_a_dropped_event_without_tokens_is_an_older_learners_and_counts_none() -> None:
    old = events.decode({"event": "dropped", "seq": 4, "group_id": "g4", "reason": "stale"})
    assert old == events.Dropped(seq=4, group_id="g4", reason="stale", tokens=0)


def test_non_finite_metrics_cannot_be_encoded_and_travel_as_null() -> None:
    assert events.finite_or_none(float("nan")) is None and events.finite_or_none(1.5) == 1.5
    bad = events.Step(
        step=1,
        version=1,
        groups=0,
        group_ids=[],
        consumed_seq=0,
        metrics={"loss": float("inf")},
        staleness={},
        idle_s=0.0,
        busy_s=0.0,
        spool_read_s=0.0,
        spool_depth_groups=0,
        spool_depth_bytes=0,
    )
    with pytest.raises(ValueError):
        events.encode(bad)
