"""A step's groups as the trainer trains them: per-token advantages on each row (pure; no model).

Segments of one episode share its turn rewards and outcome, so advantages are computed once per episode and
every segment maps its tokens through its own turn_index. A group whose advantages are all zero carries no
policy-gradient signal: counted, and left out unless the step keeps such groups (an entropy bonus or the
action prior still trains on them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from learner.advantages import Estimator, Norm, history_anchors, token_advantages, turn_advantages
from learner.batching import TrainSequence
from learner.groups import TrainGroup
from learner.loss.regularizers import overlong_penalty
from pipeline.contracts.schema import EpisodeSegment, RejectedRow

# Per-turn advantages below this are float noise of a group whose members all scored the same.
ZERO_ADVANTAGE = 1e-8


@dataclass
class StepInput:
    """The sequences to train on plus the accounting of the step's groups."""

    sequences: list[TrainSequence] = field(default_factory=list)
    episodes: list[EpisodeSegment] = field(default_factory=list)  # one row (the first segment) per episode
    rejected: list[RejectedRow] = field(default_factory=list)
    untrainable_rows: int = 0
    skipped_zero_adv_groups: int = 0
    trained_groups: int = 0
    turns: int = 0  # turns of the step's episodes (counted when the over-long penalty is on)
    overlong_turns: int = 0  # of them, turns the over-long penalty reached


def _episode_anchors(group: TrainGroup) -> list[list[bytes | None]]:
    """[episode][turn] history digests of a group (segments of one episode merged; None if unknown)."""
    result = []
    for segments in group.episodes:
        anchors: dict[int, bytes] = {}
        for seg in segments:
            anchors.update(history_anchors(seg.token_ids, seg.turn_index, seg.loss_mask))
        result.append([anchors.get(k) for k in range(len(segments[0].turn_rewards))])
    return result


def _turn_lengths(segments: Sequence[EpisodeSegment], num_turns: int) -> list[int]:
    """Generated tokens of each turn of one episode, over all its segments."""
    lengths = [0] * num_turns
    for seg in segments:
        for turn, generated in zip(seg.turn_index, seg.loss_mask, strict=True):
            if generated and 0 <= turn < num_turns:
                lengths[turn] += 1
    return lengths


def build_step_input(
    groups: Sequence[TrainGroup],
    *,
    estimator: Estimator,
    gamma: float,
    lam: float,
    keep_zero_advantage: bool = False,
    norm: Norm = "std",
    overlong: tuple[int, int] | None = None,
) -> StepInput:
    """Annotate the groups' rows with per-token advantages (pure; no model involved).

    ``overlong = (budget, slope)`` adds DAPO's soft over-long penalty of each turn's generated length to
    that turn's reward before the advantages (learner.regularizers.overlong_penalty).

    The groups were decoded, validated and triaged once by the learner (learner.groups.triage_group).
    Segments of one episode share its turn_rewards and outcome, so advantages are computed once per
    episode and every segment maps its tokens through its own turn_index.

    Groups whose advantages are all zero carry no policy-gradient signal and are counted in
    ``skipped_zero_adv_groups``; they are left out unless ``keep_zero_advantage`` (the trainer sets it
    when an entropy bonus or the action prior is on: a policy whose groups all play alike is exactly the
    one they must reach, and their tokens also dilute the remaining signal under token-mean aggregation).
    """
    result = StepInput()
    for group in groups:
        result.rejected.extend(group.rejected)
        result.untrainable_rows += group.untrainable_rows
    members = [group.first_segments for group in groups]
    result.episodes = [ep for group in members for ep in group]
    if not groups:
        return result
    rewards = [[list(ep.turn_rewards) for ep in group] for group in members]
    if overlong is not None:
        for group, group_rewards in zip(groups, rewards, strict=True):
            for segments, turn_rewards in zip(group.episodes, group_rewards, strict=True):
                for k, length in enumerate(_turn_lengths(segments, len(turn_rewards))):
                    penalty = overlong_penalty(length, *overlong)
                    turn_rewards[k] += penalty
                    result.overlong_turns += penalty < 0.0
                result.turns += len(turn_rewards)
    advantages = turn_advantages(
        [
            [(r, ep.outcome) for r, ep in zip(group_rewards, group, strict=True)]
            for group_rewards, group in zip(rewards, members, strict=True)
        ],
        gamma=gamma,
        lam=lam,
        estimator=estimator,
        anchors=[_episode_anchors(group) for group in groups] if estimator == "anchor" else None,
        norm=norm,
    )
    for group, group_adv in zip(groups, advantages, strict=True):
        if all(abs(a) <= ZERO_ADVANTAGE for episode_adv in group_adv for a in episode_adv):
            result.skipped_zero_adv_groups += 1
            if not keep_zero_advantage:
                continue
            group_adv = [[0.0] * len(episode_adv) for episode_adv in group_adv]
        else:
            result.trained_groups += 1
        for segments, episode_adv in zip(group.episodes, group_adv, strict=True):
            for seg in segments:
                if sum(seg.loss_mask[1:]) == 0:
                    continue  # nothing the model generated can be scored in this row
                try:
                    token_adv = token_advantages(episode_adv, seg.turn_index, seg.loss_mask)
                except ValueError as exc:  # a turn index without a turn reward: never guess one
                    result.rejected.append(RejectedRow(index=-1, episode_id=seg.episode_id, reason=str(exc)))
                    continue
                result.sequences.append(
                    TrainSequence(
                        token_ids=list(seg.token_ids),
                        loss_mask=list(seg.loss_mask),
                        old_logprobs=list(seg.logprobs),
                        advantages=token_adv,
                        versions=list(seg.versions),
                        source=seg,
                        routed_experts=seg.routed_experts,
                    )
                )
    return result


def episode_return(ep: EpisodeSegment) -> float:
    """Total reward of an episode: its turn rewards plus its outcome (0 when the env set none)."""
    return sum(ep.turn_rewards) + (ep.outcome if ep.outcome is not None else 0.0)
