"""Child processes of the daemon (engines, learner): start, watch, stop by PID, restart with backoff.

Every child runs in its own session (process group), so a Ctrl-C on the terminal reaches only the
supervisor, which then stops the children in order; and `stop` can signal a child's whole group (SGLang
forks helpers). Children get PR_SET_PDEATHSIG = SIGKILL on Linux: when the supervisor dies, even by
kill -9, no orphan keeps a port or keeps training on the run directory. Their stderr (and stdout unless
it is read as events) is appended to `logs/<name>.log`. Nothing is ever killed by name.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from pipeline.supervisor.observability import metrics

log = logging.getLogger("rollwise.children")

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """preexec_fn: ask the kernel to SIGKILL this child when the supervisor's thread dies."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


def redact_argv(argv: list[str]) -> list[str]:
    """The command line as it may be logged: the value after any --*key* / --*token* flag is masked."""
    out: list[str] = []
    for i, arg in enumerate(argv):
        previous = argv[i - 1] if i else ""
        secret = previous.startswith("--") and ("key" in previous or "token" in previous)
        if (
            arg.startswith("--")
            and "=" in arg
            and ("key" in arg.split("=")[0] or "token" in arg.split("=")[0])
        ):
            arg = arg.split("=")[0] + "=***"
        out.append("***" if secret else arg)
    return out


@dataclass(frozen=True)
class ChildSpec:
    """How to run one child. `events` = read stdout as JSON lines (the learner); `stdin` = keep a pipe
    open to send commands (closing it tells the child its parent is gone)."""

    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict, repr=False)  # may hold an API key
    events: bool = False
    stdin: bool = False


@dataclass
class Backoff:
    """Exponential restart delay: base * 2**n, capped; n resets once a child stayed up `stable_s`."""

    base_s: float = 0.5
    cap_s: float = 30.0
    stable_s: float = 60.0
    failures: int = 0

    def next_delay(self, uptime_s: float) -> float:
        if uptime_s >= self.stable_s:
            self.failures = 0
        delay = min(self.cap_s, self.base_s * (2**self.failures))
        self.failures += 1
        return delay


class Child:
    """One running (or finished) child process. Not restartable: make a new Child per start."""

    def __init__(self, spec: ChildSpec) -> None:
        self.spec = spec
        self.proc: asyncio.subprocess.Process | None = None
        self.started_at = 0.0
        self._log_file: TextIO | None = None

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.returncode

    @property
    def uptime_s(self) -> float:
        return time.monotonic() - self.started_at

    async def start(self) -> None:
        self.spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        # Appending to a local log file is not worth a thread hop.
        self._log_file = open(self.spec.log_path, "a", buffering=1)  # noqa: SIM115, ASYNC230
        argv = " ".join(redact_argv(self.spec.argv))
        self._log_file.write(f"--- {time.strftime('%Y-%m-%dT%H:%M:%S')} start: {argv}\n")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.spec.env}
        self.proc = await asyncio.create_subprocess_exec(
            *self.spec.argv,
            stdin=asyncio.subprocess.PIPE if self.spec.stdin else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE if self.spec.events else self._log_file,
            stderr=self._log_file,
            env=env,
            start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
            limit=1 << 24,  # one event line may carry a long list of group ids
        )
        self.started_at = time.monotonic()
        log.info("started %s pid=%d", self.spec.name, self.proc.pid)

    async def read_event(self) -> dict[str, Any] | None:
        """Next JSON object from stdout; None at EOF. Lines that are not JSON objects go to the log."""
        assert self.proc is not None and self.proc.stdout is not None
        while True:
            raw = await self.proc.stdout.readline()
            if not raw:
                return None
            line = raw.decode("utf-8", errors="replace").strip()
            try:
                event = json.loads(line)
            except ValueError:
                event = None
            if isinstance(event, dict):
                return event
            if line and self._log_file is not None:
                self._log_file.write(f"[stdout] {line}\n")

    async def send(self, command: dict[str, Any]) -> bool:
        """Write one JSON line to stdin; False if the child is gone."""
        if self.proc is None or self.proc.stdin is None or self.proc.stdin.is_closing():
            return False
        try:
            self.proc.stdin.write((json.dumps(command) + "\n").encode())
            await self.proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            return False
        return True

    async def wait(self) -> int:
        assert self.proc is not None
        code = await self.proc.wait()
        self._close_log(code)
        return code

    async def stop(self, grace_s: float) -> int | None:
        """SIGTERM the child's group, SIGKILL it after `grace_s`. Returns the exit code. Processes the
        child forked (SGLang's scheduler and detokenizer) that outlive it still hold its group id and
        are killed with it."""
        if self.proc is None:
            return None
        if self.proc.returncode is None:
            self._signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), grace_s)
            except TimeoutError:
                log.warning(
                    "%s pid=%d ignored SIGTERM for %.1f s: SIGKILL", self.spec.name, self.pid, grace_s
                )
                self._signal(signal.SIGKILL)
        code = await self.wait()
        self._signal(signal.SIGKILL)
        return code

    def kill(self) -> None:
        """SIGKILL at once (synchronous: usable from a signal handler before os._exit)."""
        if self.proc is not None and self.proc.returncode is None:
            self._signal(signal.SIGKILL)

    def _signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, sig)  # the child leads its own session: pgid == pid
        except ProcessLookupError:
            pass
        except PermissionError:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, sig)

    def _close_log(self, code: int) -> None:
        if self._log_file is not None:
            self._log_file.write(f"--- {time.strftime('%Y-%m-%dT%H:%M:%S')} exit code {code}\n")
            self._log_file.close()
            self._log_file = None


async def keep_running(
    make_spec: Callable[[], ChildSpec],
    serve: Callable[[Child], Awaitable[None]],
    stopping: asyncio.Event,
    *,
    component: str,
    backoff: Backoff | None = None,
    on_start: Callable[[Child], None] | None = None,
) -> None:
    """Run a child until `stopping` is set: start `make_spec()` (asked anew on every start, so a
    restarted engine loads the latest weights), `await serve(child)` (it returns when the child's
    work ends, e.g. stdout EOF or process exit), and restart it after a backoff delay if it exited
    while we were not stopping. Each restart counts in PROCESS_RESTARTS{component}. Cancelling this
    coroutine kills the current child."""
    backoff = backoff or Backoff()
    while not stopping.is_set():
        spec = make_spec()
        child = Child(spec)
        await child.start()
        if on_start is not None:
            on_start(child)
        try:
            await serve(child)
            code = await child.wait()
        except asyncio.CancelledError:
            child.kill()
            with contextlib.suppress(Exception):
                await asyncio.shield(child.wait())
            raise
        except Exception:
            log.exception("%s: serving the child failed; killing pid=%s", spec.name, child.pid)
            child.kill()
            code = await child.wait()
        if stopping.is_set():
            return
        delay = backoff.next_delay(child.uptime_s)
        log.warning(
            "%s exited with code %s after %.1f s; restarting in %.1f s (see %s)",
            spec.name,
            code,
            child.uptime_s,
            delay,
            spec.log_path,
        )
        metrics.PROCESS_RESTARTS.labels(component=component).inc()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stopping.wait(), delay)
