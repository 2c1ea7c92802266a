"""One micro-batch's loss as the sum of its terms, each chosen once from the config with its statistics.

`Loss` adds, in this order: the policy surrogate (always), the KL to the frozen reference (kl_mode =
"loss"), the entropy bonus, the MoE load balance and the action prior. Each term's value is already scaled
by its coefficient and by the micro-batch's share of its optimizer update's window (`Window`: sequences,
tokens, turn starts or input positions), so the micro-batches' losses sum to the window's loss. A term
may add nothing to a micro-batch (None): a coefficient decayed to 0, a placeholder batch without positions.
KL with kl_mode = "reward" is no term: it lowers the advantages the policy term reads (`KLReward`).

Each term keeps its statistics of the step in its own object (`new_stats`), merged over ranks by summing
and reported by its `metrics()`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch
from torch import Tensor

from learner.loss.action_prior import action_prior_loss_of_rows, turn_start_mask
from learner.loss.gspo import gspo_token_loss
from learner.loss.load_balance import load_balance_loss
from learner.loss.regularizers import KLEstimator, kl_estimate
from pipeline.contracts.learner_config import LearnerConfig, LossConfig


class Batch(Protocol):
    """What the terms read of a packed mini-batch (learner.batching.PackedBatch), each (B, T)."""

    @property
    def loss_mask(self) -> Tensor: ...
    @property
    def attention_mask(self) -> Tensor: ...
    @property
    def old_logprobs(self) -> Tensor: ...
    @property
    def advantages(self) -> Tensor: ...
    @property
    def proximal_logprobs(self) -> Tensor | None: ...
    @property
    def token_weights(self) -> Tensor | None: ...
    @property
    def num_loss_tokens(self) -> int: ...


class Forward(Protocol):
    """What the terms read of the policy's forward (learner.policy_forward.PolicyForward)."""

    @property
    def logprobs(self) -> Tensor: ...
    def logits_at(self, keep: Tensor) -> Tensor: ...


@dataclass(frozen=True)
class Window:
    """What one optimizer update's losses are normalised by, over all its micro-batches (and ranks)."""

    sequences: int
    tokens: int
    turn_starts: int
    positions: int = 0  # input positions of the rows with a token to train (the load balance's mean)


@dataclass(frozen=True)
class LossInput:
    """One micro-batch as the terms see it. `advantages` are the batch's, or shaped (`KLReward`);
    `updates` counts the optimizer updates so far (the clock of the decaying coefficients)."""

    batch: Batch
    out: Forward
    window: Window
    advantages: Tensor
    updates: int
    counted: bool = True  # False for a rank's placeholder batch (learner.batching.idle_batch)

    @property
    def behaviour(self) -> Tensor:
        """The log-probs the ratios are taken against: the proximal policy's when there is one."""
        proximal = self.batch.proximal_logprobs
        return proximal if proximal is not None else self.batch.old_logprobs


def trained_positions(batch: Batch) -> Tensor:
    """(B, T) bool: the input positions of the rows that have a token to train (what the load-balancing
    loss averages over; a placeholder batch has none)."""
    rows = batch.loss_mask.sum(dim=-1, keepdim=True) > 0
    return (batch.attention_mask > 0) & rows


def linear_decay(coef: float, decay_steps: int, updates: int) -> float:
    """``coef`` falling linearly to 0 over ``decay_steps`` updates; constant when decay_steps is 0."""
    if decay_steps <= 0:
        return coef
    return coef * max(0.0, 1.0 - updates / decay_steps)


def generated_token_entropy(rows: Tensor, temperature: float) -> Tensor:
    """Differentiable mean entropy of softmax(rows / T) over (N, V) logits rows, the generated positions
    (made by PolicyForward.logits_at, never a (B, T, V) tensor); a zero with the graph when N = 0."""
    if rows.shape[0] == 0:
        return rows.sum() * 0.0
    logp = torch.log_softmax(rows.float() / temperature, dim=-1)
    return -(logp.exp() * logp).sum(dim=-1).mean()


def ratio(num: float, den: float) -> float:
    """num / den, 0.0 when nothing was counted."""
    return num / den if den > 0 else 0.0


def _spread(mean: float | None, square_mean: float | None) -> float:
    """Standard deviation from E[x] and E[x^2] (0.0 when nothing was measured)."""
    if mean is None or square_mean is None:
        return 0.0
    return math.sqrt(max(0.0, square_mean - mean * mean))


# --- statistics ----------------------------------------------------------------------------------------
@dataclass
class PolicyStats:
    """The surrogate's ratio and clip statistics, weighted by sequences or by tokens."""

    ratio_means: list[float] = field(default_factory=list)
    ratio_min: float = math.inf
    ratio_max: float = -math.inf
    seq_sums: dict[str, float] = field(default_factory=dict)
    token_sums: dict[str, float] = field(default_factory=dict)
    sequences: int = 0
    scored_tokens: int = 0

    _SEQ = ("clip_fraction", "band_exit_fraction", "seq_log_ratio_abs_mean", "seq_log_ratio_mean",
            "seq_log_ratio_sq_mean")  # fmt: skip
    _TOKEN = ("clip_fraction_token", "token_log_ratio_mean", "token_log_ratio_sq_mean")

    def add(self, stats: dict[str, Tensor]) -> None:
        values = {key: float(value) for key, value in stats.items()}
        n_seq, n_tok = int(values["num_sequences"]), int(values["num_tokens"])
        self.ratio_means.append(values["ratio_mean"])
        self.ratio_min = min(self.ratio_min, values["ratio_min"])
        self.ratio_max = max(self.ratio_max, values["ratio_max"])
        for key in self._SEQ:
            self.seq_sums[key] = self.seq_sums.get(key, 0.0) + values[key] * n_seq
        for key in self._TOKEN:
            self.token_sums[key] = self.token_sums.get(key, 0.0) + values[key] * n_tok
        self.sequences += n_seq
        self.scored_tokens += n_tok

    @staticmethod
    def merged(parts: Sequence[PolicyStats]) -> PolicyStats:
        out = PolicyStats(
            ratio_means=[r for p in parts for r in p.ratio_means],
            ratio_min=min(p.ratio_min for p in parts),
            ratio_max=max(p.ratio_max for p in parts),
        )
        for p in parts:
            for sums, part in ((out.seq_sums, p.seq_sums), (out.token_sums, p.token_sums)):
                for key, value in part.items():
                    sums[key] = sums.get(key, 0.0) + value
            out.sequences += p.sequences
            out.scored_tokens += p.scored_tokens
        return out

    def metrics(self) -> dict[str, float]:
        seq = {k: ratio(v, self.sequences) for k, v in self.seq_sums.items()}
        tok = {k: ratio(v, self.scored_tokens) for k, v in self.token_sums.items()}
        measured = bool(self.ratio_means)
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
            "ratio_mean": sum(self.ratio_means) / len(self.ratio_means) if measured else 1.0,
            "ratio_min": self.ratio_min if measured else 1.0,
            "ratio_max": self.ratio_max if measured else 1.0,
        }


@dataclass
class TermMean:
    """A term's weighted mean over the step, reported as `key` (always, or only once measured)."""

    key: str
    always: bool
    total: float = 0.0
    weight: int = 0

    def add(self, total: float, weight: int) -> None:
        self.total += total
        self.weight += weight

    @staticmethod
    def merged(parts: Sequence[TermMean]) -> TermMean:
        out = TermMean(parts[0].key, parts[0].always)
        for p in parts:
            out.add(p.total, p.weight)
        return out

    def metrics(self) -> dict[str, float]:
        if self.weight or self.always:
            return {self.key: ratio(self.total, self.weight)}
        return {}


@dataclass
class NoStats:
    """The statistics of a term that keeps none."""

    @staticmethod
    def merged(parts: Sequence[NoStats]) -> NoStats:
        return NoStats()

    def metrics(self) -> dict[str, float]:
        return {}


# --- terms ---------------------------------------------------------------------------------------------
class Term(Protocol):
    """A summand of the loss: its (scaled) value on one micro-batch, or None when it adds nothing."""

    name: str

    def new_stats(self) -> Any: ...
    def __call__(self, inp: LossInput, stats: Any) -> Tensor | None: ...


class PolicyTerm:
    """The clipped GSPO / GSPO-token / token-PPO surrogate (learner.loss.gspo), normalised by the window."""

    name = "policy"

    def __init__(self, cfg: LossConfig) -> None:
        self.cfg = cfg

    def new_stats(self) -> PolicyStats:
        return PolicyStats()

    def __call__(self, inp: LossInput, stats: PolicyStats) -> Tensor:
        loss, loss_stats = gspo_token_loss(
            inp.out.logprobs,
            inp.behaviour,
            inp.advantages,
            inp.batch.loss_mask,
            clip_low=self.cfg.clip_low,
            clip_high=self.cfg.clip_high,
            level=self.cfg.level,
            num_global_sequences=inp.window.sequences,
            aggregation=self.cfg.agg,
            num_global_tokens=max(inp.window.tokens, 1),
            token_weights=inp.batch.token_weights,
        )
        if inp.counted:
            stats.add(loss_stats)
        return loss


class ReferenceKL:
    """The per-token KL estimate of the policy against the frozen reference, and its mean as statistic.
    `reference(batch)` gives the reference's log-probs of the batch (no gradient)."""

    name = "kl"

    def __init__(self, reference: Callable[[Any], Tensor], estimator: KLEstimator, coef: float) -> None:
        self.reference, self.estimator, self.coef = reference, estimator, coef

    def new_stats(self) -> TermMean:
        return TermMean("kl_reference", always=True)

    def estimate(self, inp: LossInput, stats: TermMean) -> Tensor:
        kl = kl_estimate(inp.out.logprobs, self.reference(inp.batch), self.estimator)
        keep = inp.batch.loss_mask > 0
        stats.add(float(kl.detach()[keep].sum()), int(keep.sum()))
        return kl


class KLTerm(ReferenceKL):
    """kl_mode = "loss": coef x the token mean of the KL estimate over the window."""

    def __call__(self, inp: LossInput, stats: TermMean) -> Tensor:
        kl = self.estimate(inp, stats)
        keep = inp.batch.loss_mask > 0
        # This micro-batch's tokens over the window's: they sum to the token mean.
        return self.coef * (torch.where(keep, kl, 0.0).sum() / max(inp.window.tokens, 1))


class KLReward(ReferenceKL):
    """kl_mode = "reward": the advantages lowered by coef x the KL estimate of each token."""

    def shape(self, inp: LossInput, stats: TermMean) -> LossInput:
        kl = self.estimate(inp, stats)
        return replace(inp, advantages=inp.advantages - self.coef * kl.detach())


class EntropyTerm:
    """The entropy bonus at the generated positions, on its linear decay (a negative summand)."""

    name = "entropy"

    def __init__(self, coef: float, decay_steps: int, temperature: float) -> None:
        self.coef, self.decay_steps, self.temperature = coef, decay_steps, temperature

    def new_stats(self) -> NoStats:
        return NoStats()

    def __call__(self, inp: LossInput, stats: NoStats) -> Tensor | None:
        coef = linear_decay(self.coef, self.decay_steps, inp.updates)
        if coef <= 0.0:
            return None
        # A mean over this micro-batch; weighted by its share of the window's tokens it sums to the
        # window's mean, as the policy term does.
        share = inp.batch.num_loss_tokens / max(inp.window.tokens, 1)
        rows = inp.out.logits_at(inp.batch.loss_mask > 0)
        return -(coef * share) * generated_token_entropy(rows, self.temperature)


class LoadBalanceTerm:
    """The MoE routers' load-balancing loss (learner.loss.load_balance) of the training forward.
    `router_logits()` hands over (and forgets) what the routers kept of that forward."""

    name = "load_balance"

    def __init__(
        self, coef: float, num_experts: int, router_logits: Callable[[], list[tuple[Tensor, Tensor]]]
    ) -> None:
        self.coef, self.num_experts, self.router_logits = coef, num_experts, router_logits

    def new_stats(self) -> TermMean:
        return TermMean("moe_load_balance_loss", always=False)

    def __call__(self, inp: LossInput, stats: TermMean) -> Tensor | None:
        # A mean over this micro-batch's positions; weighted by its share of the window's positions it
        # sums to the window's mean, as the policy term does.
        real = trained_positions(inp.batch).reshape(-1)
        kept = self.router_logits()
        positions = int(real.sum())
        if not positions:  # a rank's placeholder batch has none: it adds nothing
            return None
        balance = load_balance_loss(kept, real, self.num_experts)
        stats.add(float(balance.detach()) * positions, positions)
        return self.coef * (positions / max(inp.window.positions, 1)) * balance


class ActionPriorTerm:
    """The action prior (learner.loss.action_prior) at the turn starts, on its linear decay."""

    name = "action_prior"

    def __init__(self, coef: float, decay_steps: int, action_ids: Tensor, temperature: float) -> None:
        self.coef, self.decay_steps, self.action_ids, self.temperature = (
            coef,
            decay_steps,
            action_ids,
            temperature,
        )

    def new_stats(self) -> NoStats:
        return NoStats()

    def __call__(self, inp: LossInput, stats: NoStats) -> Tensor | None:
        coef = linear_decay(self.coef, self.decay_steps, inp.updates)
        if coef <= 0.0:
            return None
        starts = turn_start_mask(inp.batch.loss_mask)
        share = int(starts.sum()) / max(inp.window.turn_starts, 1)
        floor = action_prior_loss_of_rows(inp.out.logits_at(starts), self.action_ids, self.temperature)
        return coef * share * floor


class Loss:
    """The terms of a config, summed in order, and the advantage shaping before them (`KLReward`)."""

    def __init__(self, terms: Sequence[Term], shaping: KLReward | None = None) -> None:
        self.terms, self.shaping = list(terms), shaping

    def new_stats(self) -> dict[str, Any]:
        parts: list[Any] = [*self.terms, *([self.shaping] if self.shaping is not None else [])]
        return {part.name: part.new_stats() for part in parts}

    def shaped(self, inp: LossInput, stats: dict[str, Any]) -> LossInput:
        return inp if self.shaping is None else self.shaping.shape(inp, stats[self.shaping.name])

    def __call__(self, inp: LossInput, stats: dict[str, Any]) -> Tensor:
        total: Tensor | None = None
        for term in self.terms:
            value = term(inp, stats[term.name])
            if value is not None:
                total = value if total is None else total + value
        assert total is not None, "the policy term always adds"
        return total


@dataclass(frozen=True)
class LossParts:
    """What the terms need beyond the config: the reference's log-probs (KL), the routers' kept logits
    and expert count (load balance), the action tokens on the device (action prior)."""

    temperature: float
    reference: Callable[[Any], Tensor] | None = None
    router_logits: Callable[[], list[tuple[Tensor, Tensor]]] | None = None
    num_experts: int = 0
    action_ids: Tensor | None = None


def build_loss(cfg: LearnerConfig, parts: LossParts) -> Loss:
    """The terms `cfg` turns on, in the order they are summed."""
    reg = cfg.regularizers
    terms: list[Term] = [PolicyTerm(cfg.loss)]
    shaping = None
    if reg.kl_coef > 0.0:
        assert parts.reference is not None, "kl_coef > 0 needs the reference"
        if reg.kl_mode == "reward":
            shaping = KLReward(parts.reference, reg.kl_estimator, reg.kl_coef)
        else:
            terms.append(KLTerm(parts.reference, reg.kl_estimator, reg.kl_coef))
    if reg.entropy_coef > 0.0:
        terms.append(EntropyTerm(reg.entropy_coef, reg.entropy_decay_steps, parts.temperature))
    if cfg.moe.load_balance_coef > 0.0:
        assert parts.router_logits is not None, "the load balance needs the routers"
        terms.append(LoadBalanceTerm(cfg.moe.load_balance_coef, parts.num_experts, parts.router_logits))
    if reg.action_prior_coef > 0.0:
        assert parts.action_ids is not None, "the action prior needs the action tokens"
        terms.append(
            ActionPriorTerm(
                reg.action_prior_coef, reg.action_prior_decay_steps, parts.action_ids, parts.temperature
            )
        )
    return Loss(terms, shaping)
