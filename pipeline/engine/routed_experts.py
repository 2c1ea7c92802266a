"""Routed experts of an MoE model, as SGLang returns them (`return_routed_experts`).

SGLang (state_capturer/routed_experts.py, `RoutedExpertsCapturer`) records, for every token position a
forward computes, each layer's top-k expert ids, and a finished request's reply carries those of its
positions [routed_experts_start_len, prompt_tokens + completion_tokens - 1) in `meta_info.routed_experts`:
the base64 of the raw bytes of an int32 array shaped (positions, num_hidden_layers, num_experts_per_tok)
(managers/tokenizer_manager.py: `pybase64.b64encode(val.numpy().tobytes())`). The last sampled token is
never forwarded, so it has no row. The server records only when launched with
`--enable-return-routed-experts`; a request that asks a server without the flag gets no key
(scheduler_components/batch_result_processor.py `_maybe_collect_routed_experts`: no capturer, no
record).

`capture(model)` hooks every router of the model for one forward (a router: a module with `top_k`,
`num_experts` and a (num_experts, hidden) `weight`, returning (logits, scores, indices); transformers'
Qwen3-MoE `Qwen3MoeTopKRouter`) and yields the (batch x positions, layers, topk) ids it chose.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn


def routers_of(model: nn.Module) -> list[nn.Module]:
    """The model's top-k routers in layer order."""
    found = []
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (
            isinstance(getattr(module, "top_k", None), int)
            and isinstance(getattr(module, "num_experts", None), int)
            and isinstance(weight, Tensor)
            and weight.dim() == 2
            and weight.shape[0] == module.num_experts
        ):
            found.append(module)
    return found


def check_routable(model: nn.Module) -> None:
    """RuntimeError unless every decoder layer of `model` routes (what --enable-return-routed-experts
    records: one entry per layer)."""
    layers = getattr(model.config, "num_hidden_layers", None)
    topk = getattr(model.config, "num_experts_per_tok", None)
    routers = routers_of(model)
    if not routers or not isinstance(topk, int):
        raise RuntimeError(
            f"--enable-return-routed-experts needs a Mixture-of-Experts model; {type(model).__name__} is "
            "dense (no top-k routers, no num_experts_per_tok in its config)"
        )
    if len(routers) != layers:
        raise RuntimeError(
            f"--enable-return-routed-experts: {type(model).__name__} routes {len(routers)} of its {layers} "
            "layers; every layer must be an MoE layer"
        )


class Captured:
    """The top-k of the forward run inside `capture`; `ids` is (rows, positions, layers, topk) int32."""

    def __init__(self, layers: int) -> None:
        self._per_layer: list[Tensor | None] = [None] * layers
        self.ids: Tensor | None = None

    def finish(self, rows: int) -> None:
        if any(t is None for t in self._per_layer):
            raise RuntimeError("a router did not run in the captured forward")
        stacked = torch.stack([t for t in self._per_layer if t is not None], dim=1)  # (N, layers, topk)
        self.ids = stacked.to(torch.int32).cpu().view(rows, -1, *stacked.shape[1:])


@contextmanager
def capture(model: Any, rows: int) -> Iterator[Captured]:
    """Hook the routers for the forwards inside (a batch of `rows` rows); read `.ids` afterwards."""
    routers = routers_of(model)
    captured = Captured(len(routers))

    def hook_for(layer: int) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            captured._per_layer[layer] = output[2].detach()

        return hook

    handles = [router.register_forward_hook(hook_for(i)) for i, router in enumerate(routers)]
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()
    captured.finish(rows)


def encode(rows: Tensor) -> str:
    """SGLang's wire form: base64 of the int32 bytes (little endian on every platform SGLang runs)."""
    return base64.b64encode(rows.to(torch.int32).contiguous().numpy().tobytes()).decode("ascii")
