"""harbor-tasks: Harbor task directories played turn by turn in a bubblewrap sandbox, without Docker.

    [env]
    name = "harbor-tasks"
    options = { path = "envs/harbor_tasks" }      # a task directory or a tree of them (default: these)

Each episode plays one task (envs.ecosystems.harbor_task_dir reads it) in a sandbox session of its own
(envs.sandbox.sessions): the task's WORKDIR (its COPY files in place) is writable at its own path and is
where commands start, /logs/verifier and /logs/agent exist, and nothing else persists. The first message
is instruction.md. Turn protocol:

- a turn with `bash` tool calls runs each (at most `max_calls_per_turn`, each within
  `command_timeout_s`) with the task's ENV and limits, and answers each with its exit code and output
  (stdout then stderr, the middle cut beyond `output_chars`); a bad call is answered with `error: ...`;
- a turn without tool calls ends the episode: tests/ is copied to /tests, `bash /tests/test.sh` runs
  (within the task's verifier timeout) and the number in /logs/verifier/reward.txt, or reward.json's
  "reward" (or its only value), is the outcome; done;
- reaching `max_turns`, or the task's agent timeout in command time, truncates the episode and the
  verifier runs all the same (Harbor verifies whatever the agent left).

A verifier that writes no readable reward is the task's failure, not the agent's: EnvError, the episode
is excluded. A task that cannot run here (its problems: an image to build, a prebuilt image, several
containers, GPUs) stops the environment at construction with every reason, so `rollwise env check` and
`rollwise run` refuse the task set before anything starts. The oracle (solution/solve.sh) is the gold
action: one bash call with the script, then an empty final turn.
"""

from __future__ import annotations

import copy
import functools
import itertools
import json
import math
import random
import shlex
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from envs.api import Action, EnvError, Environment, EnvSpec, Message, StepResult, Task, ToolCall
from envs.ecosystems.harbor_task_dir import HarborTask, find_task_dirs, read_task
from envs.sandbox.limits import Limits, SandboxConfig
from envs.sandbox.runner import SandboxResult, SandboxUnavailable, shared_sandbox
from envs.sandbox.sessions import LocalBackend, SandboxSession

SHIPPED_TASKS = Path(__file__).resolve().parents[1] / "harbor_tasks"
BASH_TOOL_NAME = "bash"
BASH_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": BASH_TOOL_NAME,
        "description": (
            "Run a bash command in the task's directory and get its exit code and output. Files persist "
            "between calls; shell variables, the working directory and background processes do not. "
            "No network."
        ),
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string", "description": "The bash source to run."}},
            "required": ["command"],
        },
    },
}
LOGS = {"logs/verifier": "/logs/verifier", "logs/agent": "/logs/agent", "tests": "/tests"}
VERIFIER_OUTPUT_BYTES = 1 << 20


@functools.cache
def load_tasks(root: str) -> tuple[HarborTask, ...]:
    """The tasks under `root` (read once per process)."""
    return tuple(read_task(path) for path in find_task_dirs(Path(root)))


def command_reply(result: SandboxResult, limit: int) -> str:
    """What the model sees of one command: its exit code (and the limit that stopped it), then its
    output, the middle cut when longer than `limit` characters."""
    head = f"exit code {result.exit_code}"
    if result.stopped_by:
        head += f" (stopped: {result.stopped_by})"
    output = result.stdout + (f"\n[stderr]\n{result.stderr}" if result.stderr else "")
    if len(output) > limit:
        keep = limit // 2
        output = f"{output[:keep]}\n[... {len(output) - 2 * keep} characters cut ...]\n{output[-keep:]}"
    return f"{head}\n{output}" if output else head


def reward_of(files: Mapping[str, bytes | None]) -> tuple[float, dict[str, float]]:
    """(outcome, named rewards) from the verifier's reward.txt or reward.json; ValueError when neither
    holds a finite number."""
    text, document = files.get("reward.txt"), files.get("reward.json")
    if text is not None:
        value = float(text.decode().strip())
        named = {"reward": value}
    elif document is not None:
        parsed = json.loads(document)
        if not isinstance(parsed, dict) or not parsed:
            raise ValueError(f"reward.json must be an object of named rewards, got {parsed!r}")
        named = {str(k): float(v) for k, v in parsed.items()}
        if "reward" in named:
            value = named["reward"]
        elif len(named) == 1:
            value = next(iter(named.values()))
        else:
            raise ValueError(f"reward.json names several rewards and no 'reward': {sorted(named)}")
    else:
        raise ValueError("the verifier wrote neither /logs/verifier/reward.txt nor reward.json")
    if not all(math.isfinite(v) for v in named.values()):
        raise ValueError(f"the verifier's rewards are not finite: {named}")
    return value, named


class HarborTasksEnv(Environment):
    """One episode of a Harbor task (module docstring)."""

    def __init__(
        self,
        path: str | None = None,
        max_turns: int = 12,
        max_calls_per_turn: int = 4,
        command_timeout_s: float = 30.0,
        output_chars: int = 4000,
        sandbox: Mapping[str, Any] | None = None,
    ) -> None:
        root = Path(path).expanduser() if path else SHIPPED_TASKS
        if not root.is_dir():
            raise ValueError(f"harbor-tasks: path {str(root)!r} is not a directory")
        self.task_set = load_tasks(str(root.resolve()))
        if not self.task_set:
            raise ValueError(f"harbor-tasks: no task directory (holding task.toml) under {root}")
        refused = [f"{t.path.name}: {p}" for t in self.task_set for p in t.problems]
        if refused:
            raise ValueError("harbor-tasks: tasks that cannot run here:\n  " + "\n  ".join(refused))
        if max_calls_per_turn < 1 or output_chars < 100 or command_timeout_s <= 0:
            raise ValueError(
                "harbor-tasks: max_calls_per_turn >= 1, output_chars >= 100, command_timeout_s > 0"
            )
        self.sandbox = shared_sandbox(SandboxConfig.from_options({"require": "bwrap", **(sandbox or {})}))
        if self.sandbox.isolation.kind != "bwrap":  # a task's own paths (/app, /tests, /logs) need it
            raise SandboxUnavailable(
                f"harbor-tasks needs bubblewrap (tasks run at their own absolute paths); this machine "
                f"gives {self.sandbox.isolation.describe()}"
            )
        self.max_calls = max_calls_per_turn
        self.command_limits = self.sandbox.config.limits.replace(
            wall_time_s=command_timeout_s, cpu_time_s=command_timeout_s
        )
        self.output_chars = output_chars
        verifier_s = max(t.verifier_timeout_s for t in self.task_set)
        agent_s = max(t.agent_timeout_s for t in self.task_set)
        self.spec = EnvSpec(
            name="harbor-tasks",
            version="1",
            max_turns=max_turns,
            step_timeout_s=max_calls_per_turn * command_timeout_s + verifier_s + 30.0,
            episode_timeout_s=agent_s + verifier_s + max_turns * 30.0,
            tools=(BASH_TOOL,),
        )
        self.task: HarborTask | None = None
        self.session: SandboxSession | None = None
        self.backend: LocalBackend | None = None
        self.turns = 0
        self.command_s = 0.0
        self._gold_ran = False

    def tasks(self, seed: int) -> Iterator[Task]:
        rng = random.Random(seed)
        order = list(range(len(self.task_set)))
        for cycle in itertools.count():
            rng.shuffle(order)
            for index in order:
                task = self.task_set[index]
                yield Task(id=f"{task.path.name}#{cycle}", seed=seed, data={"task": task.path.name})

    def _by_name(self, name: str) -> HarborTask:
        for task in self.task_set:
            if task.path.name == name:
                return task
        raise EnvError(f"harbor-tasks: no task {name!r} in this task set")

    async def reset(self, task: Task) -> list[Message]:
        self.task = self._by_name(str(task.data["task"]))
        workdir = self.task.workdir.rstrip("/")
        binds = {workdir.lstrip("/"): workdir, **LOGS}
        self.backend = LocalBackend(self.sandbox, binds, chdir=workdir)
        files = {f"{workdir.lstrip('/')}/{dest}": source.read_bytes() for source, dest in self.task.copies}
        self.session = await self.backend.start(files)
        return [{"role": "user", "content": self.task.instruction}]

    def _limits(self, base: Limits) -> Limits:
        assert self.task is not None
        changes: dict[str, Any] = {}
        if self.task.memory_bytes:
            changes["memory_bytes"] = self.task.memory_bytes
        if self.task.file_bytes:
            changes["max_file_bytes"] = self.task.file_bytes
        return base.replace(**changes)

    def _with_env(self, command: str) -> str:
        assert self.task is not None
        exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in self.task.env.items())
        return exports + command

    async def _run_call(self, call: ToolCall) -> Message:
        command = call.arguments.get("command")
        if call.name != BASH_TOOL_NAME:
            content = f"error: unknown tool {call.name!r}; the tool is {BASH_TOOL_NAME!r}"
        elif not isinstance(command, str) or not command.strip():
            content = 'error: "command" must be a non-empty string of bash'
        else:
            assert self.session is not None
            result = await self.session.exec(
                self._with_env(command), limits=self._limits(self.command_limits)
            )
            self.command_s += result.wall_s
            content = command_reply(result, self.output_chars)
        return {"role": "tool", "name": BASH_TOOL_NAME, "content": content}

    async def step(self, action: Action) -> StepResult:
        if self.session is None or self.task is None:
            raise EnvError("harbor-tasks: step before reset")
        self.turns += 1
        messages: list[Message] = [
            {"role": "tool", "name": BASH_TOOL_NAME, "content": f"error: {error}"}
            for error in action.tool_call_errors
        ]
        for call in action.tool_calls[: self.max_calls]:
            messages.append(await self._run_call(call))
        if len(action.tool_calls) > self.max_calls:
            messages.append(
                {"role": "user", "content": f"Only the first {self.max_calls} tool calls of a turn run."}
            )
        final = not action.tool_calls and not action.tool_call_errors
        out_of_time = self.command_s >= self.task.agent_timeout_s
        if not final and self.turns < self.spec.max_turns and not out_of_time:
            return StepResult(messages)
        outcome, info = await self._verify()
        info["command_s"] = round(self.command_s, 3)
        return StepResult(messages, done=final, truncated=not final, outcome=outcome, info=info)

    async def _verify(self) -> tuple[float, dict[str, Any]]:
        assert self.session is not None and self.task is not None
        await self.session.upload({f"tests/{name}": data for name, data in self.task.test_files.items()})
        limits = self._limits(
            self.command_limits.replace(
                wall_time_s=self.task.verifier_timeout_s,
                cpu_time_s=self.task.verifier_timeout_s,
                max_output_bytes=VERIFIER_OUTPUT_BYTES,
            )
        )
        result = await self.session.exec(self._with_env("bash /tests/test.sh"), limits=limits)
        files: dict[str, bytes | None] = {}
        for name in ("reward.txt", "reward.json"):
            try:
                files[name] = await self.session.download(f"logs/verifier/{name}")
            except FileNotFoundError:
                files[name] = None
        try:
            outcome, named = reward_of(files)
        except ValueError as exc:
            tail = (result.stderr or result.stdout)[-300:]
            raise EnvError(
                f"harbor-tasks: task {self.task.name}: {exc} (test.sh exit {result.exit_code}: {tail!r})"
            ) from exc
        return outcome, {"rewards": named, "verifier_exit": result.exit_code}

    async def fork(self) -> HarborTasksEnv:
        """A twin whose session starts from a snapshot of this one's (its working directory and logs),
        with the turns and command time so far; the snapshot is discarded once the twin has it."""
        if self.session is None or self.backend is None:
            raise EnvError("fork() before reset()")
        snapshot = await self.session.snapshot()
        try:
            session = await self.backend.fork(snapshot)
        finally:
            await self.backend.discard(snapshot)
        twin = copy.copy(self)
        twin.session = session
        return twin

    async def close(self) -> None:
        if self.session is not None:
            session, self.session = self.session, None
            await session.stop()

    def gold_action(self) -> str | None:
        if self.task is None or self.task.solution is None:
            return None
        if self._gold_ran:
            return "Done."
        self._gold_ran = True
        call = {"name": BASH_TOOL_NAME, "arguments": {"command": self.task.solution}}
        return f"<tool_call>{json.dumps(call)}</tool_call>"

    def gold_unavailable(self) -> str | None:
        return "the task has no solution/solve.sh" if self.task and self.task.solution is None else None
