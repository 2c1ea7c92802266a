"""SGLang launcher: the exact command line, and the process lifecycle (the daemon's Child and readiness
wait, pipeline.supervisor.fleet.children and engine_fleet.ready_or_exited) against a stub server script."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from pipeline.supervisor.engines.client import EngineClient
from pipeline.supervisor.fleet.children import Child, ChildSpec
from pipeline.supervisor.fleet.engine_fleet import ready_or_exited
from pipeline.supervisor.fleet.engine_launch import SGLangLaunchSpec, build_sglang_command
from pipeline.tools.fake_sglang import free_port

STUB = Path(__file__).resolve().parents[2] / "fakes" / "stub_sglang_server.py"


def test_command_line_is_exact_for_a_full_spec() -> None:
    spec = SGLangLaunchSpec(
        model_path="/models/qwen3-0.6b",
        host="0.0.0.0",
        port=30001,
        mem_fraction_static=0.55,
        tp=2,
        dp=4,
        api_key="k3y",
        extra_args=("--disable-radix-cache", "--random-seed", "7"),
        python_executable="/opt/venv/bin/python",
    )
    assert build_sglang_command(spec) == [
        "/opt/venv/bin/python",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/models/qwen3-0.6b",
        "--host",
        "0.0.0.0",
        "--port",
        "30001",
        "--mem-fraction-static",
        "0.55",
        "--tp-size",
        "2",
        "--dp-size",
        "4",
        "--enable-metrics",
        "--weight-version",
        "0",
        "--api-key",
        "k3y",
        "--disable-radix-cache",
        "--random-seed",
        "7",
    ]


def test_command_line_defaults_have_no_api_key() -> None:
    cmd = build_sglang_command(SGLangLaunchSpec(model_path="m"))
    assert cmd[:3] == [sys.executable, "-m", "sglang.launch_server"]
    assert "--api-key" not in cmd
    assert cmd[cmd.index("--port") + 1] == "30000"
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert cmd[-2:] == ["--weight-version", "0"]


def stub_spec(tmp_path: Path, **overrides: object) -> SGLangLaunchSpec:
    # A wrapper in the place of the Python executable: it runs the stub with this interpreter, whatever
    # the checkout's file modes are. `exec` keeps the stub's PID the one the Child started.
    wrapper = tmp_path / "python-stub"
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{STUB}" "$@"\n')
    wrapper.chmod(0o755)
    fields: dict[str, object] = {
        "model_path": "/models/tiny",
        "port": free_port(),
        "python_executable": str(wrapper),
    }
    fields.update(overrides)
    return SGLangLaunchSpec(**fields)  # type: ignore[arg-type]


def is_running(pid: int) -> bool:
    """False once the process is gone or a zombie (killed, waiting for whoever adopted it to reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def assert_gone(pid: int) -> None:
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def sglang_child(spec: SGLangLaunchSpec, log: Path, **env: str) -> Child:
    return Child(ChildSpec("engine0", build_sglang_command(spec), log, env=env))


@pytest.mark.integration
async def test_lifecycle_start_wait_ready_stop_by_sigterm(tmp_path: Path) -> None:
    spec = stub_spec(tmp_path, api_key="s3cret", extra_args=("--random-seed", "7"))
    log = tmp_path / "run" / "logs" / "engine0.log"
    child = sglang_child(spec, log, STUB_READY_AFTER_S="0.3")
    await child.start()
    pid = child.pid
    assert pid is not None and child.returncode is None
    try:
        async with EngineClient(spec.base_url, api_key="s3cret") as client:
            started = time.monotonic()
            assert await ready_or_exited(client, child, 10.0)
            waited = time.monotonic() - started
            assert await client.health() is True
        assert waited >= 0.15  # it really waited through the 503 phase
    finally:
        code = await child.stop(grace_s=5.0)
    assert code == 0 and child.returncode == 0
    assert_gone(pid)
    text = log.read_text()
    assert text.startswith("--- ") and " start: " in text.splitlines()[0]
    assert "--api-key ***" in text and "s3cret" not in text
    assert "stub sglang: module=sglang.launch_server model=/models/tiny" in text
    assert f"port={spec.port} tp=1 dp=1 weight_version=0 extra=['--random-seed', '7']" in text
    assert "stub sglang: SIGTERM received, shutting down" in text
    assert text.rstrip().endswith("exit code 0")


@pytest.mark.integration
async def test_stop_escalates_to_sigkill_after_grace(tmp_path: Path) -> None:
    spec = stub_spec(tmp_path)
    log = tmp_path / "engine0.log"
    child = sglang_child(spec, log, STUB_MODE="ignore_sigterm", STUB_READY_AFTER_S="0")
    await child.start()
    pid = child.pid
    assert pid is not None
    async with EngineClient(spec.base_url) as client:
        assert await ready_or_exited(client, child, 10.0)
    started = time.monotonic()
    code = await child.stop(grace_s=0.3)
    assert 0.3 <= time.monotonic() - started < 3.0
    assert code == -signal.SIGKILL
    assert_gone(pid)
    assert "stub sglang: ignoring SIGTERM" in log.read_text()


@pytest.mark.integration
async def test_stop_also_kills_children_left_in_the_process_group(tmp_path: Path) -> None:
    spec = stub_spec(tmp_path)
    log = tmp_path / "engine0.log"
    child = sglang_child(spec, log, STUB_MODE="orphan_child", STUB_READY_AFTER_S="0")
    await child.start()
    async with EngineClient(spec.base_url) as client:
        assert await ready_or_exited(client, child, 10.0)
    match = re.search(r"stub sglang: child pid (\d+)", log.read_text())
    assert match is not None
    orphan = int(match.group(1))
    assert is_running(orphan)
    assert await child.stop(grace_s=5.0) == 0
    for _ in range(150):  # SIGKILL is delivered asynchronously; allow up to 3 s
        if not is_running(orphan):
            break
        await asyncio.sleep(0.02)
    assert not is_running(orphan)


@pytest.mark.integration
async def test_a_server_that_exits_while_starting_is_noticed_at_once_and_its_log_says_why(
    tmp_path: Path,
) -> None:
    spec = stub_spec(tmp_path)
    log = tmp_path / "engine0.log"
    child = sglang_child(spec, log, STUB_MODE="crash")
    await child.start()
    started = time.monotonic()
    async with EngineClient(spec.base_url) as client:
        assert not await ready_or_exited(client, child, 30.0)
    assert time.monotonic() - started < 5.0
    assert child.returncode == 3
    text = log.read_text()
    assert "CUDA out of memory (simulated)" in text and text.rstrip().endswith("exit code 3")


@pytest.mark.integration
async def test_a_server_whose_health_stays_503_is_not_ready_and_is_killed(tmp_path: Path) -> None:
    spec = stub_spec(tmp_path)
    child = sglang_child(spec, tmp_path / "engine0.log", STUB_READY_AFTER_S="100")
    await child.start()
    pid = child.pid
    assert pid is not None
    async with EngineClient(spec.base_url) as client:
        assert not await ready_or_exited(client, child, 0.5)
    assert await child.wait() == -signal.SIGKILL  # a start that never became ready is not left behind
    assert_gone(pid)
