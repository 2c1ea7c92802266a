"""GSPO / GSPO-token clipped surrogate loss (pure tensor maths, no model, no optimizer).

Reference: the GSPO paper (arXiv 2507.18071), whose GSPO-token variant is the default. Notation: ``lp`` are
log-probs of the sampled tokens under the policy being trained (with grad), ``old`` those of the
behaviour policy (here: the inference engine's own log-probs), ``A`` per-token advantages, ``mask`` 1 on
tokens the model generated and we train on (prompt, tool and environment tokens are 0).

Three importance-ratio levels share one clipped surrogate and one aggregation:

- ``"sequence_token"`` (GSPO-token, default): log r_{i,t} = lp_{i,t} - sg[lp_{i,t}] + sg[log s_i]. Its value
  is the sequence ratio s_i on every token, so the clip decision is made once per sequence, but the
  gradient is s_i * A_{i,t} * grad lp_{i,t} / |y_i|, so per-token (per-turn) advantages keep their credit.
- ``"sequence"`` (GSPO): r_{i,t} = s_i with the gradient flowing through the masked mean.
- ``"token"`` (GRPO/PPO baseline): r_{i,t} = exp(lp_{i,t} - old_{i,t}).

with log s_i = (1/|y_i|) * sum_t mask_{i,t} (lp_{i,t} - old_{i,t}).

Aggregation (verl's ``loss_agg_mode``):

- ``"seq_mean_token_mean"`` (default): each sequence's masked token mean, then the mean over sequences
  with at least one unmasked token, so every episode weighs the same regardless of its length (the
  paper's (1/G) sum_i; a long episode does not outweigh a short one).
- ``"token_mean"``: the mean over every unmasked token of the batch, so every generated token (with
  per-turn advantages: every turn of a short-answer task) weighs the same. A 5-turn episode then carries
  5x the weight of a 1-turn one instead of each of its turns getting 1/5: the late turns of long
  episodes, where a multi-turn policy has the most to learn, are not diluted.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import Tensor

Level = Literal["sequence_token", "sequence", "token"]
LEVELS: tuple[str, ...] = get_args(Level)
Aggregation = Literal["seq_mean_token_mean", "token_mean"]
AGGREGATIONS: tuple[str, ...] = get_args(Aggregation)

# Upper clamp of the log ratio before exp, as verl does. A stale or corrupt behaviour log-prob can give a
# log ratio of hundreds; exp() of that overflows fp32 (above ~88.7) to inf, and inf * A turns the loss and
# every gradient into inf/NaN. e^10 ≈ 22026 is already far outside any clip band, so clamping there changes
# no clip decision; the clamp has zero gradient above 10, so such a sequence (or token) simply drops out of
# the gradient instead of poisoning the step. No lower clamp is needed: exp of a very negative number
# underflows to 0, which is finite.
MAX_LOG_RATIO = 10.0


def _compute_dtype(*tensors: Tensor) -> torch.dtype:
    """fp64 when any input is fp64 (finite-difference tests), else fp32 (never bf16: its log-prob spacing,
    ~0.01, is wider than GSPO's clip band)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _check_inputs(named: dict[str, Tensor]) -> None:
    shapes = {name: tuple(t.shape) for name, t in named.items()}
    first_name, first_shape = next(iter(shapes.items()))
    if len(first_shape) != 2:
        raise ValueError(f"{first_name} must have shape (B, T), got {first_shape}")
    for name, shape in shapes.items():
        if shape != first_shape:
            raise ValueError(f"{name} has shape {shape}, expected {first_shape} like {first_name}")


def _masked_inputs(mask: Tensor, *tensors: Tensor, dtype: torch.dtype) -> tuple[Tensor, list[Tensor]]:
    """Boolean mask and the tensors upcast with masked positions replaced by exact zeros.

    torch.where (not multiplication) is what keeps garbage out: 0 * inf or 0 * NaN is NaN in the value,
    and where's backward sends exactly zero (not 0 * something) to the unselected positions.
    """
    keep = mask != 0
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    return keep, [torch.where(keep, t.to(dtype), zero) for t in tensors]


def sequence_log_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """log s_i = masked mean over t of (logprobs - old_logprobs), shape (B,), fp32 (fp64 if inputs are).

    Rows without any unmasked token get 0.0 (ratio 1), never 0/0. Differentiable w.r.t. ``logprobs``;
    masked positions get exactly zero gradient even if they hold NaN or inf.
    """
    _check_inputs({"logprobs": logprobs, "old_logprobs": old_logprobs, "mask": mask})
    dtype = _compute_dtype(logprobs, old_logprobs)
    keep, (lp, old) = _masked_inputs(mask, logprobs, old_logprobs, dtype=dtype)
    num_tokens = keep.sum(dim=-1).to(dtype)
    return (lp - old).sum(dim=-1) / num_tokens.clamp(min=1.0)


def gspo_token_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    level: Level = "sequence_token",
    num_global_sequences: int | None = None,
    aggregation: Aggregation = "seq_mean_token_mean",
    num_global_tokens: int | None = None,
    token_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped GSPO-token (or GSPO / token-PPO) loss to minimise, and detached statistics.

    Args:
        logprobs: (B, T) log-probs of the sampled tokens under the trained policy; carries the gradient.
        old_logprobs: (B, T) behaviour-policy log-probs (the engine's). Treated as constants.
        advantages: (B, T) per-token advantages (each token gets its turn's advantage). Constants.
        mask: (B, T) nonzero where the token is trained on. Only these positions affect anything.
        clip_low, clip_high: the ratio band is [1 - clip_low, 1 + clip_high] (paper: 3e-4, 4e-4).
        level: "sequence_token" (GSPO-token), "sequence" (GSPO) or "token" (GRPO/PPO ratio per token).
        num_global_sequences: data-parallel / micro-batch scaling. None: divide by this call's number of
            non-empty sequences (the plain mean). An int N: divide by N instead, so that summing the
            losses (and gradients) of shards that together hold N non-empty sequences reproduces the
            full-batch loss exactly, however unevenly the sequences are spread (verl's
            global_batch_size scaling; with DDP's gradient *averaging* multiply the loss by world size).
            Used by "seq_mean_token_mean" only.
        aggregation: "seq_mean_token_mean" (default) or "token_mean" (see the module docstring).
        num_global_tokens: the same scaling for "token_mean": None divides by this call's unmasked tokens,
            an int N by N (the unmasked tokens of all shards together).
        token_weights: (B, T) constants multiplying each token's loss term before aggregation (the
            truncated importance weights of learner.loss.mismatch); None = 1. They change neither |y_i| nor
            the clip decision.

    Returns:
        (loss, stats). ``loss`` is a 0-dim tensor in fp32 (fp64 if inputs are fp64). Per token:
        max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high)); then aggregated as ``aggregation`` says.
        Rows with no unmasked token contribute nothing (no NaN); an all-empty batch gives loss 0.0 with
        zero gradient.

        ``stats`` (all detached 0-dim tensors):
        - clip_fraction: share of non-empty sequences where the clipped branch is strictly active on at
          least one token (per sequence for the sequence levels, where the decision is per sequence).
        - clip_fraction_token: token-weighted share of unmasked tokens whose clipped branch is active.
        - band_exit_fraction: share of non-empty sequences with a ratio outside the band on any token,
          whatever the sign of A (what a train/engine mismatch alone would clip).
        - ratio_mean / ratio_min / ratio_max: over non-empty sequences (s_i) for the sequence levels,
          over unmasked tokens for "token"; 1.0 when there is nothing to measure.
        - mismatch_abs_mean: token-weighted mean |lp - old|.
        - mismatch_k3: token-weighted mean of (r - 1) - log r with log r = lp - old: the k3 estimator of
          KL(behaviour || trained) on tokens sampled from the behaviour policy (verl's rollout_corr/k3_kl).
        - seq_log_ratio_abs_mean: mean over non-empty sequences of |log s_i| (compare with the clip band).
        - token_log_ratio_mean / token_log_ratio_sq_mean: token-weighted mean of log r_t = lp - old and of
          its square; seq_log_ratio_mean / seq_log_ratio_sq_mean: the same of log s_i over non-empty
          sequences (the spread of the token ratios against the sequence ratio's, whatever the level).
        - num_sequences, num_tokens: non-empty sequences and unmasked tokens in this call.
    """
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    if not 0.0 <= clip_low < 1.0:
        raise ValueError(f"clip_low must be in [0, 1), got {clip_low}")
    if not clip_high >= 0.0:
        raise ValueError(f"clip_high must be >= 0, got {clip_high}")
    if num_global_sequences is not None and num_global_sequences < 1:
        raise ValueError(f"num_global_sequences must be >= 1 when given, got {num_global_sequences}")
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    if num_global_tokens is not None and num_global_tokens < 1:
        raise ValueError(f"num_global_tokens must be >= 1 when given, got {num_global_tokens}")
    _check_inputs(
        {"logprobs": logprobs, "old_logprobs": old_logprobs, "advantages": advantages, "mask": mask}
    )

    dtype = _compute_dtype(logprobs, old_logprobs, advantages)
    keep, (lp, old, adv) = _masked_inputs(mask, logprobs, old_logprobs, advantages, dtype=dtype)
    old = old.detach()
    adv = adv.detach()

    tokens_per_seq = keep.sum(dim=-1)
    non_empty = tokens_per_seq > 0
    seq_denominator = tokens_per_seq.to(dtype).clamp(min=1.0)
    seq_log_ratio = (lp - old).sum(dim=-1) / seq_denominator

    if level == "sequence_token":
        log_ratio = lp - lp.detach() + seq_log_ratio.detach().unsqueeze(-1)
    elif level == "sequence":
        log_ratio = seq_log_ratio.unsqueeze(-1).expand_as(lp)
    else:
        log_ratio = lp - old
    ratio = torch.exp(log_ratio.clamp(max=MAX_LOG_RATIO))

    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    token_loss = torch.maximum(unclipped, clipped)
    if token_weights is not None:
        _check_inputs({"logprobs": logprobs, "token_weights": token_weights})
        token_loss = token_loss * token_weights.detach().to(dtype)
    token_loss = torch.where(keep, token_loss, torch.zeros_like(unclipped))
    if aggregation == "token_mean":
        global_count = num_global_tokens
        denominator = keep.sum().to(dtype).clamp(min=1.0)
        loss = token_loss.sum()
    else:
        global_count = num_global_sequences
        denominator = non_empty.sum().to(dtype).clamp(min=1.0)
        seq_loss = token_loss.sum(dim=-1) / seq_denominator
        loss = torch.where(non_empty, seq_loss, torch.zeros_like(seq_loss)).sum()
    if global_count is not None:
        denominator = torch.tensor(float(global_count), dtype=dtype, device=lp.device)
    loss = loss / denominator

    with torch.no_grad():
        stats = _stats(
            keep=keep,
            non_empty=non_empty,
            ratio=ratio.detach(),
            clip_active=keep & (clipped.detach() > unclipped.detach()),
            seq_log_ratio=seq_log_ratio.detach(),
            log_ratio_tokens=(lp - old).detach(),
            clip_low=clip_low,
            clip_high=clip_high,
            per_token_ratio=level == "token",
        )
    return loss, stats


def _masked_mean(values: Tensor, keep: Tensor) -> Tensor:
    count = keep.sum().to(values.dtype).clamp(min=1.0)
    return torch.where(keep, values, torch.zeros_like(values)).sum() / count


def _stats(
    *,
    keep: Tensor,
    non_empty: Tensor,
    ratio: Tensor,
    clip_active: Tensor,
    seq_log_ratio: Tensor,
    log_ratio_tokens: Tensor,
    clip_low: float,
    clip_high: float,
    per_token_ratio: bool,
) -> dict[str, Tensor]:
    dtype = ratio.dtype
    outside_band = keep & ((ratio < 1.0 - clip_low) | (ratio > 1.0 + clip_high))

    # A per-sequence ratio has the same value on every token of the row; read it from the row's
    # clamped token ratios (max over the row) so the clamp at MAX_LOG_RATIO is reflected.
    if per_token_ratio:
        ratio_values, ratio_keep = ratio, keep
    else:
        ratio_values = torch.where(keep, ratio, torch.zeros_like(ratio)).amax(dim=-1)
        ratio_keep = non_empty
    one = torch.ones((), dtype=dtype, device=ratio.device)
    has_ratio = ratio_keep.any()  # a tensor, not a bool: no host sync on an accelerator
    ratio_min = torch.where(ratio_keep, ratio_values, torch.full_like(ratio_values, torch.inf)).amin()
    ratio_max = torch.where(ratio_keep, ratio_values, torch.full_like(ratio_values, -torch.inf)).amax()

    # log r may be large (stale behaviour policy); clamp like the loss so exp cannot overflow.
    k3 = torch.expm1(log_ratio_tokens.clamp(max=MAX_LOG_RATIO)) - log_ratio_tokens
    return {
        "clip_fraction": _masked_mean(clip_active.any(dim=-1).to(dtype), non_empty),
        "clip_fraction_token": _masked_mean(clip_active.to(dtype), keep),
        "band_exit_fraction": _masked_mean(outside_band.any(dim=-1).to(dtype), non_empty),
        "ratio_mean": torch.where(has_ratio, _masked_mean(ratio_values, ratio_keep), one),
        "ratio_min": torch.where(has_ratio, ratio_min, one),
        "ratio_max": torch.where(has_ratio, ratio_max, one),
        "mismatch_abs_mean": _masked_mean(log_ratio_tokens.abs(), keep),
        "mismatch_k3": _masked_mean(k3, keep),
        "seq_log_ratio_abs_mean": _masked_mean(seq_log_ratio.abs(), non_empty),
        "token_log_ratio_mean": _masked_mean(log_ratio_tokens, keep),
        "token_log_ratio_sq_mean": _masked_mean(log_ratio_tokens.square(), keep),
        "seq_log_ratio_mean": _masked_mean(seq_log_ratio, non_empty),
        "seq_log_ratio_sq_mean": _masked_mean(seq_log_ratio.square(), non_empty),
        "num_sequences": non_empty.sum(),
        "num_tokens": keep.sum(),
    }
