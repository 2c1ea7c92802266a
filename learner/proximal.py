"""Which log-probs a step's ratios are centred on, chosen once from learner.mismatch.proximal.

- `EngineProximal` ("engine"): the engine's own log-probs; the learner/engine gap is measured on every
  training forward. Once the step has updated the weights they are a newer policy than any token's
  (lag >= 1), so lag 0 stays the engine's numerics alone.
- `LearnerProximal` ("learner"): the learner's own log-probs at the step's start (a no-grad pass over the
  step's mini-batches), with the mismatch correction they imply (learner.loss.mismatch: importance
  weights, rejected tokens out of the loss mask). With `from_first_forward` the first window skips that
  pass: its training forward runs at the very weights the proximal policy is defined by.

`version` is the policy version the step started from; a token's lag is that minus its own version.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch
from torch import Tensor

from learner.batching import PackedBatch
from learner.loss.mismatch import correct
from learner.routing_replay import PolicyPass, Routing
from learner.step_stats import StepStats
from pipeline.contracts.learner_config import MismatchConfig


class Proximal(Protocol):
    from_first_forward: bool

    def prepare(self, packs: list[PackedBatch], stats: StepStats, version: int) -> list[PackedBatch]:
        """At the step's start, before any update: the packs the step trains on."""
        ...

    def on_forward(self, batch: PackedBatch, logprobs: Tensor, stats: StepStats, version: int) -> PackedBatch:
        """After a training forward (`logprobs` its sampled-token log-probs): the batch its loss reads."""
        ...


def lag(batch: PackedBatch, version: int) -> Tensor:
    """Versions behind `version` of each generated token (negative elsewhere)."""
    return torch.where(batch.versions >= 0, version - batch.versions, -1)


class EngineProximal:
    from_first_forward = False

    def __init__(self, forward: PolicyPass, routing: Routing) -> None:
        self.forward, self.routing = forward, routing

    def prepare(self, packs: list[PackedBatch], stats: StepStats, version: int) -> list[PackedBatch]:
        for pack in packs:  # an MoE policy with routing records: the router's share of the gap
            self.routing.router_mismatch(pack, self.forward, stats)
        return packs

    def on_forward(self, batch: PackedBatch, logprobs: Tensor, stats: StepStats, version: int) -> PackedBatch:
        moved = 1 if stats.applied > 0 else 0
        stats.add_mismatch(logprobs, batch.old_logprobs, batch.loss_mask, lag(batch, version) + moved)
        return batch


class LearnerProximal:
    def __init__(
        self,
        cfg: MismatchConfig,
        forward: PolicyPass,
        routing: Routing,
        device: torch.device,
        *,
        from_first_forward: bool,
        first_window: int,
        replayed: bool,
    ) -> None:
        self.cfg, self.forward, self.routing, self.device = cfg, forward, routing, device
        self.from_first_forward = from_first_forward
        self.first_window = first_window  # mini-batches of the step's first optimizer update
        self.replayed = replayed  # the loss's forwards replay the engine's routing

    def prepare(self, packs: list[PackedBatch], stats: StepStats, version: int) -> list[PackedBatch]:
        first = self.first_window if self.from_first_forward else 0
        return packs[:first] + [self._with_proximal(pack, stats, version) for pack in packs[first:]]

    def on_forward(self, batch: PackedBatch, logprobs: Tensor, stats: StepStats, version: int) -> PackedBatch:
        if batch.proximal_logprobs is not None:
            return batch
        return self._corrected(batch, logprobs.detach().float(), stats, version)

    @torch.no_grad()
    def _with_proximal(self, pack: PackedBatch, stats: StepStats, version: int) -> PackedBatch:
        batch = pack.to(self.device)
        measured = self.routing.router_mismatch(batch, self.forward, stats)
        if measured is not None:  # both routings were run: the one the loss's forwards use is the proximal
            proximal = measured[1] if self.replayed else measured[0]
        else:
            proximal = self.forward(batch, None).logprobs.float()
        return self._corrected(batch, proximal, stats, version)

    def _corrected(self, batch: PackedBatch, proximal: Tensor, stats: StepStats, version: int) -> PackedBatch:
        """`batch` with `proximal` as its proximal log-probs and the mismatch correction they imply."""
        m = self.cfg
        c = correct(
            proximal,
            batch.old_logprobs,
            batch.loss_mask,
            weights=m.is_weights,
            cap=m.is_cap,
            reject=m.reject,
            band=m.reject_band,
        )
        stats.add_mismatch(proximal, batch.old_logprobs, batch.loss_mask, lag(batch, version))
        stats.add_correction(c)
        return dataclasses.replace(
            batch, loss_mask=c.keep.float(), proximal_logprobs=proximal, token_weights=c.weights
        )
