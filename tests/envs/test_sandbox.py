"""The sandbox: results, limits, the abuse suite under bubblewrap and with rlimits only, the queue.

Every abuse case must end as a result (an observation for the model) or a clear EnvError, and leave
no process running and no working directory behind. "Leftover" processes are found by what they
carry in their command line: the launcher's tag (every sandbox interpreter and its forks) or a
marker the test put in a background process's arguments.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import shutil
import socket
import subprocess
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from envs.api import EnvError, ToolCall
from envs.sandbox.isolation import detect_isolation
from envs.sandbox.launcher import LAUNCHER_TAG
from envs.sandbox.limits import Limits
from envs.sandbox.python_tool import PYTHON_TOOL, python_tool_message
from envs.sandbox.runner import Sandbox, SandboxConfig, SandboxError, SandboxResult, SandboxUnavailable

REPO = Path(__file__).resolve().parents[2]
IS_ROOT = os.geteuid() == 0
FAST = Limits(wall_time_s=20.0, cpu_time_s=10.0, max_processes=16)


def _bwrap_problem() -> str:
    probe_uid = SandboxConfig().root_uid_base if IS_ROOT else None
    isolation = detect_isolation("bwrap", "", probe_uid, SandboxConfig().tmp_bytes)
    return "" if isolation.kind == "bwrap" else isolation.fallback_reason


BWRAP_PROBLEM = _bwrap_problem()
needs_bwrap = pytest.mark.skipif(bool(BWRAP_PROBLEM), reason=f"bubblewrap unusable here: {BWRAP_PROBLEM}")
needs_uid_separation = pytest.mark.skipif(
    not IS_ROOT, reason="rlimits only, without root the code runs as the user: files and signals reach"
)


def _sandbox(mode: str, **options: object) -> Sandbox:
    base = {"require": "bwrap"} if mode == "bwrap" else {"require": "rlimits", "bwrap": ""}
    config = SandboxConfig.from_options({**base, **options})
    return Sandbox(config)


@pytest.fixture(params=["bwrap", "rlimits"])
def mode(request: pytest.FixtureRequest) -> str:
    if request.param == "bwrap" and BWRAP_PROBLEM:
        pytest.skip(f"bubblewrap unusable here: {BWRAP_PROBLEM}")
    return str(request.param)


def _leftovers(*markers: str) -> list[str]:
    """Command lines of live (not zombie) processes carrying a marker, or the launcher's tag with this
    process as the owner (another rollwise process's sandboxes are not ours to judge)."""
    ours = f"owner={os.getpid()} "
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{name}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        launched = LAUNCHER_TAG in cmdline and ours in cmdline
        if state != "Z" and (launched or any(m in cmdline for m in markers)):
            found.append(f"{name}: {cmdline[:120]}")
    return found


def _rundirs() -> set[str]:
    parent = Path(tempfile.gettempdir()) / f"rollwise-sandbox-{os.geteuid()}"
    mine = f"run-{os.getpid()}-"  # other processes (a test file beside this one) run sandboxes too
    return {name for name in os.listdir(parent) if name.startswith(mine)} if parent.exists() else set()


@pytest.fixture
def contained() -> Iterator[list[str]]:
    """After the test: no sandbox process alive, no new working directory left. Yields a list the
    test can extend with markers of background processes it expects dead."""
    markers: list[str] = []
    before = _rundirs()
    yield markers
    deadline = time.monotonic() + 5.0  # a SIGKILLed process may take a moment to leave /proc
    while _leftovers(*markers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _leftovers(*markers) == []
    assert _rundirs() - before == set()


async def _run(sandbox: Sandbox, code: str, **limits: float) -> SandboxResult:
    return await sandbox.run_python(textwrap.dedent(code), limits=FAST.replace(**limits))


# --- ordinary results ---------------------------------------------------------------------------


async def test_stdout_stderr_exit_code_files_and_stdin(mode: str, contained: list[str]) -> None:
    sandbox = _sandbox(mode)
    code = """
        import sys
        data = open("data/input.txt").read()
        print(data.upper(), sys.stdin.read()[::-1])
        print("warn", file=sys.stderr)
        sys.exit(3)
    """
    result = await sandbox.run_python(
        textwrap.dedent(code), files={"data/input.txt": "hello"}, stdin="abc", limits=FAST
    )
    assert (result.stdout, result.stderr, result.exit_code) == ("HELLO cba\n", "warn\n", 3)
    assert (result.stdout_truncated, result.stderr_truncated, result.stopped_by) == (False, False, None)
    assert result.isolation == mode and sandbox.isolation.kind == mode
    assert not result.ok


async def test_exception_traceback_shows_only_the_program(mode: str, contained: list[str]) -> None:
    result = await _run(_sandbox(mode), "def f():\n    return 1 / 0\nf()\n")
    assert result.exit_code == 1
    assert result.stderr.startswith('Traceback (most recent call last):\n  File "main.py", line 3')
    assert result.stderr.rstrip().endswith("ZeroDivisionError: division by zero")
    assert "launcher" not in result.stderr and "<string>" not in result.stderr


async def test_syntax_error_is_reported_like_python(mode: str, contained: list[str]) -> None:
    result = await _run(_sandbox(mode), "def (:\n")
    assert result.exit_code == 1
    assert result.stderr.startswith('  File "main.py", line 1') and "SyntaxError" in result.stderr


async def test_runs_like_python_main(mode: str, contained: list[str]) -> None:
    code = """
        import os, sys
        print(__name__, sys.argv, os.getcwd() == os.path.dirname(os.path.abspath(__file__)))
        print(os.environ.get("HOME") == os.getcwd(), sorted(os.listdir(".")))
    """
    result = await _run(_sandbox(mode), code)
    assert result.stdout == "__main__ ['main.py'] True\nTrue ['main.py']\n", result.stderr


# --- the abuse suite ----------------------------------------------------------------------------


async def test_fork_bomb_is_capped_by_max_processes(mode: str, contained: list[str]) -> None:
    code = """
        import os, time
        children = 0
        while True:
            try:
                pid = os.fork()
            except OSError as exc:
                print("fork failed after", children, exc.strerror)
                break
            if pid == 0:
                time.sleep(60)
                os._exit(0)
            children += 1
    """
    result = await _run(_sandbox(mode), code, max_processes=16)
    assert result.exit_code == 0, result.stderr
    count = int(result.stdout.split()[3])
    assert 5 <= count < 16, result.stdout  # the interpreter (and bubblewrap's init) count too
    assert "Resource temporarily unavailable" in result.stdout


async def test_fork_bomb_that_never_stops_is_ended_by_the_wall_clock(mode: str, contained: list[str]) -> None:
    code = """
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
    """
    result = await _run(_sandbox(mode), code, max_processes=12, wall_time_s=2.0)
    assert result.stopped_by in ("wall_time", "cpu_time")
    assert result.exit_code >= 128


async def test_infinite_loop_is_stopped_by_the_cpu_limit(mode: str, contained: list[str]) -> None:
    result = await _run(_sandbox(mode), "while True:\n    pass\n", cpu_time_s=1.0, wall_time_s=30.0)
    # On a machine loaded by other work the wall clock may still come first; both are limits.
    assert result.stopped_by in ("cpu_time", "wall_time")
    assert result.exit_code in (128 + 24, 128 + 9)  # SIGXCPU, or SIGKILL


async def test_sleeping_program_is_stopped_by_the_wall_clock(mode: str, contained: list[str]) -> None:
    started = time.monotonic()
    result = await _run(
        _sandbox(mode), "import time\nprint('before', flush=True)\ntime.sleep(600)\n", wall_time_s=1.0
    )
    assert (result.stopped_by, result.exit_code, result.stdout) == ("wall_time", 128 + 9, "before\n")
    assert time.monotonic() - started < 15.0


async def test_ten_gigabyte_allocation_is_a_memory_error(mode: str, contained: list[str]) -> None:
    result = await _run(_sandbox(mode), "x = bytearray(10 * 2**30)\n")
    assert result.exit_code == 1 and result.stopped_by is None
    assert result.stderr.rstrip().endswith("MemoryError")


async def test_one_gigabyte_of_output_is_cut_marked_and_stopped(mode: str, contained: list[str]) -> None:
    code = "import sys\nchunk = 'x' * 2**20\nfor _ in range(1024):\n    sys.stdout.write(chunk)\n"
    started = time.monotonic()
    result = await _run(_sandbox(mode), code, max_output_bytes=4096)
    assert result.stopped_by == "output" and result.stdout_truncated and not result.stderr_truncated
    assert result.stdout == "x" * 4096 + "\n[stdout truncated: more than 4096 bytes; the program was stopped]"
    assert time.monotonic() - started < 15.0  # stopped at the cap, not after writing a gigabyte


async def test_stderr_flood_is_cut_too(mode: str, contained: list[str]) -> None:
    result = await _run(
        _sandbox(mode), "import sys\nwhile True:\n    sys.stderr.write('e' * 1000)\n", max_output_bytes=2048
    )
    assert result.stopped_by == "output" and result.stderr_truncated and result.stderr.startswith("e" * 2048)


async def test_file_size_limit(mode: str, contained: list[str]) -> None:
    code = """
        import os
        fd = os.open("big", os.O_WRONLY | os.O_CREAT)
        print(os.write(fd, b"x" * 3000), flush=True)   # cut at the limit
        os.write(fd, b"x")                               # past it: EFBIG
    """
    result = await _run(_sandbox(mode), code, max_file_bytes=2048)
    assert (result.exit_code, result.stdout) == (1, "2048\n")
    assert result.stderr.rstrip().endswith("OSError: [Errno 27] File too large")


async def test_background_process_dies_with_the_call(mode: str, contained: list[str]) -> None:
    marker = f"{random.randint(10**8, 10**9)}.5"  # sleep accepts a float: the marker is its argument
    contained.append(marker)
    code = f"""
        import os, subprocess
        subprocess.Popen(["sleep", "{marker}"])              # a plain child
        if os.fork() == 0:                                  # a daemon: double fork, new session
            os.setsid()
            if os.fork() == 0:
                os.execvp("sleep", ["sleep", "{marker}"])
            os._exit(0)
        print("spawned")
    """
    started = time.monotonic()
    result = await _run(_sandbox(mode), code)
    assert (result.exit_code, result.stdout) == (0, "spawned\n"), result.stderr
    assert time.monotonic() - started < 10.0  # the call did not wait for its background processes


async def test_killing_the_parent_is_contained(mode: str, contained: list[str]) -> None:
    sandbox = _sandbox(mode)
    code = """
        import os, signal, time
        try:
            os.kill(os.getppid(), signal.SIGKILL)
        except PermissionError:
            print("not permitted")
        time.sleep(0.3)
        print("still here")
    """
    result = await _run(sandbox, code)
    if mode == "bwrap":  # the parent is the namespace's init, which ignores signals from inside
        assert (result.exit_code, result.stdout) == (0, "still here\n")
    elif IS_ROOT:  # the parent runs as root; the code as its own uid
        assert (result.exit_code, result.stdout) == (0, "not permitted\nstill here\n")
    else:  # the supervising launcher dies; the code dies with it (PDEATHSIG)
        assert result.exit_code == 128 + 9
    assert (await _run(sandbox, "print('next')")).stdout == "next\n"


@needs_uid_separation
async def test_killing_every_process_it_can_reaches_nothing_outside(mode: str, contained: list[str]) -> None:
    code = """
        import os, signal
        try:
            os.kill(-1, signal.SIGKILL)   # every process this uid may signal, but itself
        except ProcessLookupError:        # in a PID namespace there is none
            pass
        print("alone")
    """
    # This test process, the supervising launcher (which reported the exit) and bubblewrap survive.
    result = await _run(_sandbox(mode), code)
    assert (result.exit_code, result.stdout) == (0, "alone\n")


@needs_uid_separation
async def test_writing_to_the_users_home_is_contained(mode: str, contained: list[str]) -> None:
    name = f"rollwise-sandbox-escape-{random.randint(10**8, 10**9)}"
    real_home = Path.home() / name
    code = f"""
        import os
        open(os.path.expanduser("~/{name}"), "w").write("x")   # HOME is the working directory
        try:
            open("{real_home}", "w").write("x")
            print("wrote the real home")
        except OSError as exc:
            print(type(exc).__name__)
    """
    try:
        result = await _run(_sandbox(mode), code)
        assert not real_home.exists()
        assert result.stdout in ("PermissionError\n", "FileNotFoundError\n", "OSError\n"), result.stdout
    finally:
        real_home.unlink(missing_ok=True)


@needs_uid_separation
async def test_reading_private_files_outside_the_working_directory_fails(
    mode: str, contained: list[str], tmp_path: Path
) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("token")
    secret.chmod(0o600)
    code = f"""
        for path in ["{secret}", "{Path.home() / ".bashrc"}", "/etc/shadow"]:
            try:
                print(open(path).read()[:5])
            except OSError as exc:
                print(type(exc).__name__)
    """
    result = await _run(_sandbox(mode), code)
    assert "token" not in result.stdout
    assert all(line.endswith("Error") for line in result.stdout.splitlines()), result.stdout


@needs_bwrap
async def test_bwrap_hides_the_users_files_and_the_system_config(
    contained: list[str], tmp_path: Path
) -> None:
    readable = tmp_path / "readable.txt"
    readable.write_text("visible to all")
    readable.chmod(0o644)
    code = f"""
        import os
        for path in ["{readable}", "{REPO / "pyproject.toml"}", "/etc/passwd", "/root", "/home"]:
            print(path.rsplit("/", 1)[-1], os.path.exists(path))
        print(sorted(os.listdir("/")))
        try:
            open("/usr/escape", "w")
        except OSError as exc:
            print(type(exc).__name__, exc.errno)
        open("/tmp/scratch", "w").write("private /tmp is writable")
    """
    result = await _run(_sandbox("bwrap"), code)
    lines = result.stdout.splitlines()
    assert lines[:5] == [
        "readable.txt False",
        "pyproject.toml False",
        "passwd False",
        "root False",
        "home False",
    ]
    assert "work" not in lines[5] and "root" not in lines[5]
    assert lines[6] == "OSError 30"  # EROFS: the system is read-only
    assert result.exit_code == 0
    assert not os.path.exists("/tmp/scratch")  # noqa: ASYNC240 - a stat, and the assertion is the point


@needs_bwrap
async def test_bwrap_has_no_network(contained: list[str]) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    port = listener.getsockname()[1]
    code = f"""
        import socket
        for address in [("127.0.0.1", {port}), ("192.0.2.1", 80), ("1.1.1.1", 53)]:
            try:
                socket.create_connection(address, timeout=2).close()
                print("connected")
            except OSError as exc:
                print(type(exc).__name__, exc.errno)
        print(sorted(name for _, name in socket.if_nameindex()))
    """
    try:
        result = await _run(_sandbox("bwrap"), code)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected to the host's loopback
    finally:
        listener.close()
    assert result.stdout.splitlines() == [
        "ConnectionRefusedError 111",  # the sandbox's own loopback, where nothing listens
        "OSError 101",  # ENETUNREACH: no route out
        "OSError 101",
        "['lo']",
    ], result.stderr


# --- refusal, failures, the queue, cancellation ---------------------------------------------------


def test_requiring_bwrap_where_it_is_missing_is_refused() -> None:
    with pytest.raises(SandboxUnavailable, match=r"not found.*apt-get install bubblewrap") as info:
        _sandbox("bwrap", bwrap="/nonexistent/bwrap")
    assert 'sandbox.require = "rlimits"' in str(info.value)
    assert isinstance(info.value, EnvError)
    fallback = _sandbox("rlimits", bwrap="/nonexistent/bwrap")
    assert fallback.isolation.kind == "rlimits"
    assert "not found" in fallback.isolation.describe() and "network" in fallback.isolation.describe()


def test_bwrap_that_cannot_make_namespaces_falls_back_with_the_reason() -> None:
    with tempfile.TemporaryDirectory() as directory:  # /tmp itself: a root daemon probes as another uid
        os.chmod(directory, 0o755)
        _check_failing_bwrap(Path(directory) / "bwrap")


def _check_failing_bwrap(fake: Path) -> None:
    fake.write_text(
        "#!/bin/sh\n"
        'case "$1" in --version) echo "bubblewrap 0.8.0";; --help) echo "--size --disable-userns";;\n'
        '*) echo "bwrap: setting up uid map: Permission denied" >&2; exit 1;; esac\n'
    )
    fake.chmod(0o755)
    sandbox = _sandbox("rlimits", bwrap=str(fake))
    assert sandbox.isolation.kind == "rlimits"
    assert "setting up uid map: Permission denied (unprivileged user namespaces are off" in (
        sandbox.isolation.fallback_reason
    )
    with pytest.raises(SandboxUnavailable, match="uid map"):
        _sandbox("bwrap", bwrap=str(fake))


def test_config_errors_name_the_key() -> None:
    with pytest.raises(ValueError, match=r"sandbox.wall_time_s must be in \[0.05, 86400\], got 0"):
        SandboxConfig.from_options({"wall_time_s": 0})
    with pytest.raises(ValueError, match=r"unknown setting\(s\) \['walltime'\]"):
        SandboxConfig.from_options({"walltime": 3})
    with pytest.raises(ValueError, match=r'sandbox\.require must be "bwrap" or "rlimits"'):
        SandboxConfig.from_options({"require": "docker"})
    with pytest.raises(ValueError, match=r"sandbox\.max_processes must be a number, got True"):
        SandboxConfig.from_options({"max_processes": True})
    with pytest.raises(ValueError, match='bwrap = "" turns bubblewrap off'):
        SandboxConfig.from_options({"bwrap": ""})
    with pytest.raises(SandboxUnavailable, match="no Python interpreter"):
        _sandbox("rlimits", python="/nonexistent/python3")


async def test_a_sandbox_that_cannot_start_raises_sandbox_error(tmp_path: Path) -> None:
    sandbox = _sandbox("rlimits")
    broken = tmp_path / "python"
    broken.write_text("#!/bin/sh\necho 'cannot start' >&2\nexit 2\n")
    broken.chmod(0o755)
    interpreter = dataclasses.replace(sandbox.isolation.interpreter, path=str(broken))
    sandbox.isolation = dataclasses.replace(sandbox.isolation, interpreter=interpreter)
    with pytest.raises(SandboxError, match=r"did not start the program .*cannot start"):
        await sandbox.run_python("print(1)")


async def test_bad_file_names_are_refused() -> None:
    sandbox = _sandbox("rlimits")
    for name in ("../x", "/etc/x", "main.py", ""):
        with pytest.raises(ValueError, match="must be a relative path"):
            await sandbox.run_python("pass", files={name: "x"})


async def test_concurrency_is_bounded_and_the_rest_wait(mode: str, contained: list[str]) -> None:
    sandbox = _sandbox(mode, max_concurrency=2)
    peak_running = peak_waiting = 0

    async def watch() -> None:
        nonlocal peak_running, peak_waiting
        while True:
            peak_running = max(peak_running, sandbox.running)
            peak_waiting = max(peak_waiting, sandbox.waiting)
            await asyncio.sleep(0.002)

    watcher = asyncio.create_task(watch())
    results = await asyncio.gather(
        *(_run(sandbox, f"import time\ntime.sleep(0.3)\nprint({i})") for i in range(6))
    )
    watcher.cancel()
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(6)]
    assert peak_running == 2 and peak_waiting == 4
    assert max(r.queued_s for r in results) > 0.3  # the last ones waited for earlier ones
    assert (sandbox.running, sandbox.waiting, sandbox.executions) == (0, 0, 6)


async def test_cancelling_a_call_kills_the_program_and_frees_the_slot(
    mode: str, contained: list[str]
) -> None:
    sandbox = _sandbox(mode, max_concurrency=1)
    task = asyncio.create_task(_run(sandbox, "import time\nprint('up', flush=True)\ntime.sleep(600)"))
    await asyncio.sleep(1.0)  # long enough to be running; the assertions below hold either way
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (sandbox.running, sandbox.waiting) == (0, 0)
    assert (await _run(sandbox, "print('free')")).stdout == "free\n"


async def test_executions_are_exported_as_prometheus_metrics(contained: list[str]) -> None:
    from pipeline.supervisor.observability import metrics

    def sample(name: str, **labels: str) -> float:
        value = metrics.REGISTRY.get_sample_value(name, labels)
        return 0.0 if value is None else value

    before = (
        sample("rollwise_sandbox_executions_total", kind="rlimits", reason="none"),
        sample("rollwise_sandbox_executions_total", kind="rlimits", reason="wall_time"),
        sample("rollwise_sandbox_execution_seconds_count", kind="rlimits"),
        sample("rollwise_sandbox_queue_wait_seconds_count"),
    )
    sandbox = _sandbox("rlimits")
    await _run(sandbox, "print(1)")
    await _run(sandbox, "import time\ntime.sleep(60)", wall_time_s=0.5)
    after = (
        sample("rollwise_sandbox_executions_total", kind="rlimits", reason="none"),
        sample("rollwise_sandbox_executions_total", kind="rlimits", reason="wall_time"),
        sample("rollwise_sandbox_execution_seconds_count", kind="rlimits"),
        sample("rollwise_sandbox_queue_wait_seconds_count"),
    )
    assert [b - a for a, b in zip(before, after, strict=True)] == [1.0, 1.0, 2.0, 2.0]
    assert sample("rollwise_sandbox_running") == 0.0 and sample("rollwise_sandbox_waiting") == 0.0


# --- the tool -----------------------------------------------------------------------------------


async def test_python_tool_answers_with_json_and_rejects_bad_calls(contained: list[str]) -> None:
    sandbox = _sandbox("rlimits")
    assert PYTHON_TOOL["function"]["name"] == "python"
    assert PYTHON_TOOL["function"]["parameters"]["required"] == ["code"]
    message, result = await python_tool_message(sandbox, ToolCall("python", {"code": "print(6 * 7)"}))
    assert result is not None and message["role"] == "tool" and message["name"] == "python"
    assert json.loads(message["content"]) == {
        "exit_code": 0,
        "stdout": "42\n",
        "stderr": "",
        "stdout_truncated": False,
        "stderr_truncated": False,
        "stopped_by": None,
    }
    for call, error in [
        (ToolCall("python", {}), 'error: "code" must be a string holding the program'),
        (ToolCall("python", {"code": 3}), 'error: "code" must be a string holding the program'),
        (ToolCall("python", {"code": "  "}), 'error: "code" is empty'),
        (ToolCall("shell", {"code": "ls"}), "error: unknown tool 'shell'; the tool is 'python'"),
    ]:
        assert await python_tool_message(sandbox, call) == (
            {"role": "tool", "name": "python", "content": error},
            None,
        )


# --- the non-root paths, taken by a second, unprivileged user -----------------------------------

_AS_USER_SCRIPT = """
import asyncio, json, sys
from envs.sandbox.runner import Sandbox, SandboxConfig
from envs.sandbox.limits import Limits

CASES = {
    "fork_count": (
        "import os, time\\nn = 0\\nwhile True:\\n    try:\\n        pid = os.fork()\\n"
        "    except OSError:\\n        break\\n    if pid == 0:\\n        time.sleep(60)\\n"
        "        os._exit(0)\\n    n += 1\\nprint(n)"
    ),
    "loop": "while True:\\n    pass",
    "memory": "x = bytearray(10 * 2**30)",
    "background": "import subprocess\\nsubprocess.Popen(['sleep', '%s'])\\nprint('spawned')",
    "kill_parent": "import os, time\\nos.kill(os.getppid(), 9)\\ntime.sleep(5)\\nprint('survived')",
    "output": "while True:\\n    print('x' * 1000)",
}

async def main():
    out = {}
    for options in ({"require": "rlimits", "bwrap": ""}, {"require": "bwrap"}):
        sandbox = Sandbox(SandboxConfig.from_options(options))
        limits = Limits(wall_time_s=8.0, cpu_time_s=1.0, max_processes=12, max_output_bytes=1000)
        for name, code in CASES.items():
            r = await sandbox.run_python(code, limits=limits)
            out[sandbox.isolation.kind + ":" + name] = [r.exit_code, r.stopped_by, r.stdout[:20]]
    print(json.dumps(out))

asyncio.run(main())
"""


@pytest.mark.skipif(
    not IS_ROOT, reason="needs root to act as a second user; as a user the other tests take these paths"
)
@pytest.mark.skipif(
    not Path("/usr/bin/python3").exists(), reason="needs /usr/bin/python3 for the second user"
)
def test_as_an_unprivileged_user_both_modes_contain_the_abuse(contained: list[str]) -> None:
    if BWRAP_PROBLEM:
        pytest.skip(f"bubblewrap unusable here: {BWRAP_PROBLEM}")
    uid = 1_699_999_000 + random.randint(0, 999)
    marker = f"{random.randint(10**8, 10**9)}.25"
    contained.append(marker)
    # The second user may not be able to enter the checkout (a CI clone in a 0700 temporary directory):
    # it imports a world-readable copy of the package instead.
    readable = Path(tempfile.mkdtemp(prefix="rollwise-as-user-"))
    shutil.copytree(REPO / "envs", readable / "envs", ignore=shutil.ignore_patterns("__pycache__"))
    for path in [readable, *readable.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    try:
        stdout, stderr, returncode = _run_as_user(uid, marker, readable, contained)
    finally:
        shutil.rmtree(readable, ignore_errors=True)
    assert returncode == 0, stderr
    results = json.loads(stdout)
    for kind in ("rlimits", "bwrap"):
        assert 1 <= int(results[f"{kind}:fork_count"][2]) < 12
        assert results[f"{kind}:loop"][1] in ("cpu_time", "wall_time")
        assert results[f"{kind}:memory"][0] == 1
        assert results[f"{kind}:background"] == [0, None, "spawned\n"]
        assert results[f"{kind}:output"][1] == "output"
    assert results["rlimits:kill_parent"][0] == 128 + 9  # the supervising launcher died, the code too
    assert results["bwrap:kill_parent"] == [0, None, "survived\n"]
    parent = Path(tempfile.gettempdir()) / f"rollwise-sandbox-{uid}"
    assert not parent.exists() or os.listdir(parent) == []  # every run directory was removed
    shutil.rmtree(parent, ignore_errors=True)  # the (empty) parent of a uid used by this test alone


def _run_as_user(uid: int, marker: str, pythonpath: Path, contained: list[str]) -> tuple[str, str, int]:
    with subprocess.Popen(
        ["/usr/bin/python3", "-c", _AS_USER_SCRIPT % marker],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd="/",
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(pythonpath), "HOME": "/nonexistent"},
        user=uid,
        group=uid,
        extra_groups=[],
    ) as user_process:
        contained.append(f"owner={user_process.pid} ")  # its sandboxes must be gone too
        stdout, stderr = user_process.communicate(timeout=240)
    return stdout, stderr, user_process.returncode
