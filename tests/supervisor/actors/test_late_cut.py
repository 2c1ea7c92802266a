"""The rule that cuts a group at its last chance of being trained, and the handle its episodes share
(pipeline.supervisor.actors.late_cut). The scheduler's use of them: test_scheduler.py."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from pipeline.supervisor.actors.admission import AdmissionController
from pipeline.supervisor.actors.late_cut import Admitted, GroupCut, RunningGroup, groups_to_cut, late_cuts


def _cut(
    running: list[tuple[int, int]],
    *,
    learner: int,
    waiting: int,
    writing: int = 0,
    batch: int = 4,
    eta: int = 1,
    group_size: int = 16,
    share: float = 0.25,
) -> list[str]:
    """groups_to_cut over running groups given as (admitted version, unfinished episodes), named g0, g1..."""
    return groups_to_cut(
        [RunningGroup(f"g{i}", admitted, unfinished) for i, (admitted, unfinished) in enumerate(running)],
        learner_version=learner,
        waiting_groups=waiting,
        writing_groups=writing,
        batch_groups=batch,
        max_staleness=eta,
        group_size=group_size,
        max_share=share,
    )


def test_a_group_at_its_last_batch_is_cut_when_another_group_could_take_its_place() -> None:
    # g0 admitted at 0 is at its last chance at learner version 1 (η = 1); g1 from version 1 is not.
    assert _cut([(0, 1), (1, 9)], learner=1, waiting=3) == ["g0"]
    assert _cut([(0, 1)], learner=1, waiting=3) == []  # nobody else runs: the learner waits for it
    assert _cut([(0, 1), (1, 9)], learner=0, waiting=3) == []  # a later batch can still take it
    assert _cut([(0, 1), (1, 9)], learner=1, waiting=2) == []  # the batch needs more than it
    assert _cut([(0, 1), (1, 9)], learner=1, waiting=2, writing=1) == ["g0"]  # one lands any moment
    assert _cut([(0, 1)], learner=1, waiting=4) == ["g0"]  # complete without it: only a cut can catch it
    assert _cut([(0, 1)], learner=5, waiting=9) == ["g0"]  # long past: the slot comes back sooner


def test_groups_at_their_last_chance_are_cut_together_once_they_would_complete_the_batch() -> None:
    """Cut one by one at the last free place, each would find it just taken by the first of them."""
    late = [(0, 1), (0, 2), (0, 3)]
    assert _cut([*late, (1, 9)], learner=1, waiting=1, batch=4) == ["g0", "g1", "g2"]
    assert _cut([*late, (1, 9)], learner=1, waiting=0, batch=4) == []
    # A late group with too many episodes left is not cut, and does not count towards the batch.
    assert _cut([(0, 1), (0, 5), (1, 9)], learner=1, waiting=2, batch=4) == []
    assert _cut([(0, 1), (0, 5), (1, 9)], learner=1, waiting=3, batch=4) == ["g0"]


@pytest.mark.parametrize(
    ("unfinished", "group_size", "share", "expected"),
    [
        (4, 16, 0.25, True),  # a quarter of the group: the most one cut may stop
        (5, 16, 0.25, False),
        (1, 4, 0.25, True),
        (2, 4, 0.25, False),
        (1, 2, 0.5, False),  # it would leave one finished episode: too few to train
        (2, 4, 0.5, True),
        (0, 16, 0.25, False),  # nothing left to stop (an agent function's episodes are never watched)
        (1, 16, 0.0, False),  # cutting off
    ],
)
def test_a_cut_stops_at_most_its_share_of_the_group_and_leaves_two_finished(
    unfinished: int, group_size: int, share: float, expected: bool
) -> None:
    chosen = _cut([(0, unfinished), (1, 1)], learner=1, waiting=3, group_size=group_size, share=share)
    assert chosen == (["g0"] if expected else [])


def test_with_eta_zero_admission_never_leaves_a_group_to_cut() -> None:
    """η = 0 admits B groups per version: the running ones and those written are the learner's batch,
    so no group outside it could take a place, and a batch they complete is the one the learner waits
    for."""
    assert _cut([(3, 1)], learner=3, waiting=3, eta=0) == []
    assert _cut([(3, 1), (3, 2)], learner=3, waiting=2, eta=0) == []
    assert _cut([(3, 1), (3, 2)], learner=3, waiting=1, writing=1, eta=0) == []


def test_a_larger_staleness_bound_moves_the_last_chance_later() -> None:
    assert _cut([(0, 1), (3, 9)], learner=2, waiting=7, batch=8, eta=3) == []
    assert _cut([(0, 1), (3, 9)], learner=3, waiting=7, batch=8, eta=3) == ["g0"]


async def test_a_cut_expires_every_watched_scope_and_one_entered_after_it() -> None:
    cut = GroupCut(2)
    ended: list[str] = []

    async def episode(name: str) -> None:
        try:
            async with asyncio.timeout(60.0) as scope:
                with cut.watching(scope):
                    await asyncio.Event().wait()
        except TimeoutError:
            ended.append(name)

    first = asyncio.create_task(episode("first"))
    second = asyncio.create_task(episode("second"))
    await asyncio.sleep(0.01)
    assert not cut.fired and ended == []
    cut.fire("learner at 3")
    cut.fire("a second reason is ignored")
    async with asyncio.timeout(2.0):
        await asyncio.gather(first, second)
    assert sorted(ended) == ["first", "second"] and cut.reason == "learner at 3"
    async with asyncio.timeout(2.0):
        await episode("late")  # entered after the cut: expires at once
    assert ended[-1] == "late"


async def test_a_cut_leaves_alone_a_scope_that_already_timed_out_and_one_that_has_exited() -> None:
    cut = GroupCut(2)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.0) as expiring:
            with cut.watching(expiring):
                try:
                    await asyncio.sleep(1.0)
                except asyncio.CancelledError:
                    assert expiring.expired()
                    cut.fire("while its own timeout expires")  # rescheduling it now would raise
                    raise
    assert cut.fired
    async with asyncio.timeout(60.0) as kept:
        other = GroupCut(2)
        with other.watching(kept):
            await asyncio.sleep(0)
        other.fire("after the episode left")  # not watched any more: its deadline stays
        await asyncio.sleep(0.01)
        assert not kept.expired() and kept.when() is not None


def test_what_a_cut_would_stop_is_the_episodes_not_finished_and_nothing_in_an_agent_group() -> None:
    cut = GroupCut(16)
    assert cut.unfinished == 16  # counted from the start, not from the episodes already playing
    cut.finished += 13
    assert cut.unfinished == 3
    cut.uncuttable = True  # an agent function's episode: a cut cannot stop it
    assert cut.unfinished == 0


@pytest.mark.parametrize(("doomed", "cut"), [(False, ["g0"]), (True, [])])
def test_a_group_dropped_in_flight_is_not_counted_as_about_to_be_written(
    doomed: bool, cut: list[str]
) -> None:
    """A cut group still closing its episodes will land in the batch; one dropped in flight never will
    (in_flight_drops), so it must not make the batch look complete."""
    spool: Any = SimpleNamespace(next_seq=3)  # seqs 1 and 2 written, none consumed: 2 groups waiting
    cuts = late_cuts(0.25, AdmissionController(batch_groups=4, max_staleness=1, max_concurrent=9), 16, spool)
    closing = GroupCut(16)
    (closing.doom if doomed else closing.fire)("stopped")
    late, other = GroupCut(16), GroupCut(16)
    late.finished, other.finished = 15, 7  # g0: one episode left at its last chance; g1 runs on
    admitted = {"g0": Admitted(0, 0.0, late), "g1": Admitted(1, 0.0, other), "g2": Admitted(0, 0.0, closing)}
    cuts.on_learner_step(1, 0)
    cuts.check(admitted, writes=0)
    assert [g for g, e in admitted.items() if e.cut.fired and e.cut is not closing] == cut
