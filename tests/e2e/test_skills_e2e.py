"""Every command the skills for coding agents name, run (skills/<name>/SKILL.md; their format is checked in
tests/tools/test_skills.py).

Each skill's ```bash blocks are one script, run in order by bash with `set -euo pipefail` in a fresh
working directory that holds the repository's `examples/` (a skill writes its runs under `runs/` there).
A command that no longer exists, a flag that was renamed, a file a step expects and does not find, or a
daemon that does not start fails the skill's test, so a skill cannot go stale.

A command in PARSED_ONLY is not run: its arguments go through the command's own parser (a renamed flag
still fails), and the test named beside it runs its machinery whole. `rollwise bench hosts` builds three
network namespaces and trains through a fault: 27 s of the suite's 15 minutes, which
tests/e2e/test_three_hosts.py spends already."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tools.test_skills import NAMES, REPO, SKILLS, bash_blocks

PARSED_ONLY = {
    # command prefix: (module, its argument parser, the test that runs the command's machinery)
    "rollwise bench hosts": (
        "pipeline.tools.hosts.hostile_network",
        "parse",
        "tests/e2e/test_three_hosts.py",
    ),
}


def parsed_only(script: str) -> str:
    """`script` with each PARSED_ONLY command replaced by a call of its parser on the same arguments."""
    lines = []
    for line in script.splitlines():
        for prefix, (module, parser, _) in PARSED_ONLY.items():
            if line.startswith(prefix + " "):
                call = f"import sys; from {module} import {parser}; {parser}(sys.argv[1:])"
                line = f'python -c "{call}"{line[len(prefix) :]}'
        lines.append(line)
    return "\n".join(lines)


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
    script = "set -euo pipefail\n" + parsed_only(
        "\n".join(bash_blocks((SKILLS / name / "SKILL.md").read_text()))
    )
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


def test_a_parsed_only_command_still_fails_on_a_renamed_flag(tmp_path: Path) -> None:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    good = parsed_only("rollwise bench hosts --scenarios latency --steps 1 --out runs/hosts")
    assert good.startswith('python -c "import sys; from pipeline.tools.hosts.hostile_network import parse')
    assert subprocess.run(["bash", "-c", good], cwd=tmp_path, env=env).returncode == 0
    bad = parsed_only("rollwise bench hosts --faults latency")
    done = subprocess.run(["bash", "-c", bad], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 2 and "unrecognized arguments: --faults latency" in done.stderr
