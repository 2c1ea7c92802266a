"""Run untrusted Python from an environment: ``await sandbox.run_python(code) -> SandboxResult``.

Every execution gets a fresh working directory (removed afterwards), resource limits (wall and CPU
time, memory, processes, file size, open files, output bytes: ``envs.sandbox.limits.Limits``), and
the best isolation the machine offers (``envs.sandbox.isolation``): bubblewrap namespaces where they
work, otherwise resource limits only. ``Sandbox.isolation`` says which, and a sandbox whose config
requires ``bwrap`` refuses to exist without it (``SandboxUnavailable``, an ``EnvError``).

Concurrency is bounded per event loop: at most ``max_concurrency`` interpreters run at once and
later calls wait their turn in FIFO order, so a thousand episodes never start a thousand processes.
Environments are made once per episode, so they share one ``Sandbox`` per config: ``shared_sandbox``.

What the code does wrong is a result, never an exception: a non-zero ``exit_code``, ``stopped_by``
("wall_time", "cpu_time", "output"), truncated streams. ``SandboxError`` (an ``EnvError``) means
the sandbox itself failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from envs.sandbox.isolation import (
    PATH_INSIDE,
    PYTHON_FLAGS,
    SANDBOX_DIR,
    Isolation,
    SandboxUnavailable,
    bwrap_argv,
    detect_isolation,
)
from envs.sandbox.launcher import encode_config
from envs.sandbox.limits import Limits, SandboxConfig
from envs.sandbox.process import ProcessOutcome, SandboxError, Sweep, run_process
from envs.sandbox.sandbox_paths import check_relative, write_file

__all__ = [
    "Execution",
    "Limits",
    "Sandbox",
    "SandboxConfig",
    "SandboxError",
    "SandboxResult",
    "SandboxUnavailable",
    "add_observer",
    "shared_sandbox",
]

MAIN_FILE = "main.py"
SIGXCPU_EXIT = 128 + signal.SIGXCPU
_LAUNCHER_SOURCE = Path(__file__).with_name("launcher.py").read_text()
_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SandboxResult:
    """One execution. ``exit_code`` is 128 + N when signal N ended it (as a shell reports it).

    ``stopped_by`` names the limit that ended the run, if one did: "wall_time", "cpu_time" or
    "output" (a stream passed ``max_output_bytes``: it was cut there, marked, and the run stopped).
    A MemoryError or a failed fork is the program's own exception, shown in ``stderr``.
    """

    stdout: str
    stderr: str
    exit_code: int
    stdout_truncated: bool
    stderr_truncated: bool
    stopped_by: str | None
    isolation: str
    wall_s: float
    queued_s: float

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.stopped_by is None


def truncation_marker(stream: str, limit: int) -> str:
    return f"\n[{stream} truncated: more than {limit} bytes; the program was stopped]"


@dataclass(frozen=True)
class Execution:
    """What observers hear of every finished call (``add_observer``): a metrics exporter's view."""

    isolation: str
    stopped_by: str | None
    queued_s: float
    wall_s: float
    failed: bool


_observers: list[Callable[[Execution], None]] = []


def add_observer(callback: Callable[[Execution], None]) -> None:
    """Call ``callback`` after every execution of every sandbox of this process (the daemon's metrics)."""
    _observers.append(callback)


def _notify(execution: Execution) -> None:
    for callback in _observers:
        try:
            callback(execution)
        except Exception:  # an observer's bug must not cost an episode
            _log.exception("sandbox observer %r failed", callback)


class _UidPool:
    """Unprivileged uids for a root daemon's sandboxes, one per running sandbox.

    A uid is first reserved for this process with a lock file (``flock``, released when the process
    ends, however it ends), so two rollwise processes on one machine (a daemon and an env check) never
    share one: a sandbox's uid then names its processes alone, and its process limit counts them alone.
    A newly reserved uid is swept once, in case a process that held it died with code still running.
    """

    MAX_UIDS = 65_536

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reserved: dict[int, int] = {}  # uid -> the locked file descriptor
        self._free: dict[int, list[int]] = {}  # base -> reserved uids not in use

    def take(self, base: int) -> int:
        with self._lock:
            free = self._free.setdefault(base, [])
            if free:
                return free.pop()
            for uid in range(base, base + self.MAX_UIDS):
                if uid not in self._reserved and self._reserve(uid):
                    return uid
        raise SandboxError(f"sandbox: every uid from {base} to {base + self.MAX_UIDS - 1} is in use")

    def give(self, base: int, uid: int) -> None:
        with self._lock:
            self._free.setdefault(base, []).append(uid)

    def _reserve(self, uid: int) -> bool:
        locks = _rundir_parent() / "uids"
        locks.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(locks / str(uid), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._reserved[uid] = fd
        _kill_uid(uid)
        return True


_UIDS = _UidPool()


class Sandbox:
    """Runs Python under ``config``; safe to share between episodes and tasks of one process."""

    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config or SandboxConfig()
        self.as_root = os.geteuid() == 0
        probe_uid = self.config.root_uid_base if self.as_root else None
        self.isolation: Isolation = detect_isolation(
            self.config.bwrap, self.config.python, probe_uid, self.config.tmp_bytes
        )
        # A warning only when bubblewrap was wanted and does not work; "bwrap = ''" is a choice.
        fell_back = self.isolation.kind != "bwrap" and bool(self.config.bwrap)
        _log.log(logging.WARNING if fell_back else logging.INFO, "sandbox: %s", self.isolation.describe())
        if self.config.require == "bwrap" and self.isolation.kind != "bwrap":
            raise SandboxUnavailable(
                f'sandbox.require = "bwrap", but this machine gives {self.isolation.describe()}. '
                "Install bubblewrap and allow unprivileged user namespaces, or set "
                'sandbox.require = "rlimits" to accept resource limits without isolation'
            )
        self._gates: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary()
        )
        self.running = 0
        self.waiting = 0
        self.executions = 0

    async def run_python(
        self,
        code: str,
        *,
        files: Mapping[str, str | bytes] | None = None,
        stdin: str | bytes | None = None,
        limits: Limits | None = None,
        mounts: tuple[str, ...] = (),
    ) -> SandboxResult:
        """Run ``code`` as ``main.py`` in a fresh working directory that also holds ``files``.

        ``files`` maps relative paths to contents; ``stdin`` is the program's standard input
        (default: empty); ``mounts`` are absolute host paths the program may read, at the same paths
        (bind-mounted read-only under bubblewrap; with rlimits only, everything is visible anyway).
        Raises ``SandboxError`` when the sandbox itself fails.
        """
        if not isinstance(code, str):
            raise TypeError(f"code must be a str, got {type(code).__name__}")
        files = dict(files or {})
        for name in files:
            check_relative(name, "file name", "the working directory", reserved=MAIN_FILE)
        for path in mounts:
            if not os.path.isabs(path) or not os.path.exists(path):  # noqa: ASYNC240  (a stat)
                raise ValueError(f"sandbox mount {path!r} must be an absolute path that exists")
        limits = limits or self.config.limits
        run_limits = limits

        async def execute(uid: int | None) -> ProcessOutcome:
            return await self._execute(code, files, stdin, run_limits, uid, mounts)

        return await self._gated(execute, limits, uid=None)

    async def run_in(
        self,
        work: Path,
        tmp: Path,
        main: str,
        *,
        uid: int | None,
        stdin: str | bytes | None = None,
        limits: Limits | None = None,
        mounts: tuple[str, ...] = (),
        binds: tuple[tuple[str, str], ...] = (),
        chdir: str = SANDBOX_DIR,
    ) -> SandboxResult:
        """Run the Python file `main` (an absolute path the sandbox can read: under `mounts` with
        bubblewrap) with `work` as its working directory, kept as it is before and after: the door of a
        session that outlives one execution (envs.sandbox.sessions). `uid` is the session's own (a root
        daemon's sandbox uid, held by the session) or None; `tmp` is the working directory's temporary
        one when there is no bubblewrap (which gives every run its own /tmp). Under bubblewrap `binds`
        mount host directories writable at paths inside and the program starts in `chdir`; without it
        `binds` are refused (SandboxUnavailable) and the program starts in `work`."""
        if binds and self.isolation.kind != "bwrap":
            raise SandboxUnavailable(
                f"sandbox: paths inside the sandbox ({', '.join(inside for _, inside in binds)}) need "
                f"bubblewrap; this machine gives {self.isolation.describe()}"
            )
        limits = limits or self.config.limits
        run_limits = limits
        layout = (mounts, binds, chdir)

        async def execute(run_uid: int | None) -> ProcessOutcome:
            with _stdin_file(stdin) as stdin_file:
                return await self._spawn(work, tmp, stdin_file, run_limits, run_uid, *layout, main=main)

        return await self._gated(execute, limits, uid=uid)

    def take_uid(self) -> int | None:
        """A sandbox uid for a caller that keeps one across executions (a session); None unless root."""
        return _UIDS.take(self.config.root_uid_base) if self.as_root else None

    def give_uid(self, uid: int | None) -> None:
        """Return a uid from `take_uid`, once nothing of it runs any more."""
        if uid is not None:
            _kill_uid(uid)
            _UIDS.give(self.config.root_uid_base, uid)

    async def _gated(
        self, execute: Callable[[int | None], Awaitable[ProcessOutcome]], limits: Limits, *, uid: int | None
    ) -> SandboxResult:
        """One execution under this sandbox's concurrency bound, counted and heard by observers. With
        `uid` None a root daemon's execution gets a pool uid for its duration."""
        gate = self._gate()
        queued_at = time.monotonic()
        self.waiting += 1
        try:
            await gate.acquire()
        finally:
            self.waiting -= 1
        queued_s = time.monotonic() - queued_at
        self.running += 1
        pooled: int | None = None
        try:
            if uid is None:
                pooled = uid = self.take_uid()
            outcome = await execute(uid)
            result = self._result(outcome, limits, queued_s)
        except SandboxError:
            _notify(Execution(self.isolation.kind, None, queued_s, 0.0, failed=True))
            raise
        finally:
            if pooled is not None:
                _UIDS.give(self.config.root_uid_base, pooled)
            self.running -= 1
            gate.release()
        self.executions += 1
        _notify(Execution(result.isolation, result.stopped_by, queued_s, result.wall_s, failed=False))
        return result

    def _gate(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        gate = self._gates.get(loop)
        if gate is None:
            gate = self._gates[loop] = asyncio.Semaphore(self.config.max_concurrency)
        return gate

    async def _execute(
        self,
        code: str,
        files: dict[str, str | bytes],
        stdin: str | bytes | None,
        limits: Limits,
        uid: int | None,
        mounts: tuple[str, ...] = (),
    ) -> ProcessOutcome:
        # Directory work runs in a thread: on a slow or busy disk a mkdir or rmdir takes milliseconds,
        # and the event loop serves every other episode meanwhile.
        preparing = asyncio.ensure_future(asyncio.to_thread(_prepare_rundir, uid, {**files, MAIN_FILE: code}))
        try:
            rundir = await asyncio.shield(preparing)
        except asyncio.CancelledError:
            preparing.add_done_callback(_remove_prepared)
            raise
        try:
            with _stdin_file(stdin) as stdin_file:
                return await self._spawn(rundir / "work", rundir / "tmp", stdin_file, limits, uid, mounts)
        finally:
            await asyncio.shield(asyncio.to_thread(_remove_tree, rundir))

    async def _spawn(
        self,
        work: Path,
        tmp: Path,
        stdin: IO[bytes] | None,
        limits: Limits,
        uid: int | None,
        mounts: tuple[str, ...] = (),
        binds: tuple[tuple[str, str], ...] = (),
        chdir: str = SANDBOX_DIR,
        *,
        main: str = MAIN_FILE,
    ) -> ProcessOutcome:
        isolation = self.isolation
        python = isolation.interpreter.path
        bwrap = isolation.kind == "bwrap"

        def build_argv(status_fd: int) -> list[str]:
            launcher = encode_config(
                owner=os.getpid(),
                status_fd=status_fd,
                main=main,
                max_processes=limits.max_processes,
                # Under bubblewrap the user namespace counts the sandbox's tasks alone, and a root
                # daemon's sandbox has a uid of its own; otherwise all the user's tasks count.
                count_user_tasks=not bwrap and uid is None,
                supervise=not bwrap,
                drop_to=None if bwrap else uid,
                rlimits=limits.rlimits(),
            )
            args = [python, *PYTHON_FLAGS, "-c", _LAUNCHER_SOURCE, launcher]
            if not bwrap:
                return args
            assert isolation.bwrap_path is not None
            prefix = bwrap_argv(
                isolation.bwrap_path,
                isolation.bwrap_features,
                isolation.interpreter,
                str(work),
                self.config.tmp_bytes,
                mounts,
                binds,
                chdir,
            )
            return [*prefix, *args]

        if bwrap:
            # bubblewrap runs as the sandbox's uid; its PID namespace ends every process with it.
            run_as, cwd, env = uid, None, {"PATH": PATH_INSIDE}
            halt_signal, sweep = signal.SIGKILL, _NOTHING
        else:
            # The supervising launcher starts as this process's user (root: it drops the code to uid)
            # and, on SIGTERM, kills and reaps the code's processes itself.
            run_as, cwd = None, str(work)
            env = {"PATH": PATH_INSIDE, "HOME": str(work), "TMPDIR": str(tmp), "LANG": "C.UTF-8"}
            halt_signal, sweep = signal.SIGTERM, _unless_finished(uid)
        return await run_process(
            build_argv,
            cwd=cwd,
            env=env,
            uid=run_as,
            new_session=True,
            stdin=stdin,
            max_output_bytes=limits.max_output_bytes,
            wall_time_s=limits.wall_time_s,
            halt_signal=halt_signal,
            sweep=sweep,
        )

    def _result(self, outcome: ProcessOutcome, limits: Limits, queued_s: float) -> SandboxResult:
        errors = [line[len("error ") :] for line in outcome.status if line.startswith("error ")]
        if errors:
            raise SandboxError(f"sandbox ({self.isolation.kind}): the launcher failed: {errors[0]}")
        if not any(line.startswith("started ") for line in outcome.status):
            tail = outcome.stderr.decode(errors="replace").strip()[-500:]
            raise SandboxError(
                f"sandbox ({self.isolation.kind}) did not start the program (exit {outcome.exit_code}, "
                f"stopped by {outcome.stopped_by}): {tail or 'no error output'}"
            )
        stopped_by = outcome.stopped_by
        if stopped_by is None and outcome.exit_code == SIGXCPU_EXIT:
            stopped_by = "cpu_time"
        stdout = outcome.stdout.decode(errors="replace")
        stderr = outcome.stderr.decode(errors="replace")
        if outcome.stdout_truncated:
            stdout += truncation_marker("stdout", limits.max_output_bytes)
        if outcome.stderr_truncated:
            stderr += truncation_marker("stderr", limits.max_output_bytes)
        return SandboxResult(
            stdout=stdout,
            stderr=stderr,
            exit_code=outcome.exit_code,
            stdout_truncated=outcome.stdout_truncated,
            stderr_truncated=outcome.stderr_truncated,
            stopped_by=stopped_by,
            isolation=self.isolation.kind,
            wall_s=outcome.wall_s,
            queued_s=queued_s,
        )


_shared: dict[SandboxConfig, Sandbox] = {}
_shared_lock = threading.Lock()


def shared_sandbox(config: SandboxConfig | None = None) -> Sandbox:
    """The process's one ``Sandbox`` for ``config`` (made, and its isolation checked, on first use)."""
    config = config or SandboxConfig()
    with _shared_lock:
        sandbox = _shared.get(config)
        if sandbox is None:
            sandbox = _shared[config] = Sandbox(config)
        return sandbox


def running_total() -> int:
    """Interpreters running now in every shared sandbox of this process."""
    with _shared_lock:
        return sum(sandbox.running for sandbox in _shared.values())


def waiting_total() -> int:
    """Calls waiting for a slot now in every shared sandbox of this process."""
    with _shared_lock:
        return sum(sandbox.waiting for sandbox in _shared.values())


# --- working directories ------------------------------------------------------------------------


def _rundir_parent() -> Path:
    """A directory only this user can write; a root daemon's sandbox uids may only traverse it."""
    parent = Path(tempfile.gettempdir()) / f"rollwise-sandbox-{os.geteuid()}"
    with contextlib.suppress(FileExistsError):
        parent.mkdir(mode=0o700)
    info = parent.lstat()
    if not parent.is_dir() or parent.is_symlink() or info.st_uid != os.geteuid():
        raise SandboxError(f"sandbox: {parent} exists but is not a directory owned by uid {os.geteuid()}")
    parent.chmod(0o711 if os.geteuid() == 0 else 0o700)
    return parent


def _prepare_rundir(uid: int | None, files: dict[str, str | bytes]) -> Path:
    """A fresh run directory: ``work/`` (the working directory, holding ``files``) and ``tmp/``."""
    rundir = _make_rundir(uid)
    try:
        for name, content in files.items():
            write_file(rundir / "work", name, content, uid)
    except BaseException:
        _remove_tree(rundir)
        raise
    return rundir


def _remove_prepared(preparing: asyncio.Future[Path]) -> None:
    """Remove a directory whose preparation finished after the call was cancelled."""
    if not preparing.cancelled() and preparing.exception() is None:
        _remove_tree(preparing.result())


def _make_rundir(uid: int | None, prefix: str = "run-") -> Path:
    """A directory of ``work/`` and ``tmp/`` under the sandboxes' parent: "run-" for one execution's, other
    prefixes for what outlives one (a session's), then the pid of the process that made it (every
    process shares the parent: a leftover names its owner)."""
    rundir = Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=_rundir_parent()))
    for sub in ("work", "tmp"):
        (rundir / sub).mkdir(mode=0o700)
        if uid is not None:
            os.chown(rundir / sub, uid, uid)
    if uid is not None:
        rundir.chmod(0o711)
    return rundir


@contextlib.contextmanager
def _stdin_file(stdin: str | bytes | None) -> Iterator[IO[bytes] | None]:
    if stdin is None:
        yield None
        return
    with tempfile.TemporaryFile() as handle:  # unlinked at once: nothing to clean up
        handle.write(stdin.encode() if isinstance(stdin, str) else stdin)
        handle.seek(0)
        yield handle


def _remove_tree(path: Path) -> None:
    def make_writable(_function: Callable[..., Any], failed: str, _exc: Any) -> None:
        # A program may have taken the write bit off its own directories.
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(failed), 0o700)
            if os.path.isdir(failed) and not os.path.islink(failed):
                os.chmod(failed, 0o700)
                shutil.rmtree(failed, ignore_errors=True)
            else:
                os.unlink(failed)

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=make_writable)
    else:
        shutil.rmtree(path, onerror=make_writable)


# --- killing what a run left behind -------------------------------------------------------------


def _nothing(_status: list[str]) -> None:
    return None


_NOTHING: Sweep = _nothing


def _unless_finished(uid: int | None) -> Sweep:
    """After a supervised run: nothing when the launcher reported its exit (it killed and reaped
    everything itself); otherwise (it was killed) every process of the sandbox's uid, when it has one.
    A user's own processes cannot be told apart from what the code left: those are the documented
    weakness of rlimits without root."""

    def sweep(status: list[str]) -> None:
        if not any(line.startswith("exit ") for line in status):
            _kill_uid(uid)

    return sweep


def _kill_uid(uid: int | None) -> None:
    """SIGKILL every process of ``uid`` (a root daemon's sandbox uid: nothing else runs as it)."""
    if uid is None:
        return
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            pidfd = os.pidfd_open(int(name))
            try:
                # Read after opening the pidfd, so the pid cannot have been reused; from status, not
                # the owner of /proc/<pid>, which a process that made itself non-dumpable hides.
                if _real_uid(name) == uid:
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            finally:
                os.close(pidfd)


def _real_uid(pid: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("Uid:"):
                return int(line.split()[1])
    raise ValueError(f"no Uid line for process {pid}")
