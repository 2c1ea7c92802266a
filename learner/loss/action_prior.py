"""Action prior: a floor of probability on an environment's valid answers while the policy learns.

A softmax policy gradient only moves a token up where it was sampled with a positive advantage, and the
entropy bonus pushes a token up in proportion to its own probability (dH/dz_j = -p_j (log p_j + H)). An
answer that is right in one state only, and reached only once the rest is learned, is therefore lost for
good once it has been outvoted everywhere else.

The prior is the cross-entropy of a uniform distribution over the action tokens against the policy at
the first generated position of each turn, i.e. KL(U_A || pi) up to a constant. Its gradient on the logit
of action token j is coef * (pi_j - 1/|A|): a push that does not shrink with pi_j, so every valid answer
keeps enough probability to be tried where it is right.

It is meant to decay to 0 (``learner.regularizers.action_prior_decay_steps``) once those answers have been
found: held constant it caps how sure the policy may become (docs/training_curve.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch
from torch import Tensor


class TokenCodec(Protocol):
    """The two tokenizer methods used here (any Hugging Face tokenizer has them)."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> object: ...  # HF's is typed str | list[str]


def action_token_ids(tokenizer: TokenCodec, hints: Iterable[str]) -> list[int]:
    """Sorted ids of the tokens that can start an answer in ``hints``, written alone or after a space.

    The first token that decodes to visible text counts, so a tokenizer that splits off the space (" ",
    "1", "6") contributes "1", not the bare space. Raises ValueError when no hint yields a token.
    """
    ids: set[int] = set()
    for hint in hints:
        for text in (hint, " " + hint):
            for token in tokenizer.encode(text, add_special_tokens=False):
                if str(tokenizer.decode([token])).strip():
                    ids.add(int(token))
                    break
    if not ids:
        raise ValueError("the action hints encode to no visible token")
    return sorted(ids)


def turn_start_mask(loss_mask: Tensor) -> Tensor:
    """Bool (B, T): the first generated position of each turn, a masked-in position whose left neighbour
    in the row is masked out (or the row's first position)."""
    keep = loss_mask > 0
    before = torch.zeros_like(keep)
    before[:, 1:] = keep[:, :-1]
    return keep & ~before


def action_prior_loss(logits: Tensor, loss_mask: Tensor, action_ids: Tensor, temperature: float) -> Tensor:
    """Mean over turn starts of -(1/|A|) sum_{j in A} log softmax(logits / T)_j; differentiable.

    ``logits`` (B, T, V) are aligned with ``loss_mask`` (B, T) as in the GSPO loss (position t scores
    the token generated at t). Only the turn-start rows are materialised in fp32. A batch without a
    generated token gives a zero that still carries the graph.
    """
    starts = turn_start_mask(loss_mask)
    if not bool(starts.any()):
        return logits.sum() * 0.0
    return action_prior_loss_of_rows(logits[starts], action_ids, temperature)


def action_prior_loss_of_rows(rows: Tensor, action_ids: Tensor, temperature: float) -> Tensor:
    """The same mean for (S, V) logits rows that are already the turn starts (the fused learner path
    makes only those rows)."""
    if rows.shape[0] == 0:
        return rows.sum() * 0.0
    logp = torch.log_softmax(rows.float() / temperature, dim=-1)
    return -logp.index_select(-1, action_ids.to(logp.device)).mean()  # no copy when already there
