"""The run-health advisor (pipeline.tools.doctor): each rule on hand-made views with known numbers, firing
above its threshold and silent below it; the ranking and the advice held back; the command on a run
directory."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from pipeline.supervisor.observability.run_health import health_checks as checks
from pipeline.supervisor.observability.run_health.findings import Finding, held_back, ranked, render_text
from pipeline.supervisor.observability.run_health.run_view import RunView, load, parse_metrics
from pipeline.tools.doctor import main


def _step(version: int, **metrics: float) -> dict[str, Any]:
    base = {
        "reward_mean": 0.5,
        "success_rate": 0.5,
        "overlong_fraction": 0.0,
        "clip_fraction": 0.05,
        "grad_norm": 1.0,
        "mismatch_abs_mean_lag0": 0.001,
        "skipped_zero_adv_groups": 0.0,
        "num_groups": 8.0,
        "loss_tokens": 800.0,
        "num_sequences": 32.0,
    }
    return {
        "event": "step",
        "step": version,
        "version": version,
        "idle_s": 0.1,
        "busy_s": 0.9,
        "metrics": {**base, **metrics},
    }


def _healthy(n: int = 40) -> RunView:
    return RunView(
        steps=[_step(v) for v in range(1, n + 1)],
        last_step_at=1000.0,
        config={
            "sampling": {"max_new_tokens": 48},
            "async": {"max_staleness": 2},
            "rollout": {"max_concurrent_groups": 8},
            "env": {"group_size": 8},
            "eval": {"every_versions": 50},
        },
        free_share=0.5,
        running=True,
        now=1001.0,
    )


def _with_steps(view: RunView, **metrics: float) -> RunView:
    """The same view with the last WINDOW steps' metrics overridden."""
    steps = [dict(s) for s in view.steps]
    for s in steps[-checks.WINDOW :]:
        s["metrics"] = {**s["metrics"], **metrics}
    return dataclasses.replace(view, steps=steps)


def test_a_healthy_run_has_no_finding() -> None:
    assert checks.examine(_healthy()) == []


def test_a_stall_is_ten_median_steps_and_at_least_five_minutes_without_a_step() -> None:
    view = dataclasses.replace(_healthy(), now=1000.0 + 301.0)  # median step 1 s: the 300 s floor binds
    found = checks.stalled(view)
    assert found is not None and found.level == "alarm" and "301 s" in found.title
    assert checks.stalled(dataclasses.replace(view, now=1000.0 + 299.0)) is None
    assert checks.stalled(dataclasses.replace(view, running=False)) is None  # a stopped run is not stalled


def test_a_stall_says_which_side_stopped_and_the_operator_may_set_the_limit() -> None:
    view = dataclasses.replace(_healthy(), now=1000.0 + 30.0, stall_after_s=20.0)
    engines_gone = dataclasses.replace(view, metrics=parse_metrics("rollwise_engines_serving 0\n"))
    found = checks.stalled(engines_gone)
    assert found is not None and "limit 20 s" in found.evidence[1]
    assert found.evidence[2].startswith("metrics: rollwise_engines_serving = 0")
    assert "logs/engine<i>.log" in found.action
    waiting = dataclasses.replace(
        view, metrics=parse_metrics("rollwise_engines_serving 1\nrollwise_spool_depth_groups 6\n")
    )
    found = checks.stalled(waiting)
    assert found is not None and "rollwise_spool_depth_groups = 6" in found.evidence[2]
    assert "logs/learner.log" in found.action
    assert checks.stalled(dataclasses.replace(view, stall_after_s=40.0)) is None


def test_every_reward_zero_or_no_variance_is_an_alarm() -> None:
    zero = checks.no_reward(_with_steps(_healthy(), reward_mean=0.0))
    assert zero is not None and "every reward" in zero.title
    flat = checks.no_reward(_with_steps(_healthy(), skipped_zero_adv_groups=8.0))
    assert flat is not None and "variance" in flat.title
    assert checks.no_reward(_with_steps(_healthy(), skipped_zero_adv_groups=7.0)) is None
    assert "check the reward" in flat.action  # success 0.5: the reward is suspect
    solved = checks.no_reward(_with_steps(_healthy(), skipped_zero_adv_groups=8.0, success_rate=0.97))
    assert solved is not None and "solves every task" in solved.action
    assert "training success 0.97" in solved.evidence[1]


def test_truncation_is_advice_above_a_tenth_and_an_alarm_above_half() -> None:
    assert checks.truncated(_with_steps(_healthy(), overlong_fraction=0.09)) is None
    advice = checks.truncated(_with_steps(_healthy(), overlong_fraction=0.3))
    alarm = checks.truncated(_with_steps(_healthy(), overlong_fraction=0.8))
    assert advice is not None and advice.level == "advice"
    assert alarm is not None and alarm.level == "alarm" and "80%" in alarm.title
    assert "sampling.max_new_tokens = 48" in alarm.evidence[1]


def test_truncation_counts_the_cut_turns_of_the_actors_when_the_daemon_exported_them() -> None:
    """Every turn the budget cut (the actors' counter), whatever the learner's over-long penalty: the
    steps' overlong_fraction (0 here: no penalty configured) is read only without the counters."""
    cut = _metrics('rollwise_turns_total{env="g"} 200\nrollwise_turns_cut_total{env="g"} 150\n')
    alarm = checks.truncated(cut)
    assert alarm is not None and alarm.level == "alarm" and "75%" in alarm.title
    assert alarm.evidence[0] == "metrics: rollwise_turns_cut_total = 150 of rollwise_turns_total = 200"
    few = _metrics('rollwise_turns_total{env="g"} 200\nrollwise_turns_cut_total{env="g"} 19\n')
    assert checks.truncated(few) is None
    young = _metrics('rollwise_turns_total{env="g"} 10\nrollwise_turns_cut_total{env="g"} 10\n')
    assert checks.truncated(young) is None  # under 20 turns: the steps' fraction decides (0 here)


def test_unstable_updates_by_clipping_or_by_the_gradient_norm() -> None:
    clipped = checks.unstable_update(_with_steps(_healthy(), clip_fraction=0.6))
    assert clipped is not None and "clip_fraction 0.60" in clipped.evidence[0]
    steps = _healthy().steps
    for s in steps[-5:]:
        s["metrics"] = {**s["metrics"], "grad_norm": 11.0}
    exploded = checks.unstable_update(dataclasses.replace(_healthy(), steps=steps))
    assert exploded is not None and "grad_norm 11" in exploded.evidence[0]


def test_the_lag0_mismatch_doubling_above_its_floor_is_drift() -> None:
    view = _healthy()
    for s in view.steps[-10:]:
        s["metrics"] = {**s["metrics"], "mismatch_abs_mean_lag0": 0.03}
    found = checks.served_drift(view)
    assert found is not None and "0.001" in found.evidence[0] and "0.03" in found.evidence[0]
    low = _healthy()
    for s in low.steps[-10:]:
        s["metrics"] = {**s["metrics"], "mismatch_abs_mean_lag0": 0.009}  # nine times, under the floor
    assert checks.served_drift(low) is None


def _metrics(text: str) -> RunView:
    return dataclasses.replace(_healthy(), metrics=parse_metrics(text))


def test_stale_drops_count_those_dropped_in_flight_among_the_groups_ended() -> None:
    text = (
        "rollwise_groups_written_total 95\n"
        'rollwise_groups_dropped_total{reason="stale"} 3\n'
        'rollwise_groups_dropped_total{reason="stale_in_flight"} 5\n'
        'rollwise_groups_dropped_total{reason="no_update"} 40\n'
    )
    found = checks.stale_drops(_metrics(text))
    assert found is not None and found.level == "alarm" and found.title.startswith("8.0%")  # 8 of 100
    light = checks.stale_drops(
        _metrics('rollwise_groups_written_total 100\nrollwise_groups_dropped_total{reason="stale"} 2\n')
    )
    assert light is not None and light.level == "advice"
    assert checks.stale_drops(_healthy()) is None  # no scrape: nothing said


def test_an_engine_storm_counts_errors_and_aborts_over_requests() -> None:
    text = (
        'rollwise_engine_request_duration_seconds_count{engine="e0"} 100\n'
        'rollwise_engine_errors_total{engine="e0",kind="unavailable"} 15\n'
        'rollwise_engine_aborts_total{reason="timeout"} 10\n'
    )
    found = checks.engine_storm(_metrics(text))
    assert found is not None and "25%" in found.title and "'unavailable': 15.0" in found.evidence[0]
    assert checks.engine_storm(_metrics(text.replace(" 15\n", " 5\n"))) is None  # 15%


def test_a_failing_environment_is_its_error_share_of_the_episodes_closing_errors_aside() -> None:
    text = (
        'rollwise_episodes_total{env="g",reason="stop"} 70\n'
        'rollwise_episodes_total{env="g",reason="env_error"} 30\n'
        'rollwise_env_errors_total{env="g",kind="error"} 20\n'
        'rollwise_env_errors_total{env="g",kind="timeout"} 10\n'
        'rollwise_env_errors_total{env="g",kind="close"} 50\n'
    )
    found = checks.env_failing(_metrics(text))
    assert found is not None and found.title.startswith("the environment fails in 30%")
    assert "'g/error': 20.0" in found.evidence[0] and "close" not in found.evidence[0]
    assert checks.env_failing(_metrics(text.replace('kind="error"} 20', 'kind="error"} 0'))) is None


def test_disk_filling_by_free_space_or_refused_writes() -> None:
    assert checks.disk_filling(dataclasses.replace(_healthy(), free_share=0.04)) is not None
    assert checks.disk_filling(_metrics('rollwise_storage_blocked{component="spool"} 1\n')) is not None
    assert checks.disk_filling(_healthy()) is None


def _eval(version: int, success: float, behind: int = 0) -> dict[str, Any]:
    return {"event": "eval", "version": version, "versions_behind": behind, "greedy": {"success": success}}


def test_held_out_falling_while_training_success_holds_is_the_hacking_pattern() -> None:
    view = dataclasses.replace(_healthy(), evals=[_eval(0, 0.2), _eval(10, 0.7), _eval(30, 0.5)])
    found = checks.held_out_falls(view)
    assert found is not None and "0.70 at version 10, 0.50 at 30" in found.evidence[0]
    collapsed = _with_steps(view, success_rate=0.2)  # training success fell too: not this pattern
    assert checks.held_out_falls(collapsed) is None


def test_evaluation_lagging_by_versions_behind_or_by_age() -> None:
    behind = dataclasses.replace(_healthy(), evals=[_eval(30, 0.5, behind=25)])
    assert checks.eval_lagging(behind) is not None
    old = dataclasses.replace(_healthy(n=200), evals=[_eval(10, 0.5)])  # 190 versions since, every 50
    assert checks.eval_lagging(old) is not None
    assert checks.eval_lagging(dataclasses.replace(_healthy(), evals=[_eval(30, 0.5, behind=3)])) is None


def test_reply_lengths_collapsing_or_exploding() -> None:
    view = _healthy()
    for s in view.steps[-10:]:
        s["metrics"] = {**s["metrics"], "loss_tokens": 64.0}  # 2 tokens a sequence, from 25
    found = checks.length_runaway(view)
    assert found is not None and "collapsed" in found.title
    assert checks.length_runaway(_healthy()) is None


def test_advice_learner_waiting_and_zero_variance_groups() -> None:
    waits = [dict(s, idle_s=0.5, busy_s=0.5) for s in _healthy().steps]
    found = checks.learner_waits(dataclasses.replace(_healthy(), steps=waits))
    assert found is not None and found.level == "advice" and "50%" in found.title
    # Embedded engines beside a one-thread CPU learner (make run's layout): no core left to move.
    config = {**_healthy().config, "engine": {"kind": "embedded"}, "learner": {"threads": 1, "device": "cpu"}}
    alone = dataclasses.replace(_healthy(), steps=waits, config=config)
    assert checks.learner_waits(alone) is None
    for learner in ({"threads": 4, "device": "cpu"}, {"threads": 1, "device": "cuda"}):
        assert checks.learner_waits(dataclasses.replace(alone, config={**config, "learner": learner}))
    external = {**config, "engine": {"kind": "external"}}
    assert checks.learner_waits(dataclasses.replace(alone, config=external)) is not None
    some = checks.zero_variance(_with_steps(_healthy(), skipped_zero_adv_groups=4.0))
    assert some is not None and some.level == "advice" and "env.group_size = 8" in some.evidence[1]


def test_alarms_rank_by_score_and_hold_the_advice_back() -> None:
    advice = Finding("a", "advice", 0.9, "tune")
    low, high = Finding("x", "alarm", 40.0, "lagging"), Finding("y", "alarm", 95.0, "disk")
    assert ranked([advice, low, high]) == [high, low]
    assert held_back([advice, low, high]) == 1
    assert ranked([advice]) == [advice] and held_back([advice]) == 0
    text = render_text([high, low], 1, "runs/x")
    assert text.index("disk") < text.index("lagging") and "1 tuning advice held back" in text


def _run_dir(tmp_path: Path, steps: list[dict[str, Any]]) -> Path:
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    (run / "config.toml").write_text("[sampling]\nmax_new_tokens = 4\n")
    return run


def test_the_command_ranks_a_run_directory_and_exits_one_on_an_alarm(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _run_dir(tmp_path, [_step(v, overlong_fraction=0.9) for v in range(1, 30)])
    assert load(run).setting("sampling.max_new_tokens") == 4
    assert main(["--run-dir", str(run)]) == 1
    out = capsys.readouterr().out
    assert out.splitlines()[1].startswith("1. [alarm] 90% of the turns are cut at the token budget")
    assert main(["--run-dir", str(run), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert [f["check"] for f in report["findings"]] == ["truncated"]


def test_without_a_scrape_the_counters_come_from_the_daemons_snapshot(tmp_path: Path) -> None:
    run = _run_dir(tmp_path, [_step(v) for v in range(1, 30)])
    (run / "logs" / "metrics.prom").write_text(
        'rollwise_groups_written_total 90\nrollwise_groups_dropped_total{reason="stale"} 10\n'
    )
    view = load(run)
    assert view.total("rollwise_groups_dropped_total", reason="stale") == 10.0
    assert [f.check for f in checks.examine(view)] == ["stale_drops"]


def test_a_missing_run_directory_or_a_bad_url_exits_two(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--run-dir", str(tmp_path / "nope")]) == 2
    assert "no run directory at" in capsys.readouterr().err
    run = _run_dir(tmp_path, [_step(1)])
    assert main(["--run-dir", str(run), "--prometheus", "localhost:9400"]) == 2
    assert "must be an http(s) URL" in capsys.readouterr().err
