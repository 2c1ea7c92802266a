"""One forward of the policy (or the frozen reference) on a packed batch.

With `learner.fused_logprobs` (the default) the model runs up to its final hidden states and the
sampled-token log-probs come through the output layer fused per chunk (learner.fused_logprobs), so no
(B, T, V) logits tensor exists in forward or backward. Rows of logits are made only where something needs
them (the entropy metric and bonus at generated positions, the action prior at turn starts), a chunk at a
time for the metric. Models whose head is not a bias-free linear layer on the hidden states (soft-capped or
scaled logits) take the logits path, as does `fused_logprobs = false`.

`scored` (B, T) names the positions whose log-probs anything reads (the loss mask: loss, mismatch, KL and
trace use nothing else); the fused path runs the output layer and its log-softmax only there and leaves
0.0 elsewhere (a prompt is most of a short-answer episode's tokens).
With `share_prefix` the rows of a group run their common prompt once (learner.shared_prefix).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from learner.fused_logprobs import linear_sampled_token_logprobs
from learner.logprobs import entropy_from_logits, sampled_token_logprobs
from learner.model.frozen_casts import weight_in
from learner.model.precision import Precision, compute
from learner.shared_prefix import shared_prefix_hidden_states

_ENTROPY_ROWS = 256


def fused_head(model: Any) -> torch.nn.Linear | None:
    """The output layer when the fused path reproduces the model's logits exactly, else None."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    base = getattr(model, "base_model", None)
    if not isinstance(head, torch.nn.Linear) or base is None or base is model:
        return None
    if getattr(head, "bias", None) is not None:  # typed as a Tensor, but None for bias-free heads
        return None
    config = getattr(model, "config", None)
    for attr in ("final_logit_softcapping", "logit_scale", "output_multiplier_scale"):
        if getattr(config, attr, None) not in (None, 1.0):
            return None
    return head


@dataclass
class PolicyForward:
    """Sampled-token log-probs (B, T) in fp32, and the means to make logits rows where needed."""

    logprobs: Tensor
    hidden: Tensor | None = None  # fused path: final hidden states (B, T, H)
    head: torch.nn.Linear | None = None
    logits: Tensor | None = None  # logits path: (B, T, V)
    compute_dtype: torch.dtype = torch.float32

    def logits_at(self, keep: Tensor) -> Tensor:
        """(N, V) logits of the positions where `keep` (B, T) is true; differentiable."""
        if self.logits is not None:
            return self.logits[keep]
        assert self.hidden is not None and self.head is not None
        weight = weight_in(self.head, self.compute_dtype).to(self.compute_dtype)
        return self.hidden[keep].to(self.compute_dtype) @ weight.t()

    @torch.no_grad()
    def entropy(self, mask: Tensor, temperature: float) -> float:
        """Mean entropy (nats) of softmax(logits / T) over the positions where `mask` > 0."""
        keep = mask > 0
        if self.logits is not None:
            return float(entropy_from_logits(self.logits.detach(), mask, temperature=temperature))
        assert self.hidden is not None and self.head is not None
        rows = self.hidden.detach()[keep]
        if rows.shape[0] == 0:
            return 0.0
        weight = weight_in(self.head, self.compute_dtype).detach().to(self.compute_dtype)
        total = 0.0
        for start in range(0, rows.shape[0], _ENTROPY_ROWS):
            chunk = rows[start : start + _ENTROPY_ROWS].to(self.compute_dtype) @ weight.t()
            total += float(entropy_from_logits(chunk, temperature=temperature)) * chunk.shape[0]
        return total / rows.shape[0]


# A sharded policy's root carries this method, registered with FSDP (learner.sharding): the base model and
# then the output layer's weight are used outside the root's own forward, so FSDP must gather them for it.
HIDDEN_STATES_METHOD = "rollwise_hidden_states"


def final_hidden_states(model: Any, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """The base model's last hidden states (after its final norm), (B, T, H)."""
    method = getattr(model, HIDDEN_STATES_METHOD, None)
    if method is not None:
        return method(input_ids, attention_mask)
    return model.base_model(
        input_ids=input_ids, attention_mask=attention_mask, use_cache=False
    ).last_hidden_state


def forward_policy(
    model: Any,
    input_ids: Tensor,
    attention_mask: Tensor,
    targets: Tensor,
    *,
    temperature: float,
    precision: Precision,
    device: torch.device,
    fused: bool,
    scored: Tensor | None = None,
    share_prefix: bool = False,
) -> PolicyForward:
    """The model's sampled-token log-probs of `targets`.

    With `scored` (bool, (B, T)) only those positions are computed on the fused path; the others hold 0.0
    (the logits path computes every position either way). With `share_prefix` as well, rows that start
    with the same tokens before their first scored column run those once (learner.shared_prefix)."""
    head = fused_head(model) if fused else None
    if head is None:
        with compute(precision, device):
            logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        logprobs = sampled_token_logprobs(logits, targets, temperature=temperature)
        return PolicyForward(logprobs=logprobs, logits=logits)
    with compute(precision, device):
        hidden = None
        if share_prefix and scored is not None and not hasattr(model, HIDDEN_STATES_METHOD):
            hidden = shared_prefix_hidden_states(model.base_model, input_ids, attention_mask, scored)
        if hidden is None:
            hidden = final_hidden_states(model, input_ids, attention_mask)
    dtype = precision.autocast_dtype or head.weight.dtype
    weight = weight_in(head, dtype)  # a frozen head (LoRA) is cast once, not in every forward and backward
    if scored is None:
        logprobs = linear_sampled_token_logprobs(
            hidden, weight, targets, temperature=temperature, compute_dtype=dtype
        )
    else:
        picked = linear_sampled_token_logprobs(
            hidden[scored], weight, targets[scored], temperature=temperature, compute_dtype=dtype
        )
        logprobs = picked.new_zeros(targets.shape).masked_scatter(scored, picked)
    return PolicyForward(logprobs=logprobs, hidden=hidden, head=head, compute_dtype=dtype)
