"""A daemon trains through an OpenEnv environment: a tiny daemon plays guess_env (tests/envs/
openenv_fixtures) over the /ws sessions of a server it started from the OpenEnv venv, the environment's
rewards reach the learner, and weights change. The tiny random model never writes a number, so the
environment is reset with `coin = true`: a reply that is not a number scores a fair coin flip, and groups
have variance whatever the model writes. Skipped, naming `make env-openenv`, without the OpenEnv venv."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from envs.ecosystems.ecosystem_venvs import EcosystemMissing, venv_python
from tests.e2e.test_run_e2e import TINY, DaemonRun, daemons, tiny_model

__all__ = ["daemons", "tiny_model"]  # fixtures are used by name

FIXTURES = Path(__file__).resolve().parents[1] / "envs" / "openenv_fixtures"
try:
    venv_python("openenv")
    VENV_MISSING = ""
except EcosystemMissing as exc:
    VENV_MISSING = str(exc)


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.skipif(bool(VENV_MISSING), reason=f"OpenEnv venv missing: {VENV_MISSING}")
def test_a_daemon_trains_through_an_openenv_server(
    tmp_path: Path, tiny_model: Path, daemons: list[DaemonRun]
) -> None:
    options = (
        f"{{path = {json.dumps(str(FIXTURES))}, action_field = 'guess', max_turns = 3, "
        "reset_kwargs = {coin = true}}"
    )
    overrides = [
        *TINY,
        f"model.path={json.dumps(str(tiny_model))}",
        "env.name='openenv/guess_env'",
        f"env.options={options}",
    ]
    run = DaemonRun(tmp_path / "run", overrides, max_steps=2)
    daemons.append(run)
    assert run.wait(timeout_s=180) == 0, run.tail()
    steps = run.snapshot("step")
    assert len(steps) == 2
    assert any(s["optimizer_updates"] > 0 for s in steps), steps  # the coin flips had variance
    assert all(0.0 <= s["reward_mean"] <= 3.0 for s in steps)  # at most 3 turns of at most 1.0
