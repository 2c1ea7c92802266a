"""The running batch's KV cache: left padded, an explicit mask and explicit positions.

Per layer the batch keeps keys/values of shape (B, kv_heads, T, head_dim) with LEFT padding, a (B, T)
attention mask (0 on padding) and per-row position ids, so a row's numbers do not depend on what it is
batched with. Rows join by left-padding the shorter side (`merge`) and leave between steps (`select`,
which also trims all-padding leading columns). The KV lives in `GrowableLayer`s because transformers'
DynamicLayer concatenates on every update, copying the whole cache each token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from pipeline.engine.engine_request import EngineRequest
from pipeline.engine.prefix_cache import LayerKV

GROW_MIN = 64  # spare KV positions added at least when a GrowableLayer is (re)allocated


class GrowableLayer(DynamicLayer):
    """A DynamicLayer whose keys/values live in a buffer with spare room along the sequence axis.

    A step writes its column in place and `keys`/`values` are views of the first `length` positions. The
    buffer grows by half its length when full (amortised O(1) per token). Only `update` and
    `get_seq_length` are supported (the engine never crops or reorders a layer; it builds a new one).
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True
        self._length = keys.shape[2]
        capacity = self._length + max(GROW_MIN, self._length // 2)
        self._key_buffer = self._allocate(keys, capacity)
        self._value_buffer = self._allocate(values, capacity)
        self._expose()

    @staticmethod
    def _allocate(content: torch.Tensor, capacity: int) -> torch.Tensor:
        batch, heads, length, dim = content.shape
        buffer = content.new_empty(batch, heads, capacity, dim)
        buffer[:, :, :length] = content
        return buffer

    def _expose(self) -> tuple[torch.Tensor, torch.Tensor]:
        keys = self._key_buffer[:, :, : self._length]
        values = self._value_buffer[:, :, : self._length]
        self.keys, self.values = keys, values
        return keys, values

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        end = self._length + key_states.shape[2]
        if end > self._key_buffer.shape[2]:
            capacity = end + max(GROW_MIN, end // 2)
            self._key_buffer = self._allocate(self._key_buffer[:, :, : self._length], capacity)
            self._value_buffer = self._allocate(self._value_buffer[:, :, : self._length], capacity)
        self._key_buffer[:, :, self._length : end] = key_states
        self._value_buffer[:, :, self._length : end] = value_states
        self._length = end
        return self._expose()

    def get_seq_length(self) -> int:
        return self._length


def growable_cache(kv: list[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    """A DynamicCache holding `kv` (per layer (B, kv_heads, T, head_dim)) in GrowableLayers."""
    cache = DynamicCache()
    cache.layers = [GrowableLayer(keys, values) for keys, values in kv]
    return cache


@dataclass
class RunningBatch:
    """Rows being decoded, with their left-padded KV cache."""

    rows: list[EngineRequest]
    cache: DynamicCache
    mask: torch.Tensor  # (B, T) int64, 0 = padding
    next_pos: torch.Tensor  # (B,) int64, position id of the token fed next
    last_tokens: torch.Tensor  # (B,) int64, the token fed next (sampled, not yet in the cache)

    @property
    def size(self) -> int:
        return len(self.rows)

    def kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self.kv_of(self.cache)

    @staticmethod
    def kv_of(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
        # getattr: transformers types `layers` as a union that includes linear-attention layers.
        return [(getattr(layer, "keys"), getattr(layer, "values")) for layer in cache.layers]  # noqa: B009

    def select(self, keep: list[int]) -> RunningBatch:
        """The batch restricted to rows `keep`, with all-padding leading columns trimmed."""
        index = torch.tensor(keep, dtype=torch.long, device=self.mask.device)
        mask = self.mask.index_select(0, index)
        used = mask.any(dim=0).nonzero()
        start = int(used[0]) if used.numel() else mask.shape[1]
        kv = [
            (k.index_select(0, index)[:, :, start:], v.index_select(0, index)[:, :, start:])
            for k, v in self.kv()
        ]
        return RunningBatch(
            rows=[self.rows[i] for i in keep],
            cache=growable_cache(kv),
            mask=mask[:, start:],
            next_pos=self.next_pos.index_select(0, index),
            last_tokens=self.last_tokens.index_select(0, index),
        )

    def merge(self, other: RunningBatch) -> RunningBatch:
        """Both batches' rows in one batch; the shorter side is left-padded with masked zeros."""
        length = max(self.mask.shape[1], other.mask.shape[1])
        merged_kv = [
            (
                torch.cat([_left_pad(k1, length), _left_pad(k2, length)]),
                torch.cat([_left_pad(v1, length), _left_pad(v2, length)]),
            )
            for (k1, v1), (k2, v2) in zip(self.kv(), other.kv(), strict=True)
        ]
        return RunningBatch(
            rows=self.rows + other.rows,
            cache=growable_cache(merged_kv),
            mask=torch.cat([_left_pad_mask(self.mask, length), _left_pad_mask(other.mask, length)]),
            next_pos=torch.cat([self.next_pos, other.next_pos]),
            last_tokens=torch.cat([self.last_tokens, other.last_tokens]),
        )


def _left_pad(kv: torch.Tensor, length: int) -> torch.Tensor:
    missing = length - kv.shape[2]
    if missing == 0:
        return kv
    pad = kv.new_zeros(kv.shape[0], kv.shape[1], missing, kv.shape[3])
    return torch.cat([pad, kv], dim=2)


def _left_pad_mask(mask: torch.Tensor, length: int) -> torch.Tensor:
    missing = length - mask.shape[1]
    if missing == 0:
        return mask
    return torch.cat([mask.new_zeros(mask.shape[0], missing), mask], dim=1)


def left_padded(
    sequences: list[list[int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, mask, positions) of `sequences` left-padded to the longest, on `device`."""
    width = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    mask = torch.zeros(len(sequences), width, dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
        mask[row, width - len(seq) :] = 1
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    return ids.to(device), mask.to(device), positions.to(device)


def row_gather(kv: LayerKV, row: int, columns: torch.Tensor) -> Callable[[int, int], LayerKV]:
    """The prefix cache's view of one batch row: the KV of its tokens [start, end), whose columns in the
    batch are `columns` (padding skipped)."""

    def gather(start: int, end: int) -> LayerKV:
        index = columns[start:end]
        return [(k[row].index_select(1, index), v[row].index_select(1, index)) for k, v in kv]

    return gather
