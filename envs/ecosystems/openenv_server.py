"""The OpenEnv servers the adapter talks to: local ones this process starts, or one the user runs.

A local server is envs/ecosystems/openenv_serve.py run by the OpenEnv venv's interpreter (never Docker),
serving one environment app on 127.0.0.1 at a port it picks itself. Rules:

- One server per ServerSpec per process, shared by every episode of the process, started on first use
  (``ensure_running``) and by the next episode after it dies. A failed start (the process exits, or is not
  serving within ``start_timeout_s``) is retried no sooner than a backoff (1 s, doubling, at most 60 s);
  asking in between raises ServerFailed with the last failure.
- The process runs in its own session (process group), working directory = the environment's ``path``
  (first on its ``sys.path``) or a private directory, stdout and stderr appended to a log file in this
  process's temporary directory; every failure message names the app, the PID, the exit code and the
  log's last lines.
- Ready = the launcher's ready file, then ``GET /health`` answering 200.
- Stopped with SIGTERM to its process group, SIGKILL after 5 s: at ``stop()`` and, for every local server,
  at this process's exit (atexit), which also removes the logs unless a server failed. The launcher
  also stops by itself when this process is gone, so a crash or kill -9 leaves no server behind.
- ``describe`` reads a server once (``/schema``, ``/metadata``, and an MCP environment's tool list from a
  session of its own) and keeps it: the adapter's EnvSpec needs the tools before any episode resets.

The supervisor does not own these processes (docs/design/env_ecosystems.md wants env servers as fleet
children): the process that plays the episodes does. Moving them into the fleet means the supervisor
starts them and hands each URL to the environment as ``base_url``, which the adapter already takes.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from envs.ecosystems.openenv_wire import ServerRefused, SessionLost, WsSession, get_json

SERVE_SCRIPT = Path(__file__).with_name("openenv_serve.py")
POLL_S = 0.05
STOP_GRACE_S = 5.0
HEALTH_TIMEOUT_S = 5.0
BACKOFF_FIRST_S, BACKOFF_MAX_S = 1.0, 60.0
LOG_TAIL_LINES = 12
T = TypeVar("T")
_launch_numbers = itertools.count(1)


class ServerFailed(Exception):
    """The server cannot serve (it did not start, or it exited); the message says which and why."""


@dataclass(frozen=True)
class ServerSpec:
    """What makes one local server: interpreter, app (``module:attr``), directory, session cap, env vars."""

    python: str
    app: str
    path: str | None
    sessions: int
    start_timeout_s: float
    env: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class ServerInfo:
    """A server as read once: its action schema, metadata, and (MCP environments) its tools as listed."""

    action_schema: dict[str, Any]
    observation_schema: dict[str, Any]
    name: str
    version: str
    mcp: bool
    tools: tuple[dict[str, Any], ...]


def is_mcp_action(schema: Mapping[str, Any]) -> bool:
    """Whether an action schema is OpenEnv's CallToolAction (an MCP environment, RFC 003)."""
    properties = schema.get("properties")
    return isinstance(properties, Mapping) and "tool_name" in properties and "arguments" in properties


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    tail = [line for line in text.splitlines() if line.strip()][-lines:]
    return "\n  ".join(tail) if tail else "(empty log)"


class Launch:
    """One process of a local server (a restart is a new launch)."""

    def __init__(self, spec: ServerSpec, directory: Path) -> None:
        stem = f"{spec.app.replace(':', '.')}-{next(_launch_numbers)}"  # unique in this process
        self.log_path = directory / f"{stem}.log"
        self.ready_file = directory / f"{stem}.ready"
        cwd = spec.path or str(directory)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **dict(spec.env)}
        argv = [spec.python, str(SERVE_SCRIPT), spec.app, "--ready-file", str(self.ready_file)]
        argv += ["--sessions", str(spec.sessions), "--parent-pid", str(os.getpid())]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                argv,
                cwd=cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.app = spec.app
        self.deadline = time.monotonic() + spec.start_timeout_s
        self.state = "starting"  # -> "checking" (ready file read) -> "ready" (/health answered)
        self.port = 0
        self.sessions: int | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def label(self) -> str:
        where = f", {self.base_url}" if self.port else ""
        return f"OpenEnv server {self.app} (pid {self.proc.pid}{where})"

    def read_ready(self) -> bool:
        try:
            info = json.loads(self.ready_file.read_text())
        except (OSError, ValueError):
            return False
        self.port, self.sessions = int(info["port"]), info.get("sessions")
        return True

    def exit_reason(self) -> str | None:
        """Why this process is gone (its exit code and last log lines), None while it runs."""
        code = self.proc.poll()
        if code is None:
            return None
        how = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
        when = "while serving" if self.state == "ready" else "before serving"
        return f"{self.label()} {how} {when}; its log {self.log_path} ends:\n  {log_tail(self.log_path)}"

    def kill(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM to its process group, SIGKILL after `grace_s` (at once when 0); reaps it."""
        if self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM if grace_s > 0 else signal.SIGKILL)
        try:
            self.proc.wait(grace_s if grace_s > 0 else None)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


class LocalServer:
    """A server this process starts and stops (module docstring)."""

    def __init__(self, spec: ServerSpec, directory: Path) -> None:
        self.spec = spec
        self.directory = directory
        self.info: ServerInfo | None = None
        self.launch: Launch | None = None
        self._lock = threading.Lock()
        self._retry_at = 0.0
        self._backoff_s = BACKOFF_FIRST_S
        self._last_failure = ""

    @property
    def label(self) -> str:
        return (
            self.launch.label()
            if self.launch is not None
            else f"OpenEnv server {self.spec.app} (not started)"
        )

    def _fail(self, launch: Launch, reason: str, backoff: bool) -> str:
        global _failures_logged
        _failures_logged = True
        launch.kill(grace_s=0)  # a failed launch: no graceful stop, and the event loop must not wait
        self.launch = None
        self._last_failure = reason
        if backoff:
            self._retry_at = time.monotonic() + self._backoff_s
            self._backoff_s = min(2 * self._backoff_s, BACKOFF_MAX_S)
        return reason

    def _advance(self) -> tuple[str, str, Launch | None]:
        """One look at the process: ("ready" | "fresh" | "wait" | "failed", url or reason, launch)."""
        with self._lock:
            now = time.monotonic()
            launch = self.launch
            if launch is not None and (reason := launch.exit_reason()) is not None:
                serving = launch.state == "ready"
                self._fail(launch, reason, backoff=not serving)
                if not serving:
                    return "failed", reason, None
                launch = None  # it died while serving: start it again at once
            if launch is None:
                if now < self._retry_at:
                    wait = self._retry_at - now
                    return "failed", f"{self._last_failure}\n(next start in {wait:.1f} s)", None
                self.launch = launch = Launch(self.spec, self.directory)
                return "wait", "", launch
            if launch.state == "starting":
                if launch.read_ready():
                    launch.state = "checking"
                    return "fresh", launch.base_url, launch
                if now > launch.deadline:
                    reason = (
                        f"{launch.label()} was not serving after {self.spec.start_timeout_s} s "
                        f"(start_timeout_s); its log {launch.log_path} ends:\n  {log_tail(launch.log_path)}"
                    )
                    return "failed", self._fail(launch, reason, backoff=True), None
                return "wait", "", launch
            if launch.state == "checking":
                return "wait", "", launch
            return "ready", launch.base_url, launch

    async def ensure_running(self) -> tuple[str, Launch]:
        """The base URL of a serving process (starting one if none is), and that launch."""
        while True:
            state, value, launch = self._advance()
            if state == "failed":
                raise ServerFailed(value)
            assert launch is not None
            if state == "ready":
                return value, launch
            if state == "fresh":
                try:
                    await get_json(value, "/health", HEALTH_TIMEOUT_S)
                except SessionLost as exc:
                    with self._lock:
                        raise ServerFailed(
                            self._fail(launch, f"{launch.label()}: {exc}", backoff=True)
                        ) from exc
                with self._lock:
                    launch.state = "ready"
                    self._backoff_s = BACKOFF_FIRST_S
                return value, launch
            await asyncio.sleep(POLL_S)

    async def lost_reason(self, launch: Launch | None, grace_s: float = 1.0) -> str | None:
        """Why `launch` stopped serving, waiting up to `grace_s` for its exit to show; None if it runs."""
        if launch is None:
            return None
        deadline = time.monotonic() + grace_s
        # A dropped connection is seen before the process is reaped; there is no event to wait on.
        while (reason := launch.exit_reason()) is None and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(POLL_S)
        return reason

    def stop(self) -> None:
        with self._lock:
            launch, self.launch = self.launch, None
        if launch is not None:
            launch.kill()


class RemoteServer:
    """A server the user runs (``base_url``): never started or stopped here."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url.rstrip("/")
        self.label = f"OpenEnv server at {self.base_url}"
        self.info: ServerInfo | None = None

    async def ensure_running(self) -> tuple[str, None]:
        return self.base_url, None

    async def lost_reason(self, launch: Launch | None, grace_s: float = 1.0) -> str | None:
        return None

    def stop(self) -> None:
        pass


Server = LocalServer | RemoteServer

_registry: dict[ServerSpec | str, Server] = {}
_registry_lock = threading.Lock()
_registry_pid = os.getpid()
_directory: Path | None = None
_failures_logged = False


def _process_directory() -> Path:
    global _directory
    if _directory is None:
        _directory = Path(tempfile.mkdtemp(prefix=f"rollwise-openenv-{os.getpid()}-"))
        atexit.register(stop_all)
    return _directory


def server_for(target: ServerSpec | str) -> Server:
    """This process's server for a spec (local) or a base URL (remote), made on first use."""
    global _registry_pid
    with _registry_lock:
        if os.getpid() != _registry_pid:  # a forked child owns none of its parent's servers
            _registry.clear()
            _registry_pid = os.getpid()
        server = _registry.get(target)
        if server is None:
            if isinstance(target, ServerSpec):
                server = LocalServer(target, _process_directory())
            else:
                server = RemoteServer(target)
            _registry[target] = server
        return server


def stop_all(keep_failure_logs: bool = True) -> None:
    """Stop every local server of this process (atexit does it too); they start again on next use. The
    logs go too, unless a server failed and `keep_failure_logs` (failure messages name the log)."""
    global _directory, _failures_logged
    with _registry_lock:
        servers = list(_registry.values()) if os.getpid() == _registry_pid else []
    for server in servers:
        server.stop()
    if _directory is not None:
        if not (_failures_logged and keep_failure_logs):
            shutil.rmtree(_directory, ignore_errors=True)
        _directory, _failures_logged = None, False
        atexit.unregister(stop_all)


def run_blocking(make: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run a coroutine to completion from synchronous code, even inside a running event loop (in a
    thread of its own, joined before returning)."""
    with ThreadPoolExecutor(1, thread_name_prefix="openenv-probe") as pool:
        return pool.submit(lambda: asyncio.run(make())).result()


async def describe(server: Server, timeout_s: float) -> ServerInfo:
    """The server's ServerInfo, read once (starting it if it is local); ServerFailed if it cannot be."""
    if server.info is not None:
        return server.info
    try:
        base_url, _ = await server.ensure_running()
        schema = await get_json(base_url, "/schema", timeout_s)
        metadata = await get_json(base_url, "/metadata", timeout_s)
        action = schema.get("action") if isinstance(schema, dict) else None
        if not isinstance(action, dict):
            raise ServerFailed(f"{server.label}: /schema has no action schema: {str(schema)[:200]}")
        mcp = is_mcp_action(action)
        tools: list[dict[str, Any]] = []
        if mcp:
            session = WsSession(base_url, timeout_s)
            try:
                await session.connect()
                await session.send({"type": "reset", "data": {}})
                listed = await session.send({"type": "step", "data": {"type": "list_tools"}})
            finally:
                await session.close()
            tools = list(listed.get("observation", {}).get("tools", []))
            if not tools:
                problem = listed.get("observation", {}).get("metadata", {}).get("error", "no tools")
                raise ServerFailed(f"{server.label}: an MCP environment whose tool list is empty ({problem})")
    except (SessionLost, ServerRefused) as exc:
        raise ServerFailed(f"{server.label}: {exc}") from exc
    meta = metadata if isinstance(metadata, dict) else {}
    server.info = ServerInfo(
        action_schema=action,
        observation_schema=schema.get("observation") or {},
        name=str(meta.get("name") or ""),
        version=str(meta.get("version") or "unknown"),
        mcp=mcp,
        tools=tuple(tools),
    )
    return server.info
