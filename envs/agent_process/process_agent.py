"""Agent-process environments: the episode is a command (any language, any framework, a CLI) that only
needs a base URL, run in the sandbox against the episode's own endpoint.

    [env]
    name = "agent-process"
    options = { command = ["python3", "agent.py"], files = { "agent.py" = "my_agent/agent.py" },
                tasks = "my_agent/tasks.py:tasks", episode_timeout_s = 120.0 }

Per episode the command runs in a fresh working directory (``files`` copied in; ``mounts``: host paths it
may read) under the sandbox's limits (envs/sandbox; the ``sandbox`` option) with:

- the endpoint in ``OPENAI_BASE_URL`` (``.../v1``), ``OPENAI_API_KEY``, ``ANTHROPIC_BASE_URL`` (without
  ``/v1``), ``ANTHROPIC_API_KEY``, ``ROLLWISE_BASE_URL``, ``ROLLWISE_API_KEY``, ``ROLLWISE_MODEL``,
  ``ROLLWISE_EPISODE_ID``, plus the ``env`` option's variables;
- the task as JSON (``{"id", "seed", "data"}``) on stdin and in the file ``ROLLWISE_TASK_FILE``;
- the outcome as JSON in the file ``ROLLWISE_OUTCOME_FILE``, else on the last non-empty line of stdout: a
  number or ``{"outcome": number | null, "turn_rewards": [one per request, optional], "info": {...}}``.

No network but the endpoint: under bubblewrap the sandbox's network namespace has only its own loopback,
and agent_relay.py relays its 127.0.0.1:``RELAY_PORT`` to the endpoint's Unix socket, bind-mounted
read-only. With rlimits only (``sandbox.require = "rlimits"``) the agent gets the endpoint's TCP address
and the network is NOT restricted (envs/sandbox/isolation.py).

Every failure costs its episode, counted, never a silent 0 (rollwise_agent_failures_total{reason}):
``exit``, ``signal``, ``wall_time`` (finish "timeout"), ``cpu_time``, ``output_limit``, ``bad_output``
(no valid outcome), ``sandbox`` (it could not run).
"""

from __future__ import annotations

import json
import math
import signal
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from envs.agent import AgentEnvironment, AgentEpisode, AgentFailure, AgentResult, TaskSource
from envs.api import Task
from envs.sandbox import Sandbox, SandboxConfig, SandboxError, shared_sandbox
from envs.sandbox.limits import MiB

RELAY_PORT = 8731
TASK_FILE = "task.json"
OUTCOME_FILE = "outcome.json"
MAX_STDOUT = 1 << 20
_RELAY_SOURCE = Path(__file__).with_name("agent_relay.py").read_text()
_SANDBOX_DEFAULTS = {"memory_bytes": 2048 * MiB, "max_processes": 64, "max_output_bytes": 2 * MAX_STDOUT}


async def _not_called(client: Any, task: Task) -> float:
    raise RuntimeError("an agent-process environment runs its command, not an agent function")


class AgentProcessEnvironment(AgentEnvironment):
    """An environment whose episode runs ``command`` in the sandbox (module docstring).

    ``command``: a list of arguments, or a string run by ``/bin/sh -c``; ``tasks``: as for
    ``AgentEnvironment``; ``files``: name in the working directory -> host file to copy there (read
    once, here); ``mounts``: host paths the command may read (a virtualenv, the agent's package);
    ``env``: extra variables; ``sandbox``: the sandbox's settings (envs/sandbox/limits.py; defaults:
    2 GiB of memory per process, 64 processes, wall and CPU time = ``episode_timeout_s``).
    """

    def __init__(
        self,
        command: str | Sequence[str],
        tasks: str | TaskSource,
        *,
        files: Mapping[str, str] | None = None,
        mounts: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        sandbox: Mapping[str, Any] | None = None,
        name: str = "agent-process",
        version: str = "1",
        max_turns: int = 16,
        episode_timeout_s: float = 300.0,
        model: str = "policy",
        max_refused_requests: int = 8,
    ) -> None:
        super().__init__(
            _not_called,
            tasks,
            name=name,
            version=version,
            max_turns=max_turns,
            episode_timeout_s=episode_timeout_s,
            model=model,
            max_refused_requests=max_refused_requests,
        )
        self.agent_ref = None  # nothing for a worker process to import
        self.argv = _argv(command)
        self.files = {name: _read_file(name, path) for name, path in dict(files or {}).items()}
        self.mounts = tuple(_mount(path) for path in mounts)
        self.env = {str(k): str(v) for k, v in dict(env or {}).items()}
        # Within the episode's own timeout, so that the sandbox's limit (reason wall_time) acts first.
        wall = max(0.05, episode_timeout_s - 1.0) if episode_timeout_s > 2.0 else episode_timeout_s
        options = {**_SANDBOX_DEFAULTS, "wall_time_s": wall, "cpu_time_s": wall, **dict(sandbox or {})}
        try:
            self.sandbox_config = SandboxConfig.from_options(options)
        except ValueError as exc:
            raise ValueError(f"sandbox: {exc}") from None
        self._sandbox: Sandbox | None = None

    @property
    def sandbox(self) -> Sandbox:
        """The process's shared sandbox for this config (its isolation checked on first use)."""
        if self._sandbox is None:
            self._sandbox = shared_sandbox(self.sandbox_config)
        return self._sandbox

    async def play(self, episode: AgentEpisode, task: Task) -> object:
        """Run the command once for `task`; its outcome (an AgentResult) or AgentFailure."""
        sandbox = self.sandbox
        isolated = sandbox.isolation.kind == "bwrap"
        if isolated and episode.unix_socket is None:
            raise AgentFailure("the endpoint has no Unix socket to relay to", kind="error", reason="sandbox")
        base = (
            f"http://127.0.0.1:{RELAY_PORT}/e/{episode.api_key}" if isolated else episode.anthropic_base_url
        )
        task_json = json.dumps({"id": task.id, "seed": task.seed, "data": task.data}, ensure_ascii=False)
        variables = {
            **self.env,
            "OPENAI_BASE_URL": base + "/v1",
            "OPENAI_API_KEY": episode.api_key,
            "ANTHROPIC_BASE_URL": base,
            "ANTHROPIC_API_KEY": episode.api_key,
            "ROLLWISE_BASE_URL": base + "/v1",
            "ROLLWISE_API_KEY": episode.api_key,
            "ROLLWISE_MODEL": episode.model,
            "ROLLWISE_EPISODE_ID": episode.episode_id,
            "ROLLWISE_TASK_FILE": TASK_FILE,
            "ROLLWISE_OUTCOME_FILE": OUTCOME_FILE,
        }
        config = {
            "argv": self.argv,
            "env": variables,
            "socket": episode.unix_socket if isolated else None,
            "relay_port": RELAY_PORT if isolated else 0,
            "outcome_file": OUTCOME_FILE,
            "max_stdout": MAX_STDOUT,
        }
        files: dict[str, str | bytes] = {
            **self.files,
            TASK_FILE: task_json,
            "rollwise_agent.json": json.dumps(config),
        }
        mounts = (*self.mounts, episode.unix_socket) if isolated and episode.unix_socket else self.mounts
        try:
            result = await sandbox.run_python(_RELAY_SOURCE, files=files, stdin=task_json, mounts=mounts)
        except SandboxError as exc:
            raise AgentFailure(
                f"the sandbox could not run the agent: {exc}", kind="error", reason="sandbox"
            ) from exc
        stderr = result.stderr.strip()[-800:]
        if result.stopped_by == "wall_time":
            limit = self.sandbox_config.limits.wall_time_s
            raise AgentFailure(
                f"the agent ran past {limit} s", finish="timeout", kind="timeout", reason="wall_time"
            )
        if result.stopped_by in ("cpu_time", "output"):
            reason = "cpu_time" if result.stopped_by == "cpu_time" else "output_limit"
            raise AgentFailure(f"the agent hit the sandbox's {reason} limit; stderr: {stderr}", reason=reason)
        report = _report(result.stdout)
        if report is None or "error" in report or result.exit_code != 0:
            problem = (report or {}).get("error") or f"the agent's sandbox exited {result.exit_code}"
            raise AgentFailure(f"{problem}; stderr: {stderr}", reason="sandbox" if report is None else "exit")
        code = report.get("exit")
        if code != 0:
            # The rlimits act on the agent's own processes: its CPU limit is SIGXCPU, its file-size limit
            # (its stdout is a file) SIGXFSZ, while the relay above it exits normally.
            reason = "exit"
            if isinstance(code, int) and code < 0:
                reason = {-signal.SIGXCPU: "cpu_time", -signal.SIGXFSZ: "output_limit"}.get(code, "signal")
            raise AgentFailure(f"the agent exited with {code}; stderr: {stderr}", reason=reason)
        return _outcome(report)


def _argv(command: str | Sequence[str]) -> list[str]:
    if isinstance(command, str):
        if not command.strip():
            raise ValueError("command must not be empty")
        return ["/bin/sh", "-c", command]
    argv = list(command)
    if not argv or not all(isinstance(a, str) and a for a in argv):
        raise ValueError(
            f"command must be a string or a non-empty list of non-empty strings, got {command!r}"
        )
    return argv


def _read_file(name: str, path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"files.{name}: cannot read {path!r}: {exc}") from None


def _mount(path: str) -> str:
    resolved = Path(path)
    if not resolved.is_absolute() or not resolved.exists():
        raise ValueError(f"mounts: {path!r} must be an absolute path that exists")
    return str(resolved)


def _report(stdout: str) -> dict[str, Any] | None:
    """The relay's report: the last line of the sandbox's stdout (it writes nothing else)."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    try:
        report = json.loads(lines[-1]) if lines else None
    except ValueError:
        return None
    return report if isinstance(report, dict) else None


def _outcome(report: dict[str, Any]) -> AgentResult:
    """The agent's outcome: its outcome file, else the last non-empty line of its stdout."""
    text = report.get("outcome_file")
    source = "the outcome file"
    if not isinstance(text, str):
        lines = [line for line in str(report.get("stdout") or "").splitlines() if line.strip()]
        text, source = (lines[-1] if lines else ""), "the last line of stdout"
    try:
        value = json.loads(text)
    except ValueError:
        raise AgentFailure(
            f"{source} is not JSON: {text[:200]!r}", kind="invalid", reason="bad_output"
        ) from None
    if isinstance(value, bool):
        value = None
    if isinstance(value, int | float):
        return AgentResult(outcome=float(value)) if math.isfinite(value) else _bad(source, value)
    if not isinstance(value, dict) or set(value) - {"outcome", "turn_rewards", "info"}:
        return _bad(source, value)
    outcome, rewards, info = value.get("outcome"), value.get("turn_rewards", []), value.get("info", {})
    numbers = isinstance(rewards, list) and all(
        isinstance(r, int | float) and not isinstance(r, bool) for r in rewards
    )
    if (
        outcome is not None and (isinstance(outcome, bool) or not isinstance(outcome, int | float))
    ) or not numbers:
        return _bad(source, value)
    if not isinstance(info, dict):
        return _bad(source, value)
    return AgentResult(
        outcome=None if outcome is None else float(outcome), turn_rewards=tuple(rewards), info=info
    )


def _bad(source: str, value: Any) -> AgentResult:
    raise AgentFailure(
        f"{source} holds {json.dumps(value)[:200]}; expected a number or "
        '{"outcome": number | null, "turn_rewards": [numbers], "info": {...}}',
        kind="invalid",
        reason="bad_output",
    )
