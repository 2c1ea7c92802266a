"""End to end: a real daemon with a dedicated evaluation engine (the embedded engine on the tiny preset):
every evaluation runs there and reports how many versions behind it landed; the engine stops with the
daemon, and a resumed daemon starts it again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.supervisor.eval_schedule import read_eval_log
from tests.e2e.test_run_e2e import TINY, DaemonRun, daemons, tiny_model  # noqa: F401 - fixtures


@pytest.mark.integration
@pytest.mark.slow
def test_a_dedicated_eval_engine_reports_versions_behind_and_survives_a_restart(
    tmp_path: Path,
    tiny_model: Path,  # noqa: F811 - fixture
    daemons: list[DaemonRun],  # noqa: F811 - fixture
) -> None:
    run_dir = tmp_path / "run"
    overrides = [
        *TINY,
        f"model.path={json.dumps(str(tiny_model))}",
        "eval.every_versions=1",
        "eval.tasks=4",
        'eval.engine="dedicated"',
        # The evaluation running at the stop may finish: 4 tiny steps can outpace the engine's start.
        "run.shutdown_grace_s=30",
    ]
    first = DaemonRun(run_dir, overrides, max_steps=4)
    daemons.append(first)
    assert first.wait(timeout_s=180) == 0, first.tail()
    rows = read_eval_log(run_dir / "logs" / "eval.jsonl")
    assert rows and rows[0]["version"] == 0, first.tail()
    for row in rows:
        assert row["engine"] == "dedicated" and row["load_s"] >= 0.0
        assert 0 <= row["versions_behind"] <= 4 and row["greedy"]["versions"] == [row["version"]] * 2
    texts = [str(e.get("text")) for e in first.snapshot("message")]
    assert any("on a dedicated engine" in t for t in texts)
    log = run_dir / "logs" / "eval-engine.log"
    lines = log.read_text().splitlines()
    # Stopped with the daemon.
    assert sum("start:" in line for line in lines) == 1 and "exit code" in lines[-1]

    second = DaemonRun(run_dir, overrides, max_steps=6)
    daemons.append(second)
    assert second.wait(timeout_s=180) == 0, second.tail()
    resumed = read_eval_log(run_dir / "logs" / "eval.jsonl")[len(rows) :]
    # The resumed run evaluates the version served when its evaluator starts (the learner may have trained
    # the spool's leftover groups by then).
    assert resumed and resumed[0]["version"] >= 4 and all(r["engine"] == "dedicated" for r in resumed)
    assert log.read_text().count("start:") == 2
