"""Test glue: synthetic rows, and rows -> the TrainGroups the learner process would hand the trainer."""

from __future__ import annotations

import pyarrow as pa

from learner.groups import TrainGroup, triage_group
from pipeline.contracts.schema import EpisodeSegment, batch_to_segments, segments_to_batch


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


def one_turn_segment(
    episode_id: str,
    group_id: str,
    prompt: list[int],
    action: list[int],
    *,
    logprob: float,
    outcome: float | None,
    env: str = "test-env",
    version: int = 0,
    finish: str = "stop",
) -> EpisodeSegment:
    """A valid one-turn row: `prompt`, then `action` generated at `version`, each of its tokens at
    `logprob`."""
    n, k = len(prompt), len(action)
    return EpisodeSegment(
        episode_id=episode_id,
        group_id=group_id,
        task_id="task",
        env=env,
        token_ids=prompt + action,
        prompt_len=n,
        loss_mask=[0] * n + [1] * k,
        logprobs=[0.0] * n + [logprob] * k,
        turn_index=[-1] * n + [0] * k,
        versions=[-1] * n + [version] * k,
        turn_rewards=[0.0],
        outcome=outcome,
        num_turns=1,
        finish_reason=finish,
    )


def one_turn_row(
    group_id: str,
    index: int,
    version: int,
    *,
    finish: str = "stop",
    outcome: float | None = None,
    episode_id: str | None = None,
) -> EpisodeSegment:
    """A valid one-turn row: 4 prompt tokens, 3 generated at `version` with plausible log-probs, outcome
    index % 2 unless given (members of a group differ, so the group carries a learning signal)."""
    return EpisodeSegment(
        episode_id=episode_id or f"{group_id}-{index}",
        group_id=group_id,
        task_id="task",
        env="test-env",
        token_ids=[5, 6, 7, 8, 30 + index, 40 + index, 50],
        prompt_len=4,
        loss_mask=[0, 0, 0, 0, 1, 1, 1],
        logprobs=[0.0, 0.0, 0.0, 0.0, -2.0, -1.5, -3.0],
        turn_index=[-1, -1, -1, -1, 0, 0, 0],
        versions=[-1, -1, -1, -1, version, version, version],
        turn_rewards=[0.0],
        outcome=float(index % 2) if outcome is None else outcome,
        num_turns=1,
        finish_reason=finish,
    )
