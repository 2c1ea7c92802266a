"""The advisor's rules: each a pure function of a RunView returning a Finding or None
(docs/design/run_health.md, "The checks").

Alarms carry a score that orders them: first what stops the run (no step, no disk, no engine), then what
makes its steps worthless (most replies cut by the token budget, which also explains a zero reward, so
it comes before it; no reward; unstable updates), then what wastes part of it (stale drops, a drifting
served policy, evaluation that lags). The thresholds are the alerts' where an
alert exists (grafana/alerts.py: lag-0 mismatch, stale drops, free space), otherwise stated here. A rule
that lacks its data (a stopped run has no counters; a young run has few steps) says nothing.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

from pipeline.supervisor.observability.run_health.findings import Finding
from pipeline.supervisor.observability.run_health.run_view import RunView, quarters

WINDOW = 20  # the last steps a rule reads
MIN_STEPS = 8  # fewer steps than this: too young to judge
STALL_FACTOR, STALL_FLOOR_S = 10.0, 300.0  # no step for 10 median steps, and at least 5 minutes
ENGINE_ERROR_SHARE = 0.2  # of the engine requests
ENV_ERROR_SHARE, MIN_EPISODES = 0.1, 20  # as grafana/alerts.py's RollwiseEnvErrorRateHigh
TRUNCATED_ALARM, TRUNCATED_ADVICE = 0.5, 0.1  # share of turns cut by the token budget
LAG0_FLOOR, DRIFT_FACTOR = 0.01, 2.0  # nats; as grafana/alerts.py's RollwiseLag0MismatchRising
CLIP_ALARM = 0.5  # more than half the tokens clipped: the updates overshoot the trust region
GRAD_FACTOR = 10.0  # recent gradient norm over the run's median
STALE_ALARM, STALE_ADVICE = 0.05, 0.01  # share of the groups that ended
FREE_ALARM = 0.05  # as grafana/alerts.py's RollwiseRunDirNearlyFull
EVAL_LAG_VERSIONS = 20
HELD_OUT_FALL = 0.15  # held-out success below its best by this much while training success holds
LENGTH_FACTOR = 3.0  # generated tokens per sequence, last quarter against the first
IDLE_ADVICE = 0.2  # learner waiting for data
ZERO_VARIANCE_ADVICE = 0.3  # share of the groups that taught nothing
SOLVED = 0.9  # training success at which groups without variance mean a solved task, not a broken reward


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def stalled(view: RunView) -> Finding | None:
    """No step for STALL_FACTOR median steps (STALL_FLOOR_S at least; `view.stall_after_s` when the
    operator set a limit). The evidence says which side stopped: no engine serving, or groups waiting."""
    if not view.running or view.last_step_at is None or len(view.steps) < 2:
        return None
    median = view.median_step_s()
    if median is None:
        return None
    limit = (
        view.stall_after_s if view.stall_after_s is not None else max(STALL_FACTOR * median, STALL_FLOOR_S)
    )
    age = view.now - view.last_step_at
    if age <= limit:
        return None
    evidence = [
        f"logs/steps.jsonl: step {view.steps[-1].get('step')} was the last, written {age:.0f} s ago",
        f"median step {median:.1f} s (waiting + working) over {len(view.steps)} steps; limit {limit:.0f} s",
    ]
    serving = view.total("rollwise_engines_serving")
    if serving == 0:
        evidence.append("metrics: rollwise_engines_serving = 0: no engine answers, so no group is generated")
        action = "the engines stopped answering: read logs/engine<i>.log; `rollwise engines --run-dir D list`"
    else:
        waiting = view.total("rollwise_spool_depth_groups")
        if waiting:
            evidence.append(
                f"metrics: rollwise_spool_depth_groups = {waiting:g}: groups wait for the learner"
            )
        action = (
            "read logs/learner.log and logs/supervisor.log's last lines; `rollwise engines --run-dir D list`"
        )
    return Finding(
        "stalled",
        "alarm",
        100.0,
        f"training stalled: no learner step for {age:.0f} s",
        evidence,
        action + "; docs/troubleshoot.md",
    )


def disk_filling(view: RunView) -> Finding | None:
    blocked = view.total("rollwise_storage_blocked")
    if view.free_share is not None and view.free_share < FREE_ALARM:
        cause = f"the run directory's filesystem has {view.free_share:.1%} free (statvfs)"
    elif blocked:
        cause = f"metrics: rollwise_storage_blocked = {blocked:g} (the storage refuses writes)"
    else:
        return None
    return Finding(
        "disk_filling",
        "alarm",
        95.0,
        "the run directory is out of space",
        [cause],
        "free space or move the run to a larger volume; lower `learner.keep_checkpoints` and the logs' "
        "`logs.keep`; docs/troubleshoot.md, 'When things break'",
    )


def engine_storm(view: RunView) -> Finding | None:
    requests = view.total("rollwise_engine_request_duration_seconds_count")
    errors = view.total("rollwise_engine_errors_total")
    if not requests or errors is None:
        return None
    aborts = view.total("rollwise_engine_aborts_total") or 0.0
    share = (errors + aborts) / requests
    if share <= ENGINE_ERROR_SHARE:
        return None
    kinds = {
        lab.get("kind", "?"): v for lab, v in view.metrics.get("rollwise_engine_errors_total", []) if v > 0
    }
    return Finding(
        "engine_storm",
        "alarm",
        90.0 + share,
        f"engines failing: {share:.0%} of requests ended in an error or an abort",
        [
            f"metrics: rollwise_engine_errors_total = {errors:g} by kind {kinds}",
            f"metrics: rollwise_engine_aborts_total = {aborts:g}; requests = {requests:g}",
        ],
        "read logs/engine<i>.log; `rollwise engines list`; an engine that dies under load needs fewer "
        "concurrent groups (`rollout.max_concurrent_groups`) or more memory",
    )


def env_failing(view: RunView) -> Finding | None:
    episodes = view.total("rollwise_episodes_total")
    errors = view.total("rollwise_env_errors_total")
    if not episodes or episodes < MIN_EPISODES or errors is None:
        return None
    closing = view.total("rollwise_env_errors_total", kind="close") or 0.0
    share = (errors - closing) / episodes
    if share <= ENV_ERROR_SHARE:
        return None
    kinds = {
        f"{lab.get('env', '?')}/{lab.get('kind', '?')}": v
        for lab, v in view.metrics.get("rollwise_env_errors_total", [])
        if v > 0 and lab.get("kind") != "close"
    }
    return Finding(
        "env_failing",
        "alarm",
        88.0 + share,
        f"the environment fails in {share:.0%} of the episodes: those are never trained",
        [
            f"metrics: rollwise_env_errors_total = {errors - closing:g} (env/kind {kinds}); "
            f"rollwise_episodes_total = {episodes:g}",
        ],
        "`rollwise env check` the environment; the episode errors are in logs/supervisor.log; raise its "
        "`step_timeout_s` if it is only slow",
    )


def no_reward(view: RunView) -> Finding | None:
    rewards = view.step_metric("reward_mean", WINDOW)
    if len(rewards) < MIN_STEPS:
        return None
    if all(r == 0 for r in rewards):
        title = f"every reward of the last {len(rewards)} steps is zero"
        evidence = [f"logs/steps.jsonl: reward_mean = 0 in each of the last {len(rewards)} steps"]
    else:
        skipped = view.step_metric("skipped_zero_adv_groups", WINDOW)
        groups = view.step_metric("num_groups", WINDOW)
        if (
            len(skipped) != len(groups)
            or not groups
            or any(s < g for s, g in zip(skipped, groups, strict=True))
        ):
            return None
        title = f"no group of the last {len(groups)} steps has any reward variance: nothing is learned"
        evidence = [
            f"logs/steps.jsonl: skipped_zero_adv_groups = num_groups in each of the last {len(groups)} steps"
        ]
    success = view.step_metric("success_rate", WINDOW)
    solved = bool(success) and _mean(success) >= SOLVED
    if success:
        evidence.append(f"logs/steps.jsonl: training success {_mean(success):.2f} over those steps")
    return Finding(
        "no_reward",
        "alarm",
        85.0,
        title,
        evidence,
        "the policy solves every task it is given: stop the run, or give it harder tasks (its steps now "
        "update nothing)"
        if solved
        else "check the reward on a few episodes: `rollwise env check`, `rollwise inspect --run-dir D`; a "
        "task too hard for the model gives no variance either (an easier curriculum, a larger group)",
    )


def truncated(view: RunView) -> Finding | None:
    """The share of turns the token budget cut: the actors' counters (every turn so far), or else the
    trainer's over-long fraction (only with learner.regularizers' over-long penalty on)."""
    turns = view.total("rollwise_turns_total")
    cut = view.total("rollwise_turns_cut_total")
    if turns is not None and cut is not None and turns >= MIN_EPISODES:
        share = cut / turns
        source = f"metrics: rollwise_turns_cut_total = {cut:g} of rollwise_turns_total = {turns:g}"
    else:
        overlong = view.step_metric("overlong_fraction", WINDOW)
        if len(overlong) < MIN_STEPS:
            return None
        share = _mean(overlong)
        source = f"logs/steps.jsonl: overlong_fraction, mean of the last {len(overlong)} steps"
    if share <= TRUNCATED_ADVICE:
        return None
    budget = view.setting("sampling.max_new_tokens")
    alarm = share > TRUNCATED_ALARM
    return Finding(
        "truncated",
        "alarm" if alarm else "advice",
        (86.0 if alarm else 0.0) + share,  # above no_reward (85): cut replies often explain a zero reward
        f"{share:.0%} of the turns are cut at the token budget",
        [source, f"config.toml: sampling.max_new_tokens = {budget}"],
        "raise `sampling.max_new_tokens`, or reward shorter answers (`learner.regularizers.overlong_budget`)",
    )


def unstable_update(view: RunView) -> Finding | None:
    clip = view.step_metric("clip_fraction", WINDOW)
    norms = view.step_metric("grad_norm")
    evidence: list[str] = []
    if len(clip) >= MIN_STEPS and _mean(clip) > CLIP_ALARM:
        evidence.append(
            f"logs/steps.jsonl: clip_fraction {_mean(clip):.2f}, mean of the last {len(clip)} steps"
        )
    if len(norms) >= 2 * MIN_STEPS:
        recent, before = statistics.median(norms[-5:]), statistics.median(norms[:-5])
        if before > 0 and recent > GRAD_FACTOR * before:
            evidence.append(
                f"logs/steps.jsonl: grad_norm {recent:.3g} in the last 5 steps against {before:.3g} before"
            )
    if not evidence:
        return None
    return Finding(
        "unstable_update",
        "alarm",
        65.0,
        "the updates are unstable: clipping or gradient norms exploding",
        evidence,
        "lower `learner.optim.lr`; check the clip band (`learner.loss.clip_low/clip_high`) and "
        "`learner.optim.grad_clip`",
    )


def served_drift(view: RunView) -> Finding | None:
    lag0 = view.step_metric("mismatch_abs_mean_lag0")
    first, last = quarters(lag0)
    if len(lag0) < 2 * MIN_STEPS or not first:
        return None
    before, now = statistics.median(first), statistics.median(last)
    if now <= LAG0_FLOOR or now <= DRIFT_FACTOR * before:
        return None
    return Finding(
        "served_drift",
        "alarm",
        60.0,
        "the engines' log-probs drift from the learner's on the same weights",
        [
            f"logs/steps.jsonl: mismatch_abs_mean_lag0 {before:.3g} nats in the first quarter, "
            f"{now:.3g} in the last"
        ],
        "check the weight sync and the engines' dtype (`rollwise_served_check_logprob_diff_nats`); "
        "docs/scale_out.md, 'Weight sync'",
    )


def stale_drops(view: RunView) -> Finding | None:
    written = view.total("rollwise_groups_written_total")
    if not written:
        return None
    stale = view.total("rollwise_groups_dropped_total", reason="stale") or 0.0
    in_flight = view.total("rollwise_groups_dropped_total", reason="stale_in_flight") or 0.0
    share = (stale + in_flight) / (written + in_flight)
    if share <= STALE_ADVICE:
        return None
    alarm = share > STALE_ALARM
    eta = view.setting("async.max_staleness")
    return Finding(
        "stale_drops",
        "alarm" if alarm else "advice",
        (50.0 if alarm else 0.0) + share,
        f"{share:.1%} of the groups were dropped as stale",
        [
            f"metrics: rollwise_groups_dropped_total stale {stale:g}, stale_in_flight {in_flight:g}; "
            f"written {written:g}",
            f"config.toml: async.max_staleness = {eta}",
        ],
        "raise `async.max_staleness` by one, or set `async.straggler_patience`: `rollwise bench async "
        "--model` predicts both for your workload (docs/troubleshoot.md, 'Choosing eta')",
    )


def eval_lagging(view: RunView) -> Finding | None:
    if not view.evals or not view.steps:
        return None
    last = view.evals[-1]
    behind = last.get("versions_behind")
    every = view.setting("eval.every_versions")
    newest = int(view.steps[-1].get("version", 0))
    since = newest - int(last.get("version", 0))
    if isinstance(behind, int | float) and behind > EVAL_LAG_VERSIONS:
        evidence = f"logs/eval.jsonl: the last evaluation landed {behind:g} versions behind the learner"
    elif isinstance(every, int) and every > 0 and since > 3 * every:
        evidence = (
            f"logs/eval.jsonl: the last evaluation scored version {last.get('version')}, {since} versions ago"
        )
    else:
        return None
    return Finding(
        "eval_lagging",
        "alarm",
        40.0,
        "held-out evaluation lags the learner",
        [evidence, f"config.toml: eval.every_versions = {every}"],
        "evaluate less often or with fewer tasks (`eval.every_versions`, `eval.tasks`), or give it its own "
        "engine (docs/run.md, evaluation)",
    )


def _held_out(row: dict[str, object]) -> float | None:
    greedy = row.get("greedy")
    value = greedy.get("success") if isinstance(greedy, dict) else None
    return float(value) if isinstance(value, int | float) else None


def held_out_falls(view: RunView) -> Finding | None:
    scored = [(int(e.get("version", 0)), s) for e in view.evals if (s := _held_out(e)) is not None]
    if len(scored) < 3:
        return None
    best_version, best = max(scored, key=lambda vs: vs[1])
    last_version, last = scored[-1]
    if best - last < HELD_OUT_FALL or last_version <= best_version:
        return None
    then = [
        float(s["metrics"]["success_rate"])
        for s in view.steps
        if s.get("version", 0) <= best_version
        and isinstance(s.get("metrics", {}).get("success_rate"), int | float)
    ][-WINDOW:]
    now = view.step_metric("success_rate", WINDOW)
    if not then or not now or _mean(now) < _mean(then) - 0.02:
        return None  # training success fell too: a collapse, not the reward-hacking pattern
    return Finding(
        "held_out_falls",
        "alarm",
        45.0,
        "training success holds while held-out success falls: the policy may be gaming the reward",
        [
            f"logs/eval.jsonl: held-out greedy success {best:.2f} at version {best_version}, "
            f"{last:.2f} at {last_version}",
            f"logs/steps.jsonl: training success {_mean(then):.2f} then, {_mean(now):.2f} now",
        ],
        "read the recent episodes (`rollwise inspect --run-dir D`) for an answer that satisfies the reward "
        "without solving the task; tighten the reward",
    )


def length_runaway(view: RunView) -> Finding | None:
    per_seq = [
        float(m["loss_tokens"]) / float(m["num_sequences"])
        for s in view.steps
        if isinstance(m := s.get("metrics", {}), dict)
        and isinstance(m.get("loss_tokens"), int | float)
        and m.get("num_sequences")
    ]
    first, last = quarters(per_seq)
    if len(per_seq) < 2 * MIN_STEPS or not first:
        return None
    before, now = statistics.median(first), statistics.median(last)
    if before <= 0 or 1 / LENGTH_FACTOR <= now / before <= LENGTH_FACTOR:
        return None
    return Finding(
        "length_runaway",
        "alarm",
        42.0,
        f"replies {'collapsed' if now < before else 'exploded'}: {now:.0f} generated tokens per sequence, "
        f"{before:.0f} at the start",
        [
            f"logs/steps.jsonl: loss_tokens / num_sequences, median of the first and the last quarter "
            f"of {len(per_seq)} steps"
        ],
        "check the entropy (`learner.regularizers.entropy_coef`) and the length terms of the reward",
    )


def concurrency_bound(view: RunView) -> Finding | None:
    limit = view.total("rollwise_admission_concurrency_limit")
    ceiling = view.setting("rollout.max_concurrent_groups")
    if limit is None or not isinstance(ceiling, int) or limit >= ceiling / 2:
        return None
    return Finding(
        "concurrency_bound",
        "advice",
        0.5,
        f"the engines queue: admission runs {limit:g} groups at once of the {ceiling} allowed",
        [
            f"metrics: rollwise_admission_concurrency_limit = {limit:g}; "
            f"config.toml: rollout.max_concurrent_groups = {ceiling}"
        ],
        "the engines bind: add engines or engine threads (docs/operations.md, cores); on SGLang, a larger "
        "KV pool",
    )


def cores_to_move(view: RunView) -> bool:
    """Whether the run could give generation more of what it has: not when embedded engines share a CPU
    with a learner on one thread (every other core already generates; more needs another machine)."""
    embedded = view.setting("engine.kind") == "embedded"
    on_cpu = view.setting("learner.device") in ("auto", "cpu")
    return not (embedded and on_cpu and view.setting("learner.threads") == 1)


def learner_waits(view: RunView) -> Finding | None:
    recent = view.steps[-WINDOW:]
    if len(recent) < MIN_STEPS or not cores_to_move(view):
        return None
    idle = sum(float(s.get("idle_s", 0.0)) for s in recent)
    busy = sum(float(s.get("busy_s", 0.0)) for s in recent)
    if idle + busy <= 0 or idle / (idle + busy) <= IDLE_ADVICE:
        return None
    share = idle / (idle + busy)
    return Finding(
        "learner_waits",
        "advice",
        share,
        f"the learner waits for data {share:.0%} of its time: generation binds",
        [f"logs/steps.jsonl: idle_s {idle:.0f} s, busy_s {busy:.0f} s over the last {len(recent)} steps"],
        "give the engines more cores or engines; `rollwise bench learn` prints the run's limit line",
    )


def zero_variance(view: RunView) -> Finding | None:
    skipped = view.step_metric("skipped_zero_adv_groups", WINDOW)
    groups = view.step_metric("num_groups", WINDOW)
    if len(groups) < MIN_STEPS or len(skipped) != len(groups) or not sum(groups):
        return None
    share = sum(skipped) / sum(groups)
    if share <= ZERO_VARIANCE_ADVICE or share >= 1:
        return None
    size = view.setting("env.group_size")
    return Finding(
        "zero_variance",
        "advice",
        share,
        f"{share:.0%} of the groups taught nothing (every episode scored the same)",
        [
            f"logs/steps.jsonl: skipped_zero_adv_groups over num_groups, last {len(groups)} steps",
            f"config.toml: env.group_size = {size}",
        ],
        "raise `env.group_size`, or draw tasks nearer the policy's level",
    )


CHECKS: tuple[Callable[[RunView], Finding | None], ...] = (
    stalled,
    disk_filling,
    engine_storm,
    env_failing,
    no_reward,
    truncated,
    unstable_update,
    served_drift,
    stale_drops,
    held_out_falls,
    length_runaway,
    eval_lagging,
    concurrency_bound,
    learner_waits,
    zero_variance,
)


def examine(view: RunView) -> list[Finding]:
    """Every rule's finding on `view`, unranked (findings.ranked orders them)."""
    return [f for check in CHECKS if (f := check(view)) is not None]
