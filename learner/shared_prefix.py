"""A group's shared prompt, run once per mini-batch: the final hidden states of a packed batch whose rows
share their first tokens, with every distinct prefix computed once and its keys and values reused by the
rows that start with it.

The G episodes of a group start with the same prompt, and on a short-answer task the prompt is most of
their tokens; the learner's forward and backward on it are then mostly repeated work. Here a row's
tokens are split at its first scored column c (the last prompt token, whose hidden state scores the first
generated token):

    prefix    = input[0 : c]        run once per distinct prefix, keys and values kept (use_cache)
    remainder = input[c : length]   every row; attends to its prefix's cached keys and values

The cache is indexed to one entry per row (differentiable: the gradients of every row that shares a
prefix sum into it, as they would through G copies), and the remainder runs at positions c, c + 1, ...
with the prefix's padding masked out. The hidden states come back in the batch's own (B, T, H) layout:
exact (to float rounding: other matmul shapes) from column c on, zero before it, where nothing is scored
(learner.policy_forward reads only scored positions and subsets of them).

`shared_prefix_hidden_states` returns None when no prefix is shared by two rows (nothing to save) or the
model cannot take a cache in its forward (gradient checkpointing turns the cache off in training): the
caller then runs the plain forward.
"""

from __future__ import annotations

import inspect
from functools import cache
from typing import Any

import torch
from torch import Tensor


@cache
def _cache_keyword(forward: Any) -> str:
    """The name the base model's forward takes its KV cache by (transformers 5.24 renamed past_key_values
    to cache; the old name still works there but warns)."""
    parameters = inspect.signature(forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def split_columns(attention_mask: Tensor, scored: Tensor) -> Tensor:
    """Per row, the column its remainder starts at: the first scored column, or the row's last real
    column when nothing in it is scored (it then runs one token, whose hidden state nobody reads)."""
    lengths = attention_mask.sum(dim=-1)
    first = torch.where(scored.any(dim=-1), scored.int().argmax(dim=-1), lengths - 1)
    return first.clamp(min=0)


def shared_prefix_hidden_states(
    base_model: Any, input_ids: Tensor, attention_mask: Tensor, scored: Tensor
) -> Tensor | None:
    """(B, T, H) final hidden states, exact where columns >= the row's first scored column (module
    docstring); None when no prefix is shared or the model cannot use a cache here."""
    if getattr(base_model, "gradient_checkpointing", False) and base_model.training:
        return None
    rows, width = input_ids.shape
    split = split_columns(attention_mask, scored)
    keys: dict[tuple[int, ...], int] = {}
    owner = []
    for r in range(rows):
        prefix = tuple(input_ids[r, : int(split[r])].tolist())
        owner.append(keys.setdefault(prefix, len(keys)) if prefix else -1)
    if -1 in owner or len(keys) >= rows:
        return None
    prefixes = list(keys)
    prefix_width = max(len(p) for p in prefixes)
    device = input_ids.device
    prefix_ids = torch.zeros((len(prefixes), prefix_width), dtype=input_ids.dtype, device=device)
    prefix_mask = torch.zeros((len(prefixes), prefix_width), dtype=attention_mask.dtype, device=device)
    for u, prefix in enumerate(prefixes):
        prefix_ids[u, : len(prefix)] = torch.tensor(prefix, dtype=input_ids.dtype)
        prefix_mask[u, : len(prefix)] = 1
    keyword = _cache_keyword(base_model.forward)
    first = base_model(input_ids=prefix_ids, attention_mask=prefix_mask, use_cache=True)
    kv = getattr(first, keyword, None)
    if kv is None:
        kv = first.past_key_values
    index = torch.tensor(owner, dtype=torch.long, device=device)
    kv.batch_select_indices(index)
    # The remainder of each row, left-aligned: row r's column j is its input column split[r] + j.
    lengths = attention_mask.sum(dim=-1)
    rest = (lengths - split).clamp(min=1)
    rest_width = int(rest.max())
    offsets = torch.arange(rest_width, device=device)
    columns = (split.unsqueeze(1) + offsets).clamp(max=width - 1)
    rest_mask = (offsets.unsqueeze(0) < rest.unsqueeze(1)).to(attention_mask.dtype)
    rest_ids = torch.where(rest_mask.bool(), input_ids.gather(1, columns), 0)
    full_mask = torch.cat([prefix_mask.index_select(0, index), rest_mask], dim=1)
    out = base_model(
        input_ids=rest_ids,
        attention_mask=full_mask,
        position_ids=split.unsqueeze(1) + offsets,
        use_cache=True,
        **{keyword: kv},
    )
    hidden: Tensor = out.last_hidden_state
    placed = hidden.new_zeros((rows, width, hidden.shape[-1]))
    keep = rest_mask.bool()
    row_index = torch.arange(rows, device=device).unsqueeze(1).expand(-1, rest_width)
    return placed.index_put((row_index[keep], columns[keep]), hidden[keep])
