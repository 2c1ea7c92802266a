"""Every command the skills for coding agents name, run (skills/<name>/SKILL.md; their format is checked in
tests/tools/test_skills.py).

Each skill's ```bash blocks are one script, run in order by bash with `set -euo pipefail` in a fresh
working directory that holds the repository's `examples/` (a skill writes its runs under `runs/` there).
A command that no longer exists, a flag that was renamed, a file a step expects and does not find, or a
daemon that does not start fails the skill's test, so a skill cannot go stale."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tools.test_skills import NAMES, REPO, SKILLS, bash_blocks


def _workdir(tmp_path: Path) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    (work / "examples").symlink_to(REPO / "examples")
    return work


def _tails(work: Path) -> str:
    """The end of every file the skill's commands wrote under runs/ (their output and the daemons' logs)."""
    parts = []
    for path in sorted(work.glob("runs/*.out")) + sorted(work.glob("runs/*/logs/supervisor.log")):
        lines = path.read_text(errors="replace").splitlines()[-15:]
        parts.append(f"--- {path.relative_to(work)}\n" + "\n".join(lines))
    return "\n".join(parts)


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_every_command_of_the_skill_runs(name: str, tmp_path: Path) -> None:
    script = "set -euo pipefail\n" + "\n".join(bash_blocks((SKILLS / name / "SKILL.md").read_text()))
    work = _workdir(tmp_path)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("PYTHONPATH", None)  # as a user's shell: the skill sets what it needs
    proc = subprocess.Popen(
        ["bash", "-c", script],
        cwd=work,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its background daemons and engines are stopped with it below
    )
    try:
        out, _ = proc.communicate(timeout=420)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"skill {name} did not finish in 420 s\n{out[-3000:]}\n{_tails(work)}")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    assert proc.returncode == 0, f"skill {name}: exit {proc.returncode}\n{out[-4000:]}\n{_tails(work)}"
