"""The learner's steps as the supervisor records them from its events, weight syncs, checkpoints and
the processes the supervisor runs."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from pipeline.supervisor.observability.metrics.registry import (
    LATENCY_BUCKETS,
    RATIO_BUCKETS,
    REGISTRY,
    STEP_BUCKETS,
)

# --- learner ----------------------------------------------------------------------------------------
LEARNER_STEP = Gauge(
    "rollwise_learner_step", "Optimizer steps taken (restored on resume).", registry=REGISTRY
)
LEARNER_STEPS = Counter("rollwise_learner_steps", "Optimizer steps taken by this daemon.", registry=REGISTRY)
LEARNER_LOSS = Gauge("rollwise_learner_loss", "Loss of the last step.", registry=REGISTRY)
LEARNER_CLIP_FRACTION = Gauge(
    "rollwise_learner_clip_fraction_ratio",
    "Fraction of sequences clipped in the last step.",
    registry=REGISTRY,
)
LEARNER_IMPORTANCE_RATIO = Histogram(
    "rollwise_learner_importance_ratio",
    "Sequence importance ratios (mean, min, max of each step).",
    buckets=RATIO_BUCKETS,
    registry=REGISTRY,
)
LEARNER_CLIP_FRACTION_TOKEN = Gauge(
    "rollwise_learner_clip_fraction_token_ratio",
    "Fraction of trained tokens whose clipped branch was active in the last step.",
    registry=REGISTRY,
)
LEARNER_BAND_EXIT = Gauge(
    "rollwise_learner_band_exit_ratio",
    "Fraction of sequences whose ratio left the clip band in the last step, whatever the advantage's sign.",
    registry=REGISTRY,
)
LEARNER_SEQ_LOG_RATIO = Gauge(
    "rollwise_learner_sequence_log_ratio_abs",
    "Mean |log s_i| of the sequence ratios in the last step (compare with the clip band).",
    registry=REGISTRY,
)
LEARNER_MISMATCH_ABS = Gauge(
    "rollwise_learner_logprob_mismatch_abs",
    "Mean |learner - engine| log-prob of the generated tokens in the last step, at the step's start "
    "(mismatch.proximal = learner) or as each mini-batch is trained (engine).",
    registry=REGISTRY,
)
LEARNER_MISMATCH_BY_LAG = Gauge(
    "rollwise_learner_logprob_mismatch_abs_by_lag",
    "The same mean by token staleness: lag 0 (the weights that sampled them: numerics) and lag 1+.",
    ["lag"],
    registry=REGISTRY,
)
LEARNER_MISMATCH_K3 = Gauge(
    "rollwise_learner_logprob_mismatch_k3_kl",
    "k3 estimate of KL(engine || learner) over the same tokens.",
    registry=REGISTRY,
)
LEARNER_IS_WEIGHT = Gauge(
    "rollwise_learner_is_weight",
    "Truncated importance weights of the last step (learner.mismatch), by stat: mean or max.",
    ["stat"],
    registry=REGISTRY,
)
LEARNER_IS_TRUNCATED = Gauge(
    "rollwise_learner_is_truncated_ratio",
    "Fraction of kept tokens whose importance weight hit learner.mismatch.is_cap in the last step.",
    registry=REGISTRY,
)
LEARNER_REJECTED = Gauge(
    "rollwise_learner_rejected_tokens_ratio",
    "Fraction of generated tokens learner.mismatch.reject took out of the last step's loss.",
    registry=REGISTRY,
)
LEARNER_KL_REFERENCE = Gauge(
    "rollwise_learner_kl_reference",
    "Token-mean KL estimate (learner.regularizers.kl_estimator) of the policy against the initial weights, "
    "last step; 0 while learner.regularizers.kl_coef is 0.",
    registry=REGISTRY,
)
LEARNER_OVERLONG = Gauge(
    "rollwise_learner_overlong_turns_ratio",
    "Fraction of the last step's turns that DAPO's over-long penalty reached "
    "(learner.regularizers.overlong_budget).",
    registry=REGISTRY,
)
LEARNER_ENTROPY = Gauge(
    "rollwise_learner_entropy_nats", "Mean token entropy of the policy.", registry=REGISTRY
)
LEARNER_GRAD_NORM = Gauge("rollwise_learner_grad_norm", "Gradient norm before clipping.", registry=REGISTRY)
LEARNER_LR = Gauge("rollwise_learner_learning_rate", "Learning rate of the last step.", registry=REGISTRY)
LEARNER_TOKENS = Counter("rollwise_learner_tokens", "Tokens trained on.", registry=REGISTRY)
LEARNER_STEP_DURATION = Histogram(
    "rollwise_learner_step_duration_seconds",
    "Wall time of one optimizer step.",
    buckets=STEP_BUCKETS,
    registry=REGISTRY,
)
LEARNER_SKIPPED = Counter(
    "rollwise_learner_skipped", "Skipped steps or groups, by reason.", ["reason"], registry=REGISTRY
)
LEARNER_IDLE = Counter(
    "rollwise_learner_idle_seconds", "Time the learner waited for data.", registry=REGISTRY
)
LEARNER_BUSY = Counter("rollwise_learner_busy_seconds", "Time the learner spent training.", registry=REGISTRY)
POLICY_VERSION = Gauge("rollwise_policy_version", "Latest policy version published.", registry=REGISTRY)
LEARNER_LOG_RATIO_SPREAD = Gauge(
    "rollwise_learner_log_ratio_spread",
    "Standard deviation of the last step's log importance ratios, by level: token (log r_t = learner - "
    "behaviour log-prob, over trained tokens) or sequence (log s_i, their mean per sequence).",
    ["level"],
    registry=REGISTRY,
)

# --- Mixture-of-Experts models (learner.moe; docs/train.md "Mixture-of-Experts") -------------------
# No series exist until a step of an MoE model reports them: a dense model's dashboard shows "no data".
LEARNER_MOE_ROUTING_CHANGE = Gauge(
    "rollwise_learner_moe_routing_change_ratio",
    "Share of token positions whose set of top-k experts changed after the step's first update, on the "
    "same inputs (MoE), by stat over the layers: mean or max.",
    ["stat"],
    registry=REGISTRY,
)
LEARNER_MOE_LOAD_IMBALANCE = Gauge(
    "rollwise_learner_moe_load_imbalance",
    "Expert load of the last step's training forwards: the most loaded expert's assignments over the "
    "mean per expert (1 = balanced, num_experts = one expert takes all; MoE), by stat over the layers.",
    ["stat"],
    registry=REGISTRY,
)
LEARNER_ROUTER_MISMATCH = Gauge(
    "rollwise_learner_router_mismatch_abs",
    "Mean |learner - engine| log-prob of the last step's generated tokens at the step's start, with the "
    "learner's own routing or the engine's replayed (MoE with learner.moe.record_routing or "
    "routing_replay); 1 - replayed / own is the router's share of the mismatch.",
    ["routing"],
    registry=REGISTRY,
)

# --- weight sync, checkpoints, processes -------------------------------------------------------------
WEIGHT_SYNC_PHASE = Histogram(
    "rollwise_weight_sync_phase_duration_seconds",
    "Duration of each weight-sync phase.",
    ["phase"],
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)
WEIGHT_SYNCS = Counter("rollwise_weight_syncs", "Weight syncs by status.", ["status"], registry=REGISTRY)
SERVED_CHECKS = Counter(
    "rollwise_served_checks",
    "Served-policy checks after a weight sync, by engine and result: ok, mismatch (the engine's log-probs "
    "of the learner's probe are another policy's), error (no answer).",
    ["engine", "result"],
    registry=REGISTRY,
)
SERVED_LOGPROB_DIFF = Gauge(
    "rollwise_served_check_logprob_diff_nats",
    "Mean absolute difference of engine and learner log-probs of the probe at the last served-policy check.",
    ["engine"],
    registry=REGISTRY,
)
SERVED_CHECK_FAILURES = Gauge(
    "rollwise_served_check_consecutive_failures",
    "Consecutive served-policy mismatches of the engine (async.served_check.max_failures stops the daemon).",
    ["engine"],
    registry=REGISTRY,
)
PUBLISHED_BYTES = Gauge(
    "rollwise_weights_published_bytes",
    "Size of the newest published version on disk (full weights, merged weights or a LoRA adapter).",
    registry=REGISTRY,
)
CHECKPOINT_DURATION = Histogram(
    "rollwise_checkpoint_duration_seconds",
    "Time to write a checkpoint.",
    buckets=STEP_BUCKETS,
    registry=REGISTRY,
)
PROCESS_RESTARTS = Counter(
    "rollwise_process_restarts", "Child process restarts by component.", ["component"], registry=REGISTRY
)
EVENT_LOOP_LAG = Histogram(
    "rollwise_supervisor_event_loop_lag_seconds",
    "Extra delay of a periodic 100 ms timer.",
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)
SUPERVISOR_UP = Gauge(
    "rollwise_supervisor_start_time_seconds", "Unix time the supervisor started.", registry=REGISTRY
)


# --- a learner with its own run directory (learner.remote.run_dir): versions copied from its weight server
# -------
WEIGHT_MIRROR_DURATION = Histogram(
    "rollwise_weight_mirror_duration_seconds",
    "Time to copy one published version from the learner's weight server into the run directory "
    "(learner.remote.run_dir set), every file checked against the manifest.",
    buckets=STEP_BUCKETS,
    registry=REGISTRY,
)
WEIGHT_MIRROR_FAILURES = Counter(
    "rollwise_weight_mirror_failures",
    "Failed copies of a published version from the learner's weight server (unreachable, a file that "
    "does not match the manifest); each is retried until a newer version supersedes it.",
    registry=REGISTRY,
)

SKIP_REASONS = ("zero_advantage_groups", "nonfinite_updates", "empty_updates")
SYNC_PHASES = ("pause", "load", "continue")
COMPONENTS = ("engine", "learner")


def init_learner_label_values() -> None:
    """Create every known label combination of this module at zero."""
    for lag in ("0", "1+"):
        LEARNER_MISMATCH_BY_LAG.labels(lag=lag)
    for stat in ("mean", "max"):
        LEARNER_IS_WEIGHT.labels(stat=stat)
    for level in ("token", "sequence"):
        LEARNER_LOG_RATIO_SPREAD.labels(level=level)
    for reason in SKIP_REASONS:
        LEARNER_SKIPPED.labels(reason=reason)
    for phase in SYNC_PHASES:
        WEIGHT_SYNC_PHASE.labels(phase=phase)
    for status in ("ok", "error"):  # engines/weightsync.py's two outcomes
        WEIGHT_SYNCS.labels(status=status)
    for component in COMPONENTS:
        PROCESS_RESTARTS.labels(component=component)
