"""The staleness model (pipeline.tools.bench.staleness_model): hand-computed runs, orderings, errors."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest

from pipeline.tools.bench.async_speedup import main
from pipeline.tools.bench.staleness_model import (
    Simulation,
    Workload,
    pooled,
    predict,
    simulate,
    split_at_pause,
    summary,
)

# One group of one one-turn episode at a time, every response `median_tokens` long: each run below can be
# followed by hand on a timeline (prefill 20 ms, 2 ms a token, a sync 50 ms, a step 0.5 s).
SINGLE = Workload(
    batch_groups=1,
    group_size=1,
    turns=1,
    max_concurrent=1,
    sigma=0.0,
    median_tokens=50,
    max_new_tokens=500,
    cut_late_groups=0.0,
)


def test_eta_zero_trains_only_fresh_tokens_and_wastes_nothing() -> None:
    p = simulate(Workload(max_staleness=0))
    assert p.steps > 0 and p.trained_tokens > 0
    assert (p.mean_staleness, p.dropped_groups, p.groups_cut, p.waste_share) == (0.0, 0, 0, 0.0)


def test_synchronous_cycle_is_generation_then_step_then_sync() -> None:
    # Group k starts at 0.67·k (when the sync of version k ends), lands 0.12 s later, and its step ends
    # at 0.67·k + 0.62; the step started at 9.5 ends past the 9.9 s deadline: 15 steps in 10 s.
    p = simulate(dataclasses.replace(SINGLE, max_staleness=0, seconds=9.9))
    assert (p.steps, p.trained_groups, p.generated_tokens, p.trained_tokens) == (15, 15, 750, 750)
    assert p.wall_s == pytest.approx(10.0)
    assert p.steps_per_hour == pytest.approx(5400.0)
    assert p.learner_idle_s == pytest.approx(0.12 + 14 * 0.17)  # the first wait, then sync + generation
    assert p.engine_idle_fraction == pytest.approx(1.0 - 15 * 0.12 / 10.0)
    assert p.mean_staleness == 0.0


def test_eta_one_keeps_the_learner_busy_one_version_behind() -> None:
    # Two groups start at 0; after that one starts when each sync ends, 0.05 s into the step that will
    # train it: every group but the first is trained one version after the one that generated it.
    p = simulate(dataclasses.replace(SINGLE, max_staleness=1, max_concurrent=4, seconds=10.0))
    assert (p.steps, p.dropped_groups) == (20, 0)
    assert p.wall_s == pytest.approx(10.12)
    assert p.learner_idle_s == pytest.approx(0.12)
    assert p.mean_staleness == pytest.approx(19 / 20)


def test_a_request_spanning_a_sync_takes_both_versions() -> None:
    # 400-token responses (0.82 s a request). Groups 1 and 2 start at 0 and land at 0.82; group 3 starts
    # when version 1 is served (1.37) and decodes from 1.39. The sync of version 2 pauses it at 1.82: 26
    # chunks of 8 are done, the 27th finishes during the pause, all 216 tokens on version 1; the other
    # 184 decode on version 2 from 1.87 and it lands at 2.238, trained from version 2 (step ends 2.738).
    p = simulate(
        dataclasses.replace(SINGLE, max_staleness=1, max_concurrent=4, median_tokens=400, seconds=2.5)
    )
    assert (p.steps, p.trained_tokens) == (3, 1200)
    assert p.staleness_sum == 400 * 1 + 216 * 1  # group 2 one version behind, group 3's first 216 tokens
    assert p.wall_s == pytest.approx(2.738)
    assert p.generated_tokens == 1600  # group 4 (1.87 to 2.69) finished before the last step


@pytest.mark.parametrize(
    ("elapsed_s", "remaining", "expected"),
    [
        (0.0, 50, (0, 8)),
        (0.020, 50, (8, 8)),
        (0.020, 10, (10, 0)),
        (0.033, 30, (16, 8)),
        (0.033, 20, (20, 0)),
    ],
)
def test_split_at_pause_finishes_the_chunk_under_way(
    elapsed_s: float, remaining: int, expected: tuple[int, int]
) -> None:
    assert split_at_pause(elapsed_s, remaining, chunk_tokens=8, per_token_s=0.002) == expected


def test_same_seed_same_prediction_and_pooling_adds_the_runs() -> None:
    w = Workload(seconds=5.0)
    assert simulate(w) == simulate(w)
    runs = [simulate(Workload(seconds=5.0, seed=s)) for s in (0, 1)]
    both = predict(w, runs=2)
    assert both == pooled(runs)
    assert both.steps == runs[0].steps + runs[1].steps
    assert summary(both)["steps_per_hour"] == pytest.approx(both.steps * 3600.0 / both.wall_s)


def test_a_heavier_tail_wastes_more() -> None:
    light, heavy = (predict(Workload(step_s=0.35, sigma=sigma), runs=3) for sigma in (0.5, 1.5))
    assert light.waste_share < 0.02 < 0.05 < heavy.waste_share
    assert light.steps_per_hour > heavy.steps_per_hour


def test_patience_trades_steps_for_waste() -> None:
    hasty, patient = (predict(Workload(step_s=0.35, straggler_patience=x), runs=3) for x in (0.0, 3.0))
    assert patient.waste_share < 0.01 < hasty.waste_share
    assert patient.steps_per_hour < hasty.steps_per_hour
    assert patient.learner_idle_fraction > hasty.learner_idle_fraction


def test_without_cuts_nothing_is_cut() -> None:
    p = predict(Workload(step_s=0.35, cut_late_groups=0.0), runs=2)
    assert (p.groups_cut, p.cut_tokens) == (0, 0)
    assert p.stale_tokens > 0


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("batch_groups", 0, "batch_groups must be >= 1"),
        ("max_staleness", -1, "max_staleness must be >= 0"),
        ("max_concurrent", 0, "max_concurrent must be >= 1"),
        ("group_size", 0, "group_size must be >= 1"),
        ("step_s", 0.0, "step_s must be > 0"),
        ("sigma", -0.5, "sigma must be >= 0"),
        ("straggler_patience", -1.0, "straggler_patience must be >= 0"),
        ("cut_late_groups", 1.5, r"cut_late_groups must be a share in \[0, 1\]"),
    ],
)
def test_invalid_parameters_name_the_field(field: str, value: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Workload(**{field: value})


def test_predict_needs_a_run() -> None:
    with pytest.raises(ValueError, match="runs must be >= 1, got 0"):
        predict(Workload(), runs=0)


def test_a_bench_length_run_takes_well_under_a_second() -> None:
    started = time.process_time()
    simulate(Workload(seconds=22.0))
    assert time.process_time() - started < 1.0


def test_bench_async_model_prints_a_row_per_eta(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", "--eta", "1", "--runs", "2", "--seconds", "5"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("model: B=4 G=4") and "2 runs of 5 s pooled" in lines[0]
    header = "eta steps/h learner idle engine idle staleness dropped stale cut wasted"
    assert lines[1].split() == header.split()
    assert [line.split()[0] for line in lines[2:]] == ["0", "1"]


def test_bench_async_model_json_carries_the_workload(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--model", "--json", "--runs", "1", "--seconds", "5", "--write-ms", "8", "--step-s", "0.35"])
    report = json.loads(capsys.readouterr().out)
    assert report["workload"]["write_s"] == pytest.approx(0.008)
    assert report["workload"]["step_s"] == pytest.approx(0.35)
    assert [p["eta"] for p in report["predictions"]] == [0, 1, 2]
    assert report["predictions"][0]["mean_staleness"] == 0.0


def test_a_running_group_past_the_bound_is_dropped_in_flight_unwritten() -> None:
    """As the scheduler does at a step event (in_flight_drops): a running group holding a token older than
    the learner's version − η stops, is never written, and all its tokens are stale."""
    sim = Simulation(dataclasses.replace(SINGLE, max_staleness=1, turns=2, max_concurrent=2))
    sim._start_group()
    sim._start_group()
    doomed, fresh = sim.admitted.values()
    doomed.episodes[0].versions.update({0: 30})  # a finished first turn at version 0
    doomed.episodes[0].generated = 30
    fresh.episodes[0].versions.update({1: 20})
    fresh.episodes[0].generated = 20
    sim.learner_version = 2
    sim._drop_doomed()
    assert list(sim.admitted.values()) == [fresh]
    assert (sim.running, sim.dropped_in_flight, sim.stale_tokens, sim.written) == (1, 1, 30, 0)
    assert doomed.episodes[0].request is None and doomed.episodes[0].done
