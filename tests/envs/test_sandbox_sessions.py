"""envs.sandbox.sessions: a directory that persists across commands, its files in and out, paths that
may not leave it, a snapshot that forks into independent sessions, limits per command, and nothing
left behind; under bubblewrap and with rlimits only."""

from __future__ import annotations

from pathlib import Path

import pytest

from envs.sandbox.isolation import SANDBOX_DIR
from envs.sandbox.limits import Limits
from envs.sandbox.process import SandboxError
from envs.sandbox.runner import Sandbox, SandboxConfig, SandboxUnavailable
from envs.sandbox.sessions import LocalBackend, SandboxBackend, SessionSnapshot, SnapshotUnsupported
from tests.envs.test_sandbox import BWRAP_PROBLEM, IS_ROOT

FAST = Limits(wall_time_s=20.0, cpu_time_s=10.0, max_processes=16)


@pytest.fixture(params=["bwrap", "rlimits"])
def backend(request: pytest.FixtureRequest) -> LocalBackend:
    if request.param == "bwrap" and BWRAP_PROBLEM:
        pytest.skip(f"bubblewrap unusable here: {BWRAP_PROBLEM}")
    base = {"require": "bwrap"} if request.param == "bwrap" else {"require": "rlimits", "bwrap": ""}
    sandbox = Sandbox(SandboxConfig.from_options({**base, "wall_time_s": 20.0, "max_processes": 16}))
    assert sandbox.isolation.kind == request.param
    return LocalBackend(sandbox)


async def test_files_persist_from_one_command_to_the_next(backend: LocalBackend) -> None:
    async with await backend.start({"notes/start.txt": "one\n"}) as session:
        first = await session.exec("echo two >> notes/start.txt && mkdir -p out && wc -l < notes/start.txt")
        assert first.ok and first.stdout.strip() == "2"
        second = await session.exec("cat notes/start.txt; ls out; echo $PWD >&2")
        assert second.stdout == "one\ntwo\n" and second.exit_code == 0
        # The shell starts in the session's directory: mounted at SANDBOX_DIR, or itself without bwrap.
        assert second.stderr.strip() in {SANDBOX_DIR, str(session.work)}  # type: ignore[attr-defined]


async def test_exit_codes_stdin_and_a_command_cut_by_its_wall_time(backend: LocalBackend) -> None:
    async with await backend.start() as session:
        failed = await session.exec("echo broken >&2; exit 3")
        assert (failed.exit_code, failed.stderr, failed.ok) == (3, "broken\n", False)
        assert (await session.exec("tr a-z A-Z", stdin="shout\n")).stdout == "SHOUT\n"
        slow = await session.exec("touch before; sleep 30", limits=FAST.replace(wall_time_s=0.5))
        assert slow.stopped_by == "wall_time"
        after = await session.exec("ls")
        assert after.ok and after.stdout.split() == ["before"]  # the session outlives a cut command


async def test_upload_and_download_round_trip_bytes(backend: LocalBackend) -> None:
    payload = bytes(range(256))
    async with await backend.start() as session:
        await session.upload({"data/blob.bin": payload, "script.sh": "printf made > made.txt\n"})
        assert (await session.exec("bash script.sh && wc -c < data/blob.bin")).stdout.strip() == "256"
        assert await session.download("data/blob.bin") == payload
        assert await session.download("made.txt") == b"made"
        with pytest.raises(FileNotFoundError, match=r"no file 'absent\.txt'"):
            await session.download("absent.txt")


async def test_paths_that_leave_the_directory_are_refused(backend: LocalBackend, tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("host file")
    async with await backend.start() as session:
        for bad in ("../x", "/etc/passwd", "a/../../x", ""):
            with pytest.raises(ValueError, match="must be a relative path inside"):
                await session.download(bad)
        with pytest.raises(ValueError, match="must be a relative path inside"):
            await session.upload({"../escape.txt": "x"})
        await session.exec(f"ln -s {secret} link; ln -s / root")
        with pytest.raises(ValueError, match="leads outside the session's directory"):
            await session.download("link")
        with pytest.raises(ValueError, match="leads outside the session's directory"):
            await session.upload({"root/tmp/planted.txt": "x"})
    assert secret.read_text() == "host file"


async def test_a_snapshot_forks_into_sessions_that_no_longer_share_files(backend: LocalBackend) -> None:
    parent = await backend.start({"state.txt": "turn 1\n"})
    await parent.exec("echo 'turn 2' >> state.txt")
    snapshot = await parent.snapshot()
    await parent.exec("echo 'parent only' >> state.txt")
    left, right = await backend.fork(snapshot), await backend.fork(snapshot)
    try:
        await left.exec("echo left >> state.txt")
        assert (await left.download("state.txt")) == b"turn 1\nturn 2\nleft\n"
        assert (await right.download("state.txt")) == b"turn 1\nturn 2\n"
        assert (await right.exec("echo right >> state.txt && cat state.txt")).stdout.endswith(
            "turn 2\nright\n"
        )
        assert (await parent.download("state.txt")).endswith(b"parent only\n")
    finally:
        for session in (parent, left, right):
            await session.stop()
        await backend.discard(snapshot)
    with pytest.raises(SandboxError, match="is gone"):
        await backend.fork(snapshot)
    with pytest.raises(SnapshotUnsupported, match="'remote' snapshot cannot start a 'local' session"):
        await backend.fork(SessionSnapshot("remote", snapshot.location))


async def test_stop_removes_everything_and_ends_the_session(backend: LocalBackend) -> None:
    session = await backend.start({"a.txt": "a"})
    rundir = session.rundir  # type: ignore[attr-defined]
    await session.stop()
    await session.stop()  # twice is fine
    assert not rundir.exists()
    with pytest.raises(SandboxError, match="exec after stop"):
        await session.exec("true")


@pytest.mark.skipif(not IS_ROOT, reason="a root daemon's sessions get sandbox uids")
async def test_a_root_daemons_session_keeps_one_uid_and_forks_get_their_own(backend: LocalBackend) -> None:
    async with await backend.start() as session:
        uids = {(await session.exec("id -u")).stdout.strip() for _ in range(3)}
        assert len(uids) == 1 and uids != {"0"}
        await session.exec("echo mine > owned.txt && chmod 600 owned.txt")
        fork = await backend.fork(await session.snapshot())
        async with fork:
            assert (await fork.exec("id -u")).stdout.strip() not in uids | {"0"}
            assert (await fork.exec("cat owned.txt")).stdout == "mine\n"  # copied files are the fork's


class _Minimal(SandboxBackend):
    name = "minimal"

    async def start(self, files: object = None) -> object:  # type: ignore[override]
        raise NotImplementedError


async def test_a_backend_without_snapshots_says_so() -> None:
    with pytest.raises(SnapshotUnsupported, match="backend 'minimal' cannot fork"):
        await _Minimal().fork(SessionSnapshot("minimal", "x"))


@pytest.mark.skipif(bool(BWRAP_PROBLEM), reason=f"bubblewrap unusable here: {BWRAP_PROBLEM}")
async def test_binds_put_session_directories_at_absolute_paths() -> None:
    sandbox = Sandbox(SandboxConfig.from_options({"require": "bwrap", "wall_time_s": 20.0}))
    backend = LocalBackend(sandbox, {"app": "/app", "logs/verifier": "/logs/verifier"}, chdir="/app")
    async with await backend.start({"app/input.txt": "3 4\n"}) as session:
        result = await session.exec("pwd; read a b < input.txt; echo $((a + b)) > /logs/verifier/reward.txt")
        assert result.ok and result.stdout == "/app\n"
        assert await session.download("logs/verifier/reward.txt") == b"7\n"
        fork = await backend.fork(await session.snapshot())
        async with fork:
            assert (await fork.exec("cat /logs/verifier/reward.txt /app/input.txt")).stdout == "7\n3 4\n"


def test_binds_need_bubblewrap_and_free_absolute_paths() -> None:
    rlimits = Sandbox(SandboxConfig.from_options({"require": "rlimits", "bwrap": ""}))
    with pytest.raises(SandboxUnavailable, match=r"paths of its own \(/app\) needs bubblewrap"):
        LocalBackend(rlimits, {"app": "/app"})
    if BWRAP_PROBLEM:
        return
    sandbox = Sandbox(SandboxConfig.from_options({"require": "bwrap"}))
    for sub, inside in (("app", "app"), ("app", "/tmp"), ("app", "/"), ("../up", "/up")):
        with pytest.raises(ValueError):
            LocalBackend(sandbox, {sub: inside})
