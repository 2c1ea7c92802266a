"""One training step's statistics, summed over its mini-batches (and ranks), and the metrics they give.

The loss terms keep their own statistics (learner.loss.terms) in `StepStats.terms`; what is kept here
belongs to the step itself: the window losses and gradient norms, the entropy of the training forwards,
the learner/engine mismatch and its correction, and the MoE routing measurements.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from learner.loss.gspo import MAX_LOG_RATIO
from learner.loss.mismatch import Correction
from learner.loss.terms import ratio
from learner.model.moe_routing import MoeStats
from learner.step_input import StepInput, episode_return


@dataclass
class StepStats:
    """Accumulates the statistics of every mini-batch of one step (weighted by sequences or tokens)."""

    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    entropies: list[float] = field(default_factory=list)
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
    corrected_tokens: int = 0
    rejected_tokens: int = 0
    truncated_tokens: int = 0
    weight_sum: float = 0.0
    weight_max: float = 0.0
    moe: MoeStats = field(default_factory=MoeStats)  # MoE routing measurements (learner.model.moe_routing)
    routing_measured: bool = False  # the step's routing change was measured (its first update)
    terms: dict[str, Any] = field(default_factory=dict)  # each loss term's own (learner.loss.terms)

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
    def merged(parts: Sequence[StepStats]) -> StepStats:
        """One step's statistics over every rank's share of it. The update counts, learning rate and
        gradient norms are the same on every rank (the norm is global); window losses are partial sums."""
        first = parts[0]
        out = StepStats(
            losses=[sum(values) for values in zip(*(p.losses for p in parts), strict=True)],
            grad_norms=list(first.grad_norms),
            entropies=[e for p in parts for e in p.entropies],
            lr=first.lr,
            applied=first.applied,
            skipped_nonfinite=first.skipped_nonfinite,
            skipped_empty=first.skipped_empty,
            weight_max=max(p.weight_max for p in parts),
            moe=MoeStats.merged([p.moe for p in parts]),
            terms={name: type(s).merged([p.terms[name] for p in parts]) for name, s in first.terms.items()},
        )
        for p in parts:
            for key, (total, count) in p.mismatch.items():
                out.mismatch[key][0] += total
                out.mismatch[key][1] += count
            for name in (
                "tokens", "loss_tokens", "corrected_tokens", "rejected_tokens", "truncated_tokens",
                "weight_sum",
            ):  # fmt: skip
                setattr(out, name, getattr(out, name) + getattr(p, name))
        return out

    def mismatch_metrics(self) -> dict[str, float]:
        lag0, lag1, k3 = (self.mismatch[k] for k in ("lag0", "lag1plus", "k3"))
        kept = self.corrected_tokens - self.rejected_tokens
        return {
            "mismatch_abs_mean": ratio(lag0[0] + lag1[0], lag0[1] + lag1[1]),
            "mismatch_abs_mean_lag0": ratio(*lag0),
            "mismatch_abs_mean_lag1plus": ratio(*lag1),
            "mismatch_k3": ratio(*k3),
            "is_weight_mean": ratio(self.weight_sum, kept) if self.corrected_tokens else 1.0,
            "is_weight_max": self.weight_max if self.corrected_tokens else 1.0,
            "is_truncated_fraction": ratio(self.truncated_tokens, kept),
            "rejected_fraction": ratio(self.rejected_tokens, self.corrected_tokens),
        }

    def term_metrics(self) -> dict[str, float]:
        return {key: value for part in self.terms.values() for key, value in part.metrics().items()}


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


@dataclass(frozen=True)
class StepClock:
    """The trainer's side of a step's metrics: its coefficients, learning rate and policy version."""

    entropy_coef: float
    action_prior_coef: float
    lr: float  # the optimizer's current learning rate (reported when no update was applied)
    policy_version: int


def step_metrics(data: StepInput, stats: StepStats, elapsed: float, clock: StepClock) -> dict[str, float]:
    """The metrics of one step (docs/metrics.md)."""
    episodes = data.episodes
    outcomes = [ep.outcome for ep in episodes if ep.outcome is not None]
    return {
        "loss": _mean(stats.losses),
        "kl_reference": 0.0,  # without a KL term
        **stats.term_metrics(),
        **stats.mismatch_metrics(),
        **stats.moe.metrics(),
        "overlong_fraction": ratio(data.overlong_turns, data.turns),
        "entropy": _mean(stats.entropies),
        "entropy_coef": clock.entropy_coef,
        "action_prior_coef": clock.action_prior_coef,
        "grad_norm": _mean(stats.grad_norms),
        "lr": stats.lr if stats.applied else clock.lr,
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
        "policy_version": float(clock.policy_version),
    }
