"""GSPO / GSPO-token loss: the numeric cases T1-T10 of shared/reference/gspo_impls.md §7, by name."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TypedDict

import pytest
import torch

from learner.logprobs import sampled_token_logprobs
from learner.loss.gspo import MAX_LOG_RATIO, Level, gspo_token_loss, sequence_log_ratio


class Clip(TypedDict):
    clip_low: float
    clip_high: float


PAPER_CLIP = Clip(clip_low=3e-4, clip_high=4e-4)
WIDE_CLIP = Clip(clip_low=0.2, clip_high=0.2)
SEQUENCE_LEVELS: tuple[Level, ...] = ("sequence_token", "sequence")
ALL_LEVELS: tuple[Level, ...] = ("sequence_token", "sequence", "token")


def _ragged_batch(dtype: torch.dtype = torch.float32, seed: int = 0) -> dict[str, torch.Tensor]:
    """Three sequences of 2, 5 and 3 unmasked tokens (one internal masked "tool" token), T = 6."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.tensor(
        [[1, 1, 0, 0, 0, 0], [1, 1, 0, 1, 1, 1], [1, 1, 1, 0, 0, 0]],
        dtype=torch.bool,
    )
    logprobs = -torch.rand(3, 6, generator=gen, dtype=torch.float64).to(dtype) * 3.0
    return {"logprobs": logprobs, "mask": mask}


def _leaf(values: torch.Tensor) -> torch.Tensor:
    return values.detach().clone().requires_grad_(True)


def _grad(loss: torch.Tensor, leaf: torch.Tensor) -> torch.Tensor:
    (grad,) = torch.autograd.grad(loss, leaf)
    return grad


def _seq_constant(values: list[float], shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).unsqueeze(-1).expand(shape).clone()


# --------------------------------------------------------------------------------------------- T1


@pytest.mark.parametrize("level", ALL_LEVELS)
@pytest.mark.parametrize("detached_old", [False, True])
def test_t1_identity_ratio_is_exactly_one_and_gradient_is_grpo(level: Level, detached_old: bool) -> None:
    batch = _ragged_batch()
    mask = batch["mask"]
    lp = _leaf(batch["logprobs"])
    old = lp.detach() if detached_old else batch["logprobs"].clone()
    adv_per_seq = [1.5, -0.5, 2.0]
    adv = _seq_constant(adv_per_seq, (3, 6), torch.float32)

    loss, stats = gspo_token_loss(lp, old, adv, mask, level=level, **PAPER_CLIP)

    assert torch.equal(sequence_log_ratio(lp, old, mask), torch.zeros(3))
    assert stats["ratio_mean"].item() == 1.0
    assert stats["ratio_min"].item() == 1.0
    assert stats["ratio_max"].item() == 1.0
    assert stats["clip_fraction"].item() == 0.0
    assert stats["band_exit_fraction"].item() == 0.0
    group = 3
    assert loss.item() == pytest.approx(-sum(adv_per_seq) / group, abs=1e-7)
    lengths = mask.sum(-1).float()
    expected = torch.where(mask, -adv / (group * lengths.unsqueeze(-1)), torch.zeros_like(adv))
    torch.testing.assert_close(_grad(loss, lp), expected, rtol=0, atol=1e-7)


# --------------------------------------------------------------------------------------------- T2


def _t2_batch(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Seq 0: mean delta +1e-4 (inside the band); seq 1: +2e-3 (above); seq 2: -2e-3 (below)."""
    batch = _ragged_batch(dtype)
    wiggle = torch.tensor(
        [
            [0.01, -0.01, 0.7, 0.0, 0.0, 0.0],
            [0.02, -0.01, 0.9, 0.01, -0.03, 0.01],
            [0.005, -0.01, 0.005, 0.0, 0.0, 0.0],
        ],
        dtype=dtype,
    )
    means = torch.tensor([1e-4, 2e-3, -2e-3], dtype=dtype).unsqueeze(-1)
    batch["old"] = batch["logprobs"] - (means + wiggle)
    return batch


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_t2_gspo_token_equals_gspo_for_sequence_constant_advantages(dtype: torch.dtype) -> None:
    batch = _t2_batch(dtype)
    mask = batch["mask"]
    # A > 0 on the seq above the band and A < 0 below: both are clipped; seq 0 is not.
    adv = _seq_constant([0.8, 1.2, -0.7], (3, 6), dtype)
    results = {}
    for level in SEQUENCE_LEVELS:
        lp = _leaf(batch["logprobs"])
        loss, stats = gspo_token_loss(lp, batch["old"], adv, mask, level=level, **PAPER_CLIP)
        results[level] = (loss, stats, _grad(loss, lp))

    (loss_tok, stats_tok, grad_tok), (loss_seq, stats_seq, grad_seq) = results.values()
    assert stats_tok["clip_fraction"].item() == pytest.approx(2 / 3)
    assert stats_tok["clip_fraction"].item() == stats_seq["clip_fraction"].item()
    assert loss_tok.item() == pytest.approx(loss_seq.item(), abs=1e-6)
    torch.testing.assert_close(grad_tok, grad_seq, rtol=0, atol=1e-6)
    # The unclipped sequence really has a gradient and the clipped ones really have none.
    assert grad_tok[0, :2].abs().min().item() > 0.1
    assert grad_tok[1:].abs().max().item() == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_t2_gspo_token_differs_from_gspo_for_per_token_advantages(dtype: torch.dtype) -> None:
    batch = _t2_batch(dtype)
    mask = batch["mask"]
    adv = torch.tensor(
        [
            [1.0, -1.0, 0.0, 0.0, 0.0, 0.0],
            [0.5, 0.5, 9.0, -1.0, -1.0, 2.0],
            [-0.3, 0.4, 1.0, 0.0, 0.0, 0.0],
        ],
        dtype=dtype,
    )
    lp_tok, lp_seq = _leaf(batch["logprobs"]), _leaf(batch["logprobs"])
    loss_tok, _ = gspo_token_loss(lp_tok, batch["old"], adv, mask, **WIDE_CLIP)
    loss_seq, _ = gspo_token_loss(lp_seq, batch["old"], adv, mask, level="sequence", **WIDE_CLIP)
    grad_tok, grad_seq = _grad(loss_tok, lp_tok), _grad(loss_seq, lp_seq)

    # Same value (the ratio's value is s_i in both), different credit assignment.
    assert loss_tok.item() == pytest.approx(loss_seq.item(), abs=1e-6)
    assert (grad_tok - grad_seq).abs().max().item() > 0.05

    # GSPO-token: d loss / d lp_{i,t} = -(1/G) * s_i * A_{i,t} / |y_i| (unclipped everywhere here).
    s = torch.exp(sequence_log_ratio(batch["logprobs"], batch["old"], mask)).unsqueeze(-1)
    lengths = mask.sum(-1, keepdim=True).to(dtype)
    expected_tok = torch.where(mask, -s * adv / (3 * lengths), torch.zeros_like(adv))
    torch.testing.assert_close(grad_tok, expected_tok, rtol=0, atol=1e-6)
    # GSPO: every token gets the same weight, -(1/G) * s_i * mean_u(A_{i,u}) / |y_i|.
    mean_adv = torch.where(mask, adv, torch.zeros_like(adv)).sum(-1, keepdim=True) / lengths
    expected_seq = torch.where(mask, -s * mean_adv / (3 * lengths), torch.zeros_like(adv))
    torch.testing.assert_close(grad_seq, expected_seq, rtol=0, atol=1e-6)


def test_t2_gspo_token_clips_per_token_by_the_sign_of_each_turns_advantage() -> None:
    """Above the band, turns with A > 0 lose their gradient and turns with A < 0 keep s * A / |y|."""
    old = torch.tensor([[-1.0, -0.5, -2.0, -0.25]])
    lp = _leaf(old + 2e-3)  # s = exp(2e-3) > 1 + 4e-4
    adv = torch.tensor([[0.7, 0.7, -1.1, -1.1]])  # turn 0 good, turn 1 bad
    loss, stats = gspo_token_loss(lp, old, adv, torch.ones(1, 4), **PAPER_CLIP)
    grad = _grad(loss, lp)
    s = math.exp(2e-3)
    assert stats["clip_fraction"].item() == 1.0
    assert stats["clip_fraction_token"].item() == 0.5
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.0, 1.1 * s / 4, 1.1 * s / 4]]), atol=2e-7, rtol=0)
    expected_loss = (2 * -0.7 * (1 + 4e-4) + 2 * 1.1 * s) / 4
    assert loss.item() == pytest.approx(expected_loss, abs=1e-6)


# --------------------------------------------------------------------------------------------- T3

T3_OLD = [[-1.0, -2.0, -0.5]]
T3_LP = [[-0.9, -2.1, -0.5]]


def _t3(level: Level, advantage: float) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    lp = torch.tensor(T3_LP, requires_grad=True)
    old = torch.tensor(T3_OLD)
    adv = torch.full((1, 3), advantage)
    loss, stats = gspo_token_loss(lp, old, adv, torch.ones(1, 3), level=level, **PAPER_CLIP)
    return loss, stats, _grad(loss, lp)


def test_t3_token_ratios_and_sequence_ratio_exactly_one() -> None:
    lp, old = torch.tensor(T3_LP), torch.tensor(T3_OLD)
    torch.testing.assert_close(
        torch.exp(lp - old), torch.tensor([[1.105171, 0.904837, 1.0]]), atol=1e-6, rtol=0
    )
    assert torch.exp(sequence_log_ratio(lp, old, torch.ones(1, 3))).item() == 1.0
    _, stats, _ = _t3("token", 1.0)
    assert stats["ratio_max"].item() == pytest.approx(1.105171, abs=1e-6)
    assert stats["ratio_min"].item() == pytest.approx(0.904837, abs=1e-6)


def test_t3_token_ppo_zeroes_first_token_for_positive_advantage() -> None:
    advantage = 2.0
    _, stats, grad = _t3("token", advantage)
    # Both out-of-band ratios count as leaving the band; only the r > 1 + eps one is clipped for A > 0.
    assert stats["band_exit_fraction"].item() == 1.0
    assert stats["clip_fraction_token"].item() == pytest.approx(1 / 3)
    assert stats["clip_fraction"].item() == 1.0
    assert grad[0, 0].item() == 0.0
    # Unclipped tokens: d(-A r_t / |y|)/d lp_t = -A r_t / 3.
    assert grad[0, 1].item() == pytest.approx(-advantage * 0.904837 / 3, abs=1e-6)
    assert grad[0, 2].item() == pytest.approx(-advantage * 1.0 / 3, abs=1e-6)


def test_t3_token_ppo_zeroes_second_token_for_negative_advantage() -> None:
    advantage = -2.0
    _, stats, grad = _t3("token", advantage)
    assert stats["clip_fraction_token"].item() == pytest.approx(1 / 3)
    assert grad[0, 1].item() == 0.0
    assert grad[0, 0].item() == pytest.approx(-advantage * 1.105171 / 3, abs=1e-6)
    assert grad[0, 2].item() == pytest.approx(-advantage * 1.0 / 3, abs=1e-6)


@pytest.mark.parametrize("level", SEQUENCE_LEVELS)
@pytest.mark.parametrize("advantage", [2.0, -2.0])
def test_t3_gspo_clips_nothing_and_every_token_keeps_its_gradient(level: Level, advantage: float) -> None:
    loss, stats, grad = _t3(level, advantage)
    assert stats["clip_fraction"].item() == 0.0
    assert stats["clip_fraction_token"].item() == 0.0
    assert loss.item() == -advantage
    # GSPO-token gives -A/|y| per token directly; GSPO's -s*A*(1/|y|)*(1/|y|)*|y| is the same number.
    torch.testing.assert_close(grad, torch.full((1, 3), -advantage / 3), atol=1e-7, rtol=0)


# --------------------------------------------------------------------------------------------- T4


def _t4(mean_delta: float, advantage: float, level: Level) -> tuple[float, torch.Tensor, float]:
    """One sequence of 4 tokens whose deltas average ``mean_delta``; returns (s, grad, clip_fraction)."""
    old = torch.tensor([[-1.25, -0.5, -2.0, -0.75]], dtype=torch.float64)
    wiggle = torch.tensor([[0.002, -0.001, -0.003, 0.002]], dtype=torch.float64)
    lp = _leaf((old + mean_delta + wiggle).float())
    old32 = old.float()
    s = math.exp(sequence_log_ratio(lp, old32, torch.ones(1, 4)).item())
    loss, stats = gspo_token_loss(
        lp, old32, torch.full((1, 4), advantage), torch.ones(1, 4), level=level, **PAPER_CLIP
    )
    grad = _grad(loss, lp)
    if stats["clip_fraction"].item() == 1.0:
        bound = 1 + 4e-4 if advantage > 0 else 1 - 3e-4
        assert loss.item() == pytest.approx(-bound * advantage, rel=1e-7)
    return s, grad, stats["clip_fraction"].item()


@pytest.mark.parametrize("level", SEQUENCE_LEVELS)
def test_t4_above_band_clipped_for_positive_advantage(level: Level) -> None:
    s, grad, clipped = _t4(5e-4, 1.0, level)
    assert s == pytest.approx(1.00050013, abs=2e-7)
    assert clipped == 1.0
    assert torch.equal(grad, torch.zeros_like(grad))


@pytest.mark.parametrize("level", SEQUENCE_LEVELS)
def test_t4_above_band_not_clipped_for_negative_advantage(level: Level) -> None:
    advantage = -1.0
    s, grad, clipped = _t4(5e-4, advantage, level)
    assert clipped == 0.0
    # grad of the objective s*A*mean(lp) is s*A/|y| per token; the loss is its negative.
    torch.testing.assert_close(grad, torch.full((1, 4), -s * advantage / 4), atol=1e-7, rtol=0)


@pytest.mark.parametrize("level", SEQUENCE_LEVELS)
def test_t4_below_band_clipped_for_negative_advantage(level: Level) -> None:
    s, grad, clipped = _t4(-4.0008e-4, -1.0, level)
    assert s == pytest.approx(0.99960000, abs=2e-7)
    assert clipped == 1.0
    assert torch.equal(grad, torch.zeros_like(grad))


@pytest.mark.parametrize("level", SEQUENCE_LEVELS)
def test_t4_below_band_not_clipped_for_positive_advantage(level: Level) -> None:
    advantage = 1.0
    s, grad, clipped = _t4(-4.0008e-4, advantage, level)
    assert clipped == 0.0
    torch.testing.assert_close(grad, torch.full((1, 4), -s * advantage / 4), atol=1e-7, rtol=0)


@pytest.mark.parametrize("level", SEQUENCE_LEVELS)
@pytest.mark.parametrize(
    ("target_ratio", "advantage", "expect_clipped"),
    [
        (1 + 4e-4 + 1e-6, 1.0, True),
        (1 + 4e-4 - 1e-6, 1.0, False),
        (1 - 3e-4 - 1e-6, -1.0, True),
        (1 - 3e-4 + 1e-6, -1.0, False),
    ],
)
def test_t4_one_micro_step_either_side_of_the_band_edges(
    level: Level, target_ratio: float, advantage: float, expect_clipped: bool
) -> None:
    s, grad, clipped = _t4(math.log(target_ratio), advantage, level)
    assert s == pytest.approx(target_ratio, abs=2e-7)  # fp32 resolution keeps us on the intended side
    assert clipped == (1.0 if expect_clipped else 0.0)
    if expect_clipped:
        assert torch.equal(grad, torch.zeros_like(grad))
    else:
        torch.testing.assert_close(grad, torch.full((1, 4), -s * advantage / 4), atol=1e-7, rtol=0)


# --------------------------------------------------------------------------------------------- T5


def _toy_policy_loss(theta: torch.Tensor, level: Level, clip: Clip) -> torch.Tensor:
    """Independent logits per position (L = 5, V = 7): lp_t = log_softmax(theta_t)[y_t]; A = 1.3."""
    tokens = torch.tensor([3, 0, 6, 2, 5])
    lp = torch.log_softmax(theta, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1).unsqueeze(0)
    base = torch.log_softmax(_toy_theta(), dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    # Behaviour log-probs chosen so that s = 1.00087 at theta0.
    old = (base - math.log(1.00087) + torch.tensor([0.01, -0.02, 0.0, 0.015, -0.005])).unsqueeze(0)
    adv = torch.full((1, 5), 1.3, dtype=torch.float64)
    loss, _ = gspo_token_loss(lp, old, adv, torch.ones(1, 5), level=level, **clip)
    return loss


def _toy_theta() -> torch.Tensor:
    return torch.randn(5, 7, generator=torch.Generator().manual_seed(7), dtype=torch.float64)


def _central_differences(
    fn: Callable[[torch.Tensor], torch.Tensor], theta: torch.Tensor, step: float = 1e-6
) -> torch.Tensor:
    grad = torch.zeros_like(theta)
    for index in range(theta.numel()):
        bump = torch.zeros_like(theta).view(-1)
        bump[index] = step
        bump = bump.view_as(theta)
        grad.view(-1)[index] = (fn(theta + bump) - fn(theta - bump)).item() / (2 * step)
    return grad


@pytest.mark.parametrize("level", ALL_LEVELS)
def test_t5_autograd_matches_central_differences_unclipped(level: Level) -> None:
    theta = _toy_theta().requires_grad_(True)
    loss = _toy_policy_loss(theta, level, WIDE_CLIP)
    autograd = _grad(loss, theta)
    numeric = _central_differences(lambda th: _toy_policy_loss(th, level, WIDE_CLIP), theta.detach())
    torch.testing.assert_close(autograd, numeric, atol=1e-8, rtol=0)


@pytest.mark.parametrize("level", SEQUENCE_LEVELS)
def test_t5_matches_analytic_sequence_gradient(level: Level) -> None:
    theta = _toy_theta().requires_grad_(True)
    loss = _toy_policy_loss(theta, level, WIDE_CLIP)
    tokens = torch.tensor([3, 0, 6, 2, 5])
    onehot = torch.nn.functional.one_hot(tokens, 7).double()
    softmax = torch.softmax(theta.detach(), dim=-1)
    # Objective gradient s*A*(1/L)*sum_t grad lp_t; grad lp_t w.r.t. theta_t is onehot - softmax.
    analytic = -(1.00087 * 1.3 / 5) * (onehot - softmax)
    torch.testing.assert_close(_grad(loss, theta), analytic, atol=1e-10, rtol=0)


@pytest.mark.parametrize("level", SEQUENCE_LEVELS)
def test_t5_clipped_gradient_is_zero_by_autograd_and_by_differences(level: Level) -> None:
    theta = _toy_theta().requires_grad_(True)
    loss = _toy_policy_loss(theta, level, PAPER_CLIP)
    assert loss.item() == pytest.approx(-1.3 * (1 + 4e-4), rel=1e-12)
    assert torch.equal(_grad(loss, theta), torch.zeros(5, 7, dtype=torch.float64))
    numeric = _central_differences(lambda th: _toy_policy_loss(th, level, PAPER_CLIP), theta.detach())
    assert torch.equal(numeric, torch.zeros_like(numeric))


# --------------------------------------------------------------------------------------------- T6


def test_t6_equal_sequence_losses_give_that_loss() -> None:
    lp = torch.zeros(2, 3)
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]])
    adv = torch.full((2, 3), 0.75)
    loss, _ = gspo_token_loss(lp, lp.clone(), adv, mask)
    assert loss.item() == -0.75


@pytest.mark.parametrize("level", ALL_LEVELS)
def test_t6_each_sequence_weighs_the_same_not_its_token_count(level: Level) -> None:
    lp = _leaf(torch.zeros(2, 3))
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]])
    adv = torch.tensor([[2.0, 0.0, 0.0], [-1.0, -1.0, -1.0]])
    loss, stats = gspo_token_loss(lp, lp.detach(), adv, mask, level=level)
    # seq-mean-token-mean: (-2 + 1) / 2 = -0.5. A global token mean would give (-2 + 3) / 4 = 0.25.
    assert loss.item() == -0.5
    assert stats["num_sequences"].item() == 2
    assert stats["num_tokens"].item() == 4
    expected = torch.tensor([[-2.0 / 2, 0.0, 0.0], [1.0 / 6, 1.0 / 6, 1.0 / 6]])
    torch.testing.assert_close(_grad(loss, lp), expected, atol=1e-7, rtol=0)


# --------------------------------------------------------------------------------------------- T7


@pytest.mark.parametrize("level", ALL_LEVELS)
@pytest.mark.parametrize("garbage", [float("nan"), float("inf"), -float("inf"), 1e30, -7.0])
def test_t7_masked_positions_never_affect_value_stats_or_gradient(level: Level, garbage: float) -> None:
    batch = _t2_batch(torch.float32)
    mask = batch["mask"]
    adv = torch.randn(3, 6, generator=torch.Generator().manual_seed(3))

    def run(fill: float | None) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
        lp_values, old, advantages = batch["logprobs"].clone(), batch["old"].clone(), adv.clone()
        if fill is not None:
            for tensor in (lp_values, old, advantages):
                tensor[~mask] = fill
        lp = _leaf(lp_values)
        loss, stats = gspo_token_loss(lp, old, advantages, mask, level=level, **PAPER_CLIP)
        return loss, stats, _grad(loss, lp)

    loss_clean, stats_clean, grad_clean = run(None)
    loss_dirty, stats_dirty, grad_dirty = run(garbage)
    assert torch.equal(loss_clean, loss_dirty)
    assert torch.equal(grad_clean, grad_dirty)
    for name, value in stats_clean.items():
        assert torch.equal(value, stats_dirty[name]), name
    assert torch.equal(grad_dirty[~mask], torch.zeros(int((~mask).sum())))
    assert torch.equal(
        sequence_log_ratio(batch["logprobs"], batch["old"], mask),
        sequence_log_ratio(torch.where(mask, batch["logprobs"], garbage), batch["old"], mask),
    )


def test_t7_length_counts_only_unmasked_tokens() -> None:
    """An internal masked (tool) token changes nothing versus the same sequence without it."""
    lp_values = torch.tensor([[-1.0, -9.0, -2.0, -0.5]])
    old = torch.tensor([[-1.0005, 0.0, -2.0002, -0.5001]])
    adv = torch.tensor([[0.3, 5.0, -0.2, 0.1]])
    loss_gap, _ = gspo_token_loss(_leaf(lp_values), old, adv, torch.tensor([[1, 0, 1, 1]]), **WIDE_CLIP)
    keep = [0, 2, 3]
    loss_dense, _ = gspo_token_loss(
        _leaf(lp_values[:, keep]), old[:, keep], adv[:, keep], torch.ones(1, 3), **WIDE_CLIP
    )
    assert loss_gap.item() == pytest.approx(loss_dense.item(), abs=1e-8)
    s = sequence_log_ratio(lp_values, old, torch.tensor([[1, 0, 1, 1]])).item()
    assert s == pytest.approx((0.0005 + 0.0002 + 0.0001) / 3, abs=1e-7)


@pytest.mark.parametrize("level", ALL_LEVELS)
def test_t7_all_masked_row_is_excluded_without_nan(level: Level) -> None:
    batch = _t2_batch(torch.float32)
    empty_row = torch.tensor([[float("nan")] * 6])
    lp = _leaf(torch.cat([batch["logprobs"], empty_row]))
    old = torch.cat([batch["old"], empty_row])
    adv = torch.cat([torch.ones(3, 6), empty_row])
    mask = torch.cat([batch["mask"], torch.zeros(1, 6, dtype=torch.bool)])
    loss, stats = gspo_token_loss(lp, old, adv, mask, level=level, **PAPER_CLIP)
    grad = _grad(loss, lp)

    lp_ref = _leaf(batch["logprobs"])
    loss_ref, _ = gspo_token_loss(lp_ref, batch["old"], torch.ones(3, 6), batch["mask"], level=level)
    assert torch.isfinite(loss)
    assert loss.item() == pytest.approx(loss_ref.item(), abs=1e-7)
    torch.testing.assert_close(grad[:3], _grad(loss_ref, lp_ref), atol=1e-7, rtol=0)
    assert torch.equal(grad[3], torch.zeros(6))
    assert stats["num_sequences"].item() == 3
    assert all(torch.isfinite(value).all() for value in stats.values())
    assert sequence_log_ratio(lp.detach(), old, mask)[3].item() == 0.0


@pytest.mark.parametrize("level", ALL_LEVELS)
def test_t7_all_masked_batch_gives_zero_loss_zero_grad_and_neutral_stats(level: Level) -> None:
    lp = _leaf(torch.full((2, 4), float("nan")))
    loss, stats = gspo_token_loss(lp, lp.detach(), torch.ones(2, 4), torch.zeros(2, 4), level=level)
    assert loss.item() == 0.0
    assert torch.equal(_grad(loss, lp), torch.zeros(2, 4))
    assert stats["num_sequences"].item() == 0
    assert stats["ratio_mean"].item() == 1.0
    assert stats["clip_fraction"].item() == 0.0


# --------------------------------------------------------------------------------------------- T8


def test_t8_engine_logprobs_equal_to_train_logprobs_give_zero_step0_clipping() -> None:
    batch = _ragged_batch()
    engine = batch["logprobs"].clone()
    adv = torch.randn(3, 6, generator=torch.Generator().manual_seed(1))
    _, stats = gspo_token_loss(_leaf(batch["logprobs"]), engine, adv, batch["mask"])
    assert stats["clip_fraction"].item() == 0.0
    assert stats["band_exit_fraction"].item() == 0.0
    assert stats["mismatch_abs_mean"].item() == 0.0
    assert stats["mismatch_k3"].item() == 0.0
    assert stats["seq_log_ratio_abs_mean"].item() == 0.0


def test_t8_mismatch_statistics_by_hand() -> None:
    lp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]])
    engine = torch.tensor([[-1.1, -1.8, 0.0], [-0.5, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    _, stats = gspo_token_loss(lp, engine, torch.ones(2, 3), mask)
    deltas = [0.1, -0.2, 0.0]  # lp - engine on the three unmasked tokens
    assert stats["mismatch_abs_mean"].item() == pytest.approx(0.3 / 3, abs=1e-6)
    k3 = sum(math.exp(d) - 1 - d for d in deltas) / 3
    assert stats["mismatch_k3"].item() == pytest.approx(k3, abs=1e-6)
    # Sequence 0: log s = -0.05, outside the band with A > 0 -> not clipped (ratio below 1 - eps, A > 0),
    # but it has left the band; sequence 1 is exactly on-policy.
    assert stats["band_exit_fraction"].item() == 0.5
    assert stats["clip_fraction"].item() == 0.0
    assert stats["seq_log_ratio_abs_mean"].item() == pytest.approx(0.05 / 2, abs=1e-6)
    assert stats["ratio_min"].item() == pytest.approx(math.exp(-0.05), abs=1e-6)


def test_t8_huge_stale_log_ratio_is_clamped_finite_and_drops_out_of_the_gradient() -> None:
    lp = _leaf(torch.tensor([[-0.1, -0.2], [-1.0, -1.0]]))
    old = torch.tensor([[-500.0, -500.0], [-1.0, -1.0]])
    adv = torch.tensor([[-1.0, -1.0], [1.0, 1.0]])
    loss, stats = gspo_token_loss(lp, old, adv, torch.ones(2, 2))
    grad = _grad(loss, lp)
    assert torch.isfinite(loss)
    assert loss.item() == pytest.approx((math.exp(MAX_LOG_RATIO) - 1.0) / 2, rel=1e-6)
    assert torch.equal(grad[0], torch.zeros(2))
    assert stats["ratio_max"].item() == pytest.approx(math.exp(MAX_LOG_RATIO), rel=1e-6)
    assert all(torch.isfinite(value).all() for value in stats.values())


# --------------------------------------------------------------------------------------------- T9


def test_t9_fp32_sequence_mean_is_far_inside_the_band_and_bf16_is_not() -> None:
    """Per-sequence mean of (lp_path - lp_exact) on synthetic logits (4 x 256 positions, V = 4096, std 3).

    Measured (seed 0, deterministic): the fp32 path is off by at most 5e-8 on a sequence mean. A
    log_softmax computed in bf16 is off by 0.014 per token on average (max 0.047) and by up to 1.6e-3 on
    a sequence mean: five times the 3e-4 clip band, so precision alone would clip sequences (§6.5). That is
    why the learner never computes log-probs in bf16.
    """
    gen = torch.Generator().manual_seed(0)
    num_seqs, seq_len, vocab = 4, 256, 4096
    logits = torch.randn(num_seqs, seq_len, vocab, generator=gen) * 3.0
    tokens = torch.multinomial(torch.softmax(logits, -1).view(-1, vocab), 1, generator=gen).view(
        num_seqs, seq_len
    )
    exact = sampled_token_logprobs(logits.double(), tokens)
    fp32 = sampled_token_logprobs(logits, tokens)
    bf16 = torch.log_softmax(logits.bfloat16(), dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1).double()
    ones = torch.ones(num_seqs, seq_len)
    fp32_error = sequence_log_ratio(fp32.double(), exact, ones).abs().max().item()
    bf16_error = sequence_log_ratio(bf16, exact, ones).abs().max().item()
    bf16_token_error = (bf16 - exact).abs().max().item()
    assert fp32_error < 1e-6  # << 3e-4
    assert bf16_token_error > 3e-3
    assert bf16_error > 100 * fp32_error
    assert bf16_error > 3e-4


# -------------------------------------------------------------------------------------------- T10


@pytest.mark.parametrize("level", ALL_LEVELS)
def test_t10_data_parallel_shards_reproduce_the_full_batch(level: Level) -> None:
    gen = torch.Generator().manual_seed(5)
    lengths = [3, 7, 0, 1, 5, 6]  # one empty row, unevenly spread over shards
    mask = (torch.arange(8).unsqueeze(0) < torch.tensor(lengths).unsqueeze(-1)).int()
    lp_values = -torch.rand(6, 8, generator=gen) * 2
    old = lp_values + (torch.rand(6, 8, generator=gen) - 0.5) * 2e-3
    adv = torch.randn(6, 8, generator=gen)

    lp_full = _leaf(lp_values)
    loss_full, stats_full = gspo_token_loss(lp_full, old, adv, mask, level=level, **PAPER_CLIP)
    grad_full = _grad(loss_full, lp_full)
    total = int(stats_full["num_sequences"].item())
    assert total == 5

    shards = [slice(0, 2), slice(2, 5), slice(5, 6)]
    summed_loss = torch.zeros(())
    weighted_loss = torch.zeros(())
    grads = []
    for rows in shards:
        lp = _leaf(lp_values[rows])
        # Scaling 1: divide by the global count, then sum (verl's global_batch_size; an all-reduce SUM).
        loss, _ = gspo_token_loss(
            lp, old[rows], adv[rows], mask[rows], level=level, num_global_sequences=total, **PAPER_CLIP
        )
        grads.append(_grad(loss, lp))
        summed_loss += loss.detach()
        # Scaling 2: local means recombined with their num_sequences as weights.
        local, local_stats = gspo_token_loss(lp, old[rows], adv[rows], mask[rows], level=level, **PAPER_CLIP)
        weighted_loss += local.detach() * local_stats["num_sequences"] / total
    assert summed_loss.item() == pytest.approx(loss_full.item(), abs=1e-7)
    assert weighted_loss.item() == pytest.approx(loss_full.item(), abs=1e-7)
    torch.testing.assert_close(torch.cat(grads), grad_full, atol=1e-7, rtol=0)


def test_t10_a_shard_without_any_trainable_token_adds_zero() -> None:
    lp = _leaf(torch.full((2, 3), float("nan")))
    loss, stats = gspo_token_loss(
        lp, lp.detach(), torch.ones(2, 3), torch.zeros(2, 3), num_global_sequences=4
    )
    assert loss.item() == 0.0
    assert stats["num_sequences"].item() == 0
    assert torch.equal(_grad(loss, lp), torch.zeros(2, 3))


# ----------------------------------------------------------------------------- token-mean aggregation


@pytest.mark.parametrize("level", ["sequence_token", "token"])  # per-token gradients (GSPO's is per sequence)
def test_token_mean_weighs_every_token_the_same_not_every_sequence(level: Level) -> None:
    # On-policy (ratio 1): a 1-token row with A = 1 and a 3-token row with A = -1, 2, 3 per token.
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]])
    lp = _leaf(torch.tensor([[-0.5, 0.0, 0.0], [-1.0, -2.0, -0.25]]))
    adv = torch.tensor([[1.0, 0.0, 0.0], [-1.0, 2.0, 3.0]])
    loss, stats = gspo_token_loss(
        lp, lp.detach(), adv, mask, level=level, aggregation="token_mean", **WIDE_CLIP
    )
    assert loss.item() == pytest.approx(-(1.0 - 1.0 + 2.0 + 3.0) / 4)
    assert stats["num_tokens"].item() == 4
    # d loss / d lp = -A / (unmasked tokens of the batch), whatever the row's length.
    expected = torch.tensor([[-1.0, 0.0, 0.0], [1.0, -2.0, -3.0]]) / 4
    torch.testing.assert_close(_grad(loss, lp), expected)
    seq_mean, _ = gspo_token_loss(lp, lp.detach(), adv, mask, level=level, **WIDE_CLIP)
    assert seq_mean.item() == pytest.approx(-(1.0 + (-1.0 + 2.0 + 3.0) / 3) / 2)


@pytest.mark.parametrize("level", ALL_LEVELS)
def test_token_mean_shards_with_the_global_token_count_reproduce_the_full_batch(level: Level) -> None:
    gen = torch.Generator().manual_seed(7)
    lengths = [3, 7, 0, 1, 5, 6]
    mask = (torch.arange(8).unsqueeze(0) < torch.tensor(lengths).unsqueeze(-1)).int()
    lp_values = -torch.rand(6, 8, generator=gen) * 2
    old = lp_values + (torch.rand(6, 8, generator=gen) - 0.5) * 2e-3
    adv = torch.randn(6, 8, generator=gen)
    lp_full = _leaf(lp_values)
    loss_full, _ = gspo_token_loss(
        lp_full, old, adv, mask, level=level, aggregation="token_mean", **PAPER_CLIP
    )
    grad_full = _grad(loss_full, lp_full)

    summed, grads = torch.zeros(()), []
    for rows in (slice(0, 2), slice(2, 5), slice(5, 6)):
        lp = _leaf(lp_values[rows])
        loss, _ = gspo_token_loss(
            lp,
            old[rows],
            adv[rows],
            mask[rows],
            level=level,
            aggregation="token_mean",
            num_global_tokens=sum(lengths),
            **PAPER_CLIP,
        )
        grads.append(_grad(loss, lp))
        summed += loss.detach()
    assert summed.item() == pytest.approx(loss_full.item(), abs=1e-7)
    torch.testing.assert_close(torch.cat(grads), grad_full, atol=1e-7, rtol=0)


def test_token_mean_all_masked_batch_gives_zero_loss_and_zero_grad() -> None:
    lp = _leaf(torch.full((2, 3), float("nan")))
    loss, _ = gspo_token_loss(lp, lp.detach(), torch.ones(2, 3), torch.zeros(2, 3), aggregation="token_mean")
    assert loss.item() == 0.0
    assert torch.equal(_grad(loss, lp), torch.zeros(2, 3))


# ---------------------------------------------------------------------------------------- errors


def test_rejects_unknown_level_and_mismatched_shapes() -> None:
    lp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="level must be one of"):
        gspo_token_loss(lp, lp, lp, lp, level="tokens")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"advantages has shape \(2, 4\)"):
        gspo_token_loss(lp, lp, torch.zeros(2, 4), lp)
    with pytest.raises(ValueError, match=r"must have shape \(B, T\)"):
        gspo_token_loss(torch.zeros(3), torch.zeros(3), torch.zeros(3), torch.zeros(3))
    with pytest.raises(ValueError, match="clip_low"):
        gspo_token_loss(lp, lp, lp, lp, clip_low=1.0)
    with pytest.raises(ValueError, match="num_global_sequences"):
        gspo_token_loss(lp, lp, lp, lp, num_global_sequences=0)
    with pytest.raises(ValueError, match="aggregation must be one of"):
        gspo_token_loss(lp, lp, lp, lp, aggregation="token_sum")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_global_tokens"):
        gspo_token_loss(lp, lp, lp, lp, aggregation="token_mean", num_global_tokens=0)


def test_bf16_inputs_are_upcast_and_loss_is_fp32() -> None:
    lp = _leaf(torch.tensor([[-1.0, -2.0]], dtype=torch.bfloat16))
    loss, stats = gspo_token_loss(lp, lp.detach(), torch.ones(1, 2, dtype=torch.bfloat16), torch.ones(1, 2))
    assert loss.dtype == torch.float32
    assert stats["ratio_mean"].dtype == torch.float32
    assert _grad(loss, lp).dtype == torch.bfloat16


# ---------------------------------------------- the three [learner.loss] kinds, by hand, paper bands
# Two sequences (G = 2), fp64. Sequence a: log ratios 0.3, -0.1 with A = +1 (s_a = e^0.1 = 1.1052, above
# both bands' top). Sequence b: 0.0002, 0.0001, -0.0006 with A = -0.5 (s_b = e^-0.0001, inside both bands).
HAND_DELTAS = [[0.3, -0.1, 0.0], [0.0002, 0.0001, -0.0006]]
HAND_MASK = [[1, 1, 0], [1, 1, 1]]
HAND_ADV = [1.0, -0.5]
PAPER_BANDS = {"gspo_token": (3e-4, 4e-4), "gspo": (3e-4, 4e-4), "grpo": (0.2, 0.27)}


def _hand_loss(kind: str, agg: str) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    from pipeline.contracts.learner_config import LossConfig

    low, high = PAPER_BANDS[kind]
    cfg = LossConfig(kind=kind, clip_low=low, clip_high=high, agg=agg)  # type: ignore[arg-type]
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.7, -1.1, -3.0]], dtype=torch.float64)
    lp = _leaf(old + torch.tensor(HAND_DELTAS, dtype=torch.float64))
    adv = _seq_constant(HAND_ADV, (2, 3), torch.float64)
    mask = torch.tensor(HAND_MASK)
    loss, stats = gspo_token_loss(
        lp, old, adv, mask, clip_low=low, clip_high=high, level=cfg.level, aggregation=cfg.agg
    )
    return loss, stats, _grad(loss, lp)


def test_grpo_clips_each_token_by_its_own_ratio_by_hand() -> None:
    loss, stats, grad = _hand_loss("grpo", "seq_mean_token_mean")
    r = [[math.exp(d) for d in row] for row in HAND_DELTAS]
    # a: r = 1.3499 > 1.27 with A > 0 is clipped (term -1.27, no gradient); r = 0.9048 is not.
    seq_a = (-1.27 - r[0][1]) / 2
    seq_b = sum(0.5 * x for x in r[1]) / 3  # every b ratio is inside [0.8, 1.27]
    assert loss.item() == pytest.approx((seq_a + seq_b) / 2, abs=1e-12)
    assert stats["clip_fraction_token"].item() == pytest.approx(1 / 5)
    assert stats["clip_fraction"].item() == pytest.approx(1 / 2)
    assert grad[0, 0].item() == 0.0
    assert grad[0, 1].item() == pytest.approx(-1.0 * r[0][1] / 2 / 2, abs=1e-12)
    assert grad[1].tolist() == pytest.approx([0.5 * x / 3 / 2 for x in r[1]], abs=1e-12)


def test_grpo_token_mean_weighs_every_token_the_same_by_hand() -> None:
    loss, _, _ = _hand_loss("grpo", "token_mean")
    r = [[math.exp(d) for d in row] for row in HAND_DELTAS]
    terms = [-1.27, -r[0][1], *(0.5 * x for x in r[1])]
    assert loss.item() == pytest.approx(sum(terms) / 5, abs=1e-12)


@pytest.mark.parametrize("kind", ["gspo", "gspo_token"])
def test_gspo_clips_each_sequence_once_by_hand(kind: str) -> None:
    loss, stats, grad = _hand_loss(kind, "seq_mean_token_mean")
    s_b = math.exp(-0.0001)
    # a: s = e^0.1 above 1.0004 with A > 0: clipped at -1.0004, no gradient. b: inside the band.
    assert loss.item() == pytest.approx((-1.0004 + 0.5 * s_b) / 2, abs=1e-12)
    assert stats["clip_fraction"].item() == pytest.approx(1 / 2)
    assert stats["clip_fraction_token"].item() == pytest.approx(2 / 5)  # the tokens of the clipped sequence
    assert grad[0].abs().sum().item() == 0.0
    # every token of b gets the sequence's weight: -A s_b / |y_b| / G
    assert grad[1].tolist() == pytest.approx([0.5 * s_b / 3 / 2] * 3, abs=1e-12)


def test_ratio_spread_statistics_by_hand() -> None:
    _, stats, _ = _hand_loss("grpo", "seq_mean_token_mean")
    tokens = [0.3, -0.1, 0.0002, 0.0001, -0.0006]
    sequences = [0.1, -0.0001]
    assert stats["token_log_ratio_mean"].item() == pytest.approx(sum(tokens) / 5, abs=1e-12)
    assert stats["token_log_ratio_sq_mean"].item() == pytest.approx(sum(x * x for x in tokens) / 5, abs=1e-12)
    assert stats["seq_log_ratio_mean"].item() == pytest.approx(sum(sequences) / 2, abs=1e-12)
    assert stats["seq_log_ratio_sq_mean"].item() == pytest.approx(
        sum(x * x for x in sequences) / 2, abs=1e-12
    )


def test_the_loss_kinds_map_to_their_ratio_levels_and_refuse_others() -> None:
    from pydantic import ValidationError

    from pipeline.contracts.learner_config import LossConfig

    assert [LossConfig(kind=k).level for k in ("gspo_token", "gspo", "grpo")] == [  # type: ignore[arg-type]
        "sequence_token",
        "sequence",
        "token",
    ]
    with pytest.raises(ValidationError, match="kind"):
        LossConfig(kind="ppo")  # type: ignore[arg-type]
