"""Which running groups the learner can no longer train (pipeline.supervisor.actors.in_flight_drops), from
the versions of the tokens each holds (late_cut.GroupCut.note)."""

from __future__ import annotations

import pytest

from pipeline.supervisor.actors.in_flight_drops import doomed_groups, drop_doomed
from pipeline.supervisor.actors.late_cut import Admitted, GroupCut
from pipeline.supervisor.observability import metrics


def _running(admitted_version: int, *answers: list[int]) -> Admitted:
    handle = GroupCut(4)
    for versions in answers:
        handle.note(len(versions), versions)
    return Admitted(admitted_version, 0.0, handle)


def test_a_handle_notes_the_tokens_and_their_oldest_version() -> None:
    handle = GroupCut(2)
    handle.note(3, [5, 5, 6])
    handle.note(2, [4, 6])  # a resubmitted turn may carry an older prefix's answer: the minimum counts
    handle.note(0, [])
    assert (handle.generated, handle.oldest_version) == (5, 4)


def test_doomed_are_the_groups_holding_a_token_older_than_the_learner_version_less_eta() -> None:
    admitted = {
        "old-token": _running(3, [3, 3], [4]),  # oldest 3 < 6 - 2: never trainable at version 6
        "at-the-bound": _running(3, [4, 4]),  # admitted at 3, first token at 4 (it waited through a sync)
        "no-token-yet": _running(2),  # admitted at 2 but nothing generated: it starts on the new weights
        "fresh": _running(5, [5]),
    }
    assert doomed_groups(admitted, learner_version=6, max_staleness=2) == ["old-token"]
    assert doomed_groups(admitted, learner_version=7, max_staleness=2) == ["old-token", "at-the-bound"]
    assert doomed_groups(admitted, learner_version=5, max_staleness=2) == []


def test_a_group_already_cut_is_left_to_its_write() -> None:
    entry = _running(0, [0])
    entry.cut.fire("cut: its last chance")
    assert doomed_groups({"g": entry}, learner_version=9, max_staleness=1) == []


def test_dropping_stops_the_group_marks_it_unwritable_and_counts_it() -> None:
    admitted = {"a": _running(1, [1, 1]), "b": _running(4, [4])}
    before = metrics.REGISTRY.get_sample_value("rollwise_groups_dropped_total", {"reason": "stale_in_flight"})
    assert drop_doomed(admitted, learner_version=4, max_staleness=2) == 1
    doomed = admitted["a"].cut
    assert doomed.doomed and doomed.fired and not admitted["b"].cut.fired
    assert doomed.reason is not None and "holds tokens of version 1 (max_staleness 2)" in doomed.reason
    after = metrics.REGISTRY.get_sample_value("rollwise_groups_dropped_total", {"reason": "stale_in_flight"})
    assert (after or 0.0) - (before or 0.0) == pytest.approx(1.0)
    assert drop_doomed(admitted, learner_version=5, max_staleness=2) == 0  # fired once, counted once
