"""Dashboards as code: builds grafana/dashboards/*.json with Grafana's own Python SDK.

    .venv/bin/python grafana/generate.py          # rewrite the committed JSON
    .venv/bin/python grafana/generate.py --check  # exit 1 if the committed JSON is stale

Every panel: the `${datasource}` variable, a unit, a description naming the metric it reads, and
PromQL that exports counts and lets Prometheus compute ratios over `$__rate_interval`.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders import dashboard as gd
from grafana_foundation_sdk.builders import prometheus, stat, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import dashboard as dm

OUT_DIR = Path(__file__).parent / "dashboards"
GRAFANA_SCHEMA_VERSION = 39  # Grafana 11.x
DS = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")
RI = "$__rate_interval"
SEL = 'instance=~"$instance"'
SEL_ENV = 'instance=~"$instance", env=~"$env"'


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True)
class PanelSpec:
    title: str
    description: str
    unit: str
    queries: tuple[Query, ...]
    kind: str = "timeseries"  # or "stat"
    width: int = 12


@dataclass
class DashboardSpec:
    uid: str
    title: str
    description: str
    rows: list[tuple[str, list[PanelSpec]]] = field(default_factory=list)
    env_variable: bool = True
    instance_metric: str = "rollwise_supervisor_start_time_seconds"


def q(expr: str, legend: str = "") -> Query:
    return Query(expr, legend)


def quantiles(
    metric: str, sel: str, by: str = "", qs: tuple[float, ...] = (0.5, 0.9, 0.99)
) -> tuple[Query, ...]:
    group = f"le{', ' + by if by else ''}"
    legend_by = f"{{{{{by}}}}} " if by else ""
    return tuple(
        q(
            f"histogram_quantile({x}, sum by ({group}) (rate({metric}_bucket{{{sel}}}[{RI}])))",
            f"{legend_by}p{int(x * 100)}",
        )
        for x in qs
    )


def hist_mean(metric: str, sel: str, by: str = "env") -> Query:
    return q(
        f"sum by ({by}) (rate({metric}_sum{{{sel}}}[{RI}])) / "
        f"sum by ({by}) (rate({metric}_count{{{sel}}}[{RI}]))",
        f"{{{{{by}}}}}",
    )


def overview() -> DashboardSpec:
    d = DashboardSpec(
        "rollwise-overview", "rollwise / pipeline overview", "Throughput, reward, success, staleness."
    )
    d.rows.append(
        (
            "Progress",
            [
                PanelSpec(
                    "Policy version",
                    "rollwise_policy_version (published by the learner) and rollwise_engine_policy_version "
                    "(served by each engine after the last weight sync).",
                    "none",
                    (
                        q(f"max(rollwise_policy_version{{{SEL}}})", "published"),
                        q(f"max by (engine) (rollwise_engine_policy_version{{{SEL}}})", "served {{engine}}"),
                    ),
                ),
                PanelSpec(
                    "Success rate",
                    "rate(rollwise_episode_successes_total) / rate(rollwise_episodes_total): episodes whose "
                    "outcome reached 1.0.",
                    "percentunit",
                    (
                        q(
                            f"sum by (env) (rate(rollwise_episode_successes_total{{{SEL_ENV}}}[{RI}])) / "
                            f"sum by (env) (rate(rollwise_episodes_total{{{SEL_ENV}}}[{RI}]))",
                            "{{env}}",
                        ),
                    ),
                ),
                PanelSpec(
                    "Episode reward (mean)",
                    "(rate(rollwise_episode_reward_positive_total) - "
                    "rate(rollwise_episode_reward_negative_total)) / rate(rollwise_episode_reward_count): "
                    "the histogram has negative buckets, so no _sum.",
                    "none",
                    (
                        q(
                            "(sum by (env) (rate(rollwise_episode_reward_positive_total"
                            f"{{{SEL_ENV}}}[{RI}])) - "
                            "sum by (env) (rate(rollwise_episode_reward_negative_total"
                            f"{{{SEL_ENV}}}[{RI}]))) / "
                            f"sum by (env) (rate(rollwise_episode_reward_count{{{SEL_ENV}}}[{RI}]))",
                            "{{env}}",
                        ),
                    ),
                ),
                PanelSpec(
                    "Episodes per second",
                    "rate(rollwise_episodes_total) by env and finish reason.",
                    "ops",
                    (
                        q(
                            f"sum by (env, reason) (rate(rollwise_episodes_total{{{SEL_ENV}}}[{RI}]))",
                            "{{env}} {{reason}}",
                        ),
                    ),
                ),
            ],
        )
    )
    prompt, cached, generated = (
        f"sum by (env) (rate(rollwise_{name}_total{{{SEL_ENV}}}[{RI}]))"
        for name in ("prompt_tokens", "prompt_tokens_cached", "generated_tokens")
    )
    d.rows.append(
        (
            "Throughput",
            [
                PanelSpec(
                    "Turns and generated tokens per second",
                    "rate(rollwise_turns_total) and rate(rollwise_generated_tokens_total).",
                    "ops",
                    (
                        q(f"sum by (env) (rate(rollwise_turns_total{{{SEL_ENV}}}[{RI}]))", "turns {{env}}"),
                        q(
                            f"sum by (env) (rate(rollwise_generated_tokens_total{{{SEL_ENV}}}[{RI}]))",
                            "tokens {{env}}",
                        ),
                    ),
                ),
                PanelSpec(
                    "Prefill per generated token, and the prefix cache's share",
                    "rate(rollwise_prompt_tokens_total) / rate(rollwise_generated_tokens_total): the context "
                    "tokens each generated token costs to prefill without a cache; minus the cached ones "
                    "(rollwise_prompt_tokens_cached_total): what the engines prefilled. Cached share: the "
                    "prefix cache's hit rate on the episodes' prompts (low with session affinity on: look at "
                    "the router's policy).",
                    "short",
                    (
                        q(f"{prompt} / {generated}", "prompt / generated {{env}}"),
                        q(f"({prompt} - {cached}) / {generated}", "prefilled / generated {{env}}"),
                        q(f"{cached} / {prompt}", "cached share {{env}}"),
                    ),
                ),
                PanelSpec(
                    "Turns per episode, tokens per turn (mean)",
                    "rollwise_episode_turns and rollwise_turn_generated_tokens histograms.",
                    "short",
                    (
                        hist_mean("rollwise_episode_turns", SEL_ENV),
                        hist_mean("rollwise_turn_generated_tokens", SEL_ENV),
                    ),
                ),
                PanelSpec(
                    "In-flight episodes, queued groups, concurrency limit",
                    "rollwise_episodes_in_flight; rollwise_groups_queued: groups staleness admission "
                    "allows but that wait for a free actor slot (> 0: rollout is the bottleneck); "
                    "rollwise_admission_concurrency_limit: the groups that may run at once (adaptive: it "
                    "falls while the engines queue requests).",
                    "short",
                    (
                        q(f"sum(rollwise_episodes_in_flight{{{SEL}}})", "episodes in flight"),
                        q(f"sum(rollwise_groups_queued{{{SEL}}})", "groups queued"),
                        q(f"max(rollwise_admission_concurrency_limit{{{SEL}}})", "concurrency limit"),
                    ),
                ),
                PanelSpec(
                    "Groups admitted, written, accepted",
                    "rate of rollwise_groups_admitted_total, rollwise_groups_written_total, "
                    "rollwise_groups_accepted_total.",
                    "ops",
                    (
                        q(f"sum(rate(rollwise_groups_admitted_total{{{SEL}}}[{RI}]))", "admitted"),
                        q(f"sum(rate(rollwise_groups_written_total{{{SEL}}}[{RI}]))", "written"),
                        q(f"sum(rate(rollwise_groups_accepted_total{{{SEL}}}[{RI}]))", "accepted"),
                    ),
                ),
            ],
        )
    )
    d.rows.append(
        (
            "Staleness",
            [
                PanelSpec(
                    "Staleness of trained tokens",
                    "rollwise_trained_token_staleness_versions histogram: policy version at training minus "
                    "the version that generated the token.",
                    "short",
                    quantiles("rollwise_trained_token_staleness_versions", SEL, qs=(0.5, 0.9, 1.0)),
                ),
                PanelSpec(
                    "Where staleness accrues: in flight and in the queue (mean)",
                    "Of a trained token's staleness, the versions that passed before its group was written "
                    "(rollwise_trained_token_staleness_in_flight_versions: long groups) and while it waited "
                    "in the spool (..._in_queue_versions: a learner behind the actors).",
                    "short",
                    tuple(
                        q(
                            f"sum(rate({metric}_sum{{{SEL}}}[{RI}])) / "
                            f"sum(rate({metric}_count{{{SEL}}}[{RI}]))",
                            label,
                        )
                        for metric, label in (
                            ("rollwise_trained_token_staleness_in_flight_versions", "in flight"),
                            ("rollwise_trained_token_staleness_in_queue_versions", "in the queue"),
                        )
                    ),
                ),
                PanelSpec(
                    "Idle fractions",
                    "Learner: rate(rollwise_learner_idle_seconds_total) over idle + busy. Actors: "
                    "rate(rollwise_actor_idle_seconds_total) (seconds held back per second).",
                    "percentunit",
                    (
                        q(
                            f"sum(rate(rollwise_learner_idle_seconds_total{{{SEL}}}[{RI}])) / "
                            f"(sum(rate(rollwise_learner_idle_seconds_total{{{SEL}}}[{RI}])) + "
                            f"sum(rate(rollwise_learner_busy_seconds_total{{{SEL}}}[{RI}])))",
                            "learner idle",
                        ),
                        q(f"sum(rate(rollwise_actor_idle_seconds_total{{{SEL}}}[{RI}]))", "actors held back"),
                    ),
                ),
            ],
        )
    )
    d.rows.append(
        (
            "Held-out evaluation",
            [
                PanelSpec(
                    "Held-out eval success",
                    "rollwise_eval_success_ratio (greedy and sampled episodes of the last evaluation on the "
                    "held-out tasks, [eval]) and rollwise_eval_pass_at_k_ratio of the sampled mode (a task "
                    "counts when one of its k episodes solved it). Not training episodes: see Success rate.",
                    "percentunit",
                    (
                        q(f"max by (env, mode) (rollwise_eval_success_ratio{{{SEL}}})", "{{env}} {{mode}}"),
                        q(
                            f'max by (env) (rollwise_eval_pass_at_k_ratio{{{SEL}, mode="sampled"}})',
                            "{{env}} pass@k",
                        ),
                    ),
                ),
                PanelSpec(
                    "Held-out eval reward and turns",
                    "rollwise_eval_reward_mean (turn rewards plus outcome) and rollwise_eval_turns_mean of "
                    "the last evaluation (rollwise_eval_policy_version: the version it evaluated).",
                    "short",
                    (
                        q(
                            f"max by (env, mode) (rollwise_eval_reward_mean{{{SEL}}})",
                            "reward {{env}} {{mode}}",
                        ),
                        q(
                            f"max by (env, mode) (rollwise_eval_turns_mean{{{SEL}}})",
                            "turns {{env}} {{mode}}",
                        ),
                    ),
                ),
                PanelSpec(
                    "Eval's share of engine time",
                    "rollwise_eval_engine_seconds_total: wall seconds evaluations ran, per second: on the "
                    "training engines (kind=training, since the supervisor started and over the rate "
                    "interval, where each evaluation shows as a burst) against the budget "
                    "rollwise_eval_engine_share_budget_ratio (eval.max_engine_share); on a dedicated "
                    "evaluation engine (kind=dedicated) it is that engine's busy share, which costs "
                    "training nothing.",
                    "percentunit",
                    (
                        q(
                            "sum by (instance, env) "
                            f'(rollwise_eval_engine_seconds_total{{{SEL}, kind="training"}})'
                            " / on (instance) group_left () max by (instance) "
                            f"(time() - rollwise_supervisor_start_time_seconds{{{SEL}}})",
                            "{{env}} training engines, since start",
                        ),
                        q(
                            f"sum by (env, kind) (rate(rollwise_eval_engine_seconds_total{{{SEL}}}[{RI}]))",
                            "{{env}} {{kind}}",
                        ),
                        q(
                            f"max by (env) (rollwise_eval_engine_share_budget_ratio{{{SEL}}})",
                            "{{env}} budget",
                        ),
                    ),
                ),
                PanelSpec(
                    "Eval versions behind",
                    "rollwise_eval_lag_versions: versions the learner had published past the evaluated one "
                    "when the last evaluation finished (its row's versions_behind in logs/eval.jsonl), and "
                    "rollwise_eval_deferred_total: served versions a trigger made due that waited for a "
                    "running evaluation or for the budget.",
                    "short",
                    (
                        q(f"max by (env) (rollwise_eval_lag_versions{{{SEL}}})", "{{env}} versions behind"),
                        q(
                            f"sum by (env, reason) (increase(rollwise_eval_deferred_total{{{SEL}}}[{RI}]))",
                            "{{env}} deferred ({{reason}})",
                        ),
                    ),
                ),
            ],
        )
    )
    return d


def learner() -> DashboardSpec:
    d = DashboardSpec("rollwise-learner", "rollwise / learner", "GSPO-token internals.", env_variable=False)
    d.rows.append(
        (
            "Objective",
            [
                PanelSpec(
                    "Loss",
                    "rollwise_learner_loss (last step).",
                    "none",
                    (q(f"rollwise_learner_loss{{{SEL}}}", "loss"),),
                ),
                PanelSpec(
                    "Clip fraction",
                    "rollwise_learner_clip_fraction_ratio (sequences clipped), "
                    "rollwise_learner_clip_fraction_token_ratio (tokens clipped) and "
                    "rollwise_learner_band_exit_ratio (sequences outside the band, any advantage sign).",
                    "percentunit",
                    (
                        q(f"rollwise_learner_clip_fraction_ratio{{{SEL}}}", "sequences clipped"),
                        q(f"rollwise_learner_clip_fraction_token_ratio{{{SEL}}}", "tokens clipped"),
                        q(f"rollwise_learner_band_exit_ratio{{{SEL}}}", "outside the band"),
                    ),
                ),
                PanelSpec(
                    "Importance ratio",
                    "rollwise_learner_importance_ratio histogram (sequence ratios per step).",
                    "none",
                    quantiles("rollwise_learner_importance_ratio", SEL, qs=(0.01, 0.5, 0.99)),
                ),
                PanelSpec(
                    "Train vs engine log-prob mismatch",
                    "rollwise_learner_logprob_mismatch_abs_by_lag: mean |dlogp| of tokens trained on the "
                    "weights that sampled them (lag 0: numerics) and on newer ones (lag 1+); "
                    "rollwise_learner_logprob_mismatch_k3_kl; rollwise_learner_sequence_log_ratio_abs "
                    "(mean |log s_i|, against the clip band).",
                    "none",
                    (
                        q(
                            f"rollwise_learner_logprob_mismatch_abs_by_lag{{{SEL}}}",
                            "mean |dlogp| lag {{lag}}",
                        ),
                        q(f"rollwise_learner_logprob_mismatch_k3_kl{{{SEL}}}", "k3 KL"),
                        q(f"rollwise_learner_sequence_log_ratio_abs{{{SEL}}}", "mean |log s|"),
                    ),
                ),
                PanelSpec(
                    "Importance-ratio spread: tokens vs sequences",
                    "rollwise_learner_log_ratio_spread{level}: standard deviation of the last step's log "
                    "importance ratios per token (log r_t, what GRPO clips) and per sequence (log s_i, the "
                    "mean over a sequence's tokens, what GSPO clips).",
                    "none",
                    (q(f"rollwise_learner_log_ratio_spread{{{SEL}}}", "std of log ratio, {{level}}"),),
                ),
                PanelSpec(
                    "Mismatch correction",
                    "learner.mismatch: rollwise_learner_is_weight{stat} (truncated importance weights), "
                    "rollwise_learner_is_truncated_ratio (weights at the cap) and "
                    "rollwise_learner_rejected_tokens_ratio (tokens masked out). Weights stay 1 and the "
                    "ratios 0 without a correction.",
                    "none",
                    (
                        q(f"rollwise_learner_is_weight{{{SEL}}}", "IS weight {{stat}}"),
                        q(f"rollwise_learner_is_truncated_ratio{{{SEL}}}", "truncated"),
                        q(f"rollwise_learner_rejected_tokens_ratio{{{SEL}}}", "rejected"),
                    ),
                ),
            ],
        )
    )
    d.rows.append(
        (
            "Mixture of Experts (MoE models only; no data for a dense model)",
            [
                PanelSpec(
                    "Routing change after an update",
                    "rollwise_learner_moe_routing_change_ratio{stat}: share of token positions whose set of "
                    "top-k experts changed after the step's first update, on the same inputs (mean over the "
                    "layers, and the most volatile layer). The GSPO paper reports ~10% on Qwen3-30B-A3B.",
                    "percentunit",
                    (q(f"rollwise_learner_moe_routing_change_ratio{{{SEL}}}", "{{stat}} over layers"),),
                    width=8,
                ),
                PanelSpec(
                    "Expert load imbalance",
                    "rollwise_learner_moe_load_imbalance{stat}: the most loaded expert's assignments over "
                    "the mean per expert in the last step's training forwards (1 = balanced), mean over the "
                    "layers and the worst layer.",
                    "none",
                    (q(f"rollwise_learner_moe_load_imbalance{{{SEL}}}", "{{stat}} over layers"),),
                    width=8,
                ),
                PanelSpec(
                    "Router's share of the engine/learner mismatch",
                    "1 - rollwise_learner_router_mismatch_abs{routing=replayed} / {routing=own}: the part "
                    "of the mean |learner - engine| log-prob that replaying the engine's routing removes "
                    "(needs learner.moe.record_routing or routing_replay).",
                    "percentunit",
                    (
                        q(
                            f'1 - rollwise_learner_router_mismatch_abs{{{SEL}, routing="replayed"}} / '
                            f'ignoring(routing) rollwise_learner_router_mismatch_abs{{{SEL}, routing="own"}}',
                            "router's share",
                        ),
                    ),
                    width=8,
                ),
                PanelSpec(
                    "Engine/learner mismatch by routing",
                    "rollwise_learner_router_mismatch_abs{routing}: mean |learner - engine| log-prob of the "
                    "last step's generated tokens at the step's start, with the learner's own routing and "
                    "with the engine's replayed.",
                    "none",
                    (
                        q(
                            f"rollwise_learner_router_mismatch_abs{{{SEL}}}",
                            "mean |dlogp|, {{routing}} routing",
                        ),
                    ),
                ),
            ],
        )
    )
    d.rows.append(
        (
            "Optimisation",
            [
                PanelSpec(
                    "Entropy",
                    "rollwise_learner_entropy_nats.",
                    "none",
                    (q(f"rollwise_learner_entropy_nats{{{SEL}}}", "entropy"),),
                ),
                PanelSpec(
                    "Gradient norm and learning rate",
                    "rollwise_learner_grad_norm (before clipping) and rollwise_learner_learning_rate.",
                    "none",
                    (
                        q(f"rollwise_learner_grad_norm{{{SEL}}}", "grad norm"),
                        q(f"rollwise_learner_learning_rate{{{SEL}}}", "lr"),
                    ),
                ),
                PanelSpec(
                    "Regularisers",
                    "rollwise_learner_kl_reference (KL estimate to the initial weights; 0 with kl_coef 0) "
                    "and rollwise_learner_overlong_turns_ratio (turns DAPO's over-long penalty reached).",
                    "none",
                    (
                        q(f"rollwise_learner_kl_reference{{{SEL}}}", "KL to reference"),
                        q(f"rollwise_learner_overlong_turns_ratio{{{SEL}}}", "over-long turns"),
                    ),
                ),
                PanelSpec(
                    "Tokens trained per second",
                    "rate(rollwise_learner_tokens_total).",
                    "ops",
                    (q(f"sum(rate(rollwise_learner_tokens_total{{{SEL}}}[{RI}]))", "tokens/s"),),
                ),
                PanelSpec(
                    "Step duration",
                    "rollwise_learner_step_duration_seconds histogram.",
                    "s",
                    quantiles("rollwise_learner_step_duration_seconds", SEL, qs=(0.5, 0.9)),
                ),
                PanelSpec(
                    "Learner step",
                    "rollwise_learner_step (restored on resume).",
                    "none",
                    (q(f"max(rollwise_learner_step{{{SEL}}})", "step"),),
                    kind="stat",
                    width=6,
                ),
                PanelSpec(
                    "Skipped steps and groups",
                    "increase(rollwise_learner_skipped_total) by reason.",
                    "short",
                    (
                        q(
                            f"sum by (reason) (increase(rollwise_learner_skipped_total{{{SEL}}}[{RI}]))",
                            "{{reason}}",
                        ),
                    ),
                    width=6,
                ),
                PanelSpec(
                    "Checkpoint duration",
                    "rollwise_checkpoint_duration_seconds histogram.",
                    "s",
                    quantiles("rollwise_checkpoint_duration_seconds", SEL, qs=(0.5, 1.0)),
                ),
            ],
        )
    )
    return d


ENGINE_SEL = 'instance=~"$instance"'


def engine() -> DashboardSpec:
    d = DashboardSpec(
        "rollwise-engine",
        "rollwise / engine",
        "SGLang (or the embedded engine) as seen from its /metrics.",
        env_variable=False,
        instance_metric="sglang:num_running_reqs",
    )
    d.rows.append(
        (
            "Load",
            [
                PanelSpec(
                    "Running and queued requests",
                    "sglang:num_running_reqs and sglang:num_queue_reqs.",
                    "short",
                    (
                        q(
                            f"sum by (instance) (sglang:num_running_reqs{{{ENGINE_SEL}}})",
                            "running {{instance}}",
                        ),
                        q(
                            f"sum by (instance) (sglang:num_queue_reqs{{{ENGINE_SEL}}})",
                            "queued {{instance}}",
                        ),
                    ),
                ),
                PanelSpec(
                    "Generation throughput",
                    "sglang:gen_throughput (tokens/s) and rate(sglang:generation_tokens_total).",
                    "ops",
                    (
                        q(
                            f"sum by (instance) (sglang:gen_throughput{{{ENGINE_SEL}}})",
                            "gen_throughput {{instance}}",
                        ),
                        q(
                            f"sum by (instance) (rate(sglang:generation_tokens_total{{{ENGINE_SEL}}}[{RI}]))",
                            "generated {{instance}}",
                        ),
                        q(
                            f"sum by (instance) (rate(sglang:prompt_tokens_total{{{ENGINE_SEL}}}[{RI}]))",
                            "prompt {{instance}}",
                        ),
                    ),
                ),
                PanelSpec(
                    "Requests and aborts per second",
                    "rate(sglang:num_requests_total) and rate(sglang:num_aborted_requests_total).",
                    "reqps",
                    (
                        q(f"sum(rate(sglang:num_requests_total{{{ENGINE_SEL}}}[{RI}]))", "requests"),
                        q(f"sum(rate(sglang:num_aborted_requests_total{{{ENGINE_SEL}}}[{RI}]))", "aborted"),
                    ),
                ),
            ],
        )
    )
    d.rows.append(
        (
            "Latency",
            [
                PanelSpec(
                    "End-to-end request latency",
                    "sglang:e2e_request_latency_seconds histogram.",
                    "s",
                    quantiles("sglang:e2e_request_latency_seconds", ENGINE_SEL),
                ),
                PanelSpec(
                    "Time to first token",
                    "sglang:time_to_first_token_seconds histogram.",
                    "s",
                    quantiles("sglang:time_to_first_token_seconds", ENGINE_SEL),
                ),
                PanelSpec(
                    "Client-side /generate latency",
                    "rollwise_engine_request_duration_seconds histogram, measured by the actors.",
                    "s",
                    quantiles("rollwise_engine_request_duration_seconds", 'instance=~".*"', qs=(0.5, 0.99)),
                ),
            ],
        )
    )
    return d


def reliability() -> DashboardSpec:
    d = DashboardSpec("rollwise-reliability", "rollwise / reliability", "Errors, drops, restarts, transport.")
    d.rows.append(
        (
            "Errors",
            [
                PanelSpec(
                    "Failed episodes by reason",
                    "rate(rollwise_episodes_total) for env_error, engine_error and timeout.",
                    "ops",
                    (
                        q(
                            f"sum by (env, reason) (rate(rollwise_episodes_total{{{SEL_ENV}, "
                            f'reason=~"env_error|engine_error|timeout"}}[{RI}]))',
                            "{{env}} {{reason}}",
                        ),
                    ),
                ),
                PanelSpec(
                    "Engine errors by kind",
                    "rate(rollwise_engine_errors_total) by engine and kind.",
                    "ops",
                    (
                        q(
                            f"sum by (engine, kind) (rate(rollwise_engine_errors_total{{{SEL}}}[{RI}]))",
                            "{{engine}} {{kind}}",
                        ),
                    ),
                ),
                PanelSpec(
                    "Environment errors and step latency",
                    "rate(rollwise_env_errors_total) by kind; rollwise_env_step_duration_seconds p99.",
                    "short",
                    (
                        q(
                            f"sum by (env, kind) (rate(rollwise_env_errors_total{{{SEL_ENV}}}[{RI}]))",
                            "{{env}} {{kind}}",
                        ),
                        *quantiles("rollwise_env_step_duration_seconds", SEL_ENV, by="env", qs=(0.99,)),
                    ),
                ),
                PanelSpec(
                    "Groups dropped by reason, and cut",
                    "increase(rollwise_groups_dropped_total) by reason; increase(rollwise_groups_cut_total): "
                    "groups written without their slowest episodes so that they were not dropped stale "
                    "(async.cut_late_groups).",
                    "short",
                    (
                        q(
                            f"sum by (reason) (increase(rollwise_groups_dropped_total{{{SEL}}}[{RI}]))",
                            "{{reason}}",
                        ),
                        q(f"sum(increase(rollwise_groups_cut_total{{{SEL}}}[{RI}]))", "cut"),
                    ),
                ),
                PanelSpec(
                    "Generated tokens never trained, by cause",
                    "rate(rollwise_generated_tokens_wasted_total) by cause (stale, rejected by the learner, "
                    "cut late, aborted and not resumed, failed episodes, groups lost before their write), "
                    "and its share of rate(rollwise_generated_tokens_total): generation thrown away. "
                    "rollwise_generated_tokens_no_signal_total apart: trained in steps that changed no "
                    "weight.",
                    "short",
                    (
                        q(
                            f"sum by (cause) (rate(rollwise_generated_tokens_wasted_total{{{SEL}}}[{RI}]))",
                            "{{cause}}",
                        ),
                        q(
                            f"sum(rate(rollwise_generated_tokens_no_signal_total{{{SEL}}}[{RI}]))",
                            "no signal",
                        ),
                        q(
                            f"sum(rate(rollwise_generated_tokens_wasted_total{{{SEL}}}[{RI}])) / "
                            f"sum(rate(rollwise_generated_tokens_total{{{SEL}}}[{RI}]))",
                            "wasted share",
                        ),
                    ),
                ),
                PanelSpec(
                    "Tree rollouts: groups by shape, tokens shared",
                    "rate(rollwise_tree_groups_total) by shape (branched: the trunk was forked at "
                    "rollout.branch_turn; whole: it ended first and the group played from the start), and "
                    "rate(rollwise_tree_shared_tokens_total): generated tokens the branches took from their "
                    "trunk. Zero unless rollout.branch_turn is set.",
                    "short",
                    (
                        q(
                            f"sum by (shape) (rate(rollwise_tree_groups_total{{{SEL_ENV}}}[{RI}]))",
                            "groups {{shape}}",
                        ),
                        q(
                            f"sum(rate(rollwise_tree_shared_tokens_total{{{SEL_ENV}}}[{RI}]))",
                            "tokens shared",
                        ),
                    ),
                ),
                PanelSpec(
                    "Engines serving, ejections and rejoins",
                    "rollwise_engines_serving (members that take work; 0 = admission waits and /readyz is "
                    "false), increase(rollwise_engine_ejections_total) and "
                    "increase(rollwise_engine_rejoins_total) by engine.",
                    "short",
                    (
                        q(f"max(rollwise_engines_serving{{{SEL}}})", "serving"),
                        q(
                            f"sum by (engine) (increase(rollwise_engine_ejections_total{{{SEL}}}[{RI}]))",
                            "{{engine}} ejected",
                        ),
                        q(
                            f"sum by (engine) (increase(rollwise_engine_rejoins_total{{{SEL}}}[{RI}]))",
                            "{{engine}} rejoined",
                        ),
                    ),
                ),
                PanelSpec(
                    "Process restarts",
                    "increase(rollwise_process_restarts_total) by component.",
                    "short",
                    (
                        q(
                            f"sum by (component) (increase(rollwise_process_restarts_total{{{SEL}}}[{RI}]))",
                            "{{component}}",
                        ),
                    ),
                ),
            ],
        )
    )
    d.rows.append(
        (
            "Transport and sync",
            [
                PanelSpec(
                    "Spool depth",
                    "rollwise_spool_depth_groups and rollwise_spool_depth_bytes: written, not yet consumed.",
                    "short",
                    (
                        q(f"sum(rollwise_spool_depth_groups{{{SEL}}})", "groups"),
                        q(f"sum(rollwise_spool_depth_bytes{{{SEL}}}) / 1024", "KiB"),
                    ),
                ),
                PanelSpec(
                    "Spool write and read latency",
                    "p99 of rollwise_spool_write_duration_seconds (one group, + fsync) and "
                    "rollwise_spool_read_duration_seconds (learner reading + decoding per step, no waiting).",
                    "s",
                    (
                        *quantiles("rollwise_spool_write_duration_seconds", SEL, qs=(0.99,)),
                        *quantiles("rollwise_spool_read_duration_seconds", SEL, qs=(0.99,)),
                    ),
                ),
                PanelSpec(
                    "Quarantined spool files",
                    "increase(rollwise_spool_quarantined_files_total) by reason.",
                    "short",
                    (
                        q(
                            "sum by (reason) (increase(rollwise_spool_quarantined_files_total"
                            f"{{{SEL}}}[{RI}]))",
                            "{{reason}}",
                        ),
                    ),
                ),
                PanelSpec(
                    "Weight-sync phases",
                    "rollwise_weight_sync_phase_duration_seconds by phase (pause, load, continue).",
                    "s",
                    quantiles("rollwise_weight_sync_phase_duration_seconds", SEL, by="phase", qs=(0.5, 1.0)),
                ),
                PanelSpec(
                    "Served-policy check: engine vs learner",
                    "rollwise_served_check_logprob_diff_nats (mean |engine - learner| log-prob of the "
                    "learner's probe after the last sync; an engine's numerical floor is its level at "
                    "version 0, docs/scale_out.md) and rollwise_served_check_consecutive_failures.",
                    "none",
                    (
                        q(
                            f"max by (engine) (rollwise_served_check_logprob_diff_nats{{{SEL}}})",
                            "{{engine}} gap",
                        ),
                        q(
                            f"max by (engine) (rollwise_served_check_consecutive_failures{{{SEL}}})",
                            "{{engine}} mismatches in a row",
                        ),
                    ),
                ),
                PanelSpec(
                    "Served-policy checks by result",
                    "increase(rollwise_served_checks_total) by engine and result (ok, mismatch, error).",
                    "short",
                    (
                        q(
                            "sum by (engine, result) "
                            f"(increase(rollwise_served_checks_total{{{SEL}}}[{RI}]))",
                            "{{engine}} {{result}}",
                        ),
                    ),
                ),
                PanelSpec(
                    "Bytes published per version",
                    "rollwise_weights_published_bytes: the newest published version on disk (full weights, "
                    "merged weights or a LoRA adapter).",
                    "bytes",
                    (q(f"max(rollwise_weights_published_bytes{{{SEL}}})", "bytes"),),
                ),
                PanelSpec(
                    "Supervisor event-loop lag",
                    "rollwise_supervisor_event_loop_lag_seconds histogram.",
                    "s",
                    quantiles("rollwise_supervisor_event_loop_lag_seconds", SEL, qs=(0.5, 0.99)),
                ),
            ],
        )
    )
    d.rows.append(
        (
            "Silent failures (episodes finish, the policy does the wrong thing)",
            [
                PanelSpec(
                    "Tool calls and parse failures per turn",
                    "rate(rollwise_tool_calls_total) and rate(rollwise_tool_call_errors_total) (call "
                    "markup that did not parse) over rate(rollwise_turns_total); alert "
                    "RollwiseToolCallParseFailures.",
                    "short",
                    (
                        q(
                            f"sum by (env) (rate(rollwise_tool_calls_total{{{SEL_ENV}}}[{RI}])) / "
                            f"sum by (env) (rate(rollwise_turns_total{{{SEL_ENV}}}[{RI}]))",
                            "calls {{env}}",
                        ),
                        q(
                            f"sum by (env) (rate(rollwise_tool_call_errors_total{{{SEL_ENV}}}[{RI}])) / "
                            f"sum by (env) (rate(rollwise_turns_total{{{SEL_ENV}}}[{RI}]))",
                            "unparsable {{env}}",
                        ),
                    ),
                ),
                PanelSpec(
                    "Episodes without a tool call",
                    "rate(rollwise_episodes_without_tool_calls_total) over the finished episodes "
                    "(rollwise_episodes_total, stop|length|truncated): envs that declare tools only; alert "
                    "RollwiseToolCallsStopped.",
                    "percentunit",
                    (
                        q(
                            "sum by (env) (rate(rollwise_episodes_without_tool_calls_total"
                            f"{{{SEL_ENV}}}[{RI}])) / "
                            f"sum by (env) (rate(rollwise_episodes_total{{{SEL_ENV}, "
                            f'reason=~"stop|length|truncated"}}[{RI}]))',
                            "{{env}}",
                        ),
                    ),
                ),
                PanelSpec(
                    "Answer-format failures per turn",
                    "rate(rollwise_answer_format_errors_total) (steps whose StepResult.info['format_error'] "
                    "is set) over rate(rollwise_turns_total); alert RollwiseAnswerFormatErrors.",
                    "percentunit",
                    (
                        q(
                            f"sum by (env) (rate(rollwise_answer_format_errors_total{{{SEL_ENV}}}[{RI}])) / "
                            f"sum by (env) (rate(rollwise_turns_total{{{SEL_ENV}}}[{RI}]))",
                            "{{env}}",
                        ),
                    ),
                ),
                PanelSpec(
                    "Turns cut by the token budget",
                    "rate(rollwise_turns_cut_total) (replies sampling.max_new_tokens or the context ended "
                    "short; with EnvSpec.action_hints only a reply that begins an answer) over "
                    "rate(rollwise_turns_total); rollwise doctor's truncated finding above a tenth.",
                    "percentunit",
                    (
                        q(
                            f"sum by (env) (rate(rollwise_turns_cut_total{{{SEL_ENV}}}[{RI}])) / "
                            f"sum by (env) (rate(rollwise_turns_total{{{SEL_ENV}}}[{RI}]))",
                            "{{env}}",
                        ),
                    ),
                ),
                PanelSpec(
                    "Training minus held-out success",
                    "rollwise_eval_success_gap_ratio: success of the training episodes since the previous "
                    "evaluation minus the last evaluation's, by mode ([eval] of the training env); alert "
                    "RollwiseTrainHeldOutDivergence.",
                    "percentunit",
                    (
                        q(
                            f"max by (env, mode) (rollwise_eval_success_gap_ratio{{{SEL}}})",
                            "{{env}} {{mode}}",
                        ),
                    ),
                ),
            ],
        )
    )
    d.rows.append(
        (
            "Service health",
            [
                PanelSpec(
                    "Run directory free space",
                    "rollwise_run_dir_free_bytes and rollwise_run_dir_capacity_bytes of the run directory's "
                    "filesystem; alerts RollwiseRunDirNearlyFull, RollwiseRunDirFillingUp.",
                    "bytes",
                    (
                        q(f"max(rollwise_run_dir_free_bytes{{{SEL}}})", "free"),
                        q(f"max(rollwise_run_dir_capacity_bytes{{{SEL}}})", "capacity"),
                    ),
                ),
                PanelSpec(
                    "Engines: in the pool, ejected, not up",
                    "rollwise_engine_pool_members, rollwise_engine_pool_ejected (after consecutive failures) "
                    "and rollwise_engines_not_up (processes starting or restarting); alerts "
                    "RollwiseEngineEjected, RollwiseEngineDown.",
                    "short",
                    (
                        q(f"max(rollwise_engine_pool_members{{{SEL}}})", "in the pool"),
                        q(f"max(rollwise_engine_pool_ejected{{{SEL}}})", "ejected"),
                        q(f"max(rollwise_engines_not_up{{{SEL}}})", "not up"),
                    ),
                ),
                PanelSpec(
                    "Tracker and trace-export failures",
                    "increase(rollwise_tracker_errors_total) by tracker (wandb, mlflow, tensorboard, otlp; "
                    "queue = records dropped): training goes on without them.",
                    "short",
                    (
                        q(
                            f"sum by (tracker) (increase(rollwise_tracker_errors_total{{{SEL}}}[{RI}]))",
                            "{{tracker}}",
                        ),
                    ),
                ),
            ],
        )
    )
    d.rows.append(
        (
            "Agents (OpenAI endpoint) and judges",
            [
                PanelSpec(
                    "OpenAI endpoint requests",
                    "rate(rollwise_openai_requests_total) by route (episode = an agent's, service = a "
                    "judge's) and status (ok, rejected = 4xx, engine_error).",
                    "ops",
                    (
                        q(
                            f"sum by (route, status) (rate(rollwise_openai_requests_total{{{SEL}}}[{RI}]))",
                            "{{route}} {{status}}",
                        ),
                    ),
                ),
                PanelSpec(
                    "OpenAI endpoint latency",
                    "rollwise_openai_request_duration_seconds by route: render, engine round trip, reply.",
                    "s",
                    quantiles("rollwise_openai_request_duration_seconds", SEL, by="route", qs=(0.5, 0.99)),
                ),
                PanelSpec(
                    "Agent trajectory splits",
                    "rate(rollwise_agent_segments_total): agent requests whose prompt did not extend the "
                    "episode's token buffer (history rewritten), each a new segment.",
                    "ops",
                    (q(f"sum by (env) (rate(rollwise_agent_segments_total{{{SEL_ENV}}}[{RI}]))", "{{env}}"),),
                ),
                PanelSpec(
                    "Judge requests",
                    "rate(rollwise_judge_requests_total) by judge and outcome (ok, timeout, connection, "
                    "http, parse): every attempt, retries included.",
                    "ops",
                    (
                        q(
                            f"sum by (judge, status) (rate(rollwise_judge_requests_total{{{SEL}}}[{RI}]))",
                            "{{judge}} {{status}}",
                        ),
                    ),
                ),
                PanelSpec(
                    "Judge latency",
                    "rollwise_judge_request_duration_seconds by judge: one attempt, whatever its outcome.",
                    "s",
                    quantiles("rollwise_judge_request_duration_seconds", SEL, by="judge", qs=(0.5, 0.99)),
                ),
                PanelSpec(
                    "Episodes a judge could not score",
                    "rate(rollwise_judge_failures_total) by judge and the last attempt's reason: each such "
                    "episode is excluded from training, never scored 0.",
                    "ops",
                    (
                        q(
                            f"sum by (judge, reason) (rate(rollwise_judge_failures_total{{{SEL}}}[{RI}]))",
                            "{{judge}} {{reason}}",
                        ),
                    ),
                ),
            ],
        )
    )
    return d


def _variables(spec: DashboardSpec) -> list[gd.DatasourceVariable | gd.QueryVariable]:
    ds_var = gd.DatasourceVariable("datasource").label("Data source").type("prometheus")
    instance = (
        gd.QueryVariable("instance")
        .label("Instance")
        .datasource(DS)
        .query(f"label_values({spec.instance_metric}, instance)")
        .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .include_all(True)
        .all_value(".*")
        .multi(True)
    )
    out: list[gd.DatasourceVariable | gd.QueryVariable] = [ds_var, instance]
    if spec.env_variable:
        out.append(
            gd.QueryVariable("env")
            .label("Environment")
            .datasource(DS)
            .query("label_values(rollwise_episodes_total, env)")
            .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
            .include_all(True)
            .all_value(".*")
            .multi(True)
        )
    return out


def _panel(p: PanelSpec) -> stat.Panel | timeseries.Panel:
    builder: stat.Panel | timeseries.Panel = stat.Panel() if p.kind == "stat" else timeseries.Panel()
    builder.title(p.title).description(p.description).unit(p.unit).datasource(DS).span(p.width).height(8)
    for i, query in enumerate(p.queries):
        builder.with_target(
            prometheus.Dataquery()
            .expr(query.expr)
            .legend_format(query.legend or "__auto")
            .ref_id(chr(ord("A") + i))
        )
    return builder


def build(spec: DashboardSpec) -> dict[str, Any]:
    dash = (
        gd.Dashboard(spec.title)
        .uid(spec.uid)
        .description(spec.description)
        .tags(["rollwise"])
        .refresh("10s")
        .time("now-30m", "now")
        .tooltip(dm.DashboardCursorSync.CROSSHAIR)
    )
    for variable in _variables(spec):
        dash.with_variable(variable)
    for row_title, panels in spec.rows:
        dash.with_row(gd.Row(row_title))
        for p in panels:
            dash.with_panel(_panel(p))
    model = dash.build()
    model.schema_version = GRAFANA_SCHEMA_VERSION
    data: dict[str, Any] = json.loads(JSONEncoder(sort_keys=True, indent=2).encode(model))
    # Stable, unique ids in layout order (rows included): Grafana links and the lint test rely on them.
    for panel_id, panel in enumerate(data["panels"], start=1):
        panel["id"] = panel_id
    return data


DASHBOARDS = {"overview": overview, "learner": learner, "engine": engine, "reliability": reliability}


def render_all() -> dict[str, str]:
    """File name -> JSON text, exactly as committed."""
    return {
        f"{name}.json": json.dumps(build(fn()), indent=2, sort_keys=True) + "\n"
        for name, fn in DASHBOARDS.items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if committed dashboards differ")
    args = parser.parse_args(argv)
    stale = []
    for name, text in render_all().items():
        path = OUT_DIR / name
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            OUT_DIR.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if stale:
        print(f"stale dashboards (run grafana/generate.py): {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
