"""Two daemons on one host: the engines' ports are free ones by default, and a port that must be known
in advance (metrics, admin, Flight) and is taken stops the second daemon with one line naming the port
and the key that moves it, not an OSError traceback."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline.contracts.config import load_config
from tests.e2e.test_run_e2e import REPO


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield int(held.getsockname()[1])


def test_engines_rollwise_starts_take_free_ports_by_default() -> None:
    assert load_config(None, []).engine.port == 0
    assert load_config(REPO / "examples" / "guess_number.toml", []).engine.port == 0


@pytest.mark.parametrize("key", ["metrics.port", "admin.port", "transport.flight_port"])
def test_a_second_daemon_on_a_taken_port_says_so_in_one_line(
    tmp_path: Path, taken_port: int, key: str
) -> None:
    overrides = ["metrics.port=0", "admin.port=0", 'transport.kind="flight"', "transport.flight_port=0"]
    overrides.append(f"{key}={taken_port}")
    argv = [
        sys.executable,
        "-m",
        "pipeline.cli",
        "run",
        "--run-dir",
        str(tmp_path / "run"),
        "--log-format",
        "json",
    ]
    for item in overrides:
        argv += ["--set", item]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("rollwise: ") and f":{taken_port}: port {taken_port} is taken" in last, done.stderr
    assert f"set {key} to another port" in last
    assert "Traceback" not in done.stderr


def test_engine_serve_on_a_taken_port_says_so_in_one_line(tmp_path: Path, taken_port: int) -> None:
    argv = [sys.executable, "-m", "pipeline.cli", "engine", "serve", "--model", str(tmp_path / "absent")]
    argv += ["--port", str(taken_port)]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert f"rollwise engine: the engine cannot listen on 127.0.0.1:{taken_port}" in done.stderr
    assert "--port" in done.stderr and "Traceback" not in done.stderr
