"""The rule that cuts a group at its last chance of being trained, and the handle its episodes share
(pipeline.supervisor.actors.late_cut). The scheduler's use of them: tests/supervisor/test_scheduler.py."""

from __future__ import annotations

import asyncio

import pytest

from pipeline.supervisor.actors.late_cut import GroupCut, cut_due


def _due(
    admitted: int,
    learner: int,
    waiting: int,
    others: int,
    *,
    batch: int = 4,
    eta: int = 1,
    unfinished: int = 1,
    group_size: int = 16,
    share: float = 0.25,
) -> bool:
    return cut_due(
        admitted_version=admitted,
        learner_version=learner,
        waiting_groups=waiting,
        others_running=others,
        batch_groups=batch,
        max_staleness=eta,
        unfinished=unfinished,
        group_size=group_size,
        max_share=share,
    )


@pytest.mark.parametrize(
    ("admitted", "learner", "waiting", "others", "expected"),
    [
        (0, 0, 10, 10, False),  # the learner below a + η: a later batch can still take it
        (3, 3, 4, 5, False),
        (0, 1, 3, 1, True),  # at a + η, one group short, another running could complete the batch
        (0, 1, 3, 0, False),  # ... but nobody else can: the learner waits for this group
        (0, 1, 2, 5, False),  # two short: the batch cannot start without this group
        (0, 1, 4, 0, True),  # the batch is full without it
        (0, 5, 9, 0, True),  # long past: cut so that the slot comes back (it is dropped stale)
        (2, 3, 3, 2, True),
    ],
)
def test_a_group_is_cut_at_its_last_batch_when_another_group_could_take_its_place(
    admitted: int, learner: int, waiting: int, others: int, expected: bool
) -> None:
    assert _due(admitted, learner, waiting, others) is expected


def test_with_eta_zero_admission_never_leaves_a_group_to_cut() -> None:
    """η = 0 admits B groups per version: while one runs, at most B - 1 are written and the others that
    run are of its own batch, counted in `waiting` once written. The rule must not cut the last one."""
    assert not _due(3, 3, 3, 0, batch=4, eta=0)
    assert not _due(3, 3, 2, 1, batch=4, eta=0)
    assert _due(3, 3, 3, 1, batch=4, eta=0)  # unreachable under admission, stated for the rule's sake


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
    assert _due(0, 1, 3, 1, unfinished=unfinished, group_size=group_size, share=share) is expected


def test_a_larger_staleness_bound_moves_the_last_chance_later() -> None:
    assert not _due(0, 2, 7, 3, batch=8, eta=3)
    assert _due(0, 3, 7, 3, batch=8, eta=3)


async def test_a_cut_expires_every_watched_scope_and_one_entered_after_it() -> None:
    cut = GroupCut()
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
    assert not cut.fired and ended == [] and cut.unfinished == 2
    cut.fire("learner at 3")
    cut.fire("a second reason is ignored")
    async with asyncio.timeout(2.0):
        await asyncio.gather(first, second)
    assert sorted(ended) == ["first", "second"] and cut.reason == "learner at 3" and cut.unfinished == 0
    async with asyncio.timeout(2.0):
        await episode("late")  # entered after the cut: expires at once
    assert ended[-1] == "late"


async def test_a_cut_leaves_alone_a_scope_that_already_timed_out_and_one_that_has_exited() -> None:
    cut = GroupCut()
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
        other = GroupCut()
        with other.watching(kept):
            await asyncio.sleep(0)
        other.fire("after the episode left")  # not watched any more: its deadline stays
        await asyncio.sleep(0.01)
        assert not kept.expired() and kept.when() is not None
