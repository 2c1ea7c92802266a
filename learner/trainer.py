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

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from learner.action_prior import action_prior_loss_of_rows, turn_start_mask
from learner.advantages import Estimator, Norm, history_anchors, token_advantages, turn_advantages
from learner.batching import PackedBatch, TrainSequence, idle_batch, pack_sequences
from learner.distributed import Ranks, share
from learner.frozen_casts import cache_frozen_casts
from learner.groups import TrainGroup
from learner.gspo import MAX_LOG_RATIO, gspo_token_loss
from learner.lora import AdapterOff
from learner.mismatch import Correction, correct
from learner.moe_routing import (
    MoeStats,
    RouterHooks,
    expert_load,
    load_balance_loss,
    moe_shape,
    replay_tensor,
    require_moe,
    routing_change,
)
from learner.policy_forward import PolicyForward, forward_policy
from learner.precision import resolve_precision
from learner.regularizers import kl_estimate, overlong_penalty
from learner.trace import StepTracer, token_clip_active
from pipeline.contracts.learner_config import ConstantSchedule, DecaySchedule, LearnerConfig
from pipeline.contracts.schema import EpisodeSegment, RejectedRow

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
    turns: int = 0  # turns of the step's episodes (counted when the over-long penalty is on)
    overlong_turns: int = 0  # of them, turns the over-long penalty reached


def lr_factor(schedule: ConstantSchedule | DecaySchedule) -> Callable[[int], float]:
    """Learning-rate multiplier of optimizer update u (0-based): a linear warm-up over `warmup_steps`, then
    constant, or a linear or cosine decay over `decay_steps` to `min_ratio`, held there after.
    A pure function of u, so a resumed scheduler (its update count restored) continues exactly."""
    warmup, shape = schedule.warmup_steps, schedule.kind
    decay, floor = (
        (schedule.decay_steps, schedule.min_ratio) if isinstance(schedule, DecaySchedule) else (0, 1.0)
    )

    def factor(update: int) -> float:
        if update < warmup:
            return (update + 1) / warmup
        if shape == "constant" or decay <= 0:
            return 1.0
        progress = min(1.0, (update - warmup) / decay)
        if shape == "linear":
            return floor + (1.0 - floor) * (1.0 - progress)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

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


def _turn_lengths(segments: Sequence[EpisodeSegment], num_turns: int) -> list[int]:
    """Generated tokens of each turn of one episode, over all its segments."""
    lengths = [0] * num_turns
    for seg in segments:
        for turn, generated in zip(seg.turn_index, seg.loss_mask, strict=True):
            if generated and 0 <= turn < num_turns:
                lengths[turn] += 1
    return lengths


def build_step_input(
    groups: Sequence[TrainGroup],
    *,
    estimator: Estimator,
    gamma: float,
    lam: float,
    keep_zero_advantage: bool = False,
    norm: Norm = "std",
    overlong: tuple[int, int] | None = None,
) -> StepInput:
    """Annotate the groups' rows with per-token advantages (pure; no model involved).

    ``overlong = (budget, slope)`` adds DAPO's soft over-long penalty of each turn's generated length to
    that turn's reward before the advantages (learner.regularizers.overlong_penalty).

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
    rewards = [[list(ep.turn_rewards) for ep in group] for group in members]
    if overlong is not None:
        for group, group_rewards in zip(groups, rewards, strict=True):
            for segments, turn_rewards in zip(group.episodes, group_rewards, strict=True):
                for k, length in enumerate(_turn_lengths(segments, len(turn_rewards))):
                    penalty = overlong_penalty(length, *overlong)
                    turn_rewards[k] += penalty
                    result.overlong_turns += penalty < 0.0
                result.turns += len(turn_rewards)
    advantages = turn_advantages(
        [
            [(r, ep.outcome) for r, ep in zip(group_rewards, group, strict=True)]
            for group_rewards, group in zip(rewards, members, strict=True)
        ],
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
                        versions=list(seg.versions),
                        source=seg,
                        routed_experts=seg.routed_experts,
                    )
                )
    return result


@dataclass
class _UpdateStats:
    """Accumulates the statistics of every mini-batch of one step (weighted by sequences or tokens)."""

    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    entropies: list[float] = field(default_factory=list)
    ratio_means: list[float] = field(default_factory=list)
    ratio_min: float = math.inf
    ratio_max: float = -math.inf
    seq_sums: dict[str, float] = field(default_factory=dict)  # sequence-weighted sums
    token_sums: dict[str, float] = field(default_factory=dict)  # token-weighted sums
    sequences: int = 0
    scored_tokens: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    lr: float = 0.0  # learning rate of the last applied update
    applied: int = 0
    skipped_nonfinite: int = 0
    skipped_empty: int = 0  # windows left with no token to train (mismatch rejection took them all)
    # |learner - engine| log-prob by the tokens' staleness: [sum, count] for lag 0 and lag >= 1, and k3.
    mismatch: dict[str, list[float]] = field(
        default_factory=lambda: {"lag0": [0.0, 0.0], "lag1plus": [0.0, 0.0], "k3": [0.0, 0.0]}
    )
    kl_sum: float = 0.0
    kl_tokens: int = 0
    corrected_tokens: int = 0
    rejected_tokens: int = 0
    truncated_tokens: int = 0
    weight_sum: float = 0.0
    weight_max: float = 0.0
    moe: MoeStats = field(default_factory=MoeStats)  # MoE routing measurements (learner.moe)
    routing_measured: bool = False  # the step's routing change was measured (its first update)

    def add(self, stats: dict[str, torch.Tensor], entropy: float) -> None:
        values = {key: float(value) for key, value in stats.items()}
        n_seq, n_tok = int(values["num_sequences"]), int(values["num_tokens"])
        self.entropies.append(entropy)
        self.ratio_means.append(values["ratio_mean"])
        self.ratio_min = min(self.ratio_min, values["ratio_min"])
        self.ratio_max = max(self.ratio_max, values["ratio_max"])
        for key in (
            "clip_fraction", "band_exit_fraction", "seq_log_ratio_abs_mean", "seq_log_ratio_mean",
            "seq_log_ratio_sq_mean",
        ):  # fmt: skip
            self.seq_sums[key] = self.seq_sums.get(key, 0.0) + values[key] * n_seq
        for key in ("clip_fraction_token", "token_log_ratio_mean", "token_log_ratio_sq_mean"):
            self.token_sums[key] = self.token_sums.get(key, 0.0) + values[key] * n_tok
        self.sequences += n_seq
        self.scored_tokens += n_tok

    def add_mismatch(
        self, learner: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor, lag: torch.Tensor
    ) -> None:
        """|learner - engine| on the generated tokens, split by staleness (lag 0: numerics; lag >= 1:
        numerics plus policy change), and the k3 estimate of KL(engine || learner)."""
        keep = mask > 0
        d = torch.where(keep, learner.detach().float() - engine.float(), 0.0)
        for key, part in (("lag0", keep & (lag == 0)), ("lag1plus", keep & (lag >= 1))):
            self.mismatch[key][0] += float(d.abs()[part].sum())
            self.mismatch[key][1] += float(part.sum())
        k3 = torch.expm1(d.clamp(max=MAX_LOG_RATIO)) - d
        self.mismatch["k3"][0] += float(k3[keep].sum())
        self.mismatch["k3"][1] += float(keep.sum())

    def add_correction(self, c: Correction) -> None:
        self.corrected_tokens += c.tokens
        self.rejected_tokens += c.rejected_tokens
        self.truncated_tokens += c.truncated_tokens
        self.weight_sum += c.weight_sum
        self.weight_max = max(self.weight_max, c.weight_max)

    @staticmethod
    def merged(parts: Sequence[_UpdateStats]) -> _UpdateStats:
        """One step's statistics over every rank's share of it. The update counts, learning rate and
        gradient norms are the same on every rank (the norm is global); window losses are partial sums."""
        first = parts[0]
        out = _UpdateStats(
            losses=[sum(values) for values in zip(*(p.losses for p in parts), strict=True)],
            grad_norms=list(first.grad_norms),
            entropies=[e for p in parts for e in p.entropies],
            ratio_means=[r for p in parts for r in p.ratio_means],
            ratio_min=min(p.ratio_min for p in parts),
            ratio_max=max(p.ratio_max for p in parts),
            lr=first.lr,
            applied=first.applied,
            skipped_nonfinite=first.skipped_nonfinite,
            skipped_empty=first.skipped_empty,
            weight_max=max(p.weight_max for p in parts),
            moe=MoeStats.merged([p.moe for p in parts]),
        )
        for p in parts:
            for sums, part in ((out.seq_sums, p.seq_sums), (out.token_sums, p.token_sums)):
                for key, value in part.items():
                    sums[key] = sums.get(key, 0.0) + value
            for key, (total, count) in p.mismatch.items():
                out.mismatch[key][0] += total
                out.mismatch[key][1] += count
            for name in (
                "sequences", "scored_tokens", "tokens", "loss_tokens", "kl_sum", "kl_tokens",
                "corrected_tokens", "rejected_tokens", "truncated_tokens", "weight_sum",
            ):  # fmt: skip
                setattr(out, name, getattr(out, name) + getattr(p, name))
        return out

    def mismatch_metrics(self) -> dict[str, float]:
        lag0, lag1, k3 = (self.mismatch[k] for k in ("lag0", "lag1plus", "k3"))
        kept = self.corrected_tokens - self.rejected_tokens
        return {
            "mismatch_abs_mean": _ratio(lag0[0] + lag1[0], lag0[1] + lag1[1]),
            "mismatch_abs_mean_lag0": _ratio(*lag0),
            "mismatch_abs_mean_lag1plus": _ratio(*lag1),
            "mismatch_k3": _ratio(*k3),
            "is_weight_mean": _ratio(self.weight_sum, kept) if self.corrected_tokens else 1.0,
            "is_weight_max": self.weight_max if self.corrected_tokens else 1.0,
            "is_truncated_fraction": _ratio(self.truncated_tokens, kept),
            "rejected_fraction": _ratio(self.rejected_tokens, self.corrected_tokens),
        }

    def loss_metrics(self) -> dict[str, float]:
        seq = {k: _ratio(v, self.sequences) for k, v in self.seq_sums.items()}
        tok = {k: _ratio(v, self.scored_tokens) for k, v in self.token_sums.items()}
        return {
            "clip_fraction": seq.get("clip_fraction", 0.0),
            "band_exit_fraction": seq.get("band_exit_fraction", 0.0),
            "seq_log_ratio_abs_mean": seq.get("seq_log_ratio_abs_mean", 0.0),
            "clip_fraction_token": tok.get("clip_fraction_token", 0.0),
            # Standard deviations of log r_t over the step's tokens and of log s_i over its sequences.
            "ratio_spread_token": _spread(
                tok.get("token_log_ratio_mean"), tok.get("token_log_ratio_sq_mean")
            ),
            "ratio_spread_sequence": _spread(seq.get("seq_log_ratio_mean"), seq.get("seq_log_ratio_sq_mean")),
        }


def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 else 0.0


def _trained_positions(batch: PackedBatch) -> torch.Tensor:
    """(B, T) bool: the input positions of the rows that have a token to train (what the load-balancing
    loss averages over; a placeholder batch has none)."""
    rows = batch.loss_mask.sum(dim=-1, keepdim=True) > 0
    return (batch.attention_mask > 0) & rows


def _spread(mean: float | None, square_mean: float | None) -> float:
    """Standard deviation from E[x] and E[x^2] (0.0 when nothing was measured)."""
    if mean is None or square_mean is None:
        return 0.0
    return math.sqrt(max(0.0, square_mean - mean * mean))


@dataclass(frozen=True)
class _WindowTotals:
    """What one optimizer update's losses are normalised by: its sequences, tokens and turn starts."""

    sequences: int
    tokens: int
    turn_starts: int
    positions: int = 0  # input positions (the load-balancing loss is a mean over them)


def _linear_decay(coef: float, decay_steps: int, updates: int) -> float:
    """``coef`` falling linearly to 0 over ``decay_steps`` updates; constant when decay_steps is 0."""
    if decay_steps <= 0:
        return coef
    return coef * max(0.0, 1.0 - updates / decay_steps)


def generated_token_entropy(rows: torch.Tensor, temperature: float) -> torch.Tensor:
    """Differentiable mean entropy of softmax(rows / T) over (N, V) logits rows, the generated positions
    (made by PolicyForward.logits_at, never a (B, T, V) tensor); a zero with the graph when N = 0."""
    if rows.shape[0] == 0:
        return rows.sum() * 0.0
    logp = torch.log_softmax(rows.float() / temperature, dim=-1)
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


def enable_checkpointing(model: Any) -> None:
    """Recompute each decoder layer's activations in backward, non-reentrant (works when the inputs need
    no grad). transformers 5.24 renamed gradient_checkpointing_enable to activation_checkpointing_enable
    and warns on the old name; older releases have only the old one."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def episode_return(ep: EpisodeSegment) -> float:
    """Total reward of an episode: its turn rewards plus its outcome (0 when the env set none)."""
    return sum(ep.turn_rewards) + (ep.outcome if ep.outcome is not None else 0.0)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


class Trainer:
    """Owns the policy, its AdamW optimizer, the LR schedule and the seeded shuffling generator.

    `model` is a causal LM (HF PreTrainedModel) already in its training dtype; `temperature` must equal
    the sampling temperature of the rollouts (the engine's log-probs are of softmax(logits / T)). `device`
    defaults to where the model's parameters are (the rank's device with `ranks`); `pad_token_id` to the
    model config's.
    `action_token_ids` are the environment's answer tokens (learner.action_prior.action_token_ids); the
    action prior needs them when ``cfg.regularizers.action_prior_coef > 0``.
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
        if not (math.isfinite(temperature) and temperature > 0.0):
            raise ValueError(f"temperature must be a finite number > 0 (the sampling one), got {temperature}")
        if cfg.regularizers.kl_coef > 0.0 and reference is None:
            raise ValueError("kl_coef > 0 needs the frozen reference policy (reference), got none")
        # A model of its own, or a LoRA policy's AdapterOff (the same model with the adapter disabled,
        # which must not be frozen: its adapter is what trains).
        self.reference = reference
        if isinstance(reference, torch.nn.Module):
            reference.eval()
            reference.requires_grad_(False)
        if cfg.regularizers.action_prior_coef > 0.0 and not action_token_ids:
            raise ValueError(
                "action_prior_coef > 0 needs the environment's action tokens (action_token_ids), got none"
            )
        self.model = model
        self.cfg = cfg
        self.temperature = float(temperature)
        if device is None:  # a rank's model may still be on the meta device (learner.sharding)
            device = ranks.device if ranks is not None else next(model.parameters()).device
        self.device = torch.device(device)
        self.precision = resolve_precision(cfg.precision, self.device)
        if cfg.gradient_checkpointing:
            enable_checkpointing(model)
        # On the device once: the prior indexes the logits with them in every forward.
        self.action_ids = torch.tensor(sorted(set(action_token_ids)), dtype=torch.long, device=self.device)
        # Data parallel over `ranks` (learner.distributed): FSDP2 shards the weights (and puts each rank's
        # shards on its device) before the optimizer sees them, so AdamW's state is sharded too. One
        # process trains the model as it is.
        self.ranks = ranks if ranks is not None and ranks.world > 1 else None
        if self.ranks is None:
            self.model.to(self.device)
        else:
            from learner.sharding import shard_policies

            models = [model, *([reference] if isinstance(reference, torch.nn.Module) else [])]
            shard_policies(models, self.ranks, self.precision)
        self.model.train()
        if self.precision.autocast_dtype is not None:
            cache_frozen_casts(model, self.precision.autocast_dtype)  # the same numbers, cast once
        # MoE routing (learner.moe_routing): hooks on the policy's routers, for the routing metrics and
        # replay. A dense policy has none, and refuses the options that need routers.
        self.moe = moe_shape(getattr(model, "config", None))
        if cfg.moe.routing_replay:
            require_moe(model, "learner.moe.routing_replay")
        if cfg.moe.record_routing:
            require_moe(model, "learner.moe.record_routing")
        if cfg.moe.load_balance_coef > 0.0:
            require_moe(model, "learner.moe.load_balance_coef")
        self.router_hooks = RouterHooks(model) if self.moe is not None else None
        self._captured: torch.Tensor | None = None  # routers' own top-k of the last training forward
        # The step's first update runs at the weights its proximal policy is defined by, so its training
        # forward gives the proximal log-probs too and the no-grad pass over its window is skipped. Not
        # with rejection (the window's token counts must be known before its first loss) nor with MoE
        # routers (the proximal pass also measures the routing mismatch).
        self.proximal_from_first_forward = (
            cfg.mismatch.proximal == "learner" and cfg.mismatch.reject == "none" and self.router_hooks is None
        )
        pad = pad_token_id if pad_token_id is not None else getattr(model.config, "pad_token_id", None)
        self.pad_token_id = int(pad) if pad is not None else 0
        self.optimizer = torch.optim.AdamW(
            _param_groups(model, cfg.optim.weight_decay, cfg.optim.embedding_weight_decay),
            lr=cfg.optim.lr,
            betas=(float(cfg.optim.betas[0]), float(cfg.optim.betas[1])),
            weight_decay=cfg.optim.weight_decay,
            # One kernel over all parameters instead of a loop of small ops per tensor: 0.12 s against
            # 0.87 s per update of 135M fp32 parameters on one CPU thread (torch's default there is the
            # per-tensor loop). Sharded parameters keep torch's default.
            fused=True if ranks is None and self.device.type in ("cpu", "cuda") else None,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_factor(cfg.schedule))
        self.generator = torch.Generator().manual_seed(seed)  # mini-batch shuffling
        self.steps = 0  # step() calls
        self.optimizer_updates = 0
        self._policy_version = 0
        self.last_rejected: list[RejectedRow] = []
        # Token-level record of a few trained groups per step for `rollwise inspect` (learner.trace).
        self.tracer = tracer or StepTracer()

    @property
    def policy_version(self) -> int:
        return self._policy_version

    @property
    def entropy_coef(self) -> float:
        """The entropy bonus weight of the next update: ``entropy_coef``, falling linearly to 0 over the
        first ``entropy_decay_steps`` optimizer updates (constant when that is 0). It follows the restored
        update counter, so a resumed run continues the same schedule."""
        return _linear_decay(
            self.cfg.regularizers.entropy_coef,
            self.cfg.regularizers.entropy_decay_steps,
            self.optimizer_updates,
        )

    @property
    def action_prior_coef(self) -> float:
        """The action prior's weight for the next update, on the same linear schedule as the entropy
        bonus (``action_prior_decay_steps``; 0 = constant)."""
        cfg = self.cfg
        return _linear_decay(
            cfg.regularizers.action_prior_coef,
            cfg.regularizers.action_prior_decay_steps,
            self.optimizer_updates,
        )

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
            estimator=self.cfg.advantages.estimator,
            gamma=self.cfg.advantages.gamma,
            lam=self.cfg.advantages.lam,
            # A group without signal still trains the entropy bonus and the action prior: its failed
            # states are exactly where a rarely sampled answer has to be kept alive.
            keep_zero_advantage=self.entropy_coef > 0.0 or self.action_prior_coef > 0.0,
            norm=self.cfg.advantages.norm,
            overlong=(
                (self.cfg.regularizers.overlong_budget, self.cfg.regularizers.overlong_slope)
                if self.cfg.regularizers.overlong_budget
                else None
            ),
        )
        self.last_rejected = data.rejected
        self.tracer.begin(self.steps, data.sequences)
        stats = _UpdateStats()
        if data.sequences:
            try:
                self._update(data.sequences, stats)
            finally:  # any other forward of the policy (the served probe) routes on its own
                if self.router_hooks is not None:
                    self.router_hooks.set_replay(None)
            if self.ranks is not None:
                stats = _UpdateStats.merged(self.ranks.gather(stats))
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
        if self.ranks is not None:
            # Every rank trains a disjoint share of each mini-batch; the losses are normalised by the
            # window's global counts, so the summed gradients are the one-process ones. A rank whose share
            # is empty runs a placeholder: FSDP needs every rank in every forward and backward.
            chunks = [share(chunk, self.ranks.rank, self.ranks.world) for chunk in chunks]
        packs = [
            dataclasses.replace(
                pack_sequences([sequences[i] for i in chunk], pad_id=self.pad_token_id), rows=tuple(chunk)
            )
            if chunk
            else idle_batch(pad_id=self.pad_token_id)
            for chunk in chunks
        ]
        live = [bool(chunk) for chunk in chunks]
        if self.moe is not None and any(s.routed_experts is not None for s in sequences):
            packs = [
                dataclasses.replace(
                    pack,
                    routed=replay_tensor(
                        [sequences[i].routed_experts for i in chunk], pack.input_ids.shape[1], self.moe
                    )[0],
                )
                if chunk
                else pack
                for pack, chunk in zip(packs, chunks, strict=True)
            ]
        accum = self.cfg.optim.grad_accum
        if self.cfg.mismatch.proximal == "learner":
            # Every mini-batch's proximal log-probs are the weights' before the step's first update; the
            # first window's come from its own training forward (`proximal_from_first_forward`).
            first = accum if self.proximal_from_first_forward else 0
            packs = packs[:first] + [self._with_proximal(pack, stats) for pack in packs[first:]]
        elif self.cfg.moe.records_routing:
            for pack in packs:
                self._router_mismatch(pack.to(self.device), stats)
        for start in range(0, len(packs), accum):
            self._optimizer_update(packs[start : start + accum], stats, live[start : start + accum])

    @torch.no_grad()
    def _with_proximal(self, pack: PackedBatch, stats: _UpdateStats) -> PackedBatch:
        """`pack` with the learner's own log-probs (the proximal policy), the mismatch correction's
        importance weights, and its rejected tokens taken out of the loss mask (learner.mismatch)."""
        batch = pack.to(self.device)
        measured = self._router_mismatch(batch, stats)
        if measured is not None:  # both routings were run: the one the loss's forwards use is the proximal
            proximal = measured[1] if self.cfg.moe.routing_replay else measured[0]
        else:
            proximal = self._forward(self.model, batch).logprobs.float()
        return self._corrected(batch, proximal, stats)

    def _corrected(self, batch: PackedBatch, proximal: torch.Tensor, stats: _UpdateStats) -> PackedBatch:
        """`batch` with `proximal` as its proximal log-probs and the mismatch correction they imply."""
        m = self.cfg.mismatch
        c = correct(
            proximal,
            batch.old_logprobs,
            batch.loss_mask,
            weights=m.is_weights,
            cap=m.is_cap,
            reject=m.reject,
            band=m.reject_band,
        )
        stats.add_mismatch(proximal, batch.old_logprobs, batch.loss_mask, self._lag(batch))
        stats.add_correction(c)
        return dataclasses.replace(
            batch, loss_mask=c.keep.float(), proximal_logprobs=proximal, token_weights=c.weights
        )

    @torch.no_grad()
    def _router_mismatch(
        self, batch: PackedBatch, stats: _UpdateStats
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The learner's log-probs of `batch` with its own routing and with the engine's replayed, and
        their distance to the engine's log-probs (the router's share of the mismatch); None unless
        learner.moe asks for routing records. Measured on the weights as they are (the step's start).
        Rows without a record route on their own in both forwards."""
        hooks = self.router_hooks
        # The same decision on every rank (FSDP: every rank runs every forward), a placeholder batch too.
        if hooks is None or not self.cfg.moe.records_routing:
            return None
        own = self._forward(self.model, batch, replay=False).logprobs.float()
        replayed = self._forward(self.model, batch, replay=True).logprobs.float()
        if batch.routed is None:
            return own, replayed
        recorded = (batch.routed[..., 0, 0] >= 0).any(dim=1, keepdim=True)  # rows with a record
        keep = (batch.loss_mask > 0) & recorded
        engine = batch.old_logprobs.float()
        stats.moe.own_abs += float((own - engine).abs()[keep].sum())
        stats.moe.replayed_abs += float((replayed - engine).abs()[keep].sum())
        stats.moe.compared += int(keep.sum())
        return own, replayed

    def _kl_to_reference(
        self, batch: PackedBatch, logprobs: torch.Tensor, stats: _UpdateStats
    ) -> torch.Tensor:
        """Per-token KL estimate of the policy against the frozen reference (learner.regularizers)."""
        entered = (
            self.reference.active() if isinstance(self.reference, AdapterOff) else nullcontext(self.reference)
        )
        with torch.no_grad(), entered as reference:
            ref = self._forward(reference, batch).logprobs
        kl = kl_estimate(logprobs, ref, self.cfg.regularizers.kl_estimator)
        keep = batch.loss_mask > 0
        stats.kl_sum += float(kl.detach()[keep].sum())
        stats.kl_tokens += int(keep.sum())
        return kl

    def _forward(self, model: Any, batch: PackedBatch, *, replay: bool | None = None) -> PolicyForward:
        """One forward of `model` on `batch`. On the policy (not a reference copy) the routers replay the
        batch's engine routing when `replay` (default: learner.moe.routing_replay) and the batch has it;
        the setting stays until the next policy forward, so a layer recomputed in backward sees it too."""
        if self.router_hooks is not None and model is self.model:
            wanted = self.cfg.moe.routing_replay if replay is None else replay
            self.router_hooks.set_replay(batch.routed if wanted else None)
        return forward_policy(
            model,
            batch.input_ids,
            batch.attention_mask,
            batch.targets,
            temperature=self.temperature,
            precision=self.precision,
            device=self.device,
            fused=self.cfg.fused_logprobs,
            scored=batch.loss_mask > 0,
            # An MoE policy's router hooks capture and replay every position of the packed rows in one
            # forward; the shared-prefix forward would split them over two.
            share_prefix=self.cfg.shared_prefix and self.router_hooks is None,
        )

    def _lag(self, batch: PackedBatch) -> torch.Tensor:
        """Versions behind the learner of each generated token at the step's start (negative elsewhere)."""
        return torch.where(batch.versions >= 0, self._policy_version - batch.versions, -1)

    def _optimizer_update(
        self, window: list[PackedBatch], stats: _UpdateStats, live: Sequence[bool] | None = None
    ) -> None:
        """Accumulate gradients over `window` (seq-mean over all its sequences), then one AdamW update.
        `live[i]` is False for a rank's placeholder batch (learner.batching.idle_batch): not counted."""
        self.optimizer.zero_grad(set_to_none=True)
        totals = _WindowTotals(
            sequences=sum(int((b.loss_mask.sum(dim=-1) > 0).sum()) for b in window),
            tokens=sum(b.num_loss_tokens for b in window),
            turn_starts=sum(int(turn_start_mask(b.loss_mask).sum()) for b in window),
            positions=sum(int(_trained_positions(b).sum()) for b in window),
        )
        if self.ranks is not None:
            totals = _WindowTotals(
                *self.ranks.sum_counts(
                    [totals.sequences, totals.tokens, totals.turn_starts, totals.positions]
                )
            )
        if totals.sequences == 0:
            # Mismatch rejection can take every token of a window out of the loss. Nothing to learn from,
            # and an AdamW step on zero gradients would still move the weights (decay, momentum).
            stats.skipped_empty += 1
            return
        window_loss = 0.0
        finite = True
        # The step's first update measures how the routing of its first mini-batch moved (learner.moe).
        measure = (
            self.router_hooks is not None and self.cfg.moe.routing_metrics and not stats.routing_measured
        )
        before: torch.Tensor | None = None
        for index, (packed, counted) in enumerate(
            zip(window, live if live is not None else [True] * len(window), strict=True)
        ):
            batch = packed.to(self.device)
            loss, loss_stats, entropy = self._forward_loss(batch, totals, stats)
            if measure and index == 0:
                before = self._captured
            if counted and self._captured is not None:
                self._count_experts(batch, self._captured, stats)
            if counted:
                stats.add(loss_stats, entropy)
                stats.tokens += packed.num_tokens
                stats.loss_tokens += packed.num_loss_tokens
            if not torch.isfinite(loss):
                finite = False
                if self.ranks is None:
                    break
                # Sharded, every rank must run every backward; all of them skip the update below.
            loss.backward()
            window_loss += float(loss.detach())
        grad_norm = math.nan
        if self.ranks is not None:
            finite = self.ranks.all_true(finite)
        if finite:
            params = [p for group in self.optimizer.param_groups for p in group["params"]]
            if self.ranks is None:
                grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.cfg.optim.grad_clip))
            else:
                from learner.sharding import clip_grad_norm

                grad_norm = clip_grad_norm(params, self.cfg.optim.grad_clip)
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
        if measure and before is not None:
            self._routing_change(
                window[0].to(self.device), before, stats, counted=bool(live is None or live[0])
            )
        stats.losses.append(window_loss)
        stats.grad_norms.append(grad_norm)

    def _count_experts(self, batch: PackedBatch, captured: torch.Tensor, stats: _UpdateStats) -> None:
        """The expert load of a training forward, and how much of it ran on the engine's routing."""
        assert self.moe is not None
        real = batch.attention_mask.reshape(-1) > 0
        stats.moe.add_counts(expert_load(captured, real, self.moe.num_experts))
        stats.moe.positions += int(real.sum())
        if self.cfg.moe.routing_replay and batch.routed is not None:
            recorded = (batch.routed[..., 0, 0] >= 0).reshape(-1)
            stats.moe.replayed_positions += int((recorded & real).sum())

    @torch.no_grad()
    def _routing_change(
        self, batch: PackedBatch, before: torch.Tensor, stats: _UpdateStats, *, counted: bool
    ) -> None:
        """The routers' own top-k of `batch` again after the update, against `before` (its training
        forward's): the share of (position, layer) top-k sets that moved. Every rank runs the forward
        (FSDP); a rank's placeholder batch is not counted."""
        assert self.router_hooks is not None
        with self.router_hooks.capture():
            self._forward(self.model, batch, replay=False)
        after = self.router_hooks.captured()
        stats.routing_measured = True
        if counted:
            stats.moe.add_change(*routing_change(before, after, batch.attention_mask.reshape(-1) > 0))

    def _forward_loss(
        self, batch: PackedBatch, totals: _WindowTotals, stats: _UpdateStats
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], float]:
        self._captured = None
        hooks, balance_coef = self.router_hooks, self.cfg.moe.load_balance_coef
        if hooks is not None:
            hooks.keep_logits = balance_coef > 0.0
        try:
            if hooks is not None and self.cfg.moe.routing_metrics:
                with hooks.capture():
                    out = self._forward(self.model, batch)
                self._captured = hooks.captured()
            else:
                out = self._forward(self.model, batch)
        finally:
            if hooks is not None:
                hooks.keep_logits = False
        logprobs = out.logprobs
        if batch.proximal_logprobs is None and self.cfg.mismatch.proximal == "learner":
            # The first window of a step (`proximal_from_first_forward`): these weights are the proximal's.
            batch = self._corrected(batch, logprobs.detach().float(), stats)
        elif batch.proximal_logprobs is None:
            # The engine's log-probs are the old policy: measure the gap on every mini-batch as it is
            # trained. Once this step has updated the weights, they are a newer policy than any token's
            # (lag >= 1), so lag 0 stays the engine's numerics alone.
            moved = 1 if stats.applied > 0 else 0
            stats.add_mismatch(logprobs, batch.old_logprobs, batch.loss_mask, self._lag(batch) + moved)
        advantages, kl_term = batch.advantages, None
        if self.cfg.regularizers.kl_coef > 0.0:
            kl = self._kl_to_reference(batch, logprobs, stats)
            if self.cfg.regularizers.kl_mode == "reward":
                advantages = advantages - self.cfg.regularizers.kl_coef * kl.detach()
            else:
                keep = batch.loss_mask > 0
                kl_term = torch.where(keep, kl, 0.0).sum() / max(totals.tokens, 1)
        loss, loss_stats = gspo_token_loss(
            logprobs,
            batch.proximal_logprobs if batch.proximal_logprobs is not None else batch.old_logprobs,
            advantages,
            batch.loss_mask,
            clip_low=self.cfg.loss.clip_low,
            clip_high=self.cfg.loss.clip_high,
            level=self.cfg.loss.level,
            num_global_sequences=totals.sequences,
            aggregation=self.cfg.loss.agg,
            num_global_tokens=max(totals.tokens, 1),
            token_weights=batch.token_weights,
        )
        if kl_term is not None:  # this micro-batch's tokens over the window's: they sum to the token mean
            loss = loss + self.cfg.regularizers.kl_coef * kl_term
        if self.tracer.active:
            clip_active = token_clip_active(
                logprobs,
                batch.proximal_logprobs if batch.proximal_logprobs is not None else batch.old_logprobs,
                advantages,
                batch.loss_mask,
                level=self.cfg.loss.level,
                clip_low=self.cfg.loss.clip_low,
                clip_high=self.cfg.loss.clip_high,
            )
            self.tracer.record(batch, logprobs, clip_active)
        entropy = out.entropy(batch.loss_mask, self.temperature)
        # The bonus and the prior are means over this micro-batch; weighted by its share of the window's
        # tokens (turn starts), they sum to the window's mean, as the policy-gradient term does.
        coef = self.entropy_coef
        if coef > 0.0:
            share = batch.num_loss_tokens / max(totals.tokens, 1)
            rows = out.logits_at(batch.loss_mask > 0)
            loss = loss - coef * share * generated_token_entropy(rows, self.temperature)
        if hooks is not None and balance_coef > 0.0:
            # A mean over this micro-batch's positions; weighted by its share of the window's sequences'
            # positions it sums to the window's mean, as the policy-gradient term does.
            assert self.moe is not None
            real = _trained_positions(batch).reshape(-1)
            kept = [k for k in hooks.kept if k is not None]
            hooks.kept = [None] * hooks.layers
            positions = int(real.sum())
            if positions:  # a rank's placeholder batch has none: it adds nothing
                balance = load_balance_loss(kept, real, self.moe.num_experts)
                loss = loss + balance_coef * (positions / max(totals.positions, 1)) * balance
                stats.moe.balance_sum += float(balance.detach()) * positions
                stats.moe.balance_positions += positions
        prior = self.action_prior_coef
        if prior > 0.0:
            share = int(turn_start_mask(batch.loss_mask).sum()) / max(totals.turn_starts, 1)
            rows = out.logits_at(turn_start_mask(batch.loss_mask))
            floor = action_prior_loss_of_rows(rows, self.action_ids, self.temperature)
            loss = loss + prior * share * floor
        return loss, loss_stats, entropy

    def _metrics(self, data: StepInput, stats: _UpdateStats, elapsed: float) -> dict[str, float]:
        episodes = data.episodes
        outcomes = [ep.outcome for ep in episodes if ep.outcome is not None]
        return {
            "loss": _mean(stats.losses),
            **stats.loss_metrics(),
            "ratio_mean": _mean(stats.ratio_means) if stats.ratio_means else 1.0,
            "ratio_min": stats.ratio_min if stats.ratio_means else 1.0,
            "ratio_max": stats.ratio_max if stats.ratio_means else 1.0,
            **stats.mismatch_metrics(),
            **stats.moe.metrics(),
            "kl_reference": _ratio(stats.kl_sum, stats.kl_tokens),
            "overlong_fraction": _ratio(data.overlong_turns, data.turns),
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
            "skipped_updates_empty": float(stats.skipped_empty),
            "rejected_rows": float(len(data.rejected)),
            "untrainable_rows": float(data.untrainable_rows),
            "reward_mean": _mean([episode_return(ep) for ep in episodes]),
            "outcome_mean": _mean([float(o) for o in outcomes]),
            "success_rate": _mean([1.0 if ep.success else 0.0 for ep in episodes]),
            "policy_version": float(self._policy_version),
        }
