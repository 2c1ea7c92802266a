"""learner.spool_cursor: the learner's position in the spool when it takes groups out of write order.

Scenarios with exact positions, the refusals, and a property: a learner that reads ahead, takes groups
in any order, commits now and then and crashes now and then (restarting from its last commit) consumes
every group exactly once along its committed history.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from learner.spool_cursor import Consumed, SpoolCursor
from pipeline.contracts.staleness import deadline_key


def test_taking_in_write_order_moves_the_watermark_to_the_last_seq_read() -> None:
    cursor = SpoolCursor()
    for seq in (1, 2, 3):
        cursor.read(seq)
        cursor.take(seq)
    assert cursor.commit() == Consumed(3, ())


def test_a_group_taken_before_an_older_one_waits_in_after_until_the_older_one_is_taken() -> None:
    cursor = SpoolCursor()
    for seq in (1, 2, 3):
        cursor.read(seq)
    cursor.take(3)
    assert cursor.commit() == Consumed(0, (3,))
    cursor.take(1)
    assert cursor.commit() == Consumed(1, (3,))
    cursor.read(4)
    cursor.take(4)
    assert cursor.commit() == Consumed(1, (3, 4))
    cursor.take(2)
    assert cursor.commit() == Consumed(4, ())
    assert cursor.held == ()


def test_takes_count_only_once_committed() -> None:
    cursor = SpoolCursor(5, (7,))
    cursor.read(6)
    cursor.take(6)
    assert cursor.committed == Consumed(5, (7,))  # a crash now redoes seq 6
    assert not cursor.consumed(6)
    assert cursor.commit() == Consumed(7, ())


def test_a_quarantined_seq_is_passed_over_by_the_watermark() -> None:
    cursor = SpoolCursor()
    cursor.read(1)
    cursor.passed(2)  # unusable: moved to quarantine, nothing to take
    cursor.read(3)
    cursor.take(3)
    assert cursor.commit() == Consumed(0, (3,))  # seq 1 still waits
    cursor.take(1)
    assert cursor.commit() == Consumed(3, ())


def test_a_restored_cursor_skips_what_its_checkpoint_consumed() -> None:
    cursor = SpoolCursor(2, [5, 4])
    assert cursor.committed == Consumed(2, (4, 5))
    assert [s for s in range(1, 7) if cursor.consumed(s)] == [1, 2, 4, 5]
    cursor.read(3)
    cursor.read(6)
    cursor.take(6)
    assert cursor.commit() == Consumed(2, (4, 5, 6))
    cursor.take(3)
    assert cursor.commit() == Consumed(6, ())


def test_refusals_name_the_seq() -> None:
    with pytest.raises(ValueError, match=r"consumed seqs \[2\] are not after the watermark 3"):
        SpoolCursor(3, [2, 4])
    with pytest.raises(ValueError, match="watermark must be >= 0"):
        SpoolCursor(-1)
    cursor = SpoolCursor(2, [4])
    with pytest.raises(ValueError, match="spool seq 4 read twice"):
        cursor.read(4)
    cursor.read(3)
    with pytest.raises(ValueError, match="spool seq 3 read twice"):
        cursor.read(3)
    with pytest.raises(ValueError, match="spool seq 5 taken but not held"):
        cursor.take(5)


def test_deadline_key_takes_the_oldest_version_first_then_write_order() -> None:
    waiting = [(3, 1), (1, 4), (None, 6), (1, 2), (2, 3)]
    assert sorted(waiting, key=lambda w: deadline_key(*w)) == [(None, 6), (1, 2), (1, 4), (2, 3), (3, 1)]


@settings(max_examples=300, deadline=None)
@given(
    spool=st.lists(st.booleans(), min_size=1, max_size=30),  # per seq: True = unusable (quarantined)
    lookahead=st.integers(1, 6),
    moves=st.lists(st.tuples(st.sampled_from(["take", "commit", "crash"]), st.integers(0, 99)), max_size=120),
)
def test_every_group_is_consumed_exactly_once_through_crashes(
    spool: list[bool], lookahead: int, moves: list[tuple[str, int]]
) -> None:
    quarantined = {seq for seq, bad in enumerate(spool, start=1) if bad}
    committed_history: list[int] = []  # seqs consumed by committed steps, across restarts

    def start(position: Consumed) -> tuple[SpoolCursor, list[int], list[int]]:
        cursor = SpoolCursor(position.watermark, position.after)
        # what a reader positioned after the watermark returns, in write order
        unread = list(range(position.watermark + 1, len(spool) + 1))
        return cursor, unread, []

    position = Consumed(0)
    cursor, unread, taken = start(position)

    def read_ahead() -> None:
        while unread and len(cursor.held) < lookahead:
            seq = unread.pop(0)
            if seq in quarantined:
                cursor.passed(seq)
            elif not cursor.consumed(seq):
                cursor.read(seq)

    for move, pick in [*moves, *[("take", 0)] * (2 * len(spool)), ("commit", 0)]:
        read_ahead()
        held = cursor.held
        if move == "take" and held:
            seq = held[pick % len(held)]
            cursor.take(seq)
            taken.append(seq)
        elif move == "commit":
            position = cursor.commit()
            committed_history.extend(taken)
            taken = []
        elif move == "crash":
            cursor, unread, taken = start(position)  # the takes since the last commit are lost
    read_ahead()
    assert cursor.held == () and not unread
    assert sorted(committed_history) == sorted(set(range(1, len(spool) + 1)) - quarantined)
    assert position.after == ()
    assert position.watermark == len(spool)
