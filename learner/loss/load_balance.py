"""The Switch Transformer's load-balancing loss of an MoE model's routers (pure maths on their logits)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def load_balance_loss(kept: Sequence[tuple[Tensor, Tensor]], keep: Tensor, num_experts: int) -> Tensor:
    """transformers' `load_balancing_loss_func` with an attention mask, mean over layers: per layer
    num_experts x sum_e f_e P_e over the kept positions (`keep` (N,) true), f_e the share of their top-k
    assignments that went to expert e (no gradient), P_e their mean router probability of e. 1.0 when the
    load is even, up to num_experts when one expert takes everything; differentiable through the router
    logits. `kept`: per layer (logits (N, E), experts (N, k)), as learner.model.moe_routing.RouterHooks
    keeps them.
    """
    terms = []
    for logits, chosen in kept:
        picked = chosen[keep]
        share = torch.zeros(num_experts, device=logits.device, dtype=torch.float32)
        share.scatter_add_(0, picked.reshape(-1).long(), torch.ones(picked.numel(), device=logits.device))
        share = share / max(picked.numel(), 1)
        probs = torch.softmax(logits[keep].float(), dim=-1).mean(dim=0)
        terms.append(num_experts * (share * probs).sum())
    return torch.stack(terms).mean()
