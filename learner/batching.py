"""Padding training sequences into the (B, T) tensors the loss consumes, with the next-token shift applied.

A causal LM's logits at position j score the token at position j + 1. So for a sequence of L tokens the
model reads tokens[0 : L-1] and every per-token quantity of the loss (target id, loss mask, engine
log-prob, advantage) is taken from tokens[1 : L]: column j of every tensor below describes token j + 1.
Token 0 is never scored (nothing precedes it), so a loss-mask bit on it is dropped.

Right padding: real tokens sit in columns [0, L-1) and padding after them. With causal attention no real
position can attend to a later pad, so padded columns only need to be masked out of the loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from pipeline.contracts.schema import EpisodeSegment, RoutedExperts


@dataclass(frozen=True)
class TrainSequence:
    """One trajectory row ready for the loss: all lists have len(token_ids) entries, one per token.

    loss_mask is 1 on generated tokens; old_logprobs are the engine's log-probs (0 elsewhere); advantages
    are per token (the advantage of the turn that produced it, 0 on non-generated tokens).
    """

    token_ids: list[int]
    loss_mask: list[int]
    old_logprobs: list[float]
    advantages: list[float]
    versions: list[int] | None = None  # policy version of each generated token (-1 elsewhere)
    source: EpisodeSegment | None = None  # the trajectory row it came from (the learner's trace names it)
    routed_experts: RoutedExperts | None = None  # the engine's routing of its positions (MoE, learner.moe)

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        for name in ("loss_mask", "old_logprobs", "advantages", *(["versions"] if self.versions else [])):
            if len(getattr(self, name)) != n:
                raise ValueError(f"TrainSequence.{name} has {len(getattr(self, name))} entries, expected {n}")
        if n < 2:
            raise ValueError(f"TrainSequence needs at least 2 tokens (one context, one target), got {n}")

    @property
    def num_loss_tokens(self) -> int:
        """Generated tokens that can be scored (token 0 cannot)."""
        return sum(self.loss_mask[1:])


@dataclass(frozen=True)
class PackedBatch:
    """Right-padded tensors, shape (B, T) with T = max(len(token_ids)) - 1; column j describes token j+1.

    input_ids, attention_mask: what the model reads (long). targets: the token each position must score
    (long, pad id in padding). loss_mask (float 0/1), old_logprobs, advantages: float32, 0 in padding.
    versions (long): the policy version of each scored generated token, -1 elsewhere.
    The trainer may add the learner's own step-start log-probs (`proximal_logprobs`) and importance
    weights (`token_weights`, learner.loss.mismatch); None until then. `routed` (B, T, layers, topk) int16:
    the engine's experts of each input position, -1 where unrecorded
    (learner.model.moe_routing.replay_tensor).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    targets: torch.Tensor
    loss_mask: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    versions: torch.Tensor
    proximal_logprobs: torch.Tensor | None = None
    token_weights: torch.Tensor | None = None
    routed: torch.Tensor | None = None
    rows: tuple[int, ...] | None = None  # index of each row's sequence in the step (learner.trace)

    @property
    def num_tokens(self) -> int:
        """Real (non-padding) input tokens: the forward-pass work."""
        return int(self.attention_mask.sum().item())

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum().item())

    def to(self, device: torch.device | str) -> PackedBatch:
        moved: dict[str, Any] = {
            f.name: value.to(device) if isinstance(value, torch.Tensor) else value
            for f in fields(self)
            for value in (getattr(self, f.name),)
        }
        return PackedBatch(**moved)


def pack_sequences(sequences: Sequence[TrainSequence], *, pad_id: int) -> PackedBatch:
    """Pad `sequences` (at least one) into a PackedBatch on the CPU."""
    if not sequences:
        raise ValueError("pack_sequences needs at least one sequence")
    width = max(len(s.token_ids) for s in sequences) - 1
    rows = len(sequences)
    input_ids = torch.full((rows, width), pad_id, dtype=torch.long)
    targets = torch.full((rows, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((rows, width), dtype=torch.long)
    loss_mask = torch.zeros((rows, width), dtype=torch.float32)
    old_logprobs = torch.zeros((rows, width), dtype=torch.float32)
    advantages = torch.zeros((rows, width), dtype=torch.float32)
    versions = torch.full((rows, width), -1, dtype=torch.long)
    for row, seq in enumerate(sequences):
        n = len(seq.token_ids) - 1
        ids = torch.tensor(seq.token_ids, dtype=torch.long)
        input_ids[row, :n] = ids[:-1]
        targets[row, :n] = ids[1:]
        attention_mask[row, :n] = 1
        scored = torch.tensor(seq.loss_mask[1:], dtype=torch.bool)
        loss_mask[row, :n] = scored.float()
        # Zero outside the mask (where, not multiply: NaN * 0 is NaN) so a stray value on a prompt or env
        # token can never reach the loss.
        old_logprobs[row, :n] = torch.where(
            scored, torch.tensor(seq.old_logprobs[1:], dtype=torch.float32), 0.0
        )
        advantages[row, :n] = torch.where(scored, torch.tensor(seq.advantages[1:], dtype=torch.float32), 0.0)
        if seq.versions:
            versions[row, :n] = torch.where(scored, torch.tensor(seq.versions[1:], dtype=torch.long), -1)
    return PackedBatch(input_ids, attention_mask, targets, loss_mask, old_logprobs, advantages, versions)


def idle_batch(*, pad_id: int) -> PackedBatch:
    """One pad token with nothing to score: what a data-parallel rank whose share of a mini-batch is empty
    runs, since FSDP's gathers and reductions need every rank in every forward and backward. It adds
    exactly zero to the loss and to every gradient (attended, so the forward stays finite)."""
    return pack_sequences(
        [
            TrainSequence(
                token_ids=[pad_id, pad_id], loss_mask=[0, 0], old_logprobs=[0.0, 0.0], advantages=[0.0, 0.0]
            )
        ],
        pad_id=pad_id,
    )
