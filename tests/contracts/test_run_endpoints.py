"""A running daemon's URLs in its run directory (pipeline/contracts/run_endpoints.py), believed only while
a daemon holds the run directory's lock; and the commands that find the daemon through it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pipeline.contracts.run_dir import RunDir, hold_supervisor_lock
from pipeline.contracts.run_endpoints import (
    held_by_a_daemon,
    remove_endpoints,
    running_endpoints,
    write_endpoints,
)
from pipeline.supervisor.fleet.admin import main as engines
from pipeline.tools.doctor import main as doctor


def test_the_endpoints_of_a_running_daemon_are_read_and_a_stale_file_is_not(tmp_path: Path) -> None:
    run = RunDir.at(str(tmp_path / "run"), None)
    run.root.mkdir(parents=True)
    path = write_endpoints(run.root, metrics="http://127.0.0.1:1", admin="http://127.0.0.1:2", flight=None)
    assert json.loads(path.read_text()) == {
        "pid": os.getpid(),
        "metrics": "http://127.0.0.1:1",
        "admin": "http://127.0.0.1:2",
    }
    assert not held_by_a_daemon(run.root)
    assert running_endpoints(run.root) is None  # left by a daemon that is gone (kill -9)
    with hold_supervisor_lock(run):
        assert held_by_a_daemon(run.root)
        assert running_endpoints(run.root) == {"metrics": "http://127.0.0.1:1", "admin": "http://127.0.0.1:2"}
        (run.root / "endpoints.json").write_text("not json")
        assert running_endpoints(run.root) is None
        remove_endpoints(run.root)
        remove_endpoints(run.root)  # idempotent
        assert running_endpoints(run.root) is None
    assert not (run.root / "endpoints.json").exists()


def test_engines_and_doctor_need_a_running_daemon_to_use_its_endpoints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    assert engines(["--run-dir", str(run), "list"]) == 2
    assert f"no daemon runs on {run}" in capsys.readouterr().err
    # A stopped run: doctor reads what is on disk (no steps, no counters: nothing to say) and says so.
    assert doctor(["--run-dir", str(run), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["source"] == str(run) and report["findings"] == []
    with pytest.raises(SystemExit) as bad:
        doctor(["--run-dir", str(run), "--stalled-after", "0"])
    assert bad.value.code == 2
    assert "--stalled-after must be a positive number of seconds" in capsys.readouterr().err
