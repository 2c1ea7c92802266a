"""Mixture-of-Experts routing in the learner: which experts each token went to, recorded or forced.

A *router* is the part of an MoE layer that scores the layer's experts for each token and keeps the top k
(transformers' `Qwen3MoeTopKRouter`: `weight` (E, H); forward(hidden (N, H)) -> (logits (N, E), scores
(N, k), indices (N, k)), N = batch x positions in row-major order). `RouterHooks` puts one forward hook on
every router of a model:

- capture: the router's own top-k of each forward (before any replay), per layer, so the trainer can
  measure the expert load and how the choice moved after an update (`routing_change`);
- replay: a (B, T, layers, k) tensor of expert ids forces the choice (entries < 0 keep the router's own,
  e.g. positions the engine never recorded). The replayed experts' gate weights are read from the
  router's softmax at those experts (renormalised like the router's own top k), so the router still gets
  a gradient through them. Routing replay in the GSPO paper's sense ("Routing Replay": the old policy's
  experts reused when computing the new policy's token ratios), with the engine as the old policy.

The hooks stay registered for the model's lifetime: a layer recomputed in backward (gradient
checkpointing) sees the same replay again. Capture is switched on only around no-grad or explicit passes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from pipeline.contracts.schema import RoutedExperts

# Config names of the expert count in HF MoE configs (Qwen3-MoE / Qwen2-MoE, Mixtral, DeepSeek).
_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


@dataclass(frozen=True)
class MoeShape:
    """What a routing record of this model looks like: (positions, layers, topk) ids in [0, num_experts)."""

    layers: int
    topk: int
    num_experts: int


def moe_shape(config: Any) -> MoeShape | None:
    """The routing shape of an HF model config (an object or the config.json dict); None for a dense model."""
    get = config.get if isinstance(config, dict) else lambda key: getattr(config, key, None)
    experts = next((get(key) for key in _EXPERT_COUNT_KEYS if isinstance(get(key), int) and get(key)), None)
    topk, layers = get("num_experts_per_tok"), get("num_hidden_layers")
    if not experts or not isinstance(topk, int) or topk < 1 or not isinstance(layers, int):
        return None
    return MoeShape(layers=layers, topk=topk, num_experts=experts)


def _is_router(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        isinstance(getattr(module, "top_k", None), int)
        and isinstance(getattr(module, "num_experts", None), int)
        and isinstance(weight, Tensor)
        and weight.dim() == 2
        and weight.shape[0] == module.num_experts
    )


def find_routers(model: nn.Module) -> list[nn.Module]:
    """Every top-k router of `model`, in layer order (the order of model.modules())."""
    return [module for module in model.modules() if _is_router(module)]


def require_moe(model: nn.Module, key: str) -> MoeShape:
    """The model's routing shape; ValueError naming the config `key` that needs it when the model is
    dense or not every decoder layer is routed (a record has one entry per layer, as SGLang's)."""
    config = getattr(model, "config", None)
    shape = moe_shape(config)
    kind = type(model).__name__
    if shape is None:
        raise ValueError(
            f"{key} needs a Mixture-of-Experts model; {kind} is dense (its config has no num_experts / "
            "num_experts_per_tok). Use an MoE model (model.preset = 'moe-tiny', or a Qwen3-MoE checkpoint) "
            f"or unset {key}"
        )
    routers = find_routers(model)
    if len(routers) != shape.layers:
        raise ValueError(
            f"{key}: {kind} routes {len(routers)} of its {shape.layers} decoder layers; routing records "
            "need every layer to be an MoE layer (config.mlp_only_layers empty, decoder_sparse_step 1)"
        )
    return shape


def record_tensor(record: RoutedExperts) -> Tensor:
    """A row's routing record as a (positions, layers, topk) int16 tensor."""
    dtype = torch.uint8 if record.width == 1 else torch.int16
    flat = torch.frombuffer(bytearray(record.ids), dtype=dtype) if record.ids else torch.zeros(0, dtype=dtype)
    return flat.to(torch.int16).view(record.positions, record.layers, record.topk)


def replay_tensor(
    records: Sequence[RoutedExperts | None], width: int, shape: MoeShape
) -> tuple[Tensor, Tensor]:
    """(B, width, layers, topk) int16 expert ids for a packed batch whose row r reads token_ids[:-1] of
    sequence r (learner.batching): position j gets record[j], -1 where the row has no record. Also the
    (B, width) bool mask of the positions that have one."""
    out = torch.full((len(records), width, shape.layers, shape.topk), -1, dtype=torch.int16)
    for row, record in enumerate(records):
        if record is None or record.positions == 0:
            continue
        ids = record_tensor(record)
        n = min(ids.shape[0], width)
        out[row, :n] = ids[:n]
    return out, out[..., 0, 0] >= 0


class RouterHooks:
    """Capture and replay on every router of `model` (module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        self.routers = find_routers(model)
        self.replay: Tensor | None = None
        self._capturing = False
        self._captured: list[Tensor | None] = [None] * len(self.routers)
        # With `keep_logits`: each layer's router logits (with their graph) and the experts the forward
        # used (the replayed ones under replay), for the load-balancing loss.
        self.keep_logits = False
        self.kept: list[tuple[Tensor, Tensor] | None] = [None] * len(self.routers)
        self._handles = [
            router.register_forward_hook(self._hook(layer)) for layer, router in enumerate(self.routers)
        ]

    @property
    def layers(self) -> int:
        return len(self.routers)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def set_replay(self, replay: Tensor | None) -> None:
        """Force the next forwards' top-k to `replay` ((B, T, layers, k), < 0 = own), or stop (None)."""
        if replay is not None and replay.shape[2] != self.layers:
            raise ValueError(f"replay has {replay.shape[2]} layers, the model routes {self.layers}")
        self.replay = replay

    @contextmanager
    def capture(self) -> Iterator[None]:
        """Record the routers' own top-k of the forwards inside; read them with `captured()`."""
        self._captured = [None] * self.layers
        self._capturing = True
        try:
            yield
        finally:
            self._capturing = False

    def captured(self) -> Tensor:
        """(N, layers, k) own top-k of the last forward captured (N = batch x positions)."""
        if any(t is None for t in self._captured):
            raise RuntimeError("no forward was captured on every router")
        return torch.stack([t for t in self._captured if t is not None], dim=1)

    def _hook(self, layer: int) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            logits, scores, indices = output
            if self._capturing:
                self._captured[layer] = indices.detach()
            if self.replay is None:
                if self.keep_logits:
                    self.kept[layer] = (logits, indices.detach())
                return None
            forced = self.replay[:, :, layer, :].reshape(-1, indices.shape[-1]).to(indices.device)
            if forced.shape != indices.shape:
                raise ValueError(
                    f"routing replay of {forced.shape[0]} positions for a forward of {indices.shape[0]}"
                )
            chosen = torch.where(forced >= 0, forced.to(indices.dtype), indices)
            probs = torch.softmax(logits.float(), dim=-1)
            values = probs.gather(-1, chosen)
            if getattr(module, "norm_topk_prob", False):
                values = values / values.sum(dim=-1, keepdim=True)
            if self.keep_logits:
                self.kept[layer] = (logits, chosen.detach())
            return logits, values.to(scores.dtype), chosen

        return hook


def routing_change(before: Tensor, after: Tensor, keep: Tensor) -> tuple[Tensor, int]:
    """Per layer, how many of the kept positions (`keep` (N,) true) changed their set of top-k experts
    between `before` and `after` ((N, layers, k) each; order within the top k does not count): a (layers,)
    long tensor, and the number of kept positions."""
    a = before[keep].sort(dim=-1).values
    b = after[keep].sort(dim=-1).values
    changed = (a != b).any(dim=-1)  # (n, layers)
    return changed.sum(dim=0).cpu(), int(changed.shape[0])


def expert_load(indices: Tensor, keep: Tensor, num_experts: int) -> Tensor:
    """(layers, num_experts) count of the token-expert assignments of the kept positions."""
    chosen = indices[keep]  # (n, layers, k)
    layers = chosen.shape[1]
    counts = torch.zeros(layers, num_experts, dtype=torch.long)
    for layer in range(layers):
        counts[layer] = torch.bincount(chosen[:, layer].reshape(-1).long().cpu(), minlength=num_experts)
    return counts


def load_imbalance(counts: Tensor) -> Tensor:
    """Per layer, the most loaded expert's assignments over the mean per expert: 1.0 when every expert
    gets the same share, num_experts when one takes everything; 1.0 for a layer without assignments.
    (layers,) float64."""
    totals = counts.sum(dim=-1).double()
    peak = counts.max(dim=-1).values.double() * counts.shape[-1]
    return torch.where(totals > 0, peak / totals.clamp(min=1.0), torch.ones_like(totals))


@dataclass
class MoeStats:
    """One step's routing measurements, summed over its mini-batches (and ranks: `merged`)."""

    changed: Tensor | None = None  # per layer: positions whose top-k set moved after the first update
    measured: int = 0  # positions measured (per layer)
    counts: Tensor | None = None  # (layers, experts) assignments in the training forwards
    own_abs: float = 0.0  # sum of |learner log-prob with its own routing - engine log-prob|
    replayed_abs: float = 0.0  # the same with the engine's routing replayed
    compared: int = 0  # generated tokens in those sums
    replayed_positions: int = 0  # input positions whose routing was replayed in training forwards
    positions: int = 0  # input positions of the training forwards

    def add_counts(self, counts: Tensor) -> None:
        self.counts = counts if self.counts is None else self.counts + counts

    def add_change(self, changed: Tensor, positions: int) -> None:
        self.changed = changed if self.changed is None else self.changed + changed
        self.measured += positions

    @staticmethod
    def merged(parts: Sequence[MoeStats]) -> MoeStats:
        out = MoeStats()
        for part in parts:
            for name in (
                "own_abs", "replayed_abs", "compared", "replayed_positions", "positions",
            ):  # fmt: skip
                setattr(out, name, getattr(out, name) + getattr(part, name))
            if part.counts is not None:
                out.add_counts(part.counts)
            if part.changed is not None:
                out.add_change(part.changed, part.measured)
        return out

    def metrics(self) -> dict[str, float]:
        """The step metrics (docs/train.md, "Mixture-of-Experts"); only what was measured."""
        out: dict[str, float] = {}
        if self.changed is not None and self.measured:
            per_layer = self.changed.double() / self.measured
            out["moe_routing_change"] = float(per_layer.mean())  # = the share of (position, layer) pairs
            out["moe_routing_change_max_layer"] = float(per_layer.max())
        if self.counts is not None:
            imbalance = load_imbalance(self.counts)
            out["moe_load_imbalance"] = float(imbalance.mean())
            out["moe_load_imbalance_max_layer"] = float(imbalance.max())
        if self.compared:
            own, replayed = self.own_abs / self.compared, self.replayed_abs / self.compared
            out["router_mismatch_own"] = own
            out["router_mismatch_replayed"] = replayed
            # The part of the gap that the engine's routing removes: 0 = routing explains none of it.
            out["router_mismatch_share"] = max(0.0, min(1.0, 1.0 - replayed / own)) if own > 0 else 0.0
        if self.positions:
            out["routing_replayed_fraction"] = self.replayed_positions / self.positions
        return out
