"""Where the learner stands in the spool when it takes groups out of write order (Contract 5).

The learner reads a few groups ahead (its look-ahead) and takes them earliest staleness deadline first
(pipeline.contracts.staleness.deadline_key), so a group taken can lie after one still waiting. One
sequence number can then no longer say what was consumed; a checkpoint records

    watermark: every group with seq <= watermark is consumed (trained or dropped) or gone from the spool;
    after:     the seqs > watermark already consumed (at most the look-ahead's span).

A restarted learner reads the spool after `watermark` and skips `after`: nothing lost, nothing trained
twice. The supervisor counts the unconsumed groups as depth(watermark) - len(after), since each seq in
`after` is still a spool file (retention deletes files only up to the oldest kept checkpoint's
watermark). Pure bookkeeping, no I/O: the learner process calls `read` / `passed` / `take` as it goes and
`commit` when a step has made its takes durable-to-be (the next checkpoint writes what `commit` returned).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Consumed:
    """A committed position: `watermark` and the sorted seqs after it that are consumed too."""

    watermark: int
    after: tuple[int, ...] = ()


class SpoolCursor:
    """The learner's consumption state between checkpoints (module docstring)."""

    def __init__(self, watermark: int = 0, after: Iterable[int] = ()) -> None:
        after_set = set(after)
        if watermark < 0:
            raise ValueError(f"watermark must be >= 0, got {watermark}")
        below = sorted(s for s in after_set if s <= watermark)
        if below:
            raise ValueError(f"consumed seqs {below} are not after the watermark {watermark}")
        self._committed = Consumed(watermark, tuple(sorted(after_set)))
        self._held: set[int] = set()  # read, not taken: the look-ahead
        self._taken: set[int] = set()  # taken since the last commit
        self._highest = max([watermark, *after_set])  # the highest seq read or passed

    @property
    def committed(self) -> Consumed:
        return self._committed

    @property
    def held(self) -> tuple[int, ...]:
        """The seqs read and waiting to be taken, in write order."""
        return tuple(sorted(self._held))

    def consumed(self, seq: int) -> bool:
        """True for a seq the committed position already covers: a restart skips it."""
        return seq <= self._committed.watermark or seq in self._committed.after

    def read(self, seq: int) -> None:
        """A group read from the spool into the look-ahead."""
        if self.consumed(seq) or seq in self._held or seq in self._taken:
            raise ValueError(f"spool seq {seq} read twice")
        self._held.add(seq)
        self._highest = max(self._highest, seq)

    def passed(self, seq: int) -> None:
        """A seq that left the spool without being read (quarantined): nothing to take, nothing to skip."""
        self._highest = max(self._highest, seq)

    def take(self, seq: int) -> None:
        """A held group taken: trained or dropped in the next step."""
        if seq not in self._held:
            raise ValueError(f"spool seq {seq} taken but not held")
        self._held.remove(seq)
        self._taken.add(seq)

    def commit(self) -> Consumed:
        """Every take so far is consumed (the step that used them is done): the new committed position.
        The watermark moves up to just below the oldest group still held, or to the highest seq seen."""
        consumed = set(self._committed.after) | self._taken
        waiting = min(self._held) - 1 if self._held else self._highest
        watermark = max(self._committed.watermark, waiting)
        self._committed = Consumed(watermark, tuple(sorted(s for s in consumed if s > watermark)))
        self._taken.clear()
        return self._committed
