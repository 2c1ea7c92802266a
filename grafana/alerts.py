"""Alerting rules as code: builds grafana/alerts/rollwise.rules.yml (Prometheus recording and alerting rules)
and grafana/alerts/rollwise.rules.test.yml (their `promtool test rules` cases) from one list.

    .venv/bin/python grafana/alerts.py          # rewrite both files
    .venv/bin/python grafana/alerts.py --check  # exit 1 if a committed file is stale

Each alert carries its runbook (what it means, what to do: docs/monitoring.md has the same line, a test
compares them) and at least one case where it must fire and one where it must not, on synthetic series.
Thresholds are the constants below; change them here, regenerate, and the tests show what moved.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

OUT_DIR = Path(__file__).parent / "alerts"
RULES_FILE = "rollwise.rules.yml"
TESTS_FILE = "rollwise.rules.test.yml"
RUNBOOK = "docs/monitoring.md#alert-runbook"

# Scrape jobs of grafana/prometheus.yml.
JOB = "rollwise"
ENGINE_JOB = "rollwise-engine"

# Thresholds (see each alert's runbook line).
LEARNER_STALL = "15m"
SYNC_SLOW_S = 30  # a bucket bound of rollwise_weight_sync_phase_duration_seconds (10, 30, 60)
LAG0_FLOOR = 0.01  # nats: fp32 engine and learner agree to ~1e-7, bf16 to a few 1e-2
STALE_SHARE = 0.2
FREE_SHARE = 0.05
ENV_ERROR_SHARE = 0.1
JUDGE_ERROR_SHARE = 0.2
SUCCESS_COLLAPSE = 0.5  # of the best rolling success rate of the last 6 hours
SUCCESS_LEARNED = 0.2  # ... once it was at least this
PARSE_ERROR_SHARE = 0.1
NO_TOOL_SHARE = 0.5
FORMAT_ERROR_SHARE = 0.25
GAP = 0.3
ENTROPY_FLOOR = 0.05  # nats
SOLVED = 0.9

SUCCESS_RATE = "rollwise:episode_success:ratio_rate30m"
EVERY_50 = "0x49 1x50 2x50 3x50 4x50 5x50 6x30"  # an evaluation counted every 50 minutes
D = 'instance="d:9400", job="rollwise"'  # the daemon's series in the test cases
E = "http://e:30000"  # an engine's label value


@dataclass(frozen=True)
class Case:
    """A promtool case: `series` (selector -> values, one per minute), evaluated at `at`; `fires` lists the
    labels of each alert expected then (besides alertname and severity), empty = it must not fire."""

    name: str
    series: dict[str, str]
    at: str
    fires: tuple[dict[str, str], ...] = ()


@dataclass(frozen=True)
class Alert:
    name: str
    expr: str
    for_: str
    severity: str  # critical: the run is stuck or losing work; warning: it runs, but is it learning?
    summary: str  # may name labels as {{ $labels.x }}
    meaning: str
    action: str
    cases: tuple[Case, ...]


RECORDING_RULES = {
    SUCCESS_RATE: (
        "sum by (instance, env) (rate(rollwise_episode_successes_total[30m]))\n"
        "  / (sum by (instance, env) (rate(rollwise_episodes_total[30m])) > 0)"
    ),
}


def counter(start: float, per_minute: float, minutes: int) -> str:
    return f"{start:g}+{per_minute:g}x{minutes}"


def sync_buckets(slow: bool) -> dict[str, str]:
    """Whole weight syncs (phase="total") once a minute: about 45 s each (slow) or 2 s."""
    name = "rollwise_weight_sync_phase_duration_seconds_bucket"
    fast = {"10.0": not slow, "30.0": not slow, "60.0": True, "+Inf": True}
    return {
        f'{name}{{{D}, phase="total", le="{le}"}}': "0+1x60" if hit else "0x60" for le, hit in fast.items()
    }


def episodes(env: str, per_minute: int, successes: str, minutes: int) -> dict[str, str]:
    return {
        f'rollwise_episodes_total{{{D}, env="{env}", reason="stop"}}': counter(0, per_minute, minutes),
        f'rollwise_episode_successes_total{{{D}, env="{env}"}}': successes,
    }


ALERTS: tuple[Alert, ...] = (
    # --- the run is stuck -----------------------------------------------------------------------------
    Alert(
        "RollwiseDaemonDown",
        f'up{{job="{JOB}"}} == 0',
        "2m",
        "critical",
        "rollwise daemon {{ $labels.instance }} does not answer scrapes",
        "Prometheus cannot scrape the supervisor's /metrics: the daemon exited, hangs, or the port moved.",
        "Check the process and `logs/supervisor.log`; restart with the same `--run-dir` to resume.",
        (
            Case("down", {f"up{{{D}}}": "1 1 0x10"}, "8m", ({"instance": "d:9400", "job": JOB},)),
            Case("up", {f"up{{{D}}}": "1x10"}, "8m"),
        ),
    ),
    Alert(
        "RollwiseLearnerStalled",
        f"sum by (instance) (increase(rollwise_learner_steps_total[{LEARNER_STALL}])) == 0\n"
        "and on (instance) (time() - max by (instance) (rollwise_supervisor_start_time_seconds)) > 900",
        "5m",
        "critical",
        f"no learner step on {{{{ $labels.instance }}}} for {LEARNER_STALL}",
        f"The daemon is up but the learner took no optimizer step in {LEARNER_STALL} (after the first 15 "
        "minutes): the learner hangs or restarts, or no groups reach it (engines down, actors held back).",
        "Read `logs/learner.log` and `rollwise_process_restarts_total`; "
        "`rollwise_spool_depth_groups` at 0 with `rollwise_actor_idle_seconds_total` rising means rollout "
        "starved it, a growing spool means the learner itself is stuck.",
        (
            Case(
                "flat after 10 minutes",
                {
                    f"rollwise_learner_steps_total{{{D}}}": "0+1x10 10x50",
                    f"rollwise_supervisor_start_time_seconds{{{D}}}": "0x60",
                },
                "40m",
                ({"instance": "d:9400"},),
            ),
            Case(
                "stepping",
                {
                    f"rollwise_learner_steps_total{{{D}}}": "0+1x60",
                    f"rollwise_supervisor_start_time_seconds{{{D}}}": "0x60",
                },
                "40m",
            ),
            Case(
                "just started",
                {
                    f"rollwise_learner_steps_total{{{D}}}": "0x60",
                    f"rollwise_supervisor_start_time_seconds{{{D}}}": "1800x60",
                },
                "40m",
            ),
        ),
    ),
    Alert(
        "RollwiseEngineDown",
        "max by (instance) (rollwise_engines_not_up) > 0\n"
        "or max by (instance) (rollwise_engines_serving) == 0\n"
        f'or up{{job="{ENGINE_JOB}"}} == 0',
        "3m",
        "critical",
        "an inference engine of {{ $labels.instance }} is down",
        "An engine process rollwise started (or its router) is not up, no engine of the pool answers "
        "(admission waits; `engine.unavailable_timeout_s` may stop the daemon), or an engine's /metrics "
        "cannot be scraped: rollout runs on fewer engines, or not at all.",
        "`rollwise engines list`; `logs/engine<i>.log`; `rollwise_process_restarts_total"
        '{component="engine"}` shows restarts. An engine that keeps dying: memory, CUDA, a bad flag.',
        (
            Case(
                "a child not up",
                {f"rollwise_engines_not_up{{{D}}}": "0 1x10"},
                "6m",
                ({"instance": "d:9400"},),
            ),
            Case(
                "no engine answers",
                {f"rollwise_engines_serving{{{D}}}": "1 0x10", f"rollwise_engines_not_up{{{D}}}": "0x11"},
                "6m",
                ({"instance": "d:9400"},),
            ),
            Case(
                "engine target down",
                {f'up{{instance="e:30000", job="{ENGINE_JOB}"}}': "1 0x10"},
                "6m",
                ({"instance": "e:30000", "job": ENGINE_JOB},),
            ),
            Case(
                "restarted within a minute",
                {
                    f"rollwise_engines_not_up{{{D}}}": "0 1 0x10",
                    f"rollwise_engines_serving{{{D}}}": "1 0 1x10",
                    f'up{{instance="e:30000", job="{ENGINE_JOB}"}}': "1 0 1x10",
                },
                "6m",
            ),
        ),
    ),
    Alert(
        "RollwiseEngineEjected",
        "max by (instance) (rollwise_engine_pool_ejected) > 0",
        "3m",
        "warning",
        "an engine is ejected from the pool of {{ $labels.instance }}",
        "The actors' pool ejected an engine after consecutive failed requests; it is probed and readmitted "
        "when its /health answers, and until then its share of episodes goes to the others.",
        "`rollwise_engine_errors_total` by kind says how requests fail; check the engine's health and log; "
        "`rollwise engines drain URL` takes a broken engine out for good.",
        (
            Case(
                "ejected", {f"rollwise_engine_pool_ejected{{{D}}}": "0 1x10"}, "6m", ({"instance": "d:9400"},)
            ),
            Case("readmitted", {f"rollwise_engine_pool_ejected{{{D}}}": "0 1 0x10"}, "6m"),
        ),
    ),
    Alert(
        "RollwiseServedPolicyCheckFailing",
        'sum by (instance, engine, result) (increase(rollwise_served_checks_total{result!="ok"}[15m])) > 0',
        "0m",
        "critical",
        "served-policy check {{ $labels.result }} on engine {{ $labels.engine }}",
        "After a weight sync an engine's log-probs of the learner's probe were another policy's (mismatch) "
        "or it did not answer (error): the engine may sample from stale or corrupt weights. "
        "`async.served_check.max_failures` mismatches in a row stop the daemon.",
        "Compare `rollwise_served_check_logprob_diff_nats` with `async.served_check.tolerance`; check the "
        "engine's dtype and that it loads `weights/v<n>` (or the adapter); restart or drain that engine.",
        (
            Case(
                "mismatch",
                {f'rollwise_served_checks_total{{{D}, engine="{E}", result="mismatch"}}': "0x5 1x10"},
                "8m",
                ({"instance": "d:9400", "engine": E, "result": "mismatch"},),
            ),
            Case(
                "all ok",
                {f'rollwise_served_checks_total{{{D}, engine="{E}", result="ok"}}': "0+1x15"},
                "8m",
            ),
        ),
    ),
    Alert(
        "RollwiseStorageBlocked",
        "max by (instance, component) (rollwise_storage_blocked) > 0",
        "2m",
        "critical",
        "{{ $labels.component }} writes are refused on {{ $labels.instance }}",
        "The run directory refuses writes (full, read-only, quota, I/O error): that component holds its "
        "work and retries, so the spool, checkpoints or weights do not advance.",
        "`rollwise_storage_errors_total` names the errno; free space or remount, and the component resumes "
        "on its own (nothing is lost while it waits).",
        (
            Case(
                "spool blocked",
                {f'rollwise_storage_blocked{{{D}, component="spool"}}': "0 1x10"},
                "5m",
                ({"instance": "d:9400", "component": "spool"},),
            ),
            Case("writable", {f'rollwise_storage_blocked{{{D}, component="spool"}}': "0x10"}, "5m"),
        ),
    ),
    Alert(
        "RollwiseRunDirNearlyFull",
        f"max by (instance) (rollwise_run_dir_free_bytes / rollwise_run_dir_capacity_bytes) < {FREE_SHARE:g}",
        "5m",
        "critical",
        "the run directory of {{ $labels.instance }} is nearly full",
        f"Less than {FREE_SHARE:.0%} of the run directory's filesystem is free: the next checkpoint, "
        "weights or spool files may be refused.",
        "Delete old runs or `checkpoints/`, lower `learner.checkpoint_every` or `trace.keep_steps`, or move "
        "the run to a larger disk (stop, copy the directory, resume there).",
        (
            Case(
                "1% free",
                {
                    f"rollwise_run_dir_free_bytes{{{D}}}": "1e9x10",
                    f"rollwise_run_dir_capacity_bytes{{{D}}}": "1e11x10",
                },
                "8m",
                ({"instance": "d:9400"},),
            ),
            Case(
                "half free",
                {
                    f"rollwise_run_dir_free_bytes{{{D}}}": "5e10x10",
                    f"rollwise_run_dir_capacity_bytes{{{D}}}": "1e11x10",
                },
                "8m",
            ),
        ),
    ),
    Alert(
        "RollwiseRunDirFillingUp",
        "max by (instance) (predict_linear(rollwise_run_dir_free_bytes[1h], 6 * 3600)) < 0",
        "15m",
        "warning",
        "the run directory of {{ $labels.instance }} fills up within 6 hours at this rate",
        "Free space on the run directory's filesystem shrinks fast enough to run out within 6 hours.",
        "Find what grows (`du -sh runs/*/*`): checkpoints, weights (kept: 3 versions), trace, logs; prune "
        "or move before `RollwiseRunDirNearlyFull` and `RollwiseStorageBlocked` follow.",
        (
            Case(
                "shrinking",
                {f"rollwise_run_dir_free_bytes{{{D}}}": "2e10-2e8x100"},
                "80m",
                ({"instance": "d:9400"},),
            ),
            Case("steady", {f"rollwise_run_dir_free_bytes{{{D}}}": "2e10x100"}, "80m"),
        ),
    ),
    # --- the run is slow or losing work --------------------------------------------------------------------
    Alert(
        "RollwiseWeightSyncSlow",
        "histogram_quantile(0.9, sum by (instance, le) "
        '(rate(rollwise_weight_sync_phase_duration_seconds_bucket{phase="total"}[30m])))'
        f" > {SYNC_SLOW_S}",
        "15m",
        "warning",
        f"weight syncs on {{{{ $labels.instance }}}} take over {SYNC_SLOW_S} s (p90)",
        f"The 90th percentile of a whole weight sync (pause, load, continue) exceeds {SYNC_SLOW_S} s: "
        "engines stand paused and the staleness budget fills while they load.",
        "`rollwise_weight_sync_phase_duration_seconds` by phase shows which part; load = disk or network "
        "(`engine.weight_transport`); raise `async.sync_every_steps`, or use LoRA adapters.",
        (
            Case("45 s syncs", sync_buckets(slow=True), "50m", ({"instance": "d:9400"},)),
            Case("2 s syncs", sync_buckets(slow=False), "50m"),
        ),
    ),
    Alert(
        "RollwiseWeightSyncFailing",
        'sum by (instance) (increase(rollwise_weight_syncs_total{status!="ok"}[15m])) > 0',
        "5m",
        "warning",
        "weight syncs fail on {{ $labels.instance }}",
        "A weight sync failed on at least one engine in the last 15 minutes; the engine catches up when it "
        "is ready again, meanwhile it serves an older policy.",
        "The sync line in the progress output names the engine and error; check that engine (down, disk, "
        "`engine.weight_transport = http` fetcher reachable).",
        (
            Case(
                "errors",
                {f'rollwise_weight_syncs_total{{{D}, status="error"}}': "0x3 1x10"},
                "10m",
                ({"instance": "d:9400"},),
            ),
            Case("ok", {f'rollwise_weight_syncs_total{{{D}, status="ok"}}': "0+1x13"}, "10m"),
        ),
    ),
    Alert(
        "RollwiseLag0MismatchRising",
        'avg_over_time(rollwise_learner_logprob_mismatch_abs_by_lag{lag="0"}[30m])\n'
        '  > 2 * avg_over_time(rollwise_learner_logprob_mismatch_abs_by_lag{lag="0"}[6h] offset 30m)\n'
        f'and avg_over_time(rollwise_learner_logprob_mismatch_abs_by_lag{{lag="0"}}[30m]) > {LAG0_FLOOR:g}',
        "30m",
        "warning",
        "engine/learner log-prob mismatch at lag 0 doubled on {{ $labels.instance }}",
        "Tokens trained on the very weights that sampled them disagree twice as much as over the 6 hours "
        f"before (and above {LAG0_FLOOR:g} nats): a numerics change (dtype, kernel, an engine upgrade) or an "
        "engine serving other weights than it claims.",
        "Check `rollwise_served_check_logprob_diff_nats` and the engines' dtype; `learner.mismatch` "
        "(truncated IS weights, rejection) bounds the damage meanwhile.",
        (
            Case(
                "doubled",
                {f'rollwise_learner_logprob_mismatch_abs_by_lag{{{D}, lag="0"}}': "0.01x400 0.05x100"},
                "460m",
                ({"instance": "d:9400", "job": JOB, "lag": "0"},),
            ),
            Case(
                "steady",
                {f'rollwise_learner_logprob_mismatch_abs_by_lag{{{D}, lag="0"}}': "0.03x500"},
                "460m",
            ),
            Case(
                "rising but tiny",
                {f'rollwise_learner_logprob_mismatch_abs_by_lag{{{D}, lag="0"}}': "0.001x400 0.004x100"},
                "460m",
            ),
        ),
    ),
    Alert(
        "RollwiseStaleDropsHigh",
        'sum by (instance) (increase(rollwise_groups_dropped_total{reason="stale"}[30m]))\n'
        f"  / sum by (instance) (increase(rollwise_groups_written_total[30m])) > {STALE_SHARE:g}\n"
        "and on (instance) sum by (instance) (increase(rollwise_groups_written_total[30m])) >= 10",
        "15m",
        "warning",
        "the learner drops many groups as stale on {{ $labels.instance }}",
        f"More than {STALE_SHARE:.0%} of the groups written in 30 minutes were dropped as too stale: "
        "rollout work is wasted.",
        "Raise `async.max_staleness` (with `learner.mismatch` correction), or make rollout keep pace "
        "with the learner (`rollout.max_concurrent_groups`, engines); see docs/monitoring.md, bottleneck.",
        (
            Case(
                "half dropped",
                {
                    f"rollwise_groups_written_total{{{D}}}": "0+10x60",
                    f'rollwise_groups_dropped_total{{{D}, reason="stale"}}': "0+5x60",
                },
                "50m",
                ({"instance": "d:9400"},),
            ),
            Case(
                "a tenth dropped",
                {
                    f"rollwise_groups_written_total{{{D}}}": "0+10x60",
                    f'rollwise_groups_dropped_total{{{D}, reason="stale"}}': "0+1x60",
                },
                "50m",
            ),
        ),
    ),
    Alert(
        "RollwiseEnvErrorRateHigh",
        'sum by (instance, env) (rate(rollwise_env_errors_total{kind!="close"}[15m]))\n'
        f"  / sum by (instance, env) (rate(rollwise_episodes_total[15m])) > {ENV_ERROR_SHARE:g}\n"
        "and on (instance, env) sum by (instance, env) (increase(rollwise_episodes_total[15m])) >= 20",
        "15m",
        "warning",
        "environment {{ $labels.env }} fails often on {{ $labels.instance }}",
        f"Environment failures (errors, timeouts, invalid replies, agents, judges) exceed "
        f"{ENV_ERROR_SHARE:.0%} of the episodes: those episodes are not trained on.",
        "`rollwise_env_errors_total` by kind; the episode errors in the supervisor log; `rollwise env check` "
        "the environment; raise its `step_timeout_s` if it is only slow.",
        (
            Case(
                "a quarter fail",
                {
                    f'rollwise_episodes_total{{{D}, env="calc", reason="stop"}}': "0+20x60",
                    f'rollwise_env_errors_total{{{D}, env="calc", kind="error"}}': "0+5x60",
                },
                "40m",
                ({"instance": "d:9400", "env": "calc"},),
            ),
            Case(
                "few fail; closes do not count",
                {
                    f'rollwise_episodes_total{{{D}, env="calc", reason="stop"}}': "0+20x60",
                    f'rollwise_env_errors_total{{{D}, env="calc", kind="error"}}': "0+1x60",
                    f'rollwise_env_errors_total{{{D}, env="calc", kind="close"}}': "0+10x60",
                },
                "40m",
            ),
        ),
    ),
    Alert(
        "RollwiseJudgeErrorRateHigh",
        'sum by (instance, judge) (rate(rollwise_judge_requests_total{status!="ok"}[15m]))\n'
        f"  / sum by (instance, judge) (rate(rollwise_judge_requests_total[15m])) > {JUDGE_ERROR_SHARE:g}",
        "15m",
        "warning",
        "judge {{ $labels.judge }} fails often on {{ $labels.instance }}",
        f"More than {JUDGE_ERROR_SHARE:.0%} of the judge's requests fail (timeout, connection, http, "
        "parse); after its retries an episode it cannot score is excluded, never scored 0.",
        "`rollwise_judge_requests_total` by status and `rollwise_judge_failures_total` by reason; check the "
        "judge's endpoint, its timeout, and that its answers still parse.",
        (
            Case(
                "a third fail",
                {
                    f'rollwise_judge_requests_total{{{D}, judge="j", status="ok"}}': "0+10x60",
                    f'rollwise_judge_requests_total{{{D}, judge="j", status="timeout"}}': "0+5x60",
                },
                "40m",
                ({"instance": "d:9400", "judge": "j"},),
            ),
            Case(
                "few fail",
                {
                    f'rollwise_judge_requests_total{{{D}, judge="j", status="ok"}}': "0+10x60",
                    f'rollwise_judge_requests_total{{{D}, judge="j", status="timeout"}}': "0+1x60",
                },
                "40m",
            ),
        ),
    ),
    # --- it runs, but does it learn? ------------------------------------------------------------------------
    Alert(
        "RollwiseSuccessCollapsed",
        f"{SUCCESS_RATE} < {SUCCESS_COLLAPSE:g} * max_over_time({SUCCESS_RATE}[6h])\n"
        f"and max_over_time({SUCCESS_RATE}[6h]) > {SUCCESS_LEARNED:g}",
        "30m",
        "critical",
        "success on {{ $labels.env }} fell to under half its best of the last 6 hours",
        f"The training success rate (30-minute window) is below {SUCCESS_COLLAPSE:.0%} of its best over the "
        "last 6 hours: the policy unlearned (a bad update, an entropy collapse, reward hacking) or the "
        "environment changed.",
        "Check entropy, clip fraction, grad norm and mismatch on the learner dashboard around the drop; "
        "`rollwise inspect` recent groups; resume from a checkpoint before the drop with a lower lr.",
        (
            Case(
                "80% then 20%",
                episodes("gn", 100, "0+80x200 16000+20x200", 400),
                "300m",
                ({"instance": "d:9400", "env": "gn"},),
            ),
            Case("steady 80%", episodes("gn", 100, "0+80x400", 400), "300m"),
            Case("never learned", episodes("gn", 100, "0+10x400", 400), "300m"),
        ),
    ),
    Alert(
        "RollwiseEntropyCollapsed",
        f"max_over_time(rollwise_learner_entropy_nats[30m]) < {ENTROPY_FLOOR:g}\n"
        "and on (instance) sum by (instance) (increase(rollwise_learner_steps_total[30m])) > 0\n"
        f"and on (instance) max by (instance) ({SUCCESS_RATE}) < {SOLVED:g}",
        "30m",
        "warning",
        "policy entropy collapsed on {{ $labels.instance }} before the task is solved",
        f"The policy's mean token entropy stayed below {ENTROPY_FLOOR:g} nats for 30 minutes while training "
        f"success is under {SOLVED:.0%}: it stopped exploring, so groups play alike and carry no signal.",
        "Raise `learner.regularizers.entropy_coef` (or the action prior), lower the lr or "
        "`learner.mini_batches`; the floor is model-specific: set it from the learner dashboard's Entropy "
        "panel of a healthy run.",
        (
            Case(
                "collapsed at 30% success",
                {
                    f"rollwise_learner_entropy_nats{{{D}}}": "0.5x30 0.01x90",
                    f"rollwise_learner_steps_total{{{D}}}": "0+1x120",
                    **episodes("gn", 100, "0+30x120", 120),
                },
                "110m",
                ({"instance": "d:9400", "job": JOB},),
            ),
            Case(
                "low entropy, solved",
                {
                    f"rollwise_learner_entropy_nats{{{D}}}": "0.5x30 0.01x90",
                    f"rollwise_learner_steps_total{{{D}}}": "0+1x120",
                    **episodes("gn", 100, "0+95x120", 120),
                },
                "110m",
            ),
            Case(
                "exploring",
                {
                    f"rollwise_learner_entropy_nats{{{D}}}": "0.5x120",
                    f"rollwise_learner_steps_total{{{D}}}": "0+1x120",
                    **episodes("gn", 100, "0+30x120", 120),
                },
                "110m",
            ),
        ),
    ),
    Alert(
        "RollwiseTrainHeldOutDivergence",
        f"max by (instance, env, mode) (rollwise_eval_success_gap_ratio) > {GAP:g}",
        "30m",
        "warning",
        "training success exceeds held-out success on {{ $labels.env }} ({{ $labels.mode }})",
        f"Training episodes succeed {GAP:.0%} (absolute) more often than the held-out evaluation: training "
        "reward no longer carries to unseen tasks (memorised tasks, a leaky reward, an exploit).",
        "`rollwise inspect` high-reward training groups for an exploit; check `eval.holdout_fraction` keeps "
        "eval tasks out of training; compare greedy and sampled modes.",
        (
            Case(
                "wide gap",
                {f'rollwise_eval_success_gap_ratio{{{D}, env="gn", mode="greedy"}}': "0.1x10 0.5x60"},
                "60m",
                ({"instance": "d:9400", "env": "gn", "mode": "greedy"},),
            ),
            Case(
                "close", {f'rollwise_eval_success_gap_ratio{{{D}, env="gn", mode="greedy"}}': "0.1x70"}, "60m"
            ),
        ),
    ),
    Alert(
        "RollwiseEvalOverdue",
        "(\n"
        "  max by (instance) (max_over_time(rollwise_policy_version[3h]))\n"
        "  - max by (instance) (min_over_time(rollwise_policy_version[3h]))\n"
        ")\n"
        ">= on (instance) group_right 2 * max by (instance, env) (rollwise_eval_interval_versions > 0)\n"
        "unless on (instance, env)\n"
        '  sum by (instance, env) (increase(rollwise_eval_runs_total{status="ok"}[3h])) > 0',
        "15m",
        "warning",
        "no held-out evaluation of {{ $labels.env }} finished in 3 hours on {{ $labels.instance }}",
        "[eval] is on and the policy advanced by two evaluation intervals (`eval.every_versions`) in 3 hours "
        "without one evaluation finishing: evaluations fail, hang, or take longer than the interval.",
        '`rollwise_eval_runs_total{status="failed"}` and the `eval` lines of the progress output; '
        "`rollwise_eval_duration_seconds` against the time between versions; fewer `eval.tasks` or a "
        "larger `eval.every_versions`.",
        (
            Case(
                "stopped after 100 minutes",
                {
                    f"rollwise_policy_version{{{D}}}": "0+1x330",
                    f'rollwise_eval_interval_versions{{{D}, env="gn"}}': "50x330",
                    f'rollwise_eval_runs_total{{{D}, env="gn", status="ok"}}': "0x49 1x50 2x230",
                },
                "320m",
                ({"instance": "d:9400", "env": "gn"},),
            ),
            Case(
                "every 50 minutes",
                {
                    f"rollwise_policy_version{{{D}}}": "0+1x330",
                    f'rollwise_eval_interval_versions{{{D}, env="gn"}}': "50x330",
                    f'rollwise_eval_runs_total{{{D}, env="gn", status="ok"}}': EVERY_50,
                },
                "320m",
            ),
            Case(
                "the policy stands still",
                {
                    f"rollwise_policy_version{{{D}}}": "7x330",
                    f'rollwise_eval_interval_versions{{{D}, env="gn"}}': "50x330",
                    f'rollwise_eval_runs_total{{{D}, env="gn", status="ok"}}': "1x330",
                },
                "320m",
            ),
        ),
    ),
    Alert(
        "RollwiseEvalFailing",
        'sum by (instance, env) (increase(rollwise_eval_runs_total{status="failed"}[1h])) > 0',
        "0m",
        "warning",
        "a held-out evaluation of {{ $labels.env }} failed on {{ $labels.instance }}",
        "An evaluation raised (a bug or a broken eval env, not failed episodes); the curve has a hole.",
        "The traceback is in the supervisor log (`evaluation of version N failed`); `rollwise eval` "
        "reproduces it on one version.",
        (
            Case(
                "failed",
                {f'rollwise_eval_runs_total{{{D}, env="gn", status="failed"}}': "0x5 1x10"},
                "10m",
                ({"instance": "d:9400", "env": "gn"},),
            ),
            Case("ok", {f'rollwise_eval_runs_total{{{D}, env="gn", status="ok"}}': "0+1x15"}, "10m"),
        ),
    ),
    # --- silent failures: the episodes finish, the policy quietly does the wrong thing ----------------------
    Alert(
        "RollwiseToolCallParseFailures",
        "sum by (instance, env) (rate(rollwise_tool_call_errors_total[30m]))\n"
        f"  / sum by (instance, env) (rate(rollwise_turns_total[30m])) > {PARSE_ERROR_SHARE:g}",
        "15m",
        "warning",
        "tool-call markup does not parse in many turns of {{ $labels.env }}",
        f"More than {PARSE_ERROR_SHARE:g} unparsable tool calls per turn: the policy writes call markup "
        "(`<tool_call>`) with invalid JSON or no name, so its calls never run.",
        "`rollwise inspect` a recent group to see the markup; check `env.tool_parser` matches the model's "
        "chat template; a rising trend after an update is a regression of the policy.",
        (
            Case(
                "a fifth of turns",
                {
                    f'rollwise_turns_total{{{D}, env="calc"}}': "0+100x60",
                    f'rollwise_tool_call_errors_total{{{D}, env="calc"}}': "0+20x60",
                },
                "50m",
                ({"instance": "d:9400", "env": "calc"},),
            ),
            Case(
                "rare",
                {
                    f'rollwise_turns_total{{{D}, env="calc"}}': "0+100x60",
                    f'rollwise_tool_call_errors_total{{{D}, env="calc"}}': "0+5x60",
                },
                "50m",
            ),
        ),
    ),
    Alert(
        "RollwiseToolCallsStopped",
        "sum by (instance, env) (rate(rollwise_episodes_without_tool_calls_total[30m]))\n"
        '  / sum by (instance, env) (rate(rollwise_episodes_total{reason=~"stop|length|truncated"}[30m]))'
        f" > {NO_TOOL_SHARE:g}",
        "30m",
        "warning",
        "most episodes of {{ $labels.env }} make no tool call",
        f"More than {NO_TOOL_SHARE:.0%} of the finished episodes of an environment that declares tools made "
        "no tool call that parsed: the policy answers without its tools (or its calls no longer parse).",
        "Compare with `rollwise_tool_calls_total` per turn on the reliability dashboard; `rollwise inspect` "
        "a group; a reward that does not require the tool lets the policy drop it.",
        (
            Case(
                "8 in 10 without",
                {
                    f'rollwise_episodes_total{{{D}, env="calc", reason="stop"}}': "0+10x90",
                    f'rollwise_episodes_without_tool_calls_total{{{D}, env="calc"}}': "0+8x90",
                },
                "80m",
                ({"instance": "d:9400", "env": "calc"},),
            ),
            Case(
                "2 in 10 without",
                {
                    f'rollwise_episodes_total{{{D}, env="calc", reason="stop"}}': "0+10x90",
                    f'rollwise_episodes_without_tool_calls_total{{{D}, env="calc"}}': "0+2x90",
                },
                "80m",
            ),
        ),
    ),
    Alert(
        "RollwiseAnswerFormatErrors",
        "sum by (instance, env) (rate(rollwise_answer_format_errors_total[30m]))\n"
        f"  / sum by (instance, env) (rate(rollwise_turns_total[30m])) > {FORMAT_ERROR_SHARE:g}",
        "30m",
        "warning",
        "answers in the wrong format in many turns of {{ $labels.env }}",
        f"The environment reports a wrong answer format (StepResult.info['format_error']) in more than "
        f"{FORMAT_ERROR_SHARE:.0%} of the turns: the policy drifts from the format the reward needs.",
        "`rollwise inspect` a failing group; check the system prompt still asks for the format; a format "
        "reward (or penalty) in the environment brings it back.",
        (
            Case(
                "40% of turns",
                {
                    f'rollwise_turns_total{{{D}, env="rg"}}': "0+100x90",
                    f'rollwise_answer_format_errors_total{{{D}, env="rg"}}': "0+40x90",
                },
                "80m",
                ({"instance": "d:9400", "env": "rg"},),
            ),
            Case(
                "5% of turns",
                {
                    f'rollwise_turns_total{{{D}, env="rg"}}': "0+100x90",
                    f'rollwise_answer_format_errors_total{{{D}, env="rg"}}': "0+5x90",
                },
                "80m",
            ),
        ),
    ),
)


# --- rendering ---------------------------------------------------------------------------------------------
class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def _dump(header: str, data: dict[str, Any]) -> str:
    body = yaml.dump(data, Dumper=_Dumper, sort_keys=False, width=120, allow_unicode=True)
    return header + body


def annotations(alert: Alert) -> dict[str, str]:
    return {
        "summary": alert.summary,
        "description": alert.meaning,
        "action": alert.action,
        "runbook": f"{RUNBOOK} ({alert.name})",
    }


def rules() -> dict[str, Any]:
    return {
        "groups": [
            {
                "name": "rollwise-recording",
                "rules": [{"record": name, "expr": expr} for name, expr in RECORDING_RULES.items()],
            },
            {
                "name": "rollwise-alerts",
                "rules": [
                    {
                        "alert": a.name,
                        "expr": a.expr,
                        "for": a.for_,
                        "labels": {"severity": a.severity},
                        "annotations": annotations(a),
                    }
                    for a in ALERTS
                ],
            },
        ]
    }


def _expand(template: str, labels: dict[str, str]) -> str:
    """The summary as Prometheus renders it for these labels (only `{{ $labels.x }}` is used; `{{ $value }}`
    appears in no case that fires)."""
    return re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels.get(m.group(1), ""), template)


def tests() -> dict[str, Any]:
    groups: list[dict[str, Any]] = [
        {
            "name": "recording: success rate",
            "interval": "1m",
            "input_series": [
                {"series": s, "values": v} for s, v in episodes("gn", 100, "0+25x60", 60).items()
            ],
            "promql_expr_test": [
                {
                    "expr": SUCCESS_RATE,
                    "eval_time": "40m",
                    "exp_samples": [
                        {"labels": f'{SUCCESS_RATE}{{instance="d:9400", env="gn"}}', "value": 0.25}
                    ],
                }
            ],
        }
    ]
    for alert in ALERTS:
        for case in alert.cases:
            expected = []
            for labels in case.fires:
                shown = {**labels, "severity": alert.severity}
                expected.append(
                    {
                        "exp_labels": shown,
                        "exp_annotations": {**annotations(alert), "summary": _expand(alert.summary, labels)},
                    }
                )
            groups.append(
                {
                    "name": f"{alert.name}: {case.name}",
                    "interval": "1m",
                    "input_series": [{"series": s, "values": v} for s, v in case.series.items()],
                    "alert_rule_test": [
                        {"eval_time": case.at, "alertname": alert.name, "exp_alerts": expected}
                    ],
                }
            )
    return {"rule_files": [RULES_FILE], "evaluation_interval": "1m", "tests": groups}


HEADER = "# Generated by grafana/alerts.py; do not edit (change the code and run it).\n"


def render_all() -> dict[str, str]:
    """File name -> YAML text, exactly as committed."""
    rules_header = HEADER + "# Loaded by grafana/prometheus.yml (rule_files); runbook: docs/monitoring.md.\n"
    tests_header = HEADER + "# promtool test rules grafana/alerts/rollwise.rules.test.yml\n"
    return {RULES_FILE: _dump(rules_header, rules()), TESTS_FILE: _dump(tests_header, tests())}


def runbook_lines() -> list[str]:
    """The runbook table's rows (docs/monitoring.md holds them verbatim)."""
    return [f"| `{a.name}` | {a.severity} | {a.meaning} | {a.action} |" for a in ALERTS]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed files differ")
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
        print(f"stale alert files (run grafana/alerts.py): {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
