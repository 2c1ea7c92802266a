"""A daemon whose engine and learner share the cores in time (engine.share_cores = "time"): the learner
holds the lease while it computes, the engine yields, and training goes on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.contracts.cpu_features import usable_cores
from tests.e2e.test_run_e2e import TINY, DaemonRun, daemons, tiny_model

__all__ = ["daemons", "tiny_model"]  # fixtures are used by name


@pytest.mark.integration
@pytest.mark.slow
def test_a_daemon_shares_its_cores_in_time(
    tmp_path: Path, tiny_model: Path, daemons: list[DaemonRun]
) -> None:
    overrides = [
        *[o for o in TINY if not o.startswith("engine.threads")],
        f"model.path={json.dumps(str(tiny_model))}",
        'engine.share_cores="time"',
    ]
    run = DaemonRun(tmp_path / "run", overrides, max_steps=3)
    daemons.append(run)
    assert run.wait(timeout_s=180) == 0, run.tail()
    said = " | ".join(str(e.get("text", "")) for e in run.snapshot("message"))
    assert "shared in time (the engines hold while the learner computes)" in said, said
    assert len(run.snapshot("step")) == 3
    assert (run.run_dir / "cores.lease").read_bytes() == b"\0"  # nobody holds it after the last step
    started = (run.run_dir / "logs" / "engine0.log").read_text()
    assert f"--yield-to {run.run_dir / 'cores.lease'}" in started, started[:2000]
    assert f"--threads {usable_cores()} " in started  # every core, in turn
