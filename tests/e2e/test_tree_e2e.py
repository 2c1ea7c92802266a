"""A daemon trains on tree rollouts: guess-number groups whose episodes branch from forks of their first
turn's environment (rollout.branch_turn = 1), through the embedded engine and the learner."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.test_run_e2e import TINY, DaemonRun, daemons, tiny_model

__all__ = ["daemons", "tiny_model"]  # fixtures are used by name


@pytest.mark.integration
@pytest.mark.slow
def test_a_daemon_trains_on_tree_rollouts(tmp_path: Path, tiny_model: Path, daemons: list[DaemonRun]) -> None:
    overrides = [*TINY, f"model.path={json.dumps(str(tiny_model))}", "rollout.branch_turn=1"]
    run = DaemonRun(tmp_path / "run", overrides)
    daemons.append(run)
    run.wait_steps(2, timeout_s=120)
    text = run.scrape()
    branched = run.metric("rollwise_tree_groups_total", {"shape": "branched"}, text=text)
    whole = run.metric("rollwise_tree_groups_total", {"shape": "whole"}, text=text)
    assert branched >= 4 and branched > whole, (branched, whole)  # 2 steps of 2 groups at least
    # 3 branches per branched group took the trunk's first turn (>= 1 token) instead of generating it
    assert run.metric("rollwise_tree_shared_tokens_total", text=text) >= 3 * branched
    steps = run.snapshot("step")[:2]
    assert any(s["optimizer_updates"] > 0 for s in steps), steps  # the branches' outcomes differed
