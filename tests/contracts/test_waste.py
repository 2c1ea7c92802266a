"""Where untrained tokens are counted and under which cause (pipeline.contracts.waste), the supervisor's
book of them (pipeline.supervisor.actors.waste_book), and the bounds a run is measured against
(pipeline.tools.bench.bounds)."""

from __future__ import annotations

import pytest

from pipeline.contracts.schema import FINISH_REASONS
from pipeline.contracts.waste import WASTE_CAUSES, drop_cause, episode_cause, trainable_tokens
from pipeline.supervisor.actors.late_cut import GroupCut
from pipeline.supervisor.actors.outcomes import EpisodeOutcome, GroupOutcome
from pipeline.supervisor.actors.waste_book import WasteBook
from pipeline.supervisor.observability import metrics
from pipeline.tools.bench.bounds import Bounds, efficiency, run_bounds, waste_share
from tests.helpers.train_groups import one_turn_row


def test_each_learner_drop_reason_has_one_cause_or_none() -> None:
    assert [drop_cause(r) for r in ("stale", "too_few_members", "invalid_tokens", "routing_mismatch")] == [
        "stale",
        "rejected",
        "rejected",
        "rejected",
    ]
    assert drop_cause("no_update") is None  # reported apart: trained in name only
    assert drop_cause("quarantined") is None  # its tokens are unknown


def test_each_episode_end_has_one_cause_and_a_trainable_one_none() -> None:
    causes = {reason: episode_cause(reason) for reason in FINISH_REASONS}
    assert causes == {
        "stop": None,
        "length": None,
        "truncated": None,
        "env_error": "failed",
        "engine_error": "failed",
        "timeout": "failed",
        "cut": "cut",
    }
    assert episode_cause("engine_error", aborted=True) == "aborted"
    assert set(causes.values()) - {None} <= set(WASTE_CAUSES)
    with pytest.raises(ValueError, match="'paused' has no waste cause"):
        episode_cause("paused")


def test_only_the_trainable_rows_generated_tokens_are_the_learners_to_count() -> None:
    rows = [one_turn_row("g", 0, 1), one_turn_row("g", 1, 1), one_turn_row("g", 2, 1, finish="cut")]
    assert trainable_tokens(rows) == 6  # 3 generated tokens per row; the cut one is the supervisor's


def _episode(finish: str, tokens: int, *, aborted: bool = False) -> EpisodeOutcome:
    return EpisodeOutcome(
        episode_id=f"e-{finish}-{tokens}",
        group_id="g",
        task_id="t",
        env="test-env",
        finish_reason=finish,
        rows=[],
        turn_rewards=[],
        outcome=None,
        generated_tokens=tokens,
        duration_s=0.0,
        aborted=aborted,
    )


def _wasted(cause: str) -> float:
    return (
        metrics.REGISTRY.get_sample_value("rollwise_generated_tokens_wasted_total", {"cause": cause}) or 0.0
    )


def test_the_book_counts_a_finished_groups_untrainable_episodes_and_a_lost_groups_trainable_ones() -> None:
    group = GroupOutcome(
        "g",
        "t",
        "test-env",
        [
            _episode("stop", 30),
            _episode("length", 48),
            _episode("cut", 11),
            _episode("engine_error", 5, aborted=True),
            _episode("engine_error", 2),
            _episode("timeout", 9),
            _episode("env_error", 0),  # failed to start: nothing generated, nothing counted
        ],
    )
    before = {cause: _wasted(cause) for cause in WASTE_CAUSES}
    book = WasteBook()
    book.finished(group)
    assert dict(book.tokens) == {"cut": 11, "aborted": 5, "failed": 11}
    book.lost(group)  # its write failed: the trainable episodes go too
    assert dict(book.tokens) == {"cut": 11, "aborted": 5, "failed": 11, "lost": 78}
    assert {cause: _wasted(cause) - before[cause] for cause in WASTE_CAUSES} == {
        "stale": 0,
        "rejected": 0,
        "cut": 11,
        "aborted": 5,
        "failed": 11,
        "lost": 78,
    }


def test_a_group_dropped_in_flight_is_stale_waste_whole_and_an_unfinished_one_counts_its_notes() -> None:
    group = GroupOutcome("g", "t", "test-env", [_episode("stop", 30), _episode("cut", 11)])
    book = WasteBook()
    book.finished(group, doomed=True)  # never written: every token is stale, the cut episode's too
    assert dict(book.tokens) == {"stale": 41}
    cancelled, doomed = GroupCut(2), GroupCut(2)
    cancelled.note(7, [3] * 7)
    doomed.note(4, [2, 2, 3, 3])
    doomed.doom("stale")
    book.unfinished(cancelled)  # cancelled by a shutdown before its outcome existed
    book.unfinished(doomed)
    assert dict(book.tokens) == {"stale": 45, "lost": 7}


def _bounds(step_s: float, trained_groups: int = 8) -> Bounds:
    """Engines that generated 1,000 tokens in 2 busy seconds (500 tokens/s); B = 4; 100 tokens trained
    per group."""
    return run_bounds(
        step_s=step_s,
        generated_tokens=1000,
        engine_busy_s=2.0,
        batch_groups=4,
        trained_tokens=100 * trained_groups,
        trained_groups=trained_groups,
    )


def test_the_learner_binds_when_its_step_is_slower_than_the_engines_can_feed_it() -> None:
    # A step needs 400 tokens = 0.8 s of engine time: 4,500 steps/h. The learner: 1 s steps, 3,600/h.
    bounds = _bounds(step_s=1.0)
    assert bounds == Bounds(learner_steps_per_hour=3600.0, engine_steps_per_hour=4500.0)
    assert (bounds.binding, bounds.bound) == ("learner", 3600.0)
    assert efficiency(2700.0, bounds) == 0.75


def test_the_engines_bind_when_a_step_needs_more_generation_than_the_learners_step() -> None:
    bounds = _bounds(step_s=0.25)  # the learner could make 14,400 steps/h
    assert (bounds.binding, bounds.bound) == ("engines", 4500.0)
    assert efficiency(4500.0, bounds) == 1.0


def test_a_bound_that_cannot_be_known_is_left_out() -> None:
    nothing_trained = _bounds(step_s=0.5, trained_groups=0)
    assert nothing_trained == Bounds(7200.0, None)
    assert (nothing_trained.binding, nothing_trained.bound) == ("learner", 7200.0)
    unknown = Bounds(None, None)
    assert (unknown.binding, unknown.bound, efficiency(10.0, unknown)) == (None, None, None)


def test_the_waste_share_is_over_every_generated_token() -> None:
    assert waste_share({"stale": 30, "cut": 10}, 400) == 0.1
    assert waste_share({}, 0) is None
