"""Train or drop, and why: the one decision the learner makes about each spool group before a step.

A group is decoded and validated once (pipeline.contracts.schema.batch_to_segments); `triage_group` then
either
returns the `TrainGroup` the trainer consumes or the reason the group is dropped, and the learner
process announces that reason in its `dropped` event. Pure: no model, no I/O.

Drop reasons:
- invalid_tokens: a token id outside the model's vocabulary (an engine serving another tokenizer would
  otherwise crash every restart of the learner on the same group);
- too_few_members: fewer than two trainable episodes (leave-one-out baselines need peers);
- stale: its oldest generated token is older than `learner_version - max_staleness` (the learner's
  half of the admission rule, pipeline.supervisor.actors.admission.is_stale);
- routing_mismatch: a row's routing record (MoE, learner.moe) does not fit the model's layers, top-k
  or expert count: the engine served another model, and replaying it would be wrong.
The learner process adds `quarantined` (unreadable file) and `no_update` (a step that changed no weight).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass, field

from pipeline.contracts.schema import EpisodeSegment, RejectedRow
from pipeline.contracts.staleness import is_stale, split_staleness

MIN_GROUP_MEMBERS = 2


@dataclass(frozen=True)
class TrainGroup:
    """The trainable part of one group: each trainable episode's segment rows, in first-appearance order
    (an episode is one row unless its chat template forced a new token buffer)."""

    group_id: str
    episodes: list[list[EpisodeSegment]]
    rejected: list[RejectedRow] = field(default_factory=list)  # rows that broke the schema's invariants
    untrainable_rows: int = 0  # rows of env_error / engine_error / timeout episodes

    @property
    def first_segments(self) -> list[EpisodeSegment]:
        """One row per episode (its turn rewards and outcome are the same on every segment)."""
        return [segments[0] for segments in self.episodes]

    @property
    def rows(self) -> list[EpisodeSegment]:
        return [row for segments in self.episodes for row in segments]


def triage_group(
    group_id: str,
    rows: Sequence[EpisodeSegment],
    *,
    learner_version: int,
    max_staleness: int,
    rejected: Sequence[RejectedRow] = (),
    vocab_size: int | None = None,
    routing: tuple[int, int, int] | None = None,
) -> TrainGroup | str:
    """The group to train, or the reason it is dropped (see the module docstring). `rows` are the group's
    valid rows; `rejected` the ones that broke an invariant (they never train, and are kept for counts).
    `routing` = (layers, topk, num_experts) of an MoE model, whose routing records are checked."""
    if vocab_size is not None and any(t < 0 or t >= vocab_size for row in rows for t in row.token_ids):
        return "invalid_tokens"
    if routing is not None:
        for row in rows:
            if row.routed_experts is not None and row.routed_experts.model_problem(*routing) is not None:
                return "routing_mismatch"
    episodes: dict[str, list[EpisodeSegment]] = collections.defaultdict(list)
    for row in rows:
        if row.trainable:
            episodes[row.episode_id].append(row)
    if len(episodes) < MIN_GROUP_MEMBERS:
        return "too_few_members"
    versions = [
        v for segments in episodes.values() for row in segments if (v := row.min_version()) is not None
    ]
    if not versions:
        return "too_few_members"
    if is_stale(min(versions), learner_version, max_staleness):
        return "stale"
    return TrainGroup(
        group_id=group_id,
        episodes=list(episodes.values()),
        rejected=list(rejected),
        untrainable_rows=sum(1 for row in rows if not row.trainable),
    )


def token_staleness_split(
    groups: Sequence[tuple[TrainGroup, int | None]], learner_version: int
) -> tuple[collections.Counter[int], collections.Counter[int]]:
    """Generated tokens of the groups' rows (each group with the version it was written at, or None) by
    the versions that passed before their group was written, and after (split_staleness)."""
    in_flight: collections.Counter[int] = collections.Counter()
    in_queue: collections.Counter[int] = collections.Counter()
    for group, written in groups:
        for row in group.rows:
            for version, mask in zip(row.versions, row.loss_mask, strict=True):
                if mask:
                    flight, queue = split_staleness(version, written, learner_version)
                    in_flight[flight] += 1
                    in_queue[queue] += 1
    return in_flight, in_queue


def token_staleness(groups: Sequence[TrainGroup], learner_version: int) -> collections.Counter[int]:
    """Generated tokens of the groups' rows by how many versions behind `learner_version` they were."""
    counts: collections.Counter[int] = collections.Counter()
    for group in groups:
        for row in group.rows:
            for version, mask in zip(row.versions, row.loss_mask, strict=True):
                if mask:
                    counts[learner_version - version] += 1
    return counts
