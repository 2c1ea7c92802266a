"""pipeline.contracts.malloc_trim: at most one trim per interval, and on glibc a trim hands the pages of
freed chunks back (resident memory falls) where the allocator alone would keep them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pipeline.contracts.malloc_trim import Trimmer


def test_trims_at_first_then_at_most_once_per_interval() -> None:
    now = [100.0]
    calls: list[int] = []
    trimmer = Trimmer(60.0, clock=lambda: now[0], trim=lambda pad: calls.append(pad) or 1)
    assert trimmer.maybe() is True
    now[0] += 59.9
    assert trimmer.maybe() is False
    now[0] += 0.1
    assert trimmer.maybe() is True
    assert trimmer.maybe() is False
    assert calls == [0, 0] and trimmer.trims == 2


def test_without_glibc_it_does_nothing() -> None:
    trimmer = Trimmer(0.0, trim=None)
    trimmer._trim = None  # as on a C library without malloc_trim
    assert trimmer.available is False and trimmer.maybe() is False and trimmer.trims == 0


# Frees 15 of every 16 blocks of 40 MiB: glibc keeps the holes (the heap's top is still in use), so
# resident memory stays until a trim hands their whole pages back.
_CHILD = """
import json, sys
from pathlib import Path
from pipeline.contracts.malloc_trim import Trimmer

def anon_kib():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])

blocks = [bytes(bytearray(2000)) for _ in range(20_000)]
kept = blocks[::16]
del blocks
before = anon_kib()
trimmer = Trimmer()
assert trimmer.available
trimmer.maybe()
print(json.dumps({"before": before, "after": anon_kib(), "kept": len(kept)}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc and /proc")
def test_a_trim_hands_back_the_pages_of_freed_chunks() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD], capture_output=True, text=True, check=True, timeout=60
    )
    figures = json.loads(out.stdout)
    released_mib = (figures["before"] - figures["after"]) / 1024
    # 37.5 MiB were freed in 30 KiB holes: most of their pages must go (each hole's partial pages stay).
    assert released_mib > 25.0, figures
