"""A daemon trains through a verifiers taskset: a tiny daemon plays verifiers/coin (tests/envs/
verifiers_fixtures/coin_taskset.py) as agent-process episodes, verifiers' null harness calling the
daemon's own endpoint from rollwise's sandbox, and verifiers' rewards reach the learner. The reward is a
uniform draw, so every group has variance whatever the tiny random model writes. Skipped, naming `make
env-verifiers`, where the verifiers venv is absent or the sandbox's user cannot run it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.test_run_e2e import TINY, DaemonRun, daemons, tiny_model
from tests.envs.test_verifiers_env import readable_fixtures, verifiers_problem

__all__ = ["daemons", "tiny_model"]  # fixtures are used by name


@pytest.mark.integration
@pytest.mark.slow
def test_a_daemon_trains_through_a_verifiers_taskset(
    tmp_path: Path, tiny_model: Path, daemons: list[DaemonRun]
) -> None:
    reason = verifiers_problem()
    if reason:
        pytest.skip(reason)
    coin = readable_fixtures() / "coin_taskset.py"
    options = {"taskset": str(coin), "harness": "null", "episode_timeout_s": 120.0}
    overrides = [
        *TINY,
        # Every episode imports verifiers in a process of its own (seconds of CPU): two groups of two.
        "env.group_size=2",
        "learner.batch_groups=1",
        "rollout.max_concurrent_groups=2",
        f"model.path={json.dumps(str(tiny_model))}",
        "env.name='verifiers/coin'",
        "env.options={" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in options.items()) + "}",
    ]
    run = DaemonRun(tmp_path / "run", overrides, max_steps=2)
    daemons.append(run)
    assert run.wait(timeout_s=240) == 0, run.tail()
    steps = run.snapshot("step")
    assert len(steps) == 2
    assert all(s["optimizer_updates"] > 0 for s in steps), steps  # the rewards had variance
    assert all(0.0 < s["reward_mean"] < 1.0 for s in steps), steps
