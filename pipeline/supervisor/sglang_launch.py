"""Launcher for a real SGLang server: `python -m sglang.launch_server ...` as a child process.

The server runs in its own process group (SGLang forks scheduler and detokenizer processes), so `stop`
can signal the whole group by its id; nothing is ever killed by name. Output goes to a log file in the
run directory; when the server dies during start-up, the error carries the tail of that log.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.supervisor.engines.client import EngineClient
from pipeline.supervisor.engines.protocol import EngineUnavailable

LOG_TAIL_BYTES = 4000


@dataclass
class SGLangLaunchSpec:
    """How to launch one SGLang server. `python_executable` and `module` exist so tests can substitute
    a stub; `extra_args` are appended verbatim (any `launch_server` flag)."""

    model_path: str
    host: str = "127.0.0.1"
    port: int = 30000
    mem_fraction_static: float = 0.8
    tp: int = 1
    dp: int = 1
    api_key: str | None = field(default=None, repr=False)
    weight_version: str = "0"
    extra_args: tuple[str, ...] = ()
    python_executable: str = sys.executable
    module: str = "sglang.launch_server"

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"


def build_sglang_command(spec: SGLangLaunchSpec) -> list[str]:
    """The argv that launches `spec`. `--weight-version` labels the initial weights (rollwise's policy
    version 0) so that every response carries a parseable version from the first token on."""
    cmd = [
        spec.python_executable,
        "-m",
        spec.module,
        "--model-path",
        spec.model_path,
        "--host",
        spec.host,
        "--port",
        str(spec.port),
        "--mem-fraction-static",
        str(spec.mem_fraction_static),
        "--tp-size",
        str(spec.tp),
        "--dp-size",
        str(spec.dp),
        "--enable-metrics",
        "--weight-version",
        spec.weight_version,
    ]
    if spec.api_key:
        cmd += ["--api-key", spec.api_key]
    cmd += list(spec.extra_args)
    return cmd


def _redacted(cmd: list[str]) -> list[str]:
    return ["***" if i > 0 and cmd[i - 1] == "--api-key" else arg for i, arg in enumerate(cmd)]


def read_log_tail(path: Path, max_bytes: int = LOG_TAIL_BYTES) -> str:
    """The last `max_bytes` of a log file as text ('' when it does not exist)."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            return f.read().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return ""


class SGLangServer:
    """One SGLang server process: `await start(log)`, `await wait_ready(t)`, ..., `await stop()`."""

    def __init__(self, spec: SGLangLaunchSpec, *, env: dict[str, str] | None = None) -> None:
        self.spec = spec
        self.env = env
        self.log_path: Path | None = None
        self._proc: asyncio.subprocess.Process | None = None

    @property
    def base_url(self) -> str:
        return self.spec.base_url

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode if self._proc is not None else None

    async def start(self, log_path: Path | str) -> None:
        """Spawn the server in a new session (its own process group); stdout and stderr append to
        `log_path`, after one header line with the command (api key redacted)."""
        if self._proc is not None and self._proc.returncode is None:
            raise RuntimeError(f"SGLang server already running (pid {self._proc.pid})")
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        cmd = build_sglang_command(self.spec)
        env = {**os.environ, **self.env} if self.env is not None else None
        with self.log_path.open("ab") as log:
            log.write(f"# rollwise: launching {' '.join(_redacted(cmd))}\n".encode())
            log.flush()
            self._proc = await asyncio.create_subprocess_exec(
                *cmd,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                env=env,
                start_new_session=True,
            )

    async def wait_ready(self, timeout_s: float, *, poll_interval_s: float = 0.2) -> None:
        """Poll /health until 200. Raises EngineUnavailable, with the log tail, when the process exits
        first or `timeout_s` passes."""
        proc = self._require_proc()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        async with EngineClient(self.base_url, api_key=self.spec.api_key, retries=0) as client:
            while True:
                if proc.returncode is not None:
                    raise EngineUnavailable(self.base_url, self._exit_report(proc.returncode))
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise EngineUnavailable(
                        self.base_url,
                        f"SGLang (pid {proc.pid}) not ready after {timeout_s} s; log tail:\n{self._tail()}",
                    )
                if await client.health(timeout_s=max(0.05, min(remaining, 25.0))):
                    return
                # Wake early if the process exits while we wait.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(proc.wait(), timeout=min(poll_interval_s, max(remaining, 0.0)))

    async def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM the process group, SIGKILL it after `grace_s` seconds; reap. Returns the exit code."""
        proc = self._proc
        if proc is None:
            return None
        pgid = proc.pid  # start_new_session: the child leads its own group
        if proc.returncode is None:
            _signal_group(pgid, signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), timeout=grace_s)
            except TimeoutError:
                _signal_group(pgid, signal.SIGKILL)
                await proc.wait()
        # Children (scheduler, detokenizer) that outlived the leader still hold the group id.
        _signal_group(pgid, signal.SIGKILL)
        return proc.returncode

    def _require_proc(self) -> asyncio.subprocess.Process:
        if self._proc is None:
            raise RuntimeError("SGLang server not started")
        return self._proc

    def _tail(self) -> str:
        return read_log_tail(self.log_path) if self.log_path is not None else ""

    def _exit_report(self, code: int) -> str:
        return f"SGLang exited with code {code} before becoming ready; log tail:\n{self._tail()}"


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
