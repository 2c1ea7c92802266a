"""The learner's and the engines' budgets a learning bench prints (pipeline.tools.bench.run_budgets)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.tools.bench.run_budgets import (
    ChildCpu,
    LearnerBudget,
    engine_busy_fraction,
    learner_budget,
    render_budgets,
    run_limit,
)


def _step(n: int, busy: float, idle: float, tokens: float, seconds: float, groups: int = 4) -> str:
    metrics = {"tokens": tokens, "step_time_s": seconds}
    record = {"event": "step", "step": n, "groups": groups, "busy_s": busy, "idle_s": idle}
    return json.dumps({**record, "metrics": metrics})


def test_the_learner_budget_sums_busy_and_idle_and_leaves_the_first_step_out_of_tokens_per_s(
    tmp_path: Path,
) -> None:
    log = tmp_path / "steps.jsonl"
    lines = [_step(1, 10.0, 30.0, 1000, 9.0), '{"event": "sync"}', _step(2, 8.0, 1.0, 800, 8.0)]
    lines += [_step(3, 6.0, 1.0, 900, 6.0), _step(4, 0.5, 2.0, 0, 0.0, groups=0), "{cut"]
    log.write_text("\n".join(lines))
    budget = learner_budget(log)
    assert budget == LearnerBudget(steps=4, busy_s=24.5, idle_s=34.0, tokens_per_s=1700 / 14.0, updates=3)
    assert budget.idle_fraction == pytest.approx(34 / 58.5)
    assert learner_budget(tmp_path / "none.jsonl") == LearnerBudget(0, 0.0, 0.0, None)
    assert LearnerBudget(0, 0.0, 0.0, None).idle_fraction == 0.0


def test_engine_busy_is_cpu_time_over_its_cores() -> None:
    assert engine_busy_fraction(90.0, 100.0, threads=1) == pytest.approx(0.9)
    assert engine_busy_fraction(90.0, 100.0, threads=2) == pytest.approx(0.45)
    assert engine_busy_fraction(90.0, 50.0, threads=1, engines=2) == pytest.approx(0.9)
    assert engine_busy_fraction(300.0, 100.0, threads=1) == 1.0
    assert engine_busy_fraction(1.0, 0.0, threads=1) == 0.0


def test_child_cpu_counts_only_the_marked_children_of_the_parent() -> None:
    # It burns CPU seconds, not wall seconds, and is sampled until it shows some: a loaded machine (a
    # soak beside the suite) gave it 0.07 s of CPU in the 0.4 s a fixed sleep used to wait.
    burn = "import time\nwhile time.process_time() < 0.5: pass\n"
    busy = subprocess.Popen([sys.executable, "-c", burn, "pipeline.engine"])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        engine = ChildCpu(parent=os.getpid(), marker="pipeline.engine")
        deadline = time.monotonic() + 30.0
        engine.sample()
        while engine.total_s <= 0.1 and time.monotonic() < deadline:
            time.sleep(0.05)
            engine.sample()
        assert list(engine.seconds) == [busy.pid]
        assert engine.total_s > 0.1
        other = ChildCpu(parent=os.getpid() + 10**6, marker="pipeline.engine")
        other.sample()
        assert other.total_s == 0.0
    finally:
        idle.kill()
        for p in (busy, idle):
            p.wait(timeout=30)


def test_the_budget_line_names_both_idle_shares() -> None:
    line = render_budgets(LearnerBudget(3, 90.0, 10.0, 150.0, updates=2), engine_busy=0.94)
    assert line == (
        "learner: 3 steps (2 updated the weights), idle 10.0% of its time (busy 90 s, waiting 10 s), "
        "150.0 tokens/s; "
        "engines: idle 6.0% of their cores (CPU time)"
    )
    assert "engines" not in render_budgets(LearnerBudget(0, 0.0, 0.0, None), engine_busy=None)


def test_the_limit_comes_from_the_steps_the_engines_and_the_last_status(tmp_path: Path) -> None:
    steps = tmp_path / "steps.jsonl"
    records = [
        {
            "event": "step",
            "step": n,
            "busy_s": busy,
            "group_ids": ["a", "b"],
            "staleness": {"0": 200, "1": 100},
        }
        for n, busy in ((1, 1.0), (2, 2.0), (3, 2.0))
    ]
    steps.write_text("\n".join(json.dumps(r) for r in records))
    progress = tmp_path / "seed0.jsonl"
    status = {"event": "status", "generated_tokens": 1000, "wasted_tokens": {"stale": 120, "cut": 0}}
    progress.write_text(json.dumps({**status, "generated_tokens": 10}) + "\n" + json.dumps(status) + "\n{cut")
    # learner: a 2 s median step after the first, 1,800 steps/h; engines: 1,000 tokens in 4 busy s is
    # 250 tokens/s, 2 groups of 150 tokens a step, 3,000 steps/h; 3 steps in 10 s: 1,080 steps/h
    line = run_limit(steps, progress, wall_s=10.0, engine_busy_s=4.0, batch_groups=2)
    assert line == (
        "limit: bound by the learner at 1800 steps/h, achieved 1080 (efficiency 60%); "
        "12.0% of 1000 generated tokens never trained (stale 120)"
    )
    assert run_limit(steps, tmp_path / "none.jsonl", wall_s=10.0, engine_busy_s=4.0, batch_groups=2) is None
