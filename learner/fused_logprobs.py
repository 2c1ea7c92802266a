"""Sampled-token log-probs straight from the final hidden states: the output layer and the log-softmax
fused per chunk of positions, so neither forward nor backward ever holds a (T, V) tensor.

    lp_t = log_softmax((h_t W^T) / T)[y_t]        h: (N, H) hidden states, W: (V, H) output layer

Forward keeps, per position, only the log-sum-exp and the sampled logit. Backward recomputes each
chunk's logits and writes d lp / d z = (onehot(y) - softmax(z / T)) / T into two products: the chunk's
hidden-state gradient (dz W) and its share of the output layer's gradient (dz^T h), accumulated in fp32.
Extra memory: about two (chunk, V) fp32 buffers plus the (V, H) weight gradient that any training holds.
This is what Liger's fused linear cross-entropy does on a GPU, written with plain torch ops.

`compute_dtype` is the matmul's dtype (bf16 under bf16-mixed, as the model's own lm_head would run under
autocast); the log-softmax is always fp32.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

DEFAULT_FUSED_CHUNK = 512


def _check(hidden: Tensor, weight: Tensor, token_ids: Tensor, temperature: float, chunk_size: int) -> None:
    if hidden.dim() < 2 or weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden (..., H) and weight (V, H) must agree on H, got {tuple(hidden.shape)} and "
            f"{tuple(weight.shape)}"
        )
    if tuple(token_ids.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"token_ids {tuple(token_ids.shape)} must have shape {tuple(hidden.shape[:-1])}")
    if not (math.isfinite(temperature) and temperature > 0.0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")


class _FusedLinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        hidden: Tensor,
        weight: Tensor,
        ids: Tensor,
        temperature: float,
        chunk_size: int,
        compute_dtype: torch.dtype,
    ) -> Tensor:
        n = hidden.shape[0]
        out_dtype = torch.float64 if compute_dtype == torch.float64 else torch.float32
        logprobs = torch.empty(n, dtype=out_dtype, device=hidden.device)
        lse = torch.empty(n, dtype=out_dtype, device=hidden.device)
        w = weight.to(compute_dtype)
        for start in range(0, n, chunk_size):
            rows = slice(start, min(start + chunk_size, n))
            scaled = (hidden[rows].to(compute_dtype) @ w.t()).to(out_dtype).div_(temperature)
            lse[rows] = torch.logsumexp(scaled, dim=-1)
            logprobs[rows] = scaled.gather(-1, ids[rows].unsqueeze(-1)).squeeze(-1) - lse[rows]
        ctx.save_for_backward(hidden, weight, ids, lse)
        ctx.temperature = temperature  # type: ignore[attr-defined]
        ctx.chunk_size = chunk_size  # type: ignore[attr-defined]
        ctx.compute_dtype = compute_dtype  # type: ignore[attr-defined]
        return logprobs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_output: Tensor
    ) -> tuple[Tensor | None, Tensor | None, None, None, None, None]:
        hidden, weight, ids, lse = ctx.saved_tensors  # type: ignore[attr-defined]
        temperature: float = ctx.temperature  # type: ignore[attr-defined]
        chunk_size: int = ctx.chunk_size  # type: ignore[attr-defined]
        compute_dtype: torch.dtype = ctx.compute_dtype  # type: ignore[attr-defined]
        n = hidden.shape[0]
        w = weight.to(compute_dtype)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None  # type: ignore[attr-defined]
        need_weight = ctx.needs_input_grad[1]  # type: ignore[attr-defined]
        acc_dtype = torch.float64 if compute_dtype == torch.float64 else torch.float32
        grad_weight = (
            torch.zeros(weight.shape, dtype=acc_dtype, device=weight.device) if need_weight else None
        )
        for start in range(0, n, chunk_size):
            rows = slice(start, min(start + chunk_size, n))
            h = hidden[rows].to(compute_dtype)
            scaled = (h @ w.t()).to(lse.dtype).div_(temperature)
            g = (grad_output[rows].to(lse.dtype) / temperature).unsqueeze(-1)
            # dz = (onehot(y) - softmax(z / T)) * g / T, built in place of the recomputed logits.
            dz = (
                scaled.sub_(lse[rows].unsqueeze(-1))
                .exp_()
                .mul_(-g)
                .scatter_add_(-1, ids[rows].unsqueeze(-1), g)
            )
            dz_c = dz.to(compute_dtype)
            if grad_hidden is not None:
                grad_hidden[rows] = (dz_c @ w).to(hidden.dtype)
            if grad_weight is not None:  # in place: a (V, H) temporary per chunk would double the peak
                if dz_c.dtype == acc_dtype:
                    grad_weight.addmm_(dz_c.t(), h)
                else:
                    grad_weight.add_(dz_c.t() @ h)
        return (
            grad_hidden,
            grad_weight.to(weight.dtype) if grad_weight is not None else None,
            None,
            None,
            None,
            None,
        )


def linear_sampled_token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    token_ids: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_FUSED_CHUNK,
    compute_dtype: torch.dtype | None = None,
) -> Tensor:
    """log_softmax((hidden @ weight.T) / temperature) gathered at ``token_ids``, without the logits.

    Args:
        hidden: (..., T, H) final hidden states (after the model's last norm).
        weight: (V, H) the output layer's weight (tied or not; no bias, as in Qwen/Llama heads).
        token_ids: (..., T) ids in [0, V).
        compute_dtype: the matmul's dtype; None = hidden's (fp64 inputs give fp64 throughout).

    Returns:
        (..., T) log-probs in fp32 (fp64 for fp64 compute); differentiable w.r.t. hidden and weight.
    """
    _check(hidden, weight, token_ids, temperature, chunk_size)
    flat = hidden.reshape(-1, hidden.shape[-1])
    ids = token_ids.reshape(-1).long()
    dtype = compute_dtype if compute_dtype is not None else hidden.dtype
    logprobs = _FusedLinearLogprobs.apply(flat, weight, ids, temperature, chunk_size, dtype)
    assert isinstance(logprobs, Tensor)
    return logprobs.view(token_ids.shape)
