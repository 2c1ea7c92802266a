"""Attention for a policy trained on the CPU: plain matmuls for short sequences, SDPA for long ones.

torch's CPU scaled-dot-product attention runs a flash kernel whose backward pays a large fixed cost per
call, so on the short rows of a short-answer task the three matmuls and the softmax written out are
faster, while on long rows the flash kernel is faster and holds far less memory (docs/benchmarks.md,
"bench learner --replay --attention"). So `ATTENTION` dispatches per call on the size of the score
matrix: at most `MATH_SCORES` query x key positions go the written-out way (transformers' eager formula:
fp32 softmax, the same masking), larger ones to transformers' own SDPA function. Both take the boolean
masks transformers builds for SDPA (`sdpa_mask`, registered with the name), so a model switches between
them per layer call without rebuilding its masks.

`attention_implementation(device)` is what the learner's policy is set to when transformers chose SDPA
for it (learner.policy_setup, on every rank): this one when it trains on a CPU, "sdpa" elsewhere (a GPU's
SDPA kernels are the fast path at every size). A model transformers runs eagerly (attention sinks, logit
soft-capping) keeps its own attention: neither SDPA nor this computes those.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

ATTENTION = "rollwise_cpu"

# Query x key positions per head up to which the written-out form is used: where its forward and
# backward stopped being the faster of the two in bf16 on the CPU.
MATH_SCORES = 256 * 320


def _registered() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ATTENTION, cpu_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, sdpa_mask)


def attention_implementation(device: torch.device) -> str:
    """The attention implementation of a policy that trains on `device`."""
    if device.type != "cpu":
        return "sdpa"
    _registered()
    return ATTENTION


def math_attention(query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, scaling: float) -> Tensor:
    """softmax(q k^T * scaling + mask) v with the softmax in fp32 at least; (B, H, Tq, D) -> (B, H, Tq, D).

    `key` and `value` may have fewer heads than `query` (grouped-query attention: each serves
    H / H_kv query heads). `mask` is boolean (True = may attend), broadcastable to (B, H, Tq, Tk); None
    means causal with the queries at the last Tq key positions, as SDPA's `is_causal` reads it when
    Tq > 1 (a single query attends to every key)."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(-1, -2))
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32)) * scaling
    q_len, k_len = query.shape[-2], key.shape[-2]
    if mask is None and q_len > 1:
        mask = torch.ones(q_len, k_len, dtype=torch.bool, device=query.device).tril(k_len - q_len)
    if mask is not None:
        # The dtype's minimum, not -inf: a row that may attend to nothing (padding) stays finite.
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    weights = torch.softmax(scores, dim=-1).to(value.dtype)
    return torch.matmul(weights, value)


def cpu_attention(
    module: Any,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention-function contract: (B, Tq, H, D) output and no weights (module docstring)."""
    q_len, k_len = query.shape[-2], key.shape[-2]
    if q_len * k_len > MATH_SCORES or (dropout > 0.0 and module.training):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        raise TypeError(f"{ATTENTION} takes boolean masks (sdpa_mask), got {attention_mask.dtype}")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = math_attention(query, key, value, attention_mask, scale)
    return out.transpose(1, 2).contiguous(), None
