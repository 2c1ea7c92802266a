"""One training step: triaged groups in (learner.groups), GSPO-token updates on the policy, metrics out.

The behaviour policy is the engine: its per-token log-probs in the rows are the "old" log-probs, so there
is no recomputation pass. The step reads like the recipe:

    per-turn advantages → drop zero-signal groups → per-token advantages → shuffle (seeded)
    → mini-batches → forward, log-probs at the sampling temperature, loss, backward → clip
    → AdamW (skipped when anything is non-finite)

Policy version: incremented once per `step()` that changed the weights (at least one optimizer update
applied), i.e. once per set of weights worth publishing. Optimizer updates are counted separately.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from learner.action_prior import action_prior_loss
from learner.advantages import Estimator, Norm, history_anchors, token_advantages, turn_advantages
from learner.batching import PackedBatch, TrainSequence, pack_sequences
from learner.groups import TrainGroup
from learner.gspo import gspo_token_loss
from learner.logprobs import entropy_from_logits, sampled_token_logprobs
from learner.schema import EpisodeSegment, RejectedRow
from pipeline.config import LearnerConfig

# Per-turn advantages below this are float noise of a group whose members all scored the same.
ZERO_ADVANTAGE = 1e-8


@dataclass
class StepInput:
    """The sequences to train on plus the accounting of the step's groups."""

    sequences: list[TrainSequence] = field(default_factory=list)
    episodes: list[EpisodeSegment] = field(default_factory=list)  # one row (the first segment) per episode
    rejected: list[RejectedRow] = field(default_factory=list)
    untrainable_rows: int = 0
    skipped_zero_adv_groups: int = 0
    trained_groups: int = 0


def _warmup(warmup_steps: int) -> Callable[[int], float]:
    def factor(update: int) -> float:
        return min(1.0, (update + 1) / warmup_steps) if warmup_steps > 0 else 1.0

    return factor


def _episode_anchors(group: TrainGroup) -> list[list[bytes | None]]:
    """[episode][turn] history digests of a group (segments of one episode merged; None if unknown)."""
    result = []
    for segments in group.episodes:
        anchors: dict[int, bytes] = {}
        for seg in segments:
            anchors.update(history_anchors(seg.token_ids, seg.turn_index, seg.loss_mask))
        result.append([anchors.get(k) for k in range(len(segments[0].turn_rewards))])
    return result


def build_step_input(
    groups: Sequence[TrainGroup],
    *,
    estimator: Estimator,
    gamma: float,
    lam: float,
    keep_zero_advantage: bool = False,
    norm: Norm = "std",
) -> StepInput:
    """Annotate the groups' rows with per-token advantages (pure; no model involved).

    The groups were decoded, validated and triaged once by the learner (learner.groups.triage_group).
    Segments of one episode share its turn_rewards and outcome, so advantages are computed once per
    episode and every segment maps its tokens through its own turn_index.

    Groups whose advantages are all zero carry no policy-gradient signal and are counted in
    ``skipped_zero_adv_groups``; they are left out unless ``keep_zero_advantage`` (the trainer sets it
    when an entropy bonus or the action prior is on: a policy whose groups all play alike is exactly the
    one they must reach, and their tokens also dilute the remaining signal under token-mean aggregation).
    """
    result = StepInput()
    for group in groups:
        result.rejected.extend(group.rejected)
        result.untrainable_rows += group.untrainable_rows
    members = [group.first_segments for group in groups]
    result.episodes = [ep for group in members for ep in group]
    if not groups:
        return result
    advantages = turn_advantages(
        [[(list(ep.turn_rewards), ep.outcome) for ep in group] for group in members],
        gamma=gamma,
        lam=lam,
        estimator=estimator,
        anchors=[_episode_anchors(group) for group in groups] if estimator == "anchor" else None,
        norm=norm,
    )
    for group, group_adv in zip(groups, advantages, strict=True):
        if all(abs(a) <= ZERO_ADVANTAGE for episode_adv in group_adv for a in episode_adv):
            result.skipped_zero_adv_groups += 1
            if not keep_zero_advantage:
                continue
            group_adv = [[0.0] * len(episode_adv) for episode_adv in group_adv]
        else:
            result.trained_groups += 1
        for segments, episode_adv in zip(group.episodes, group_adv, strict=True):
            for seg in segments:
                if sum(seg.loss_mask[1:]) == 0:
                    continue  # nothing the model generated can be scored in this row
                try:
                    token_adv = token_advantages(episode_adv, seg.turn_index, seg.loss_mask)
                except ValueError as exc:  # a turn index without a turn reward: never guess one
                    result.rejected.append(RejectedRow(index=-1, episode_id=seg.episode_id, reason=str(exc)))
                    continue
                result.sequences.append(
                    TrainSequence(
                        token_ids=list(seg.token_ids),
                        loss_mask=list(seg.loss_mask),
                        old_logprobs=list(seg.logprobs),
                        advantages=token_adv,
                    )
                )
    return result


@dataclass
class _UpdateStats:
    """Accumulates per-mini-batch loss statistics over one step."""

    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    entropies: list[float] = field(default_factory=list)
    clip_fractions: list[tuple[float, int]] = field(default_factory=list)
    ratio_means: list[float] = field(default_factory=list)
    ratio_min: float = math.inf
    ratio_max: float = -math.inf
    first: dict[str, float] = field(default_factory=dict)
    tokens: int = 0
    loss_tokens: int = 0
    lr: float = 0.0  # learning rate of the last applied update
    applied: int = 0
    skipped_nonfinite: int = 0

    def add(self, stats: dict[str, torch.Tensor], entropy: float) -> None:
        values = {key: float(value) for key, value in stats.items()}
        if not self.first:
            self.first = values
        self.entropies.append(entropy)
        self.clip_fractions.append((values["clip_fraction"], int(values["num_sequences"])))
        self.ratio_means.append(values["ratio_mean"])
        self.ratio_min = min(self.ratio_min, values["ratio_min"])
        self.ratio_max = max(self.ratio_max, values["ratio_max"])


def _linear_decay(coef: float, decay_steps: int, updates: int) -> float:
    """``coef`` falling linearly to 0 over ``decay_steps`` updates; constant when decay_steps is 0."""
    if decay_steps <= 0:
        return coef
    return coef * max(0.0, 1.0 - updates / decay_steps)


def generated_token_entropy(logits: torch.Tensor, mask: torch.Tensor, temperature: float) -> torch.Tensor:
    """Differentiable mean entropy of softmax(logits / T) over the generated positions (mask > 0).

    Only those positions are materialised in fp32 ((N, V) with N generated tokens), never (B, T, V).
    """
    keep = mask > 0
    if not bool(keep.any()):
        return logits.sum() * 0.0
    selected = logits[keep].float() / temperature
    logp = torch.log_softmax(selected, dim=-1)
    return -(logp.exp() * logp).sum(dim=-1).mean()


def _param_groups(
    model: Any, weight_decay: float, embedding_weight_decay: float | None
) -> list[dict[str, Any]]:
    """AdamW parameter groups: one, or the token embeddings and output layer (tied or not) apart when
    they decay differently. One group otherwise, so checkpoints of earlier runs keep loading."""
    params = [p for p in model.parameters() if p.requires_grad]
    if embedding_weight_decay is None or embedding_weight_decay == weight_decay:
        return [{"params": params}]
    embedding_ids = {
        id(p)
        for module in (model.get_input_embeddings(), model.get_output_embeddings())
        if module is not None
        for p in module.parameters()
    }
    return [
        {"params": [p for p in params if id(p) in embedding_ids], "weight_decay": embedding_weight_decay},
        {"params": [p for p in params if id(p) not in embedding_ids], "weight_decay": weight_decay},
    ]


def episode_return(ep: EpisodeSegment) -> float:
    """Total reward of an episode: its turn rewards plus its outcome (0 when the env set none)."""
    return sum(ep.turn_rewards) + (ep.outcome if ep.outcome is not None else 0.0)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


class Trainer:
    """Owns the policy, its AdamW optimizer, the LR schedule and the seeded shuffling generator.

    `model` is a causal LM (HF PreTrainedModel) already in its training dtype; `temperature` must equal
    the sampling temperature of the rollouts (the engine's log-probs are of softmax(logits / T)). `device`
    defaults to where the model's parameters are; `pad_token_id` to the model config's.
    `action_token_ids` are the environment's answer tokens (learner.action_prior.action_token_ids); the
    action prior needs them when ``cfg.action_prior_coef > 0``.
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
    ) -> None:
        if not (math.isfinite(temperature) and temperature > 0.0):
            raise ValueError(f"temperature must be a finite number > 0 (the sampling one), got {temperature}")
        if cfg.action_prior_coef > 0.0 and not action_token_ids:
            raise ValueError(
                "action_prior_coef > 0 needs the environment's action tokens (action_token_ids), got none"
            )
        self.model = model
        self.cfg = cfg
        self.temperature = float(temperature)
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        # On the device once: the prior indexes the logits with them in every forward.
        self.action_ids = torch.tensor(sorted(set(action_token_ids)), dtype=torch.long, device=self.device)
        self.model.to(self.device)
        self.model.train()
        pad = pad_token_id if pad_token_id is not None else getattr(model.config, "pad_token_id", None)
        self.pad_token_id = int(pad) if pad is not None else 0
        self.optimizer = torch.optim.AdamW(
            _param_groups(model, cfg.weight_decay, cfg.embedding_weight_decay),
            lr=cfg.lr,
            betas=(float(cfg.betas[0]), float(cfg.betas[1])),
            weight_decay=cfg.weight_decay,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _warmup(cfg.warmup_steps))
        self.generator = torch.Generator().manual_seed(seed)  # mini-batch shuffling
        self.steps = 0  # step() calls
        self.optimizer_updates = 0
        self._policy_version = 0
        self.last_rejected: list[RejectedRow] = []

    @property
    def policy_version(self) -> int:
        return self._policy_version

    @property
    def entropy_coef(self) -> float:
        """The entropy bonus weight of the next update: ``entropy_coef``, falling linearly to 0 over the
        first ``entropy_decay_steps`` optimizer updates (constant when that is 0). It follows the restored
        update counter, so a resumed run continues the same schedule."""
        return _linear_decay(self.cfg.entropy_coef, self.cfg.entropy_decay_steps, self.optimizer_updates)

    @property
    def action_prior_coef(self) -> float:
        """The action prior's weight for the next update, on the same linear schedule as the entropy
        bonus (``action_prior_decay_steps``; 0 = constant)."""
        cfg = self.cfg
        return _linear_decay(cfg.action_prior_coef, cfg.action_prior_decay_steps, self.optimizer_updates)

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
        data = build_step_input(
            groups,
            estimator=self.cfg.estimator,
            gamma=self.cfg.gamma,
            lam=self.cfg.lam,
            # A group without signal still trains the entropy bonus and the action prior: its failed
            # states are exactly where a rarely sampled answer has to be kept alive.
            keep_zero_advantage=self.entropy_coef > 0.0 or self.action_prior_coef > 0.0,
            norm=self.cfg.advantage_norm,
        )
        self.last_rejected = data.rejected
        stats = _UpdateStats()
        if data.sequences:
            self._update(data.sequences, stats)
        if stats.applied:
            self._policy_version += 1
        self.steps += 1
        elapsed = time.perf_counter() - started
        return self._metrics(data, stats, elapsed)

    def _mini_batches(self, count: int) -> list[list[int]]:
        order = torch.randperm(count, generator=self.generator)
        parts = min(self.cfg.mini_batches, count)
        return [chunk.tolist() for chunk in torch.tensor_split(order, parts)]

    def _update(self, sequences: list[TrainSequence], stats: _UpdateStats) -> None:
        chunks = self._mini_batches(len(sequences))
        accum = self.cfg.grad_accum
        for start in range(0, len(chunks), accum):
            window = [
                pack_sequences([sequences[i] for i in c], pad_id=self.pad_token_id)
                for c in chunks[start : start + accum]
            ]
            self._optimizer_update(window, stats)

    def _optimizer_update(self, window: list[PackedBatch], stats: _UpdateStats) -> None:
        """Accumulate gradients over `window` (seq-mean over all its sequences), then one AdamW update."""
        self.optimizer.zero_grad(set_to_none=True)
        num_sequences = sum(int((b.loss_mask.sum(dim=-1) > 0).sum()) for b in window)
        num_tokens = sum(b.num_loss_tokens for b in window)
        window_loss = 0.0
        finite = True
        for packed in window:
            batch = packed.to(self.device)
            loss, loss_stats, entropy = self._forward_loss(batch, num_sequences, num_tokens)
            stats.add(loss_stats, entropy)
            stats.tokens += packed.num_tokens
            stats.loss_tokens += packed.num_loss_tokens
            if not torch.isfinite(loss):
                finite = False
                break
            loss.backward()
            window_loss += float(loss.detach())
        grad_norm = math.nan
        if finite:
            params = [p for group in self.optimizer.param_groups for p in group["params"]]
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip))
            finite = math.isfinite(grad_norm)
        if not finite:
            # Keep the weights: a non-finite update would poison every later step.
            self.optimizer.zero_grad(set_to_none=True)
            stats.skipped_nonfinite += 1
            return
        stats.lr = float(self.optimizer.param_groups[0]["lr"])
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer_updates += 1
        stats.applied += 1
        stats.losses.append(window_loss)
        stats.grad_norms.append(grad_norm)

    def _forward_loss(
        self, batch: PackedBatch, num_sequences: int, num_tokens: int
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], float]:
        # use_cache=False: a training forward has no use for a KV cache and would allocate one per layer.
        logits = self.model(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False
        ).logits
        logprobs = sampled_token_logprobs(logits, batch.targets, temperature=self.temperature)
        loss, loss_stats = gspo_token_loss(
            logprobs,
            batch.old_logprobs,
            batch.advantages,
            batch.loss_mask,
            clip_low=self.cfg.clip_low,
            clip_high=self.cfg.clip_high,
            level=self.cfg.loss_level,
            num_global_sequences=num_sequences,
            aggregation=self.cfg.loss_agg,
            num_global_tokens=max(num_tokens, 1),
        )
        entropy = float(entropy_from_logits(logits.detach(), batch.loss_mask, temperature=self.temperature))
        coef = self.entropy_coef
        if coef > 0.0:
            loss = loss - coef * generated_token_entropy(logits, batch.loss_mask, self.temperature)
        prior = self.action_prior_coef
        if prior > 0.0:
            floor = action_prior_loss(logits, batch.loss_mask, self.action_ids, self.temperature)
            loss = loss + prior * floor
        return loss, loss_stats, entropy

    def _metrics(self, data: StepInput, stats: _UpdateStats, elapsed: float) -> dict[str, float]:
        episodes = data.episodes
        weighted_clip = sum(f * n for f, n in stats.clip_fractions)
        clip_sequences = sum(n for _, n in stats.clip_fractions)
        outcomes = [ep.outcome for ep in episodes if ep.outcome is not None]
        return {
            "loss": _mean(stats.losses),
            "clip_fraction": weighted_clip / clip_sequences if clip_sequences else 0.0,
            "ratio_mean": _mean(stats.ratio_means) if stats.ratio_means else 1.0,
            "ratio_min": stats.ratio_min if stats.ratio_means else 1.0,
            "ratio_max": stats.ratio_max if stats.ratio_means else 1.0,
            "mismatch_abs_mean": stats.first.get("mismatch_abs_mean", 0.0),
            "mismatch_k3": stats.first.get("mismatch_k3", 0.0),
            "entropy": _mean(stats.entropies),
            "entropy_coef": self.entropy_coef,
            "action_prior_coef": self.action_prior_coef,
            "grad_norm": _mean(stats.grad_norms),
            "lr": stats.lr if stats.applied else float(self.optimizer.param_groups[0]["lr"]),
            "tokens": float(stats.tokens),
            "loss_tokens": float(stats.loss_tokens),
            "tokens_per_s": stats.tokens / elapsed if elapsed > 0 else 0.0,
            "step_time_s": elapsed,
            "num_sequences": float(len(data.sequences)),
            "num_groups": float(data.trained_groups),
            "optimizer_updates": float(stats.applied),
            "skipped_zero_adv_groups": float(data.skipped_zero_adv_groups),
            "skipped_steps_nonfinite": float(stats.skipped_nonfinite),
            "rejected_rows": float(len(data.rejected)),
            "untrainable_rows": float(data.untrainable_rows),
            "reward_mean": _mean([episode_return(ep) for ep in episodes]),
            "outcome_mean": _mean([float(o) for o in outcomes]),
            "success_rate": _mean([1.0 if ep.success else 0.0 for ep in episodes]),
            "policy_version": float(self._policy_version),
        }
