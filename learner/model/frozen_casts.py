"""Frozen linear weights cast to the autocast dtype once, not in every forward.

Under autocast every `F.linear` casts its fp32 weight to the compute dtype on each call. Autocast keeps
such casts only for leaves that require grad, so the frozen base of a LoRA policy (every projection of
every layer) is cast again in each forward: a pass over all of the base weights, several times per step.
`cache_frozen_casts` makes each frozen `nn.Linear` keep its compute-dtype copy and use it while autocast
to that dtype is on. The result is bit for bit the one autocast computes (the same rounding of the same
weight, the same kernel); outside autocast the layer runs as before on its own weights (the served-policy
probe runs in fp32). A copy is remade when its weight changes (a load into the parameter bumps its
version), so it can never serve a stale weight. It costs the copies' memory: half the frozen weights'
bytes for bf16 copies of fp32 weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


class _CastCache:
    """One frozen layer's weight (and bias) in `dtype`, remade when the parameter changes."""

    def __init__(self, layer: torch.nn.Linear, dtype: torch.dtype) -> None:
        self.layer = layer
        self.dtype = dtype
        self.key: tuple[int, int] | None = None
        self.weight: Tensor | None = None
        self.bias: Tensor | None = None

    def get(self) -> tuple[Tensor, Tensor | None]:
        w = self.layer.weight
        key = (w.data_ptr(), w._version)
        if self.key != key or self.weight is None:
            with torch.no_grad():
                self.weight = w.detach().to(self.dtype)
                bias = self.layer.bias
                self.bias = bias.detach().to(self.dtype) if bias is not None else None
            self.key = key
        return self.weight, self.bias


def _autocasting_to(device_type: str, dtype: torch.dtype) -> bool:
    return torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type) == dtype


def cache_frozen_casts(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Give every `nn.Linear` of `model` whose weight does not require grad a cached `dtype` copy used
    under autocast to `dtype`; returns how many layers got one. Trainable layers are left alone (autocast
    already caches their casts within a forward, and their weights change at every update)."""
    count = 0
    for module in model.modules():
        if type(module) is not torch.nn.Linear or module.weight.requires_grad:
            continue
        if module.weight.dtype == dtype:
            continue  # already in the compute dtype: autocast casts nothing
        _install(module, _CastCache(module, dtype))
        count += 1
    return count


_CACHE_ATTR = "_rollwise_cast_cache"


def weight_in(layer: torch.nn.Linear, dtype: torch.dtype) -> Tensor:
    """`layer.weight` as a kernel in `dtype` should read it: the cached copy when `layer` is frozen and has
    one in `dtype` (the same rounding `weight.to(dtype)` makes, without a pass over the weight), else the
    parameter itself (a trainable weight keeps its gradient path; the caller casts it)."""
    cache = getattr(layer, _CACHE_ATTR, None)
    if cache is None or cache.dtype != dtype or layer.weight.requires_grad:
        return layer.weight
    return cache.get()[0]


def _install(layer: torch.nn.Linear, cache: _CastCache) -> None:
    setattr(layer, _CACHE_ATTR, cache)
    plain = layer.forward
    device_type = layer.weight.device.type

    def forward(x: Tensor) -> Tensor:
        if not _autocasting_to(device_type, cache.dtype):
            return plain(x)
        weight, bias = cache.get()
        return F.linear(x.to(cache.dtype), weight, bias)

    layer.forward = forward  # type: ignore[method-assign, assignment]
