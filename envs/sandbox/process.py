"""One sandboxed process, driven from the event loop without threads.

The process is started with ``subprocess.Popen``; its stdout, stderr and the launcher's status pipe
are read by event-loop readers into bounded buffers, and its exit is seen through a pidfd, so a
thousand runs in flight cost no thread each and a blocked child never blocks the loop. A stream that
passes its byte limit is cut there and the run is stopped (it would otherwise cost the daemon the
reading of everything the program writes). The wall-clock limit, cancellation and the output limit
all end in ``stop``: SIGKILL through the pidfd (never a pid that may have been reused), then the
caller's ``sweep`` for whatever the process left behind. A supervising launcher (rlimits) is not
killed first but sent ``halt_signal`` (SIGTERM: it kills the code's processes, reaps them and exits),
so nothing is orphaned to an init that may never reap it; SIGKILL follows if it lingers.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import IO

from envs.api import EnvError

READ_CHUNK = 1 << 16
STATUS_LIMIT = 4096
EOF_GRACE_S = 2.0
HALT_GRACE_S = 5.0
KILL_WAIT_S = 30.0

Sweep = Callable[[list[str]], None]
"""Kill what a run left behind once its process ended, given the launcher's status lines."""


class SandboxError(EnvError):
    """The sandbox itself failed (could not start, or its launcher reported an error)."""


@dataclass
class ProcessOutcome:
    """How a run ended. ``exit_code`` follows the shell: 128 + N when a signal N killed it."""

    exit_code: int
    stdout: bytes
    stderr: bytes
    stdout_truncated: bool
    stderr_truncated: bool
    stopped_by: str | None
    status: list[str]
    wall_s: float


@dataclass
class _Stream:
    fd: int
    limit: int
    stops_run: bool
    data: bytearray = field(default_factory=bytearray)
    truncated: bool = False
    done: asyncio.Event = field(default_factory=asyncio.Event)


class _Run:
    def __init__(
        self, proc: subprocess.Popen[bytes], status_fd: int, max_output_bytes: int, halt_signal: int
    ) -> None:
        self.proc = proc
        self.halt_signal = halt_signal
        self.loop = asyncio.get_running_loop()
        self.stopped_by: str | None = None
        assert proc.stdout is not None and proc.stderr is not None
        self.streams = [
            _Stream(proc.stdout.fileno(), max_output_bytes, stops_run=True),
            _Stream(proc.stderr.fileno(), max_output_bytes, stops_run=True),
            _Stream(status_fd, STATUS_LIMIT, stops_run=False),
        ]
        self.exited = asyncio.Event()
        self.pidfd = os.pidfd_open(proc.pid)
        self.loop.add_reader(self.pidfd, self._on_exit)
        for stream in self.streams:
            os.set_blocking(stream.fd, False)
            self.loop.add_reader(stream.fd, self._on_readable, stream)

    def _on_exit(self) -> None:
        self.loop.remove_reader(self.pidfd)
        self.exited.set()

    def _on_readable(self, stream: _Stream) -> None:
        try:
            chunk = os.read(stream.fd, READ_CHUNK)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._finish(stream)
            return
        room = stream.limit - len(stream.data)
        stream.data += chunk[:room]
        if len(chunk) > room:
            stream.truncated = True
            self._finish(stream)
            if stream.stops_run:
                self.stop("output")

    def _finish(self, stream: _Stream) -> None:
        if not stream.done.is_set():
            self.loop.remove_reader(stream.fd)
            stream.done.set()

    def status_lines(self) -> list[str]:
        return self.streams[2].data.decode(errors="replace").splitlines()

    def stop(self, reason: str) -> None:
        """End the code: send ``halt_signal`` (by pidfd: a reaped pid may belong to someone else)."""
        self.stopped_by = self.stopped_by or reason
        self.signal(self.halt_signal)

    def signal(self, number: int) -> None:
        if not self.exited.is_set():
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self.pidfd, number)

    def close(self) -> None:
        if not self.exited.is_set():
            self.loop.remove_reader(self.pidfd)
        os.close(self.pidfd)
        for stream in self.streams:
            self._finish(stream)
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()
        os.close(self.streams[2].fd)


async def run_process(
    build_argv: Callable[[int], list[str]],
    *,
    cwd: str | None,
    env: Mapping[str, str] | None,
    uid: int | None,
    new_session: bool,
    stdin: IO[bytes] | None,
    max_output_bytes: int,
    wall_time_s: float,
    halt_signal: int,
    sweep: Sweep,
) -> ProcessOutcome:
    """Start ``build_argv(status_fd)``, wait at most ``wall_time_s``, and return how it ended.

    ``status_fd`` is the write end of the launcher's status pipe (inherited under that number).
    Raises ``SandboxError`` when the process cannot be started. Cancelling the awaiting task kills
    the process and sweeps before the cancellation propagates. ``halt_signal`` ends the process on a
    limit or a cancellation (SIGKILL follows after HALT_GRACE_S); ``sweep``: see ``Sweep``.
    """
    status_r, status_w = os.pipe()
    started = time.monotonic()
    try:
        # Popen blocks only for fork + exec (about a millisecond), and the child is ours to watch: an
        # asyncio subprocess would add a watcher thread per child on Python 3.11.
        proc = subprocess.Popen(  # noqa: ASYNC220
            build_argv(status_w),
            stdin=stdin if stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(status_w,),
            cwd=cwd,
            env=env,
            start_new_session=new_session,
            user=uid,
            group=uid,
            extra_groups=None if uid is None else [],
        )
    except (OSError, subprocess.SubprocessError) as exc:
        os.close(status_r)
        raise SandboxError(f"sandbox: could not start the process: {exc}") from exc
    finally:
        os.close(status_w)
    try:
        run = _Run(proc, status_r, max_output_bytes, halt_signal)
    except BaseException:
        proc.kill()
        proc.wait()
        os.close(status_r)
        raise
    try:
        try:
            await asyncio.wait_for(run.exited.wait(), wall_time_s)
        except TimeoutError:
            run.stop("wall_time")
        await _settle(run, sweep)
    except BaseException:
        run.stop("cancelled")
        # Cancelled (or failing): the process must still end before the slot and directory go, so a
        # second cancellation waits for that too (bounded by KILL_WAIT_S + EOF_GRACE_S).
        settling = asyncio.ensure_future(_settle(run, sweep))
        while not settling.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait({settling})
        if not settling.cancelled():
            settling.exception()  # marked as retrieved: the original exception is the one that matters
        raise
    finally:
        run.close()
    stdout, stderr, _ = run.streams
    exit_code = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
    return ProcessOutcome(
        exit_code=exit_code,
        stdout=bytes(stdout.data),
        stderr=bytes(stderr.data),
        stdout_truncated=stdout.truncated,
        stderr_truncated=stderr.truncated,
        stopped_by=run.stopped_by,
        status=run.status_lines(),
        wall_s=time.monotonic() - started,
    )


async def _settle(run: _Run, sweep: Sweep) -> None:
    """Wait for the (possibly killed) process, reap it, sweep leftovers, drain the pipes to EOF."""
    if not run.exited.is_set() and run.halt_signal != signal.SIGKILL:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(run.exited.wait(), HALT_GRACE_S)
    if not run.exited.is_set():
        run.signal(signal.SIGKILL)
        try:
            await asyncio.wait_for(run.exited.wait(), KILL_WAIT_S)
        except TimeoutError:
            pid = run.proc.pid
            raise SandboxError(f"sandbox: process {pid} survived SIGKILL for {KILL_WAIT_S}s") from None
    run.proc.wait()
    sweep(run.status_lines())
    waits = [asyncio.ensure_future(stream.done.wait()) for stream in run.streams]
    _, pending = await asyncio.wait(waits, timeout=EOF_GRACE_S)
    for waiter in pending:  # a leftover the sweep could not reach still holds a pipe: stop reading it
        waiter.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
