"""`rollwise doctor` on runs that really go wrong (docs/design/run_health.md, "Tests"): a tiny daemon each,
and the advisor names the failure first. The other real failures are asked about on the daemons their
own tests already start: a broken environment (test_faults.py's flaky environment: `env_failing`), an
engine that stops answering (test_faults.py's killed engine, frozen: `stalled`, naming the engines), a
full disk (test_disk_faults.py: `disk_filling`)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from envs.api import Action, StepResult
from envs.guess_number import GuessNumberEnv
from pipeline.tools.doctor import main as doctor
from tests.e2e.test_run_e2e import TINY, DaemonRun, daemons, tiny_model

__all__ = ["UnlistedAnswersEnv", "ZeroRewardEnv", "daemons", "tiny_model"]  # fixtures are used by name


class ZeroRewardEnv(GuessNumberEnv):
    """guess-number whose reward function is broken: every reward and outcome is 0."""

    async def step(self, action: Action) -> StepResult:
        result = await super().step(action)
        return dataclasses.replace(result, reward=0.0, outcome=None if result.outcome is None else 0.0)


class UnlistedAnswersEnv(GuessNumberEnv):
    """guess-number that does not list its answers (most environments cannot): every reply the token
    budget ends counts as cut."""

    def __init__(self, **options: int) -> None:
        super().__init__(**options)
        self.spec = dataclasses.replace(self.spec, action_hints=())


def _report(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any]]:
    capsys.readouterr()
    code = doctor(["--run-dir", str(run_dir), "--json"])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize(
    ("env", "budget", "first"),
    [("ZeroRewardEnv", 4, "no_reward"), ("UnlistedAnswersEnv", 2, "truncated")],
    ids=["reward-always-zero", "token-budget-too-small"],
)
def test_the_advisor_names_the_runs_failure_first(
    env: str,
    budget: int,
    first: str,
    tmp_path: Path,
    tiny_model: Path,
    daemons: list[DaemonRun],
    capsys: pytest.CaptureFixture[str],
) -> None:
    run_dir = tmp_path / "run"
    overrides = [
        *TINY,
        f"model.path={json.dumps(str(tiny_model))}",
        f"env.name='tests.e2e.test_doctor_e2e:{env}'",
        f"sampling.max_new_tokens={budget}",
    ]
    run = DaemonRun(run_dir, overrides, max_steps=9)  # the rules judge from 8 steps on
    daemons.append(run)
    assert run.wait(timeout_s=180) == 0, run.tail()
    code, report = _report(run_dir, capsys)
    checks = [f["check"] for f in report["findings"]]
    assert code == 1 and checks and checks[0] == first, report
    if first == "no_reward":
        assert "every reward of the last" in report["findings"][0]["title"]
        assert "truncated" not in checks  # guess-number lists its answers: a wrong one is not cut
    else:
        assert "rollwise_turns_cut_total" in report["findings"][0]["evidence"][0]
