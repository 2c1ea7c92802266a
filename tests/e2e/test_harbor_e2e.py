"""A daemon trains through harbor-tasks: a tiny daemon plays a Harbor task set in bubblewrap sessions,
its verifier's rewards reach the learner, and weights change. The task's verifier draws its reward at
random, so groups have variance whatever the tiny random model writes (it never calls the bash tool)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from envs.ecosystems.harbor_env import SHIPPED_TASKS
from tests.e2e.test_run_e2e import TINY, DaemonRun, daemons, tiny_model
from tests.envs.test_sandbox import BWRAP_PROBLEM

__all__ = ["daemons", "tiny_model"]  # fixtures are used by name


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.skipif(bool(BWRAP_PROBLEM), reason=f"bubblewrap unusable here: {BWRAP_PROBLEM}")
def test_a_daemon_trains_through_harbor_tasks(
    tmp_path: Path, tiny_model: Path, daemons: list[DaemonRun]
) -> None:
    tasks = tmp_path / "tasks"
    shutil.copytree(SHIPPED_TASKS / "hello-file", tasks / "coin")
    (tasks / "coin" / "tests" / "test.sh").write_text(
        "#!/bin/bash\necho $((RANDOM % 2)) > /logs/verifier/reward.txt\n"
    )
    overrides = [
        *TINY,
        f"model.path={json.dumps(str(tiny_model))}",
        "env.name='harbor-tasks'",
        f"env.options={{path = {json.dumps(str(tasks))}, max_turns = 2}}",
    ]
    run = DaemonRun(tmp_path / "run", overrides, max_steps=2)
    daemons.append(run)
    assert run.wait(timeout_s=180) == 0, run.tail()
    steps = run.snapshot("step")
    assert len(steps) == 2
    assert any(s["optimizer_updates"] > 0 for s in steps), steps  # the verifier's rewards had variance
    assert all(0.0 <= s["reward_mean"] <= 1.0 for s in steps)
