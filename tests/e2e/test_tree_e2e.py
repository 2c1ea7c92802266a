"""A daemon trains on tree rollouts with its cores shared in time: guess-number groups whose episodes
branch from forks of their first turn's environment (rollout.branch_turn = 1), through the embedded
engine and the learner, which take turns on every core (engine.share_cores = "time"). One daemon for
both: each is a start-up choice the other does not touch, and a daemon start is the suite's dearest
setup."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from pipeline.contracts.cpu_features import usable_cores
from tests.e2e.test_run_e2e import TINY, DaemonRun, daemons, tiny_model

__all__ = ["daemons", "tiny_model"]  # fixtures are used by name


@pytest.mark.integration
@pytest.mark.slow
def test_a_daemon_trains_on_tree_rollouts_with_its_cores_shared_in_time(
    tmp_path: Path, tiny_model: Path, daemons: list[DaemonRun]
) -> None:
    overrides = [
        *[o for o in TINY if not o.startswith("engine.threads")],
        f"model.path={json.dumps(str(tiny_model))}",
        "rollout.branch_turn=1",
        'engine.share_cores="time"',
    ]
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
    # Shared in time: said at start, every core to the engine, which yields to the learner's lease.
    said = " | ".join(str(e.get("text", "")) for e in run.snapshot("message"))
    assert "shared in time (the engines hold while the learner computes)" in said, said
    started = (run.run_dir / "logs" / "engine0.log").read_text()
    assert f"--yield-to {run.run_dir / 'cores.lease'}" in started, started[:2000]
    assert f"--threads {usable_cores()} " in started
    run.signal(signal.SIGTERM)
    assert run.wait(timeout_s=60) == 0, run.tail()
    assert (run.run_dir / "cores.lease").read_bytes() == b"\0"  # nobody holds it once the learner is gone
