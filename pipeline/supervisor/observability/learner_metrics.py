"""Learner events -> Prometheus. The learner has no scrape target of its own: the supervisor records
what each event says here, so a restarted learner can never make a counter go backwards."""

from __future__ import annotations

from pipeline.contracts import events
from pipeline.contracts.waste import NO_SIGNAL, drop_cause
from pipeline.supervisor.observability import metrics

# Step metrics (learner.trainer) exported as gauges of the same meaning.
_STEP_GAUGES = {
    "loss": metrics.LEARNER_LOSS,
    "clip_fraction": metrics.LEARNER_CLIP_FRACTION,
    "clip_fraction_token": metrics.LEARNER_CLIP_FRACTION_TOKEN,
    "band_exit_fraction": metrics.LEARNER_BAND_EXIT,
    "seq_log_ratio_abs_mean": metrics.LEARNER_SEQ_LOG_RATIO,
    "mismatch_abs_mean": metrics.LEARNER_MISMATCH_ABS,
    "mismatch_abs_mean_lag0": metrics.LEARNER_MISMATCH_BY_LAG.labels(lag="0"),
    "mismatch_abs_mean_lag1plus": metrics.LEARNER_MISMATCH_BY_LAG.labels(lag="1+"),
    "mismatch_k3": metrics.LEARNER_MISMATCH_K3,
    "is_weight_mean": metrics.LEARNER_IS_WEIGHT.labels(stat="mean"),
    "is_weight_max": metrics.LEARNER_IS_WEIGHT.labels(stat="max"),
    "is_truncated_fraction": metrics.LEARNER_IS_TRUNCATED,
    "rejected_fraction": metrics.LEARNER_REJECTED,
    "kl_reference": metrics.LEARNER_KL_REFERENCE,
    "overlong_fraction": metrics.LEARNER_OVERLONG,
    "entropy": metrics.LEARNER_ENTROPY,
    "grad_norm": metrics.LEARNER_GRAD_NORM,
    "lr": metrics.LEARNER_LR,
    "ratio_spread_token": metrics.LEARNER_LOG_RATIO_SPREAD.labels(level="token"),
    "ratio_spread_sequence": metrics.LEARNER_LOG_RATIO_SPREAD.labels(level="sequence"),
}
# MoE step metrics (present only for an MoE model): their series are created by the first one reported.
_MOE_GAUGES = {
    "moe_routing_change": (metrics.LEARNER_MOE_ROUTING_CHANGE, "stat", "mean"),
    "moe_routing_change_max_layer": (metrics.LEARNER_MOE_ROUTING_CHANGE, "stat", "max"),
    "moe_load_imbalance": (metrics.LEARNER_MOE_LOAD_IMBALANCE, "stat", "mean"),
    "moe_load_imbalance_max_layer": (metrics.LEARNER_MOE_LOAD_IMBALANCE, "stat", "max"),
    "router_mismatch_own": (metrics.LEARNER_ROUTER_MISMATCH, "routing", "own"),
    "router_mismatch_replayed": (metrics.LEARNER_ROUTER_MISMATCH, "routing", "replayed"),
}
# Step metrics counted in rollwise_learner_skipped_total{reason}.
_SKIPPED = {
    "skipped_zero_adv_groups": "zero_advantage_groups",
    "skipped_steps_nonfinite": "nonfinite_updates",
    "skipped_updates_empty": "empty_updates",
}


def record_step(event: events.Step) -> None:
    metrics.LEARNER_STEP.set(event.step)
    metrics.LEARNER_STEPS.inc()
    for key, gauge in _STEP_GAUGES.items():
        if (value := event.metric(key)) is not None:
            gauge.set(value)
    for key, (gauge, label, label_value) in _MOE_GAUGES.items():
        if (reported := event.metric(key)) is not None:
            gauge.labels(**{label: label_value}).set(reported)
    for key in ("ratio_mean", "ratio_min", "ratio_max"):
        if (value := event.metric(key)) is not None:
            metrics.LEARNER_IMPORTANCE_RATIO.observe(value)
    if (value := event.metric("step_time_s")) is not None:
        metrics.LEARNER_STEP_DURATION.observe(value)
    if (value := event.metric("tokens")) is not None:
        metrics.LEARNER_TOKENS.inc(value)
    for key, reason in _SKIPPED.items():
        if (value := event.metric(key)) is not None and value > 0:
            metrics.LEARNER_SKIPPED.labels(reason=reason).inc(value)
    metrics.LEARNER_BUSY.inc(event.busy_s)
    metrics.LEARNER_IDLE.inc(event.idle_s)
    metrics.SPOOL_READ_LATENCY.observe(event.spool_read_s)
    # Groups announced as dropped (their own events) are not in `groups`.
    metrics.GROUPS_ACCEPTED.inc(event.groups)
    for staleness, tokens in event.staleness.items():
        metrics.TOKEN_STALENESS.observe_many(float(staleness), tokens)
    for staleness, tokens in event.staleness_in_flight.items():
        metrics.TOKEN_STALENESS_IN_FLIGHT.observe_many(float(staleness), tokens)
    for staleness, tokens in event.staleness_in_queue.items():
        metrics.TOKEN_STALENESS_IN_QUEUE.observe_many(float(staleness), tokens)
    metrics.SPOOL_DEPTH_GROUPS.set(event.spool_depth_groups)
    metrics.SPOOL_DEPTH_BYTES.set(event.spool_depth_bytes)


def record_dropped(reason: str, tokens: int) -> None:
    """A group the learner dropped, and its trainable rows' generated tokens by waste cause."""
    metrics.GROUPS_DROPPED.labels(reason=reason).inc()
    if (cause := drop_cause(reason)) is not None:
        metrics.GENERATED_TOKENS_WASTED.labels(cause=cause).inc(tokens)
    elif reason == NO_SIGNAL:
        metrics.GENERATED_TOKENS_NO_SIGNAL.inc(tokens)


def token_books() -> tuple[int, dict[str, int]]:
    """The generated tokens so far (every env) and those never trained, by cause, from the counters."""
    generated = sum(
        s.value for m in metrics.GENERATED_TOKENS.collect() for s in m.samples if s.name.endswith("_total")
    )
    wasted = {
        s.labels["cause"]: int(s.value)
        for m in metrics.GENERATED_TOKENS_WASTED.collect()
        for s in m.samples
        if s.name.endswith("_total")
    }
    return int(generated), wasted


def record_checkpoint(event: events.CheckpointSaved) -> None:
    metrics.CHECKPOINT_DURATION.observe(event.seconds)


def record_quarantined(event: events.Quarantined) -> None:
    metrics.SPOOL_QUARANTINED.labels(reason=event.kind).inc()
