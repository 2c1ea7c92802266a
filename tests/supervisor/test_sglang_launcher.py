"""SGLang launcher: the exact command line, and the process lifecycle against a stub server script."""

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
from pipeline.supervisor.engines.protocol import EngineUnavailable
from pipeline.supervisor.sglang_launch import (
    SGLangLaunchSpec,
    SGLangServer,
    build_sglang_command,
    read_log_tail,
)
from tests.fakes.sglang_fake import free_port

STUB = Path(__file__).resolve().parents[1] / "fakes" / "stub_sglang_server.py"


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


def test_read_log_tail_returns_the_end_or_nothing(tmp_path: Path) -> None:
    log = tmp_path / "x.log"
    assert read_log_tail(log) == ""
    log.write_text("a" * 100 + "THE END")
    assert read_log_tail(log, max_bytes=7) == "THE END"


def stub_spec(tmp_path: Path, **overrides: object) -> SGLangLaunchSpec:
    # A wrapper in the place of the Python executable: it runs the stub with this interpreter, whatever
    # the checkout's file modes are. `exec` keeps the stub's PID the one SGLangServer started.
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


@pytest.mark.integration
async def test_lifecycle_start_wait_ready_stop_by_sigterm(tmp_path: Path) -> None:
    spec = stub_spec(tmp_path, api_key="s3cret", extra_args=("--random-seed", "7"))
    server = SGLangServer(spec, env={"STUB_READY_AFTER_S": "0.3"})
    log = tmp_path / "run" / "logs" / "sglang.log"
    await server.start(log)
    pid = server.pid
    code_while_running = server.returncode
    assert pid is not None and code_while_running is None
    try:
        async with EngineClient(server.base_url) as probe:
            started = time.monotonic()
            await server.wait_ready(10.0, poll_interval_s=0.05)
            waited = time.monotonic() - started
            assert await probe.health() is True
        assert waited >= 0.15  # it really waited through the 503 phase
    finally:
        code = await server.stop(grace_s=5.0)
    assert code == 0 and server.returncode == 0
    assert_gone(pid)
    text = log.read_text()
    assert text.startswith("# rollwise: launching ")
    assert "--api-key ***" in text and "s3cret" not in text
    assert "stub sglang: module=sglang.launch_server model=/models/tiny" in text
    assert f"port={spec.port} tp=1 dp=1 weight_version=0 extra=['--random-seed', '7']" in text
    assert "stub sglang: SIGTERM received, shutting down" in text


@pytest.mark.integration
async def test_stop_escalates_to_sigkill_after_grace(tmp_path: Path) -> None:
    server = SGLangServer(stub_spec(tmp_path), env={"STUB_MODE": "ignore_sigterm", "STUB_READY_AFTER_S": "0"})
    log = tmp_path / "sglang.log"
    await server.start(log)
    pid = server.pid
    assert pid is not None
    await server.wait_ready(10.0, poll_interval_s=0.05)
    started = time.monotonic()
    code = await server.stop(grace_s=0.3)
    assert 0.3 <= time.monotonic() - started < 3.0
    assert code == -signal.SIGKILL
    assert_gone(pid)
    assert "stub sglang: ignoring SIGTERM" in log.read_text()


@pytest.mark.integration
async def test_stop_also_kills_children_left_in_the_process_group(tmp_path: Path) -> None:
    server = SGLangServer(stub_spec(tmp_path), env={"STUB_MODE": "orphan_child", "STUB_READY_AFTER_S": "0"})
    log = tmp_path / "sglang.log"
    await server.start(log)
    await server.wait_ready(10.0, poll_interval_s=0.05)
    match = re.search(r"stub sglang: child pid (\d+)", log.read_text())
    assert match is not None
    child = int(match.group(1))
    assert is_running(child)
    assert await server.stop(grace_s=5.0) == 0
    for _ in range(150):  # SIGKILL is delivered asynchronously; allow up to 3 s
        if not is_running(child):
            break
        await asyncio.sleep(0.02)
    assert not is_running(child)


@pytest.mark.integration
async def test_wait_ready_fails_fast_with_log_tail_when_the_server_exits(tmp_path: Path) -> None:
    server = SGLangServer(stub_spec(tmp_path), env={"STUB_MODE": "crash"})
    await server.start(tmp_path / "sglang.log")
    started = time.monotonic()
    with pytest.raises(EngineUnavailable) as info:
        await server.wait_ready(30.0)
    assert time.monotonic() - started < 5.0
    assert "exited with code 3 before becoming ready" in str(info.value)
    assert "CUDA out of memory (simulated)" in str(info.value)
    assert await server.stop() == 3


@pytest.mark.integration
async def test_wait_ready_times_out_while_health_stays_503(tmp_path: Path) -> None:
    server = SGLangServer(stub_spec(tmp_path), env={"STUB_READY_AFTER_S": "100"})
    await server.start(tmp_path / "sglang.log")
    pid = server.pid
    assert pid is not None
    try:
        with pytest.raises(
            EngineUnavailable, match=r"not ready after 0.5 s; log tail:\n# rollwise: launching"
        ):
            await server.wait_ready(0.5, poll_interval_s=0.05)
        assert server.returncode is None
    finally:
        await server.stop(grace_s=5.0)
    assert_gone(pid)


async def test_wait_ready_and_double_start_need_a_sane_state(tmp_path: Path) -> None:
    server = SGLangServer(stub_spec(tmp_path), env={"STUB_READY_AFTER_S": "0"})
    with pytest.raises(RuntimeError, match="not started"):
        await server.wait_ready(1.0)
    # Stopping a server that never started is a no-op: no exit code, no process, no log written.
    assert await server.stop() is None
    assert (server.pid, server.returncode, server.log_path) == (None, None, None)
    assert os.listdir(tmp_path) == ["python-stub"]  # the launcher wrapper alone: no log file
    first_log = tmp_path / "a.log"
    await server.start(first_log)
    pid = server.pid
    assert pid is not None
    try:
        await server.wait_ready(10.0, poll_interval_s=0.05)
        with pytest.raises(RuntimeError, match=rf"already running \(pid {pid}\)"):
            await server.start(tmp_path / "b.log")
        # The refused start left the running server alone and opened no second log.
        assert (server.pid, server.returncode, server.log_path) == (pid, None, first_log)
        assert not (tmp_path / "b.log").exists()
    finally:
        code = await server.stop(grace_s=5.0)
    assert code == 0 and server.returncode == 0
    assert_gone(pid)
    assert first_log.read_text().count("# rollwise: launching ") == 1
    assert "stub sglang: SIGTERM received, shutting down" in first_log.read_text()
