"""Held-out evaluation (pipeline.supervisor.eval_schedule)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from pipeline.contracts.schema import FINISH_REASONS
from pipeline.supervisor.observability.metrics.learner import PROCESS_RESTARTS
from pipeline.supervisor.observability.metrics.registry import REGISTRY, STEP_BUCKETS

# Each evaluation scores one policy version on a fixed task set, so its results are gauges of the last
# evaluation (like the learner's loss); the counters let PromQL average over any window as well.
EVAL_SUCCESS = Gauge(
    "rollwise_eval_success_ratio",
    "Mean success of the last evaluation's episodes, by eval env and mode (greedy, sampled).",
    ["env", "mode"],
    registry=REGISTRY,
)
EVAL_PASS_AT_K = Gauge(
    "rollwise_eval_pass_at_k_ratio",
    "Share of the last evaluation's tasks solved by at least one of their k episodes (greedy: k = 1).",
    ["env", "mode"],
    registry=REGISTRY,
)
EVAL_REWARD = Gauge(
    "rollwise_eval_reward_mean",
    "Mean episode return (turn rewards plus outcome) of the last evaluation.",
    ["env", "mode"],
    registry=REGISTRY,
)
EVAL_TURNS = Gauge(
    "rollwise_eval_turns_mean",
    "Mean turns per episode of the last evaluation.",
    ["env", "mode"],
    registry=REGISTRY,
)
EVAL_VERSION = Gauge(
    "rollwise_eval_policy_version",
    "Policy version the engines served when the last evaluation started.",
    ["env"],
    registry=REGISTRY,
)
EVAL_EPISODES = Counter(
    "rollwise_eval_episodes",
    "Evaluation episodes by env, mode and finish reason.",
    ["env", "mode", "reason"],
    registry=REGISTRY,
)
EVAL_SUCCESSES = Counter(
    "rollwise_eval_successes",
    "Evaluation episodes whose outcome reached 1.0.",
    ["env", "mode"],
    registry=REGISTRY,
)
EVAL_RUNS = Counter(
    "rollwise_eval_runs", "Evaluations by status (ok, failed).", ["env", "status"], registry=REGISTRY
)
EVAL_SUCCESS_GAP = Gauge(
    "rollwise_eval_success_gap_ratio",
    "Training success rate (episodes since the previous evaluation) minus the held-out success of the "
    "last evaluation, by mode (sampled compares like with like); only when [eval] plays the training "
    "env with its options. A wide positive gap: training reward no longer carries to held-out tasks.",
    ["env", "mode"],
    registry=REGISTRY,
)
EVAL_INTERVAL = Gauge(
    "rollwise_eval_interval_versions",
    "eval.every_versions: the evaluations' spacing in published versions (for the overdue alert).",
    ["env"],
    registry=REGISTRY,
)
EVAL_TRAINING_PAUSED = Counter(
    "rollwise_eval_training_paused_seconds",
    "Seconds no new training group was started because an evaluation ran (eval.pause_training).",
    ["env"],
    registry=REGISTRY,
)
EVAL_DURATION = Histogram(
    "rollwise_eval_duration_seconds",
    "Wall time of one evaluation (every mode).",
    ["env"],
    buckets=STEP_BUCKETS,
    registry=REGISTRY,
)
EVAL_ENGINE_SECONDS = Counter(
    "rollwise_eval_engine_seconds",
    "Wall seconds evaluations ran (ok, failed or cancelled; counted while they run), by kind: training "
    "(on the training engines, where wall time is the honest proxy of the engine time they took) or "
    "dedicated (eval.engine). Its rate is eval's share of wall time.",
    ["env", "kind"],
    registry=REGISTRY,
)
EVAL_SHARE_BUDGET = Gauge(
    "rollwise_eval_engine_share_budget_ratio",
    "eval.max_engine_share in force: the most of the training engines' wall time evaluations may take "
    "(absent with a dedicated evaluation engine, which takes none of it).",
    ["env"],
    registry=REGISTRY,
)
EVAL_DEFERRED = Counter(
    "rollwise_eval_deferred",
    "Served versions a trigger made due but that were not evaluated, by reason: running (one evaluation "
    "at a time) or budget (eval.max_engine_share).",
    ["env", "reason"],
    registry=REGISTRY,
)
EVAL_LAG = Gauge(
    "rollwise_eval_lag_versions",
    "Versions the learner had published past the evaluated one when the last evaluation finished.",
    ["env"],
    registry=REGISTRY,
)


def init_eval_label_values(
    env: str,
    modes: tuple[str, ...] | list[str],
    *,
    every_versions: int = 0,
    gap: bool = False,
    kind: str = "training",
    budget: float | None = None,
) -> None:
    """The eval series of one eval env at zero, so its panel has data before the first evaluation ends
    (`gap`: the training/held-out success gap is computed for this env; `kind`: where evaluations run,
    training or dedicated; `budget`: eval.max_engine_share on the training engines)."""
    EVAL_INTERVAL.labels(env=env).set(every_versions)
    for mode in modes:
        for gauge in (EVAL_SUCCESS, EVAL_PASS_AT_K, EVAL_REWARD, EVAL_TURNS):
            gauge.labels(env=env, mode=mode)
        if gap:
            EVAL_SUCCESS_GAP.labels(env=env, mode=mode)
        EVAL_SUCCESSES.labels(env=env, mode=mode)
        for reason in FINISH_REASONS:
            EVAL_EPISODES.labels(env=env, mode=mode, reason=reason)
    EVAL_VERSION.labels(env=env)
    EVAL_DURATION.labels(env=env)
    EVAL_TRAINING_PAUSED.labels(env=env)
    for status in ("ok", "failed"):
        EVAL_RUNS.labels(env=env, status=status)
    EVAL_ENGINE_SECONDS.labels(env=env, kind=kind)
    EVAL_LAG.labels(env=env)
    for reason in ("running", "budget"):
        EVAL_DEFERRED.labels(env=env, reason=reason)
    if budget is not None:
        EVAL_SHARE_BUDGET.labels(env=env).set(budget)
    if kind == "dedicated":
        PROCESS_RESTARTS.labels(component="eval_engine")
