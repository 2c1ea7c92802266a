"""pipeline.contracts.memory_trace: the native figures a soak reads, CPython's small-object arenas
included (they are mapped outside malloc, so mallinfo2 cannot see them grow)."""

from __future__ import annotations

import sys

import pytest

from pipeline.contracts import memory_trace

STATS = """Small block threshold = 512, in 32 size classes.

class   size   num pools   blocks in use  avail blocks
-----   ----   ---------   -------------  ------------
    0     16           1              46           975

# arenas allocated total           =                   12
# arenas reclaimed                 =                    2
# arenas highwater mark            =                   11
# arenas allocated current         =                   10
10 arenas * 1048576 bytes/arena    =           10,485,760

# bytes in allocated blocks        =            7,340,032
# bytes in available blocks        =              283,408
36 unused pools * 16384 bytes      =              589,824
Total                              =           10,485,760

arena map counts
# arena map mid nodes              =                    1

           11 free PyDictObjects * 48 bytes each =                  528
2026-11-27 00:06:38,574 INFO another thread's line
"""


def test_the_arena_figures_are_read_and_another_threads_writes_are_handed_back() -> None:
    figures, other = memory_trace.parse_obmalloc_stats(STATS)
    assert figures == {"obmalloc_arenas": 10.0, "obmalloc_in_use": 7.0}
    assert other == "2026-11-27 00:06:38,574 INFO another thread's line\n"


def test_an_interpreter_that_prints_nothing_gives_no_figures() -> None:
    assert memory_trace.parse_obmalloc_stats("") == ({}, "")


@pytest.mark.skipif(not hasattr(sys, "_debugmallocstats"), reason="not CPython")
def test_the_live_process_reports_its_arenas_and_writes_nothing_to_stderr(
    capfd: pytest.CaptureFixture[str],
) -> None:
    kept = [bytearray(100) for _ in range(50_000)]  # ~6 MiB of small objects: several arenas
    figures = memory_trace.native_figures()
    assert figures["obmalloc_in_use"] >= 5.0
    assert figures["obmalloc_arenas"] >= figures["obmalloc_in_use"]
    assert 0 < figures["rss_anon"] <= figures["rss"]
    assert capfd.readouterr().err == ""
    del kept
