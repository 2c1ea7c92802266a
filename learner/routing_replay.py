"""The MoE routing of a training step, chosen once: `MoeRouting` on a policy with routers, `DenseRouting`
(every call does nothing) on a dense one, so the step never asks which it has.

On an MoE policy (learner.model.moe_routing.RouterHooks on its routers) the step's forwards replay the
engine's routing where learner.moe asks for it; the training forwards keep the routers' logits for the
load-balancing term and capture their own top-k for the expert load; the step's first applied update
measures how the routing of its first mini-batch moved; the proximal pass measures the router's share of
the learner/engine mismatch. `release()` ends the replay so that other forwards of the policy (the served
probe) route on their own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import torch
from torch import Tensor

from learner.batching import PackedBatch, TrainSequence
from learner.model.moe_routing import (
    MoeShape,
    RouterHooks,
    expert_load,
    replay_tensor,
    require_moe,
    routing_change,
)
from learner.policy_forward import PolicyForward
from learner.step_stats import StepStats
from pipeline.contracts.learner_config import MoeConfig

# The policy's forward on a batch; the flag overrides whether the batch's routing is replayed.
PolicyPass = Callable[[PackedBatch, bool | None], PolicyForward]


class Routing(Protocol):
    """What the step asks of its routing (module docstring)."""

    shares_prefix: bool  # the shared-prefix forward may run (it splits a forward the hooks must see whole)

    @property
    def hooks(self) -> RouterHooks | None: ...

    def attach(
        self, packs: list[PackedBatch], chunks: Sequence[list[int]], sequences: Sequence[TrainSequence]
    ) -> list[PackedBatch]: ...
    def set_replay(self, batch: PackedBatch, replay: bool | None) -> None: ...
    def training_forward(self) -> Any: ...
    def begin_window(self, stats: StepStats) -> None: ...
    def after_forward(self, batch: PackedBatch, index: int, counted: bool, stats: StepStats) -> None: ...
    def after_update(
        self, batch: PackedBatch, counted: bool, forward: PolicyPass, stats: StepStats
    ) -> None: ...
    def router_mismatch(
        self, batch: PackedBatch, forward: PolicyPass, stats: StepStats
    ) -> tuple[Tensor, Tensor] | None: ...
    def router_logits(self) -> list[tuple[Tensor, Tensor]]: ...
    def release(self) -> None: ...


class DenseRouting:
    """A dense policy: no routers, nothing to replay, capture or measure."""

    shares_prefix = True

    @property
    def hooks(self) -> RouterHooks | None:
        return None

    def attach(
        self, packs: list[PackedBatch], chunks: Sequence[list[int]], sequences: Sequence[TrainSequence]
    ) -> list[PackedBatch]:
        return packs

    def set_replay(self, batch: PackedBatch, replay: bool | None) -> None:
        pass

    @contextmanager
    def training_forward(self) -> Iterator[None]:
        yield

    def begin_window(self, stats: StepStats) -> None:
        pass

    def after_forward(self, batch: PackedBatch, index: int, counted: bool, stats: StepStats) -> None:
        pass

    def after_update(self, batch: PackedBatch, counted: bool, forward: PolicyPass, stats: StepStats) -> None:
        pass

    def router_mismatch(
        self, batch: PackedBatch, forward: PolicyPass, stats: StepStats
    ) -> tuple[Tensor, Tensor] | None:
        return None

    def router_logits(self) -> list[tuple[Tensor, Tensor]]:
        return []

    def release(self) -> None:
        pass


class MoeRouting:
    """Replay, capture and measurement on every router of an MoE policy (module docstring)."""

    shares_prefix = False

    def __init__(self, model: Any, shape: MoeShape, cfg: MoeConfig, device: torch.device) -> None:
        self._hooks = RouterHooks(model)
        self.shape, self.cfg, self.device = shape, cfg, device
        self.captured: Tensor | None = None  # the routers' own top-k of the last training forward
        self._measure = False
        self._before: Tensor | None = None

    @property
    def hooks(self) -> RouterHooks | None:
        return self._hooks

    def attach(
        self, packs: list[PackedBatch], chunks: Sequence[list[int]], sequences: Sequence[TrainSequence]
    ) -> list[PackedBatch]:
        """The packs with the engine's routing of their rows (learner.model.moe_routing.replay_tensor)."""
        if not any(s.routed_experts is not None for s in sequences):
            return packs
        return [
            dataclasses.replace(
                pack,
                routed=replay_tensor(
                    [sequences[i].routed_experts for i in chunk], pack.input_ids.shape[1], self.shape
                )[0],
            )
            if chunk
            else pack
            for pack, chunk in zip(packs, chunks, strict=True)
        ]

    def set_replay(self, batch: PackedBatch, replay: bool | None) -> None:
        """Before a policy forward: replay the batch's routing when `replay` (default: learner.moe.
        routing_replay). It stays until the next policy forward, so a layer recomputed in backward sees it."""
        wanted = self.cfg.routing_replay if replay is None else replay
        self._hooks.set_replay(batch.routed if wanted else None)

    @contextmanager
    def training_forward(self) -> Iterator[None]:
        """Around the loss's forward: keep the router logits (load balance), capture the top-k (metrics)."""
        hooks = self._hooks
        self.captured = None
        hooks.keep_logits = self.cfg.load_balance_coef > 0.0
        try:
            if self.cfg.routing_metrics:
                with hooks.capture():
                    yield
                self.captured = hooks.captured()
            else:
                yield
        finally:
            hooks.keep_logits = False

    def begin_window(self, stats: StepStats) -> None:
        """The step's first applied update measures how the routing of its first mini-batch moved."""
        self._measure = self.cfg.routing_metrics and not stats.routing_measured
        self._before = None

    def after_forward(self, batch: PackedBatch, index: int, counted: bool, stats: StepStats) -> None:
        """The expert load of a training forward, and how much of it ran on the engine's routing."""
        if self._measure and index == 0:
            self._before = self.captured
        if not counted or self.captured is None:
            return
        real = batch.attention_mask.reshape(-1) > 0
        stats.moe.add_counts(expert_load(self.captured, real, self.shape.num_experts))
        stats.moe.positions += int(real.sum())
        if self.cfg.routing_replay and batch.routed is not None:
            recorded = (batch.routed[..., 0, 0] >= 0).reshape(-1)
            stats.moe.replayed_positions += int((recorded & real).sum())

    @torch.no_grad()
    def after_update(self, batch: PackedBatch, counted: bool, forward: PolicyPass, stats: StepStats) -> None:
        """The routers' own top-k of the window's first batch again after the update, against its training
        forward's: the share of (position, layer) top-k sets that moved. Every rank runs the forward
        (FSDP); a rank's placeholder batch is not counted."""
        if not self._measure or self._before is None:
            return
        batch = batch.to(self.device)  # the packs stay on the CPU when the engine's log-probs are proximal
        with self._hooks.capture():
            forward(batch, False)
        after = self._hooks.captured()
        stats.routing_measured = True
        if counted:
            stats.moe.add_change(*routing_change(self._before, after, batch.attention_mask.reshape(-1) > 0))

    @torch.no_grad()
    def router_mismatch(
        self, batch: PackedBatch, forward: PolicyPass, stats: StepStats
    ) -> tuple[Tensor, Tensor] | None:
        """The learner's log-probs of `batch` with its own routing and with the engine's replayed, and
        their distance to the engine's log-probs (the router's share of the mismatch); None unless
        learner.moe asks for routing records. Measured on the weights as they are (the step's start), on
        the device.
        Rows without a record route on their own in both forwards."""
        # The same decision on every rank (FSDP: every rank runs every forward), a placeholder batch too.
        if not self.cfg.records_routing:
            return None
        batch = batch.to(self.device)
        own = forward(batch, False).logprobs.float()
        replayed = forward(batch, True).logprobs.float()
        if batch.routed is None:
            return own, replayed
        recorded = (batch.routed[..., 0, 0] >= 0).any(dim=1, keepdim=True)  # rows with a record
        keep = (batch.loss_mask > 0) & recorded
        engine = batch.old_logprobs.float()
        stats.moe.own_abs += float((own - engine).abs()[keep].sum())
        stats.moe.replayed_abs += float((replayed - engine).abs()[keep].sum())
        stats.moe.compared += int(keep.sum())
        return own, replayed

    def router_logits(self) -> list[tuple[Tensor, Tensor]]:
        """What the routers kept of the last training forward (per layer: logits, experts), handed over
        once."""
        hooks = self._hooks
        kept = [k for k in hooks.kept if k is not None]
        hooks.kept = [None] * hooks.layers
        return kept

    def release(self) -> None:
        self._hooks.set_replay(None)


def routing_for(model: Any, shape: MoeShape | None, cfg: MoeConfig, device: torch.device) -> Routing:
    """The routing of `model` (`shape`: its learner.model.moe_routing.moe_shape). A dense model refuses the
    options that need routers, naming the key."""
    if cfg.routing_replay:
        require_moe(model, "learner.moe.routing_replay")
    if cfg.record_routing:
        require_moe(model, "learner.moe.record_routing")
    if cfg.load_balance_coef > 0.0:
        require_moe(model, "learner.moe.load_balance_coef")
    return MoeRouting(model, shape, cfg, device) if shape is not None else DenseRouting()
