"""Test glue: rows -> the TrainGroups the learner process would hand the trainer (learner.groups)."""

from __future__ import annotations

import pyarrow as pa

from learner.groups import TrainGroup, triage_group
from learner.schema import EpisodeSegment, batch_to_segments, segments_to_batch


def groups_of(rows: list[EpisodeSegment] | pa.RecordBatch) -> list[TrainGroup]:
    """Decode (through Arrow, as the spool does), split by group_id in first-appearance order and triage
    each group with no staleness bound; groups triage drops are left out."""
    batch = rows if isinstance(rows, pa.RecordBatch) else segments_to_batch(rows)
    decoded, rejected = batch_to_segments(batch)
    by_group: dict[str, list[EpisodeSegment]] = {}
    for row in decoded:
        by_group.setdefault(row.group_id, []).append(row)
    groups = []
    for group_id, members in by_group.items():
        ids = {row.episode_id for row in members}
        verdict = triage_group(
            group_id,
            members,
            learner_version=0,
            max_staleness=10**6,
            rejected=[r for r in rejected if r.episode_id.startswith(group_id) or r.episode_id in ids],
        )
        if isinstance(verdict, TrainGroup):
            groups.append(verdict)
    return groups
