"""Training/inference mismatch correction: importance weights and rejection masks (pure tensor maths).

The engine samples with its own numerics (bf16 kernels, other reduction orders), so its log-probs
pi_engine differ from the learner's pi_prox for the same weights. With `learner.mismatch.proximal =
"learner"` the learner recomputes pi_prox at the start of the step; the clip is then centred on
pi_prox (decoupled PPO, as in AReaL) and the gap between the engine and pi_prox is handled here, on
log rho_t = log pi_prox(y_t) - log pi_engine(y_t) over the generated tokens (mask):

- is_weights = "token":    w_t = min(rho_t, C)                               (slime's --use-tis)
- is_weights = "sequence": w_i = min(prod_t rho_t, C) on every token of i    (verl's rollout_is="sequence")
- reject = "token":        drop token t when rho_t is outside [low, high]
- reject = "sequence":     drop sequence i when prod_t rho_t is outside the band
- reject = "geometric":    drop sequence i when exp(mean_t log rho_t) is outside the band (verl's
                           seq_mean_k1; bands like [0.999, 1.001])

Weights are constants (no gradient). The products are taken in log space and clamped at +-20 before exp,
as verl does, so a long sequence cannot overflow. A dropped token leaves the loss, |y_i| and the counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

Weights = Literal["none", "token", "sequence"]
Reject = Literal["none", "token", "sequence", "geometric"]
_LOG_CLAMP = 20.0


@dataclass(frozen=True)
class Correction:
    """`weights` (B, T) float: importance weight per token (1 where none, 0 outside the mask); `keep`
    (B, T) bool: the mask after rejection. The counts feed the step's metrics."""

    weights: Tensor
    keep: Tensor
    tokens: int  # generated tokens before rejection
    rejected_tokens: int
    truncated_tokens: int  # kept tokens whose weight hit the cap
    weight_sum: float  # over kept tokens
    weight_max: float


def correct(
    proximal: Tensor,
    engine: Tensor,
    mask: Tensor,
    *,
    weights: Weights,
    cap: float,
    reject: Reject,
    band: tuple[float, float],
) -> Correction:
    """The correction of one (B, T) batch; `proximal` and `engine` are log-probs of the sampled tokens,
    `mask` nonzero on generated tokens. Values outside the mask are ignored (they may be NaN)."""
    if proximal.shape != engine.shape or proximal.shape != mask.shape or proximal.dim() != 2:
        raise ValueError(
            f"proximal {tuple(proximal.shape)}, engine {tuple(engine.shape)} and mask {tuple(mask.shape)} "
            "must share one (B, T) shape"
        )
    if cap < 1.0:
        raise ValueError(f"cap must be >= 1, got {cap}")
    low, high = band
    if not 0.0 <= low < 1.0 < high:
        raise ValueError(f"band must satisfy 0 <= low < 1 < high, got {band}")
    generated = mask != 0
    zero = torch.zeros((), dtype=torch.float32, device=mask.device)
    log_rho = torch.where(generated, proximal.float() - engine.float(), zero)
    seq_log = log_rho.sum(dim=-1, keepdim=True).clamp(-_LOG_CLAMP, _LOG_CLAMP)
    counts = generated.sum(dim=-1, keepdim=True)

    keep = generated
    if reject == "token":
        rho = log_rho.clamp(-_LOG_CLAMP, _LOG_CLAMP).exp()
        keep = generated & (rho >= low) & (rho <= high)
    elif reject in ("sequence", "geometric"):
        seq = seq_log if reject == "sequence" else log_rho.sum(dim=-1, keepdim=True) / counts.clamp(min=1)
        inside = (seq.exp() >= low) & (seq.exp() <= high)
        keep = generated & inside
    elif reject != "none":
        raise ValueError(f"reject must be none, token, sequence or geometric, got {reject!r}")

    if weights == "token":
        raw = log_rho.clamp(-_LOG_CLAMP, _LOG_CLAMP).exp()
    elif weights == "sequence":
        raw = seq_log.exp().expand_as(log_rho)
    elif weights == "none":
        raw = torch.ones_like(log_rho)
    else:
        raise ValueError(f"weights must be none, token or sequence, got {weights!r}")
    w = torch.where(keep, raw.clamp(max=cap), zero)
    truncated = keep & (raw >= cap) if weights != "none" else torch.zeros_like(keep)
    kept_weights = w[keep]
    return Correction(
        weights=w,
        keep=keep,
        tokens=int(generated.sum()),
        rejected_tokens=int((generated & ~keep).sum()),
        truncated_tokens=int(truncated.sum()),
        weight_sum=float(kept_weights.sum()) if kept_weights.numel() else 0.0,
        weight_max=float(kept_weights.max()) if kept_weights.numel() else 0.0,
    )
