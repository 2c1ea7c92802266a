"""Per-turn advantages (C.2): hand-computed values, invariances, degenerate groups, validation."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from learner.advantages import Estimator, history_anchors, raw_channels, token_advantages, turn_advantages

# Episodes of 1, 2 and 3 turns: (turn_rewards, outcome).
K123 = [
    ([1.0], 1.0),
    ([0.0, 2.0], 0.0),
    ([1.0, 0.0, 1.0], 1.0),
]


def test_hand_computed_raw_channels_for_one_two_three_turns() -> None:
    raw = raw_channels([K123])
    # Outcome LOO: 1 - (0 + 1)/2 = 0.5;  0 - (1 + 1)/2 = -1;  1 - (1 + 0)/2 = 0.5.
    assert raw.outcome == [[0.5, -1.0, 0.5]]
    # Returns-to-go (gamma 1): e0 [1]; e1 [0+2, 2] = [2, 2]; e2 [1+0+1, 0+1, 1] = [2, 1, 1].
    # Turn 0, everyone reached it:  e0: 1 - (2+2)/2 = -1;  e1: 2 - (1+2)/2 = 0.5;  e2: 2 - (1+2)/2 = 0.5.
    # Turn 1, only e1 and e2:       e1: 2 - 1 = 1;          e2: 1 - 2 = -1.
    # Turn 2, only e2: no peer -> 0.
    assert raw.shaping == [[[-1.0], [0.5, 1.0], [0.5, -1.0, 0.0]]]
    assert raw.shaping_baseline == [[[2.0], [1.5, 1.0], [1.5, 2.0, 0.0]]]
    assert raw.has_outcome == [[True, True, True]]


def test_hand_computed_advantages_for_one_two_three_turns() -> None:
    advantages = turn_advantages([K123])
    # Sums A^o + A^s per turn: e0 [0.5 - 1]; e1 [-1 + 0.5, -1 + 1]; e2 [0.5 + 0.5, 0.5 - 1, 0.5 + 0]
    # = [-0.5], [-0.5, 0], [1, -0.5, 0.5]: mean 0, population std sqrt(2 / 6) = 0.57735.
    sigma = math.sqrt(2 / 6) + 1e-6
    expected = [[-0.5 / sigma], [-0.5 / sigma, 0.0], [1.0 / sigma, -0.5 / sigma, 0.5 / sigma]]
    assert [len(e) for e in advantages[0]] == [1, 2, 3]
    for got, want in zip(advantages[0], expected, strict=True):
        assert got == pytest.approx(want, abs=1e-12)
    assert advantages[0][2] == pytest.approx([1.73205, -0.86603, 0.86603], abs=1e-5)


def test_a_sparse_shaping_penalty_stays_small_next_to_the_outcome() -> None:
    """The issue's case: 8 three-turn episodes, half solved, one solved episode with a single -0.1 format
    penalty on its first turn. Scaled per channel, its first turns got -2.24; with one scale they keep the
    outcome's sign and lose a tenth of it."""
    group = [([0.0, 0.0, 0.0], 1.0 if i < 4 else 0.0) for i in range(8)]
    group[0] = ([-0.1, 0.0, 0.0], 1.0)
    (advantages,) = turn_advantages([group])
    raw = raw_channels([group])
    # Outcome LOO: solved 1 - 3/7 = 4/7, failed 0 - 4/7 = -4/7. Shaping (gamma 1): e0's return-to-go at
    # turn 0 is -0.1 against peers' 0 -> -0.1; every other episode's turn 0 gets +0.1/7; later turns 0.
    assert raw.outcome[0][:2] == pytest.approx([4 / 7, 4 / 7]) and raw.outcome[0][4] == pytest.approx(-4 / 7)
    assert raw.shaping[0][0] == pytest.approx([-0.1, 0.0, 0.0])
    assert raw.shaping[0][1] == pytest.approx([0.1 / 7, 0.0, 0.0])
    sums = [a_o + a_s for a_o, shaping in zip(raw.outcome[0], raw.shaping[0], strict=True) for a_s in shaping]
    sigma = statistics.pstdev(sums) + 1e-6
    assert advantages[0] == pytest.approx([(4 / 7 - 0.1) / sigma, 4 / 7 / sigma, 4 / 7 / sigma], abs=1e-12)
    assert advantages[0][0] > 0.8 * advantages[1][1] > 0  # the penalty costs about a sixth, not the sign


def test_lambda_scales_only_the_shaping_channel() -> None:
    # lam 0: the per-turn outcome terms [0.5], [-1, -1], [0.5, 0.5, 0.5]: mean 0, std sqrt(3 / 6).
    sigma = math.sqrt(0.5) + 1e-6
    outcome_only = turn_advantages([K123], lam=0.0)
    assert outcome_only == [[[0.5 / sigma], [-1.0 / sigma] * 2, [0.5 / sigma] * 3]]


def test_discounted_returns_to_go() -> None:
    raw = raw_channels([K123], gamma=0.5)
    # Returns: e0 [1]; e1 [0 + 0.5*2, 2] = [1, 2]; e2 [1 + 0.5*0 + 0.25*1, 0 + 0.5*1, 1] = [1.25, 0.5, 1].
    # Turn 0: e0: 1 - (1 + 1.25)/2 = -0.125; e1: 1 - (1 + 1.25)/2 = -0.125; e2: 1.25 - (1 + 1)/2 = 0.25.
    # Turn 1: e1: 2 - 0.5 = 1.5; e2: 0.5 - 2 = -1.5.
    assert raw.shaping == [[[-0.125], [-0.125, 1.5], [0.25, -1.5, 0.0]]]


def _random_groups(seed: int) -> list[list[tuple[list[float], float | None]]]:
    rng = random.Random(seed)
    groups = []
    for _ in range(3):
        group: list[tuple[list[float], float | None]] = []
        for _ in range(5):
            rewards = [rng.choice([-0.1, 0.0, 0.25, 1.0, 0.3]) for _ in range(rng.randint(1, 5))]
            group.append((rewards, rng.choice([0.0, 1.0, 0.5, None])))
        groups.append(group)
    return groups


@pytest.mark.parametrize("estimator", ["turn", "outcome", "anchor"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_permuting_episodes_permutes_advantages_identically(estimator: str, seed: int) -> None:
    groups = _random_groups(seed)
    base = turn_advantages(groups, gamma=0.9, estimator=estimator)  # type: ignore[arg-type]
    rng = random.Random(100 + seed)
    orders = [rng.sample(range(len(group)), len(group)) for group in groups]
    shuffled = [[group[i] for i in order] for group, order in zip(groups, orders, strict=True)]
    # Also reorder the groups themselves: channel scales are batch-level and must not care.
    result = turn_advantages(shuffled[::-1], gamma=0.9, estimator=estimator)[::-1]  # type: ignore[arg-type]
    for group_base, group_result, order in zip(base, result, orders, strict=True):
        assert group_result == [group_base[i] for i in order]  # exact: math.fsum sums are order-free


def test_own_later_turns_never_move_the_baseline_of_earlier_turns() -> None:
    """The P1 fix: episode i's baseline at turn k depends only on other episodes."""
    longer = [([1.0, 5.0, -2.0, 7.0], 1.0), *K123[1:]]  # e0 now plays 3 more turns with rewards
    before = raw_channels([K123]).shaping_baseline[0][0]
    after = raw_channels([longer]).shaping_baseline[0][0]
    assert after[:1] == before
    # ... whereas its own advantage does see its own future (it is a return-to-go).
    assert raw_channels([longer]).shaping[0][0][0] == pytest.approx((1 + 5 - 2 + 7) - 2.0)


def test_peer_turn_count_beyond_turn_k_leaves_turn_k_baselines_alone() -> None:
    # e1 plays two extra zero-reward turns: its returns at turns 0-1 are unchanged, it now reaches turn 2.
    extended = [K123[0], ([0.0, 2.0, 0.0, 0.0], 0.0), K123[2]]
    before = raw_channels([K123])
    after = raw_channels([extended])
    assert after.shaping_baseline[0][0] == before.shaping_baseline[0][0]
    assert after.shaping_baseline[0][2][:2] == before.shaping_baseline[0][2][:2]
    assert after.shaping[0][2][:2] == before.shaping[0][2][:2]
    # Turn 2 of e2 now has a peer (e1, return 0): A^s = 1 - 0 instead of "no peer" 0.
    assert after.shaping[0][2][2] == 1.0


def test_single_episode_group_gives_zeros_without_nan() -> None:
    estimators: tuple[Estimator, ...] = ("turn", "outcome")
    for estimator in estimators:
        advantages = turn_advantages([[([1.0, 2.0, 0.5], 1.0)]], estimator=estimator)
        assert advantages == [[[0.0, 0.0, 0.0]]]


def test_all_equal_outcomes_give_zero_outcome_channel_without_nan() -> None:
    group = [([0.0, 0.0], 1.0), ([0.0], 1.0), ([0.0, 0.0, 0.0], 1.0)]
    assert raw_channels([group]).outcome == [[0.0, 0.0, 0.0]]
    advantages = turn_advantages([group])
    assert advantages == [[[0.0, 0.0], [0.0], [0.0, 0.0, 0.0]]]
    assert turn_advantages([group], estimator="outcome") == advantages


def test_an_episode_without_an_outcome_has_no_outcome_channel_and_keeps_its_shaping() -> None:
    """Units never mix: the outcome-less episode's rewards stay shaping, not a stand-in outcome."""
    group = [([1.0, 1.0], None), ([0.5], 0.0), ([0.0, 3.0], 1.0)]
    raw = raw_channels([group])
    # Outcome LOO among e1 and e2 only: 0 - 1 = -1, 1 - 0 = 1; e0 has no outcome term.
    assert raw.outcome == [[0.0, -1.0, 1.0]]
    assert raw.has_outcome == [[False, True, True]]
    # Returns-to-go: e0 [2, 1]; e1 [0.5]; e2 [3, 3]. Turn 0: e0 2 - (0.5+3)/2 = 0.25; e1 0.5 - (2+3)/2 = -2;
    # e2 3 - (2+0.5)/2 = 1.75. Turn 1 (e0, e2): e0 1 - 3 = -2; e2 3 - 1 = 2.
    assert raw.shaping == [[[0.25, -2.0], [-2.0], [1.75, 2.0]]]
    advantages = turn_advantages([group])
    # Sums: e0 [0 + 0.25, 0 - 2]; e1 [-1 - 2]; e2 [1 + 1.75, 1 + 2]; one scale over the five.
    sums = [0.25, -2.0, -3.0, 2.75, 3.0]
    sigma = statistics.pstdev(sums) + 1e-6
    assert advantages[0][0] == pytest.approx([0.25 / sigma, -2.0 / sigma], abs=1e-12)
    assert advantages[0][1] == pytest.approx([-3.0 / sigma], abs=1e-12)
    assert advantages[0][2] == pytest.approx([2.75 / sigma, 3.0 / sigma], abs=1e-12)
    # The anchor estimator (still scaled per channel): sigma_s over the five shaping terms.
    sigma_s = math.sqrt(15.125 / 5) + 1e-6
    # Anchor without anchors: the peers that reached each turn. e2's turn 1 has only e0 as a peer, which
    # has no outcome: no outcome baseline, term 0. sigma_o is over every (episode, turn) term: [-1, 1, 0].
    anchored = turn_advantages([group], estimator="anchor")
    sigma_a = math.sqrt(2 / 3) + 1e-6
    assert anchored[0][0] == pytest.approx([0.25 / sigma_s, -2.0 / sigma_s], abs=1e-12)
    assert anchored[0][1] == pytest.approx([-1.0 / sigma_a - 2.0 / sigma_s], abs=1e-12)
    assert anchored[0][2] == pytest.approx([1.0 / sigma_a + 1.75 / sigma_s, 2.0 / sigma_s], abs=1e-12)


def test_outcome_estimator_is_the_grpo_group_normalisation() -> None:
    groups: list[list[tuple[list[float], float | None]]] = [
        [([0.0], 1.0), ([0.2, 0.3], 0.0), ([1.0], None), ([0.0, 0.0, 0.0], 0.5)],
        [([0.0], 3.0), ([0.0], -1.0)],
        [([0.5, 0.5], None), ([0.0], None)],
    ]
    advantages = turn_advantages(groups, estimator="outcome")
    # First group: the outcomes 1, 0, 0.5 (mean 0.5, std sqrt(1/6)); the episode without one gets 0.
    sigma = math.sqrt(1 / 6) + 1e-6
    expected = [[0.5 / sigma], [-0.5 / sigma] * 2, [0.0], [0.0] * 3]
    for got, want in zip(advantages[0], expected, strict=True):
        assert got == pytest.approx(want, abs=1e-12)
    # Second group: returns [3, -1], mean 1, std 2 -> +-2 / (2 + 1e-6).
    assert advantages[1][0] == pytest.approx([1.0 - 5e-7], abs=1e-9)
    assert advantages[1][1] == pytest.approx([-1.0 + 5e-7], abs=1e-9)
    # Third group has no outcome at all: its turn-reward sums 1 and 0 are the returns.
    assert advantages[2][0] == pytest.approx([0.5 / (0.5 + 1e-6)] * 2, abs=1e-12)
    assert advantages[2][1] == pytest.approx([-0.5 / (0.5 + 1e-6)], abs=1e-12)


def test_channel_scales_are_batch_level_across_groups() -> None:
    """A second group with a big outcome spread shrinks the first group's scaled outcome channel."""
    alone = turn_advantages([K123], lam=0.0)
    wide = [([0.0], 10.0), ([0.0], -10.0)]
    together = turn_advantages([K123, wide], lam=0.0)
    # Per-turn terms in the call: [0.5], [-1, -1], [0.5] x 3, [20], [-20] -> mean 0, std sqrt(803 / 8).
    sigma = math.sqrt((0.25 + 1 + 1 + 0.25 * 3 + 400 + 400) / 8) + 1e-6
    assert together[0][0] == pytest.approx([0.5 / sigma], abs=1e-12)
    assert abs(together[0][0][0]) < abs(alone[0][0][0])


def test_empty_groups_and_zero_turn_episodes() -> None:
    assert turn_advantages([]) == []
    assert turn_advantages([[]]) == [[]]
    # A zero-turn episode still serves as an outcome peer.
    raw = raw_channels([[([], 1.0), ([0.0], 0.0)]])
    assert raw.outcome == [[1.0, -1.0]]
    assert turn_advantages([[([], 1.0), ([0.0], 0.0)]])[0][0] == []


def test_non_finite_rewards_are_rejected_with_their_place() -> None:
    with pytest.raises(ValueError, match="group 1 episode 0 turn 2: reward nan"):
        turn_advantages([K123, [([0.0, 1.0, float("nan")], 1.0)]])
    with pytest.raises(ValueError, match="group 0 episode 1: outcome inf"):
        turn_advantages([[([0.0], 1.0), ([0.0], float("inf"))]])
    with pytest.raises(ValueError, match="group 0 episode 0: expected"):
        turn_advantages([[([0.0], 1.0, 2.0)]])  # type: ignore[list-item]


def test_bad_options_are_rejected() -> None:
    with pytest.raises(ValueError, match="estimator must be one of"):
        turn_advantages([K123], estimator="gae")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="gamma"):
        turn_advantages([K123], gamma=1.5)
    with pytest.raises(ValueError, match="lam"):
        turn_advantages([K123], lam=float("nan"))


def test_token_advantages_map_turns_and_zero_prompt_and_masked_tokens() -> None:
    turn_adv = [0.5, -1.0]
    turn_index = [-1, -1, 0, 0, 0, 1, 1, 1]
    mask = [0, 0, 1, 1, 0, 1, 1, 0]  # token 4: env reply inside turn 0; token 7: tool output
    assert token_advantages(turn_adv, turn_index, mask) == [0.0, 0.0, 0.5, 0.5, 0.0, -1.0, -1.0, 0.0]
    assert token_advantages(turn_adv, turn_index) == [0.0, 0.0, 0.5, 0.5, 0.5, -1.0, -1.0, -1.0]


def test_token_advantages_reject_bad_turn_indices() -> None:
    with pytest.raises(ValueError, match="token 2: turn index 2 outside"):
        token_advantages([0.5, -1.0], [-1, 0, 2])
    with pytest.raises(ValueError, match="token 0: turn index -2"):
        token_advantages([0.5], [-2])
    with pytest.raises(ValueError, match="loss_mask has 1 entries"):
        token_advantages([0.5], [0, 0], [1])


# --- anchor estimator -------------------------------------------------------------------------------

# Three episodes of one group; all start from the same prompt (anchor "p"). e0 and e1 guessed the same
# first number and so saw the same history "h" before turn 1; e2 guessed right at once.
ANCHORED_GROUP = [([0.0, 0.0], 1.0), ([0.0, 0.0], 0.0), ([0.0], 1.0)]
ANCHORS = [[["p", "h"], ["p", "h"], ["p"]]]


def test_anchor_estimator_hand_computed() -> None:
    (result,) = turn_advantages([ANCHORED_GROUP], estimator="anchor", anchors=ANCHORS)
    # Turn 0, peers = everyone else:  e0: 1 - (0+1)/2 = 0.5;  e1: 0 - (1+1)/2 = -1;  e2: 1 - (1+0)/2 = 0.5.
    # Turn 1, peers with history "h": e0: 1 - 0 = 1;  e1: 0 - 1 = -1.  No shaping signal (all zero).
    terms = [0.5, 1.0, -1.0, -1.0, 0.5]
    sigma = statistics.pstdev(terms) + 1e-6
    expected = [[0.5 / sigma, 1.0 / sigma], [-1.0 / sigma, -1.0 / sigma], [0.5 / sigma]]
    for got, want in zip(result, expected, strict=True):
        assert got == pytest.approx(want, rel=1e-12)


def test_anchor_estimator_ignores_peers_that_saw_another_history() -> None:
    base = [([0.0, 0.0], 1.0), ([0.0, 0.0], 0.0), ([0.0, 0.0], 0.0)]
    anchors = [[["p", "h"], ["p", "h"], ["p", "other"]]]
    changed = [*base[:2], ([0.0, 0.0], 1.0)]  # e2's outcome moves; it is not e0's turn-1 peer
    raw_before = turn_advantages([base], estimator="anchor", anchors=anchors, lam=0.0)
    raw_after = turn_advantages([changed], estimator="anchor", anchors=anchors, lam=0.0)
    # Undo the batch scale (it changes with e2) and compare e0's turn-1 term: 1 - o(e1) both times.
    scale_before = raw_before[0][1][1] / -1.0
    scale_after = raw_after[0][1][1] / -1.0
    assert raw_before[0][0][1] / scale_before == pytest.approx(1.0)
    assert raw_after[0][0][1] / scale_after == pytest.approx(1.0)


def test_anchor_estimator_falls_back_to_the_peers_that_reached_the_turn() -> None:
    unique = [[["p", "a"], ["p", "b"], ["p"]]]  # nobody shares e0's or e1's turn-1 history
    anchored = turn_advantages([ANCHORED_GROUP], estimator="anchor", anchors=unique)
    no_anchors = turn_advantages([ANCHORED_GROUP], estimator="anchor")
    assert anchored == no_anchors
    # Turn 1 falls back to e0 vs e1 (the only ones that reached it): the same terms as with "h".
    assert anchored == turn_advantages([ANCHORED_GROUP], estimator="anchor", anchors=ANCHORS)


def test_anchor_estimator_shaping_baseline_uses_same_history_peers() -> None:
    group = [([0.3, 0.4], 0.0), ([0.1, 0.0], 0.0), ([0.2, 0.1], 0.0), ([0.0, 0.3], 0.0)]
    anchors = [[["p", "x"], ["p", "x"], ["p", "y"], ["p", "y"]]]
    (result,) = turn_advantages([group], estimator="anchor", anchors=anchors, gamma=0.0)
    # gamma 0: S = the turn's own reward; equal outcomes: the outcome terms are 0.
    # Turn 0, everyone shares "p": 0.3 - 0.3/3, 0.1 - 0.5/3, 0.2 - 0.4/3, 0.0 - 0.6/3.
    # Turn 1, pairs by history:    0.4 - 0.0,   0.0 - 0.4,   0.1 - 0.3,   0.3 - 0.1.
    turn0 = [0.3 - 0.1, 0.1 - 0.5 / 3, 0.2 - 0.4 / 3, 0.0 - 0.2]
    turn1 = [0.4, -0.4, -0.2, 0.2]
    sigma = statistics.pstdev(turn0 + turn1) + 1e-6
    assert [ep[0] for ep in result] == pytest.approx([t / sigma for t in turn0], rel=1e-9)
    assert [ep[1] for ep in result] == pytest.approx([t / sigma for t in turn1], rel=1e-9)


def test_history_anchors_digest_the_tokens_before_each_turn() -> None:
    # prompt p1 p2 | turn 0: g0 then context c1 c2 | turn 1: g1
    tokens = [11, 12, 5, 21, 22, 6]
    turns = [-1, -1, 0, 0, 0, 1]
    mask = [0, 0, 1, 0, 0, 1]
    anchors = history_anchors(tokens, turns, mask)
    assert sorted(anchors) == [0, 1]
    other = history_anchors([11, 12, 5, 21, 22, 7], turns, mask)  # same history, another turn-1 action
    assert other == anchors
    diverged = history_anchors([11, 12, 9, 21, 22, 6], turns, mask)  # another turn-0 action
    assert diverged[0] == anchors[0] and diverged[1] != anchors[1]
    assert history_anchors([11, 12], [-1, -1], [0, 0]) == {}


# --- norm="none" (Dr. GRPO: advantages keep reward units) -------------------------------------------


def test_norm_none_turn_estimator_is_the_raw_channels_weighted_by_lam() -> None:
    raw = raw_channels([K123])
    (result,) = turn_advantages([K123], lam=2.0, norm="none")
    pairs = zip(raw.outcome[0], raw.shaping[0], strict=True)
    expected = [[a_o + 2.0 * a_s for a_s in shaping] for a_o, shaping in pairs]
    assert result == expected  # no division at all: exactly the raw sums
    assert result == [[0.5 - 2.0], [-1.0 + 1.0, -1.0 + 2.0], [0.5 + 1.0, 0.5 - 2.0, 0.5]]


def test_norm_none_outcome_estimator_is_the_group_mean_difference() -> None:
    (result,) = turn_advantages([K123], estimator="outcome", norm="none")
    # Outcomes 1, 0, 1 (mean 2/3), broadcast over each episode's turns.
    assert [len(ep) for ep in result] == [1, 2, 3]
    flat = [a for ep in result for a in ep]
    assert flat == pytest.approx([1 / 3, -2 / 3, -2 / 3, 1 / 3, 1 / 3, 1 / 3], abs=1e-15)


def test_norm_none_anchor_estimator_keeps_the_hand_computed_terms() -> None:
    (result,) = turn_advantages([ANCHORED_GROUP], estimator="anchor", anchors=ANCHORS, norm="none")
    assert result == [[0.5, 1.0], [-1.0, -1.0], [0.5]]


def test_norm_none_does_not_rescale_a_batch_with_little_signal() -> None:
    # A group with a small spread next to groups with none: GRPO's std blows it up to unit spread, "none"
    # leaves it small (the entropy bonus then outweighs it).
    faint = [([0.0], 0.51), ([0.0], 0.49)]
    flat = [([0.0], 1.0), ([0.0], 1.0)]
    std = turn_advantages([faint, flat, flat], estimator="outcome")
    none = turn_advantages([faint, flat, flat], estimator="outcome", norm="none")
    assert [ep[0] for ep in std[0]] == pytest.approx([1.0, -1.0], rel=1e-3)
    assert [ep[0] for ep in none[0]] == pytest.approx([0.01, -0.01], rel=1e-9)
    assert none[1] == none[2] == [[0.0], [0.0]]


def test_unknown_norm_is_rejected_by_name() -> None:
    with pytest.raises(ValueError, match="norm must be one of"):
        turn_advantages([K123], norm="batch")  # type: ignore[arg-type]
