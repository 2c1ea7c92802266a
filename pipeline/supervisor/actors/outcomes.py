"""What an episode and a group produce: their rows (Contract 1) and statistics."""

from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow as pa

from pipeline.contracts.schema import TRAINABLE_FINISH_REASONS, EpisodeSegment, segments_to_batch


@dataclass
class EpisodeOutcome:
    """Result of one episode: its rows (one per segment; none when reset failed) and statistics.

    `turn_seconds[k]` is the wall time of turn k (request to the end of the step and the buffer
    update); `engine_seconds[k]` the part spent waiting for /generate. `aborted`: it ended because the
    engine aborted a generation that was not resubmitted.
    """

    episode_id: str
    group_id: str
    task_id: str
    env: str
    finish_reason: str
    rows: list[EpisodeSegment]
    turn_rewards: list[float]
    outcome: float | None
    generated_tokens: int
    duration_s: float
    turn_seconds: list[float] = field(default_factory=list)
    engine_seconds: list[float] = field(default_factory=list)
    error: str | None = None
    aborted: bool = False

    @property
    def num_turns(self) -> int:
        return len(self.turn_rewards)

    @property
    def num_segments(self) -> int:
        return len(self.rows)

    @property
    def success(self) -> bool:
        return self.outcome is not None and self.outcome >= 1.0

    @property
    def trainable(self) -> bool:
        return self.finish_reason in TRAINABLE_FINISH_REASONS

    @property
    def score(self) -> float:
        """The outcome, or the sum of turn rewards when the environment set none."""
        return self.outcome if self.outcome is not None else sum(self.turn_rewards)


@dataclass
class GroupOutcome:
    """G episodes of one task; `to_record_batch()` is the group's Arrow batch (Contract 1)."""

    group_id: str
    task_id: str
    env: str
    episodes: list[EpisodeOutcome]

    @property
    def rows(self) -> list[EpisodeSegment]:
        return [row for ep in self.episodes for row in ep.rows]

    def to_record_batch(self) -> pa.RecordBatch:
        return segments_to_batch(self.rows)
