"""Sandbox sessions: a working directory that outlives one command, behind a backend interface.

A terminal task (a Harbor task, a repository to fix) is played over many turns in one working
directory: the files a command writes are there for the next one. ``SandboxBackend.start`` gives a
``SandboxSession`` with

    exec(command)        bash -c command in the session's directory -> SandboxResult
    upload(files)        {relative path: content} written into it
    download(path)       one file's bytes
    snapshot()           the directory as it is now (backends with ``can_snapshot``)
    stop()               everything removed; safe to call twice

and ``backend.fork(snapshot)`` starts a new session from a snapshot: an episode branches at a turn
into children that share what came before (a tree rollout), each in a directory of its own.

The local backend (``LocalBackend``) runs each command as one execution of a ``Sandbox``
(envs.sandbox.runner): bubblewrap namespaces where they work, resource limits always, and a root
daemon's session holds one sandbox uid for its whole life so its files stay its own. What persists
between commands is the directory; a command's shell variables, working directory and background
processes end with it. A snapshot is a copy of the directory; a fork copies it into a new session.

Remote sandboxes (E2B, Daytona, Modal) are further backends: an environment written against
``SandboxBackend`` runs on any of them. ``exec`` takes the command as bash source; paths are relative
to the session's directory and may not leave it.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from envs.sandbox.isolation import SANDBOX_DIR, SandboxUnavailable
from envs.sandbox.limits import Limits
from envs.sandbox.process import SandboxError
from envs.sandbox.runner import (
    Sandbox,
    SandboxResult,
    _make_rundir,
    _remove_tree,
    _rundir_parent,
)
from envs.sandbox.sandbox_paths import check_relative, make_dirs, write_file

COMMAND_FILE = "command.py"
BASH = shutil.which("bash") or "/bin/bash"  # the host's, which the sandbox mounts at the same path
MAX_DOWNLOAD_BYTES = 16 * 1024 * 1024


class SnapshotUnsupported(SandboxError):
    """The backend cannot snapshot or fork a session."""


@dataclass(frozen=True)
class SessionSnapshot:
    """A session's directory at one moment, for ``SandboxBackend.fork``; ``discard`` frees it."""

    backend: str
    location: str


class SandboxSession(ABC):
    """One working directory and the commands run in it (module docstring)."""

    @abstractmethod
    async def exec(
        self, command: str, *, stdin: str | bytes | None = None, limits: Limits | None = None
    ) -> SandboxResult:
        """Run `command` with bash in the session's directory; what it does wrong is a result."""

    @abstractmethod
    async def upload(self, files: Mapping[str, str | bytes]) -> None:
        """Write each relative path's content into the directory (parents made)."""

    @abstractmethod
    async def download(self, path: str) -> bytes:
        """The bytes of the file at relative `path` (FileNotFoundError when there is none)."""

    async def snapshot(self) -> SessionSnapshot:
        """The directory as it is now; SnapshotUnsupported where the backend cannot."""
        raise SnapshotUnsupported(f"{type(self).__name__} cannot snapshot a session")

    @abstractmethod
    async def stop(self) -> None:
        """Remove the session; later calls to `exec` raise SandboxError. Safe to call twice."""

    async def __aenter__(self) -> SandboxSession:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()


class SandboxBackend(ABC):
    """Where sessions run; chosen once per environment (module docstring)."""

    name: str
    can_snapshot: bool = False

    @abstractmethod
    async def start(self, files: Mapping[str, str | bytes] | None = None) -> SandboxSession:
        """A new session whose directory holds `files`."""

    async def fork(self, snapshot: SessionSnapshot) -> SandboxSession:
        """A new session whose directory is a copy of `snapshot`'s."""
        raise SnapshotUnsupported(f"backend {self.name!r} cannot fork a session")

    async def discard(self, snapshot: SessionSnapshot) -> None:  # noqa: B027 - nothing kept by default
        """Free what `snapshot` holds; safe to call twice."""


def _inside(work: Path, path: str) -> Path:
    """`path` under `work`, refusing names that leave it (also through a symlink the session made)."""
    check_relative(path, "path", "the session's directory")
    target = (work / path).resolve()
    if not target.is_relative_to(work.resolve()):
        raise ValueError(f"sandbox path {path!r} leads outside the session's directory")
    return target


def _discard_dir(location: Path) -> None:
    if location.is_dir():
        _remove_tree(location)


def _copy_tree(source: Path, target: Path, uid: int | None) -> None:
    """Copy a session directory (symlinks as links, modes kept), owned by `uid` when one is given."""
    shutil.copytree(source, target, symlinks=True, dirs_exist_ok=True)
    if uid is None:
        return
    for root, dirs, files in os.walk(target):
        for name in [*dirs, *files]:
            os.lchown(os.path.join(root, name), uid, uid)
    os.chown(target, uid, uid)


class LocalSession(SandboxSession):
    """A session of the local backend: `rundir/work` is its directory, `rundir/bin` holds the command
    being run (read-only inside the sandbox), `rundir/tmp` its temporary directory without bubblewrap."""

    def __init__(self, backend: LocalBackend, rundir: Path, uid: int | None) -> None:
        self.sandbox = backend.sandbox
        self.rundir = rundir
        self.uid = uid
        self.work = rundir / "work"
        self.bin = rundir / "bin"
        self.bin.mkdir(mode=0o755)
        self.chdir = backend.chdir
        self.binds = tuple((str(self.work / sub), inside) for sub, inside in backend.binds.items())
        for sub, _ in backend.binds.items():
            make_dirs(self.work, sub, uid)
        self.stopped = False
        self._turn = asyncio.Lock()  # one command at a time: each rewrites bin/command.py

    async def exec(
        self, command: str, *, stdin: str | bytes | None = None, limits: Limits | None = None
    ) -> SandboxResult:
        if not isinstance(command, str):
            raise TypeError(f"command must be a str, got {type(command).__name__}")
        async with self._turn:
            if self.stopped:
                raise SandboxError("sandbox session: exec after stop")
            main = self.bin / COMMAND_FILE
            main.write_text(f"import os\nos.execv({BASH!r}, ['bash', '-c', {command!r}])\n")
            main.chmod(0o644)
            return await self.sandbox.run_in(
                self.work,
                self.rundir / "tmp",
                str(main),
                uid=self.uid,
                stdin=stdin,
                limits=limits,
                mounts=(str(self.bin),),
                binds=self.binds,
                chdir=self.chdir,
            )

    async def upload(self, files: Mapping[str, str | bytes]) -> None:
        async with self._turn:
            for name in files:
                _inside(self.work, name)
            await asyncio.to_thread(self._write, dict(files))

    def _write(self, files: dict[str, str | bytes]) -> None:
        for name, content in files.items():
            write_file(self.work, name, content, self.uid)

    async def download(self, path: str) -> bytes:
        target = _inside(self.work, path)
        if not target.is_file():
            raise FileNotFoundError(f"sandbox session: no file {path!r}")
        size = target.stat().st_size
        if size > MAX_DOWNLOAD_BYTES:
            raise ValueError(f"sandbox file {path!r} has {size} bytes, more than {MAX_DOWNLOAD_BYTES}")
        return await asyncio.to_thread(target.read_bytes)

    async def snapshot(self) -> SessionSnapshot:
        async with self._turn:
            if self.stopped:
                raise SandboxError("sandbox session: snapshot after stop")
            target = Path(tempfile.mkdtemp(prefix="snap-", dir=_rundir_parent()))
            await asyncio.to_thread(_copy_tree, self.work, target / "work", None)
        return SessionSnapshot(LocalBackend.name, str(target))

    async def stop(self) -> None:
        async with self._turn:
            if self.stopped:
                return
            self.stopped = True
            await asyncio.to_thread(_remove_tree, self.rundir)
            self.sandbox.give_uid(self.uid)


class LocalBackend(SandboxBackend):
    """Sessions in local working directories under a `Sandbox`'s isolation and limits.

    `binds` maps subdirectories of a session's directory to absolute paths inside the sandbox (a task
    that expects /app and /tests: {"app": "/app", "tests": "/tests"}), and commands start in `chdir`;
    both need bubblewrap (SandboxUnavailable otherwise, at construction). Without them the session's
    directory is the working directory (SANDBOX_DIR under bubblewrap)."""

    name = "local"
    can_snapshot = True

    def __init__(
        self, sandbox: Sandbox, binds: Mapping[str, str] | None = None, chdir: str = SANDBOX_DIR
    ) -> None:
        self.sandbox = sandbox
        self.binds = dict(binds or {})
        self.chdir = chdir
        if (self.binds or chdir != SANDBOX_DIR) and sandbox.isolation.kind != "bwrap":
            raise SandboxUnavailable(
                f"a sandbox session with paths of its own ({', '.join(self.binds.values()) or chdir}) needs "
                f"bubblewrap; this machine gives {sandbox.isolation.describe()}"
            )
        for sub, inside in self.binds.items():
            check_relative(sub, "path", "the session's directory")
            if not inside.startswith("/") or inside.rstrip("/") in ("", "/proc", "/dev", "/tmp", SANDBOX_DIR):
                raise ValueError(
                    f"sandbox bind {sub!r} -> {inside!r}: the inside path must be absolute and free"
                )

    async def start(self, files: Mapping[str, str | bytes] | None = None) -> SandboxSession:
        session = await asyncio.to_thread(self._new_session)
        if files:
            try:
                await session.upload(files)
            except BaseException:
                await session.stop()
                raise
        return session

    def _new_session(self) -> LocalSession:
        uid = self.sandbox.take_uid()
        try:
            return LocalSession(self, _make_rundir(uid, prefix="session-"), uid)
        except BaseException:
            self.sandbox.give_uid(uid)
            raise

    async def fork(self, snapshot: SessionSnapshot) -> SandboxSession:
        if snapshot.backend != self.name:
            raise SnapshotUnsupported(f"a {snapshot.backend!r} snapshot cannot start a {self.name!r} session")
        source = Path(snapshot.location) / "work"
        if not source.is_dir():
            raise SandboxError(f"sandbox snapshot {snapshot.location} is gone (discarded?)")
        session = await asyncio.to_thread(self._new_session)
        try:
            await asyncio.to_thread(_copy_tree, source, session.work, session.uid)
        except BaseException:
            await session.stop()
            raise
        return session

    async def discard(self, snapshot: SessionSnapshot) -> None:
        await asyncio.to_thread(_discard_dir, Path(snapshot.location))
