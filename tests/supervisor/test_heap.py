"""freeze_startup_heap: what is alive at start-up leaves the collector's full passes."""

from __future__ import annotations

import gc

from pipeline.supervisor.heap import freeze_startup_heap


def test_objects_alive_at_start_up_are_frozen_and_later_ones_are_not() -> None:
    before = [object()]  # alive when the heap is frozen
    try:
        frozen = freeze_startup_heap()
        # Frozen objects still die by reference count (threads left by earlier tests drop theirs), so the
        # permanent generation can only have shrunk since.
        assert 0 < gc.get_freeze_count() <= frozen
        assert not any(o is before for o in gc.get_objects())  # out of every generation
        later = [object()]
        assert any(o is later for o in gc.get_objects())  # new objects are collected as usual
    finally:
        gc.unfreeze()
    assert any(o is before for o in gc.get_objects())
