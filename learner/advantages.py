"""Per-turn advantages for multi-turn episodes (pure Python).

Input: groups of episodes; the episodes of a group played the same task. An episode is
``(turn_rewards, outcome)``: one shaping reward per turn (the env's ``StepResult.reward``) and the final
outcome, or None when the environment reports none.

Default estimator ``"turn"``, two channels:

- outcome, leave-one-out: A^o_i = o_i - mean_{j != i} o_j over the episodes of the group that have an
  outcome (0 when there is no such peer). An episode whose environment set no outcome has no outcome
  channel: A^o_i = 0, it adds nothing to sigma_o and is no peer in the others' outcome baselines. Its
  turn rewards are shaping like everyone's, so the two channels never mix units.
- shaping, return-to-go with a per-turn leave-one-out baseline: S_{i,k} = sum_{j >= k} gamma^{j-k} s_{i,j};
  A^s_{i,k} = S_{i,k} - mean of S_{j,k} over peers j != i that have a shaping channel and reached turn k
  (0 when there is none). Each turn subtracts exactly one baseline built only from *other* episodes, so
  the baseline does not depend on episode i's own later actions or on when it stopped (no length bias,
  pitfall P1), and every episode counts once however many turns it took (P2).

The channels are added in reward units and the sum is scaled once: A_{i,k} = (A^o_i + lam * A^s_{i,k}) /
sigma, sigma the batch-level population std (+1e-6) of every (episode, turn) sum in the call. One scale
for both keeps each channel's size relative to the other: a shaping channel that holds one -0.1 format
penalty stays a -0.1-sized correction. lam sets the channels' relative weight in reward units. With
``norm="none"`` (Dr. GRPO, verl's ``norm_adv_by_std_in_grpo=False``) sigma = 1: a batch whose groups have
little left to learn yields small advantages instead of being rescaled to unit spread, so an entropy bonus
keeps its weight relative to them as the signal thins out.

Estimator ``"outcome"``: classic GRPO broadcast, per group (r_i - mean) / (std + 1e-6) with r_i the
outcome, the same value on every turn. A group where no episode has an outcome uses the sums of the turn
rewards instead (one unit for the whole group); in a group where only some have one, the others get 0
and are left out of the mean and std. std is the *population* std (so a
one-episode group gives 0, not NaN); verl and TRL use the Bessel-corrected std, which differs by the
constant factor sqrt((G - 1) / G). ``norm="none"``: r_i - mean.

Estimator ``"anchor"`` (GiGPO's anchor-state groups, arXiv 2505.10978, applied to both channels of ``turn``):
every turn k of episode i gets its own outcome term A^o_{i,k} = o_i - mean of o_j and shaping term
A^s_{i,k} = S_{i,k} - mean of S_{j,k}, both over the peers j != i of its group that saw exactly the same
history before turn k (the same ``anchors[g][i][k]``; the pipeline uses a digest of the token ids the
engine was given). Those peers had the same information as episode i when it chose its turn-k action, so
the baseline is a Monte-Carlo estimate of that state's value: each turn is credited against what other
actions from the *same* state earned, not against episodes that were elsewhere. Turns with no such peer
(or no anchor) fall back to the peers that reached turn k. The baseline never uses episode i itself, so
it stays unbiased. Each channel is scaled by its own batch std (sigma_o over every (i, k) outcome term,
sigma_s over every shaping term).

Sums use math.fsum, which is exactly rounded, so results do not depend on episode order, not even in
the last bit.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

EpisodeRewards = tuple[Sequence[float], float | None]
Group = Sequence[EpisodeRewards]
Estimator = Literal["turn", "outcome", "anchor"]
ESTIMATORS: tuple[str, ...] = ("turn", "outcome", "anchor")
Norm = Literal["std", "none"]
NORMS: tuple[str, ...] = ("std", "none")
# anchors[g][i][k]: what episode i of group g had seen before its turn k (None: unknown).
Anchors = Sequence[Sequence[Sequence[Hashable | None]]]
STD_EPS = 1e-6


@dataclass(frozen=True)
class RawChannels:
    """Un-normalised channels of the "turn" estimator, indexed [group][episode] (and [turn]).

    ``shaping_baseline[g][i][k]`` is the leave-one-out mean subtracted from S_{i,k} (0.0 when no peer
    reached turn k); ``shaping[g][i][k]`` = return-to-go minus that baseline. Episodes without an outcome
    have ``has_outcome`` False and an outcome term of 0.
    """

    outcome: list[list[float]]
    shaping: list[list[list[float]]]
    shaping_baseline: list[list[list[float]]]
    has_outcome: list[list[bool]]


def _validated(groups: Sequence[Group]) -> list[list[tuple[list[float], float | None]]]:
    checked = []
    for g, group in enumerate(groups):
        episodes = []
        for i, episode in enumerate(group):
            if not isinstance(episode, (tuple, list)) or len(episode) != 2:
                raise ValueError(f"group {g} episode {i}: expected (turn_rewards, outcome), got {episode!r}")
            rewards, outcome = episode
            values = [float(r) for r in rewards]
            for k, value in enumerate(values):
                if not math.isfinite(value):
                    raise ValueError(f"group {g} episode {i} turn {k}: reward {value} is not finite")
            if outcome is not None and not math.isfinite(float(outcome)):
                raise ValueError(f"group {g} episode {i}: outcome {outcome} is not finite")
            episodes.append((values, None if outcome is None else float(outcome)))
        checked.append(episodes)
    return checked


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values)


def _population_std(values: Sequence[float]) -> float:
    if not values:
        return 0.0
    mean = _mean(values)
    return math.sqrt(math.fsum((v - mean) ** 2 for v in values) / len(values))


def _outcome_term(own: float | None, peer_outcomes: Iterable[float | None]) -> float:
    """A^o = own - mean of the peers' outcomes (those that have one); 0 without an outcome or a peer."""
    peers = [o for o in peer_outcomes if o is not None]
    return own - _mean(peers) if own is not None and peers else 0.0


def _std_scale(values: Sequence[float]) -> float:
    """Divisor of ``norm="std"``: the population std plus STD_EPS (never 0)."""
    return _population_std(values) + STD_EPS


def _unit_scale(values: Sequence[float]) -> float:
    """Divisor of ``norm="none"``: advantages keep their reward units."""
    return 1.0


def _returns_to_go(rewards: Sequence[float], gamma: float) -> list[float]:
    returns = [0.0] * len(rewards)
    running = 0.0
    for k in range(len(rewards) - 1, -1, -1):
        running = rewards[k] + gamma * running
        returns[k] = running
    return returns


def raw_channels(groups: Sequence[Group], *, gamma: float = 1.0) -> RawChannels:
    """The outcome and shaping channels before scaling (see the module docstring)."""
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    outcome: list[list[float]] = []
    shaping: list[list[list[float]]] = []
    baselines: list[list[list[float]]] = []
    has_outcome: list[list[bool]] = []
    for episodes in _validated(groups):
        outcomes = [o for _, o in episodes]
        outcome.append(
            [_outcome_term(o, (p for j, p in enumerate(outcomes) if j != i)) for i, o in enumerate(outcomes)]
        )
        returns = [_returns_to_go(rewards, gamma) for rewards, _ in episodes]
        group_shaping, group_baselines = [], []
        for i, episode_returns in enumerate(returns):
            episode_shaping, episode_baselines = [], []
            for k, value in enumerate(episode_returns):
                peers = [returns[j][k] for j in range(len(returns)) if j != i and len(returns[j]) > k]
                baseline = _mean(peers) if peers else 0.0
                episode_baselines.append(baseline)
                episode_shaping.append(value - baseline if peers else 0.0)
            group_shaping.append(episode_shaping)
            group_baselines.append(episode_baselines)
        shaping.append(group_shaping)
        baselines.append(group_baselines)
        has_outcome.append([o is not None for _, o in episodes])
    return RawChannels(outcome, shaping, baselines, has_outcome)


def turn_advantages(
    groups: Sequence[Group],
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
    estimator: Estimator = "turn",
    anchors: Anchors | None = None,
    norm: Norm = "std",
) -> list[list[list[float]]]:
    """One advantage per turn, indexed [group][episode][turn], for every episode of every group.

    Args:
        groups: each group a sequence of ``(turn_rewards, outcome)`` episodes (outcome may be None).
        gamma: discount of the shaping return-to-go, in [0, 1].
        lam: weight of the shaping channel relative to the outcome channel ("turn" and "anchor").
        estimator: "turn" (outcome + shaping channels, default), "outcome" (GRPO broadcast of the
            group-normalised outcome) or "anchor" (``turn`` with same-history baselines per turn; see
            the module docstring).
        anchors: for "anchor", ``anchors[g][i][k]`` identifies the history episode i of group g had
            seen before its turn k (any hashable; None = unknown). Missing anchors fall back as None.
        norm: "std" divides each channel by its batch-level population std (GRPO-style); "none" keeps
            reward units (Dr. GRPO).

    Raises:
        ValueError: naming the group/episode/turn of a non-finite reward, or an unknown estimator or norm.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
    if not math.isfinite(lam):
        raise ValueError(f"lam must be finite, got {lam}")
    scale = _std_scale if norm == "std" else _unit_scale
    if estimator == "outcome":
        return _grpo_broadcast(_validated(groups), scale)
    if estimator == "anchor":
        return _anchored(_validated(groups), anchors, gamma=gamma, lam=lam, scale=scale)

    raw = raw_channels(groups, gamma=gamma)
    # One outcome term per episode, on every turn of it, plus that turn's shaping term; one scale for all.
    sums = [
        [
            [a_o + lam * a_s for a_s in episode_shaping]
            for a_o, episode_shaping in zip(group_outcome, group_shaping, strict=True)
        ]
        for group_outcome, group_shaping in zip(raw.outcome, raw.shaping, strict=True)
    ]
    sigma = scale([a for group in sums for episode in group for a in episode])
    return [[[a / sigma for a in episode] for episode in group] for group in sums]


def _combine(
    outcome: list[list[list[float]]],
    shaping: list[list[list[float]]],
    sigma_outcome: float,
    sigma_shaping: float,
    lam: float,
) -> list[list[list[float]]]:
    """A_{i,k} = A^o_{i,k} / sigma_o + lam * A^s_{i,k} / sigma_s, both indexed [group][episode][turn]."""
    return [
        [
            [a_o / sigma_outcome + lam * a_s / sigma_shaping for a_o, a_s in zip(ep_o, ep_s, strict=True)]
            for ep_o, ep_s in zip(group_outcome, group_shaping, strict=True)
        ]
        for group_outcome, group_shaping in zip(outcome, shaping, strict=True)
    ]


def _anchor(anchors: Anchors | None, g: int, i: int, k: int) -> Hashable | None:
    try:
        return anchors[g][i][k] if anchors is not None else None
    except IndexError:
        return None


def _anchored(
    groups: list[list[tuple[list[float], float | None]]],
    anchors: Anchors | None,
    *,
    gamma: float,
    lam: float,
    scale: Callable[[Sequence[float]], float],
) -> list[list[list[float]]]:
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    outcome: list[list[list[float]]] = []
    shaping: list[list[list[float]]] = []
    outcome_values: list[float] = []
    shaping_values: list[float] = []
    for g, episodes in enumerate(groups):
        outcomes = [o for _, o in episodes]
        returns = [_returns_to_go(rewards, gamma) for rewards, _ in episodes]
        group_outcome, group_shaping = [], []
        for i, episode_returns in enumerate(returns):
            episode_outcome, episode_shaping = [], []
            for k, value in enumerate(episode_returns):
                reached = [j for j in range(len(episodes)) if j != i and len(returns[j]) > k]
                key = _anchor(anchors, g, i, k)
                same = [j for j in reached if key is not None and _anchor(anchors, g, j, k) == key]
                peers = same or reached
                a_o = _outcome_term(outcomes[i], (outcomes[j] for j in peers))
                if outcomes[i] is not None:
                    outcome_values.append(a_o)
                episode_outcome.append(a_o)
                a_s = value - _mean([returns[j][k] for j in peers]) if peers else 0.0
                shaping_values.append(a_s)
                episode_shaping.append(a_s)
            group_outcome.append(episode_outcome)
            group_shaping.append(episode_shaping)
        outcome.append(group_outcome)
        shaping.append(group_shaping)
    return _combine(outcome, shaping, scale(outcome_values), scale(shaping_values), lam)


def history_anchors(
    token_ids: Sequence[int], turn_index: Sequence[int], loss_mask: Sequence[int]
) -> dict[int, bytes]:
    """Turn → digest of the token ids before that turn's first generated token (one trajectory row).

    Two rows of a group with the same digest for turn k had the engine see exactly the same tokens before
    it produced their turn-k action: the same history, hence the same state for the policy. Turns
    without a generated token in this row are absent.
    """
    anchors: dict[int, bytes] = {}
    digest = hashlib.blake2b(digest_size=16)
    for token, turn, generated in zip(token_ids, turn_index, loss_mask, strict=True):
        if generated and turn not in anchors:
            anchors[turn] = digest.copy().digest()
        digest.update(int(token).to_bytes(4, "little", signed=True))
    return anchors


def _grpo_broadcast(
    groups: list[list[tuple[list[float], float | None]]], scale: Callable[[Sequence[float]], float]
) -> list[list[list[float]]]:
    result: list[list[list[float]]] = []
    for episodes in groups:
        returns: list[float | None] = [o for _, o in episodes]
        if all(r is None for r in returns):  # no outcomes at all: the turn rewards are the return
            returns = [math.fsum(rewards) for rewards, _ in episodes]
        scored = [r for r in returns if r is not None]
        if not scored:
            result.append([])
            continue
        mean, divisor = _mean(scored), scale(scored)
        result.append(
            [
                [(r - mean) / divisor if r is not None else 0.0] * len(rewards)
                for r, (rewards, _) in zip(returns, episodes, strict=True)
            ]
        )
    return result


def token_advantages(
    turn_adv: Sequence[float], turn_index: Sequence[int], loss_mask: Sequence[int] | None = None
) -> list[float]:
    """Each token's advantage: its turn's value; 0.0 for the prompt (turn -1) and masked tokens.

    ``turn_index`` and ``loss_mask`` follow the trajectory schema (one entry per token). A turn index
    outside [-1, len(turn_adv)) raises ValueError naming the token position.
    """
    if loss_mask is not None and len(loss_mask) != len(turn_index):
        raise ValueError(f"loss_mask has {len(loss_mask)} entries, turn_index has {len(turn_index)}")
    advantages = []
    for position, turn in enumerate(turn_index):
        if not -1 <= turn < len(turn_adv):
            raise ValueError(f"token {position}: turn index {turn} outside [-1, {len(turn_adv)})")
        masked = loss_mask is not None and not loss_mask[position]
        advantages.append(0.0 if turn == -1 or masked else float(turn_adv[turn]))
    return advantages
