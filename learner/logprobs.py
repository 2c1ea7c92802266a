"""Log-probabilities and entropy of sampled tokens without a full (T, V) fp32 log_softmax.

What the engine reports (and what GSPO compares against) is log_softmax(logits / temperature) at the
sampled token, before top-p/top-k (DESIGN "Numerics"). With a 152k vocabulary and 2k positions, the
textbook ``log_softmax(logits.float() / T).gather(...)`` materialises two (T, V) fp32 tensors (the scaled
logits and the log-softmax, 2 x 1.2 GB) and keeps one alive for backward. Here the log-softmax is computed
in fp32 one chunk of positions at a time, in two reused (chunk, V) buffers, and only the sampled entry of
each row is kept: extra memory O(chunk_size x V), values bit-identical to the textbook version.

Backward: a custom autograd function saves only the logits (already alive: they are the model's output)
and the token ids, and recomputes each chunk's log-softmax to write d lp / d x = (onehot(y) -
softmax(x / T)) / T straight into the logits-shaped gradient. Letting autograd record the chunked forward
instead would keep every chunk's fp32 log-softmax for backward, i.e. the full (T, V) fp32 tensor again;
the price of recomputation is one more log-softmax pass over the logits in backward.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch import Tensor

# Positions per chunk. Peak extra memory is about 2 x chunk_size x V x 4 bytes (the upcast/scaled fp32
# chunk and its log-softmax; only the latter for fp32 logits at T = 1): 297 MiB for V = 151936. Measured
# on CPU (pipeline/tools/bench/logprob_memory.py, V = 151936, T = 2048): 256 takes 0.06-0.13x the naive
# peak at
# 0.24-0.36x its time; 1024 needs 0.50x with bf16 logits or T != 1, missing the <= 0.35x goal.
DEFAULT_CHUNK_SIZE = 256


def _check(logits: Tensor, token_ids: Tensor, temperature: float, chunk_size: int) -> None:
    if logits.dim() < 1 or tuple(token_ids.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"token_ids shape {tuple(token_ids.shape)} must equal logits shape without the vocab axis "
            f"{tuple(logits.shape[:-1])}"
        )
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    if token_ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
        raise ValueError(f"token_ids must be an integer tensor, got {token_ids.dtype}")
    if not (math.isfinite(temperature) and temperature > 0.0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if token_ids.numel() > 0:
        low, high = int(token_ids.min()), int(token_ids.max())
        vocab = logits.shape[-1]
        if low < 0 or high >= vocab:
            bad = low if low < 0 else high
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab})")


def _output_dtype(logits: Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _scaled_chunk(chunk: Tensor, temperature: float, dtype: torch.dtype) -> Tensor:
    """The chunk upcast to ``dtype`` and divided by T; may alias the chunk (read-only use)."""
    if temperature == 1.0:
        return chunk.to(dtype)
    if chunk.dtype == dtype:
        return chunk / temperature
    return chunk.to(dtype).div_(temperature)


class _ChunkWorkspace:
    """Two (chunk_size, V) buffers that every chunk reuses: the scaled/upcast chunk and its log-softmax.

    Fresh allocations this large are mmapped and page-faulted anew on every chunk, which on CPU costs as
    much as the arithmetic; reusing them makes the chunked pass faster than the naive one. The scaled
    buffer is skipped when the logits are already fp32 at T = 1.

    torch.log_softmax is used per chunk, not a hand-written logsumexp: its result for a row does not
    depend on how many rows share the call (checked bit for bit), so chunked and full-vocabulary results
    are identical, and so are those of an engine that runs the same kernel on the same logits. Autocast
    is switched off so that a bf16 autocast region around the model cannot downcast this maths.
    """

    def __init__(self, blocks: Tensor, chunk_size: int, temperature: float, dtype: torch.dtype) -> None:
        shape = (min(chunk_size, blocks.shape[1]), blocks.shape[2])
        self.temperature = temperature
        self.scaled = (
            torch.empty(shape, dtype=dtype, device=blocks.device)
            if temperature != 1.0 or blocks.dtype != dtype
            else None
        )
        self.out = torch.empty(shape, dtype=dtype, device=blocks.device)

    def log_softmax(self, chunk: Tensor) -> Tensor:
        """log_softmax(chunk / T) in the workspace; valid until the next call."""
        rows = chunk.shape[0]
        source = chunk
        if self.scaled is not None:
            source = self.scaled[:rows]
            if chunk.dtype == source.dtype:
                torch.div(chunk, self.temperature, out=source)
            else:
                source.copy_(chunk)
                if self.temperature != 1.0:
                    source.div_(self.temperature)
        out = self.out[:rows]
        with torch.autocast(device_type=chunk.device.type, enabled=False):
            torch.log_softmax(source, dim=-1, out=out)
        return out


def _row_blocks(logits: Tensor) -> Tensor:
    """(L, R, V) view of (..., T, V) logits, made without copying whenever the layout allows it.

    All positions form one block when they flatten as a view. A sliced model output such as
    ``logits[:, :-1]`` does not (its rows skip one position per sequence); then each leading index is a
    block of T rows, still a view, where ``reshape(-1, V)`` would have copied all the logits.
    """
    vocab = logits.shape[-1]
    try:
        return logits.view(1, -1, vocab)
    except RuntimeError:
        return logits.reshape(-1, logits.shape[-2], vocab)


def _chunks(blocks: Tensor, chunk_size: int) -> Iterator[tuple[int, slice]]:
    """(block, row slice) pairs covering every row, at most ``chunk_size`` rows each."""
    rows = blocks.shape[1]
    for block in range(blocks.shape[0]):
        for start in range(0, rows, chunk_size):
            yield block, slice(start, min(start + chunk_size, rows))


class _ChunkedSampledLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        blocks: Tensor,
        ids: Tensor,
        temperature: float,
        chunk_size: int,
    ) -> Tensor:
        dtype = _output_dtype(blocks)
        logprobs = torch.empty(ids.shape, dtype=dtype, device=blocks.device)
        workspace = _ChunkWorkspace(blocks, chunk_size, temperature, dtype)
        for block, rows in _chunks(blocks, chunk_size):
            chunk_logprobs = workspace.log_softmax(blocks[block, rows])
            logprobs[block, rows] = chunk_logprobs.gather(-1, ids[block, rows].unsqueeze(-1)).squeeze(-1)
        ctx.save_for_backward(blocks, ids)
        ctx.temperature = temperature  # type: ignore[attr-defined]
        ctx.chunk_size = chunk_size  # type: ignore[attr-defined]
        return logprobs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_output: Tensor
    ) -> tuple[Tensor | None, None, None, None]:
        blocks, ids = ctx.saved_tensors  # type: ignore[attr-defined]
        temperature: float = ctx.temperature  # type: ignore[attr-defined]
        chunk_size: int = ctx.chunk_size  # type: ignore[attr-defined]
        dtype = _output_dtype(blocks)
        grad_blocks = torch.empty(blocks.shape, dtype=blocks.dtype, device=blocks.device)
        workspace = _ChunkWorkspace(blocks, chunk_size, temperature, dtype)
        for block, rows in _chunks(blocks, chunk_size):
            weight = (grad_output[block, rows].to(dtype) / temperature).unsqueeze(-1)
            # d lp / d x = (onehot(y) - softmax(x / T)) / T, built in the recomputed log-softmax's buffer.
            chunk = workspace.log_softmax(blocks[block, rows])
            chunk.exp_().mul_(-weight).scatter_add_(-1, ids[block, rows].unsqueeze(-1), weight)
            grad_blocks[block, rows] = chunk
        return grad_blocks, None, None, None


def sampled_token_logprobs(
    logits: Tensor,
    token_ids: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> Tensor:
    """log_softmax(logits / temperature) gathered at ``token_ids``, chunked along positions.

    Args:
        logits: (..., T, V) in any float dtype (bf16 from the model is upcast per chunk, exactly). May
            be a non-contiguous slice such as ``logits[:, :-1]``; it is not copied.
        token_ids: (..., T) integer ids in [0, V).
        temperature: the sampling temperature the engine used (> 0).
        chunk_size: positions per chunk; trades speed for peak memory.

    Returns:
        (..., T) log-probs in fp32 (fp64 when logits are fp64), bit-identical to the full-vocabulary
        ``naive_sampled_token_logprobs``. Differentiable w.r.t. ``logits``; the gradient has the logits'
        dtype. Peak extra memory is O(chunk_size x V) in forward and backward, plus, in backward, the
        logits-shaped gradient itself.
    """
    _check(logits, token_ids, temperature, chunk_size)
    blocks = _row_blocks(logits)
    ids = token_ids.reshape(blocks.shape[:2]).long()
    logprobs = _ChunkedSampledLogprobs.apply(blocks, ids, temperature, chunk_size)
    assert isinstance(logprobs, Tensor)
    return logprobs.view(token_ids.shape)


def naive_sampled_token_logprobs(logits: Tensor, token_ids: Tensor, *, temperature: float = 1.0) -> Tensor:
    """The textbook full-vocabulary version, kept as the reference for tests and the benchmark."""
    _check(logits, token_ids, temperature, chunk_size=1)
    scaled = logits.to(_output_dtype(logits)) / temperature
    return torch.log_softmax(scaled, dim=-1).gather(-1, token_ids.long().unsqueeze(-1)).squeeze(-1)


@torch.no_grad()
def entropy_from_logits(
    logits: Tensor,
    mask: Tensor | None = None,
    *,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> Tensor:
    """Mean entropy (nats) of softmax(logits / temperature) over positions where ``mask`` is nonzero.

    ``logits`` (..., T, V), ``mask`` (..., T) or None for every position. Returns a detached 0-dim fp32
    tensor; 0.0 when no position is selected. Only selected rows are upcast, one chunk at a time.
    """
    if mask is not None and tuple(mask.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"mask shape {tuple(mask.shape)} must equal {tuple(logits.shape[:-1])}")
    if not (math.isfinite(temperature) and temperature > 0.0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    blocks = _row_blocks(logits)
    keep = torch.ones(blocks.shape[:2], dtype=torch.bool, device=logits.device)
    if mask is not None:
        keep = mask.reshape(blocks.shape[:2]) != 0
    total = torch.zeros((), dtype=torch.float64, device=logits.device)
    for block, rows in _chunks(blocks, chunk_size):
        selected = keep[block, rows]
        if not bool(selected.any()):
            continue
        scaled = _scaled_chunk(blocks[block, rows][selected], temperature, torch.float32)
        lse = torch.logsumexp(scaled, dim=-1, keepdim=True)
        # H = lse - sum_v p_v x_v with p = exp(x - lse), in one (rows, V) temporary besides the chunk.
        weighted = (scaled - lse).exp_().mul_(scaled).sum(dim=-1)
        total += (lse.squeeze(-1) - weighted).sum().double()
    count = int(keep.sum())
    return (total / max(count, 1)).float()
