"""One training step: triaged groups in (learner.groups), optimizer updates on the policy, metrics out.

    per-token advantages (learner.step_input) → shuffle (seeded) → mini-batches → per window of
    `grad_accum` mini-batches: forward, loss, backward each → clip → one AdamW update

Rules:
- The behaviour policy is the engine: the rows' log-probs are the "old" ones, taken at the sampling
  temperature; the ratios are centred on them or on the learner's own at the step's start
  (learner.proximal).
- The loss of a mini-batch is the sum of the terms the config turns on (learner.loss.terms), normalised
  by its window's counts so the mini-batches' losses sum to the window's.
- A window whose loss or gradient norm is not finite, or that has no token left to train, is skipped and
  the weights are kept.
- Variants are chosen once at construction: the loss terms, the proximal policy, the MoE routing
  (learner.routing_replay) and the spread over ranks (learner.data_parallel). The step never branches on
  them.
- The policy version increments once per step that applied an update; updates are counted apart. Both,
  with the step count, are what a checkpoint restores (`counters`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

import torch

from learner.adamw import adamw
from learner.batching import PackedBatch, TrainSequence, idle_batch, pack_sequences
from learner.data_parallel import spread_for
from learner.distributed import Ranks
from learner.groups import TrainGroup
from learner.loss.action_prior import turn_start_mask
from learner.loss.terms import LossInput, LossParts, Window, build_loss, linear_decay, trained_positions
from learner.model.frozen_casts import cache_frozen_casts
from learner.model.lora import AdapterOff
from learner.model.moe_routing import RouterHooks, moe_shape
from learner.model.precision import resolve_precision
from learner.policy_forward import PolicyForward, forward_policy
from learner.proximal import EngineProximal, LearnerProximal, Proximal
from learner.routing_replay import routing_for
from learner.step_input import StepInput, build_step_input
from learner.step_stats import StepClock, StepStats, step_metrics
from learner.trace import StepTracer, token_clip_active
from pipeline.contracts.learner_config import LearnerConfig
from pipeline.contracts.schema import RejectedRow


def enable_checkpointing(model: Any) -> None:
    """Recompute each decoder layer's activations in backward, non-reentrant (works when the inputs need
    no grad). transformers 5.24 renamed gradient_checkpointing_enable to activation_checkpointing_enable
    and warns on the old name; older releases have only the old one."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _check_options(
    cfg: LearnerConfig, temperature: float, reference: Any, action_token_ids: Sequence[int]
) -> None:
    if not (math.isfinite(temperature) and temperature > 0.0):
        raise ValueError(f"temperature must be a finite number > 0 (the sampling one), got {temperature}")
    if cfg.regularizers.kl_coef > 0.0 and reference is None:
        raise ValueError("kl_coef > 0 needs the frozen reference policy (reference), got none")
    if cfg.regularizers.action_prior_coef > 0.0 and not action_token_ids:
        raise ValueError(
            "action_prior_coef > 0 needs the environment's action tokens (action_token_ids), got none"
        )


def _entered_reference(reference: Any) -> Any:
    """How the reference is entered around its forward: a LoRA policy's AdapterOff (the same model with
    the adapter disabled, not frozen: its adapter is what trains) or a frozen model of its own."""
    if isinstance(reference, AdapterOff):
        return reference.active
    if isinstance(reference, torch.nn.Module):
        reference.eval()
        reference.requires_grad_(False)
    return lambda: nullcontext(reference)


class Trainer:
    """Owns the policy, its AdamW optimizer, the LR schedule and the seeded shuffling generator.

    `model` is a causal LM (HF PreTrainedModel) already in its training dtype; `temperature` must equal
    the sampling temperature of the rollouts. `device` defaults to where the model's parameters are (the
    rank's device with `ranks`); `pad_token_id` to the model config's. `action_token_ids` are the
    environment's answer tokens (learner.loss.action_prior.action_token_ids), needed when the action prior
    is on; `reference` the frozen KL reference (a model, or a LoRA policy's AdapterOff), needed with KL.
    """

    def __init__(
        self,
        model: Any,
        cfg: LearnerConfig,
        *,
        temperature: float,
        seed: int = 0,
        device: torch.device | str | None = None,
        pad_token_id: int | None = None,
        action_token_ids: Sequence[int] = (),
        reference: Any = None,
        ranks: Ranks | None = None,
        tracer: StepTracer | None = None,
    ) -> None:
        _check_options(cfg, temperature, reference, action_token_ids)
        self.model, self.cfg, self.temperature, self.reference = model, cfg, float(temperature), reference
        self._enter_reference = _entered_reference(reference)
        if device is None:  # a rank's model may still be on the meta device (learner.sharding)
            device = ranks.device if ranks is not None else next(model.parameters()).device
        self.device = torch.device(device)
        self.ranks = ranks if ranks is not None and ranks.world > 1 else None
        self._place(model, reference, ranks)
        self.moe = moe_shape(getattr(model, "config", None))
        self.routing = routing_for(model, self.moe, cfg.moe, self.device)
        self._share_prefix = cfg.shared_prefix and self.routing.shares_prefix
        self.proximal = self._choose_proximal()
        self.loss = build_loss(cfg, self._loss_parts(action_token_ids))
        pad = pad_token_id if pad_token_id is not None else getattr(model.config, "pad_token_id", None)
        self.pad_token_id = int(pad) if pad is not None else 0
        self.optimizer, self.scheduler = adamw(model, cfg, fused=self.spread.fused_optimizer)
        self.generator = torch.Generator().manual_seed(seed)  # mini-batch shuffling
        self.steps = 0  # step() calls
        self.optimizer_updates = 0
        self._policy_version = 0
        self.last_rejected: list[RejectedRow] = []
        # Token-level record of a few trained groups per step for `rollwise inspect` (learner.trace).
        self.tracer = tracer or StepTracer()

    def _place(self, model: Any, reference: Any, ranks: Ranks | None) -> None:
        """The policy on its device (or sharded over the ranks with a reference model), in train mode."""
        self.precision = resolve_precision(self.cfg.precision, self.device)
        if self.cfg.gradient_checkpointing:
            enable_checkpointing(model)
        self.spread = spread_for(ranks, self.device)
        self.spread.place(
            [model, *([reference] if isinstance(reference, torch.nn.Module) else [])],
            self.device,
            self.precision,
        )
        model.train()
        if self.precision.autocast_dtype is not None:
            cache_frozen_casts(model, self.precision.autocast_dtype)  # the same numbers, cast once

    def _choose_proximal(self) -> Proximal:
        m = self.cfg.mismatch
        if m.proximal == "engine":
            return EngineProximal(self._policy, self.routing)
        # The step's first update runs at the weights its proximal policy is defined by, so its training
        # forward gives the proximal log-probs too. Not with rejection (the window's token counts must be
        # known before its first loss) nor with MoE routers (the proximal pass measures their mismatch).
        reuse = m.reject == "none" and self.routing.hooks is None
        return LearnerProximal(
            m, self._policy, self.routing, self.device, from_first_forward=reuse,
            first_window=self.cfg.optim.grad_accum, replayed=self.cfg.moe.routing_replay,
        )  # fmt: skip

    def _loss_parts(self, action_token_ids: Sequence[int]) -> LossParts:
        return LossParts(
            temperature=self.temperature,
            reference=self._reference_logprobs,
            router_logits=self.routing.router_logits,
            num_experts=self.moe.num_experts if self.moe is not None else 0,
            # On the device once: the prior indexes the logits with them in every forward.
            action_ids=torch.tensor(sorted(set(action_token_ids)), dtype=torch.long, device=self.device),
        )

    @property
    def policy_version(self) -> int:
        return self._policy_version

    @property
    def router_hooks(self) -> RouterHooks | None:
        return self.routing.hooks

    @property
    def proximal_from_first_forward(self) -> bool:
        """The first window's proximal log-probs come from its training forward (learner.proximal)."""
        return self.proximal.from_first_forward

    @proximal_from_first_forward.setter
    def proximal_from_first_forward(self, value: bool) -> None:
        self.proximal.from_first_forward = value

    @property
    def entropy_coef(self) -> float:
        """The entropy bonus weight of the next update, on its linear decay over the optimizer updates
        (it follows the restored update counter, so a resumed run continues the same schedule)."""
        reg = self.cfg.regularizers
        return linear_decay(reg.entropy_coef, reg.entropy_decay_steps, self.optimizer_updates)

    @property
    def action_prior_coef(self) -> float:
        """The action prior's weight for the next update, on the same kind of decay."""
        reg = self.cfg.regularizers
        return linear_decay(reg.action_prior_coef, reg.action_prior_decay_steps, self.optimizer_updates)

    def counters(self) -> dict[str, int]:
        """Everything besides tensors that a checkpoint must restore for an identical next step."""
        return {
            "steps": self.steps,
            "optimizer_updates": self.optimizer_updates,
            "policy_version": self._policy_version,
        }

    def load_counters(self, counters: dict[str, int]) -> None:
        self.steps = int(counters["steps"])
        self.optimizer_updates = int(counters["optimizer_updates"])
        self._policy_version = int(counters["policy_version"])

    def step(self, groups: Sequence[TrainGroup]) -> dict[str, float]:
        """Train on `groups` (triaged by learner.groups); returns the step's metrics."""
        started = time.perf_counter()
        data = self._step_input(groups)
        self.last_rejected = data.rejected
        self.tracer.begin(self.steps, data.sequences)
        stats = StepStats(terms=self.loss.new_stats())
        if data.sequences:
            try:
                self._update(data.sequences, stats)
            finally:  # any other forward of the policy (the served probe) routes on its own
                self.routing.release()
            stats = self.spread.merged(stats)
        if stats.applied:
            self._policy_version += 1
        self.steps += 1
        clock = StepClock(
            self.entropy_coef,
            self.action_prior_coef,
            float(self.optimizer.param_groups[0]["lr"]),
            self._policy_version,
        )
        return step_metrics(data, stats, time.perf_counter() - started, clock)

    def _step_input(self, groups: Sequence[TrainGroup]) -> StepInput:
        cfg = self.cfg
        reg = cfg.regularizers
        return build_step_input(
            groups,
            estimator=cfg.advantages.estimator,
            gamma=cfg.advantages.gamma,
            lam=cfg.advantages.lam,
            # A group without signal still trains the entropy bonus and the action prior: its failed
            # states are exactly where a rarely sampled answer has to be kept alive.
            keep_zero_advantage=self.entropy_coef > 0.0 or self.action_prior_coef > 0.0,
            norm=cfg.advantages.norm,
            overlong=(reg.overlong_budget, reg.overlong_slope) if reg.overlong_budget else None,
        )

    def _update(self, sequences: list[TrainSequence], stats: StepStats) -> None:
        order = torch.randperm(len(sequences), generator=self.generator)
        parts = min(self.cfg.mini_batches, len(sequences))
        chunks = self.spread.chunks([chunk.tolist() for chunk in torch.tensor_split(order, parts)])
        packs = [
            dataclasses.replace(
                pack_sequences([sequences[i] for i in chunk], pad_id=self.pad_token_id), rows=tuple(chunk)
            )
            if chunk
            else idle_batch(pad_id=self.pad_token_id)
            for chunk in chunks
        ]
        packs = self.routing.attach(packs, chunks, sequences)
        packs = self.proximal.prepare(packs, stats, self._policy_version)
        live = [bool(chunk) for chunk in chunks]
        accum = self.cfg.optim.grad_accum
        for start in range(0, len(packs), accum):
            self._optimizer_update(packs[start : start + accum], stats, live[start : start + accum])

    def _optimizer_update(self, window: list[PackedBatch], stats: StepStats, live: list[bool]) -> None:
        """Accumulate gradients over `window` (normalised by all its sequences), then one AdamW update.
        `live[i]` is False for a rank's placeholder batch (learner.batching.idle_batch): not counted."""
        self.optimizer.zero_grad(set_to_none=True)
        totals = self._window(window)
        if totals.sequences == 0:
            # Mismatch rejection can take every token of a window out of the loss. Nothing to learn from,
            # and an AdamW step on zero gradients would still move the weights (decay, momentum).
            stats.skipped_empty += 1
            return
        self.routing.begin_window(stats)
        window_loss, finite = self._backward(window, live, totals, stats)
        grad_norm = self._clipped_norm() if finite else math.nan
        if not math.isfinite(grad_norm):
            # Keep the weights: a non-finite update would poison every later step.
            self.optimizer.zero_grad(set_to_none=True)
            stats.skipped_nonfinite += 1
            return
        self._apply(stats)
        self.routing.after_update(window[0], live[0], self._policy, stats)
        stats.losses.append(window_loss)
        stats.grad_norms.append(grad_norm)

    def _window(self, window: list[PackedBatch]) -> Window:
        counts = [
            sum(int((b.loss_mask.sum(dim=-1) > 0).sum()) for b in window),
            sum(b.num_loss_tokens for b in window),
            sum(int(turn_start_mask(b.loss_mask).sum()) for b in window),
            sum(int(trained_positions(b).sum()) for b in window),
        ]
        return Window(*self.spread.counts(counts))

    def _backward(
        self, window: list[PackedBatch], live: list[bool], totals: Window, stats: StepStats
    ) -> tuple[float, bool]:
        """Forward, loss and backward of each mini-batch of the window: its summed loss, and whether every
        loss was finite (on every rank)."""
        window_loss, finite = 0.0, True
        for index, (packed, counted) in enumerate(zip(window, live, strict=True)):
            batch = packed.to(self.device)
            loss = self._forward_loss(batch, totals, stats, counted)
            self.routing.after_forward(batch, index, counted, stats)
            if counted:
                stats.tokens += packed.num_tokens
                stats.loss_tokens += packed.num_loss_tokens
            if not torch.isfinite(loss):
                finite = False
                if self.spread.stop_at_nonfinite:
                    break
            loss.backward()
            window_loss += float(loss.detach())
        return window_loss, self.spread.all_finite(finite)

    def _forward_loss(
        self, batch: PackedBatch, totals: Window, stats: StepStats, counted: bool
    ) -> torch.Tensor:
        with self.routing.training_forward():
            out = self._forward(self.model, batch)
        batch = self.proximal.on_forward(batch, out.logprobs, stats, self._policy_version)
        inp = LossInput(batch, out, totals, batch.advantages, self.optimizer_updates, counted)
        inp = self.loss.shaped(inp, stats.terms)
        loss = self.loss(inp, stats.terms)
        self._trace(batch, inp)
        if counted:
            stats.entropies.append(out.entropy(batch.loss_mask, self.temperature))
        return loss

    def _clipped_norm(self) -> float:
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        return self.spread.clip(params, self.cfg.optim.grad_clip)

    def _apply(self, stats: StepStats) -> None:
        stats.lr = float(self.optimizer.param_groups[0]["lr"])
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer_updates += 1
        stats.applied += 1

    def _trace(self, batch: PackedBatch, inp: LossInput) -> None:
        if not self.tracer.active:
            return
        loss = self.cfg.loss
        clip_active = token_clip_active(
            inp.out.logprobs, inp.behaviour, inp.advantages, batch.loss_mask,
            level=loss.level, clip_low=loss.clip_low, clip_high=loss.clip_high,
        )  # fmt: skip
        self.tracer.record(batch, inp.out.logprobs, clip_active)

    def _policy(self, batch: PackedBatch, replay: bool | None) -> PolicyForward:
        return self._forward(self.model, batch, replay)

    @torch.no_grad()
    def _reference_logprobs(self, batch: PackedBatch) -> torch.Tensor:
        with self._enter_reference() as reference:
            return self._forward(reference, batch).logprobs

    def _forward(self, model: Any, batch: PackedBatch, replay: bool | None = None) -> PolicyForward:
        """One forward of `model` on `batch`. On the policy (a LoRA reference too: the same model) the
        routers replay the batch's engine routing as learner.routing_replay decides."""
        if model is self.model:
            self.routing.set_replay(batch, replay)
        return forward_policy(
            model, batch.input_ids, batch.attention_mask, batch.targets,
            temperature=self.temperature, precision=self.precision, device=self.device,
            fused=self.cfg.fused_logprobs, scored=batch.loss_mask > 0, share_prefix=self._share_prefix,
        )  # fmt: skip
