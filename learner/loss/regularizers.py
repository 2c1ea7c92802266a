"""Regularisers of the policy-gradient objective (pure maths): KL towards a frozen reference policy and
DAPO's soft over-long penalty.

KL estimators of KL(pi || pi_ref) from tokens sampled by (approximately) pi, per token, with
d = log pi_ref - log pi (Schulman's "Approximating KL divergence"; verl's kl_penalty names in brackets):
    k1 = -d                      unbiased, high variance, can be negative       ["kl"]
    k2 = d^2 / 2                 biased, low variance, >= 0                     ["mse"]
    k3 = exp(d) - 1 - d          unbiased, low variance, >= 0                   ["low_var_kl"]
k3's exp is clamped like the GSPO ratio, so a token the reference finds far likelier cannot overflow.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

KLEstimator = Literal["k1", "k2", "k3"]
_MAX_LOG = 10.0


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, estimator: KLEstimator) -> Tensor:
    """Per-token estimate, same shape as the inputs; differentiable w.r.t. ``logprobs``."""
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)} and ref_logprobs {tuple(ref_logprobs.shape)} differ"
        )
    d = ref_logprobs.detach().float() - logprobs.float()
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return torch.expm1(d.clamp(max=_MAX_LOG)) - d
    raise ValueError(f"estimator must be k1, k2 or k3, got {estimator!r}")


def overlong_penalty(length: int, budget: int, slope: int) -> float:
    """DAPO's soft over-long punishment of one response of `length` tokens: 0 up to budget - slope, then
    falling linearly to -1 at the budget, and -1 beyond it."""
    if budget < 1 or not 0 <= slope <= budget:
        raise ValueError(f"need budget >= 1 and 0 <= slope <= budget, got budget={budget}, slope={slope}")
    if length > budget:
        return -1.0
    free = budget - slope
    if length <= free:
        return 0.0
    return (free - length) / slope
