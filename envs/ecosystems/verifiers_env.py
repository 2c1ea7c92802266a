"""verifiers/<taskset>: a verifiers (v1) taskset played by verifiers' own rollout loop as an agent process.

    [env]
    name = "verifiers/gsm8k-v1"                    # an installed taskset package of the verifiers venv
    options = { harness = "null", taskset_config = { split = "train" } }

    [env]
    name = "verifiers/my-math"                     # the member only names the environment ...
    options = { taskset = "tasks/my_math.py" }     # ... when the taskset is a module or a .py file

verifiers' dependencies conflict with rollwise's (docs/design/env_ecosystems.md), so rollwise never
imports it: `make env-verifiers` builds its venv, and envs/ecosystems/verifiers_runner.py, run by that
venv's interpreter, does everything verifiers does. Rules:

- Construction lists the taskset's tasks once per process and spec (the runner's ``list``, run as the
  sandbox's user so that what it can read is what the episodes can read); a taskset that does not load
  stops construction with verifiers' own error and the option to fix (``rollwise run`` refuses the
  config before anything starts).
- ``tasks(seed)``: the listed tasks, each pass in an order drawn from ``seed``; ``Task.data`` is the
  task's position and content key (``{"index", "key"}``), and an episode whose task no longer has that
  key fails rather than play another task.
- An episode is an agent-process episode (envs/agent_process): the runner plays the task with the
  taskset's Env (its seats, harness program, toolsets and scoring) on verifiers' local subprocess
  runtime, inside rollwise's sandbox, every model call through the episode's endpoint (a recorded turn,
  token-exact with its log-probs). The outcome is the trainable seats' reward (verifiers' weighted sum
  of named rewards); the named rewards, metrics and stop condition go to ``info``.
- The venv, the taskset's directory and ``mounts`` are mounted read-only; the harness programs' uv
  environments are built per episode in the sandbox from the wheel index the make target put in the
  venv, so episodes need no network (the sandbox has none but the endpoint).
- A failing taskset, harness or runner costs only its episode, counted under
  ``rollwise_agent_failures_total{reason}`` with verifiers' error as the episode's.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import os
import random
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from envs.agent_process import AgentProcessEnvironment
from envs.api import EnvFactory, EnvFamily, FamilyMember, Task
from envs.ecosystems.ecosystem_venvs import EcosystemMissing, venv_python
from envs.sandbox import SandboxConfig, shared_sandbox
from envs.sandbox.isolation import PATH_INSIDE, SYSTEM_DIRS, no_groups

RUNNER = Path(__file__).with_name("verifiers_runner.py")
RUNNER_NAME = "verifiers_runner.py"
SPEC_VARIABLE = "ROLLWISE_VERIFIERS"
MAKE_TARGET = "make env-verifiers"
LIST_TIMEOUT_S = 180.0
# The sandbox counts threads as tasks, and an episode holds many: the runner's, the tool servers', and
# uv's (40 to 60 while it builds the harness program's environment). That environment holds a 14 MiB
# library (cryptography's), close to the sandbox's 16 MiB default file size.
SANDBOX_DEFAULTS: dict[str, Any] = {"max_processes": 256, "max_file_bytes": 64 << 20}
BUILTIN_NOTES = {
    "harbor": "downloads Harbor Hub tasks and runs them in container images (rollwise's harbor-tasks "
    "runs task directories without them)",
    "nemo_gym": "needs NeMo Gym resource servers",
    "openenv": "starts OpenEnv servers from their packages (network, uv or Docker)",
    "textarena": "needs textarena and nltk in the verifiers venv (verifiers[ta])",
}


@dataclass(frozen=True)
class TasksetListing:
    """What the runner's ``list`` found: the taskset's resolved id, its Env class, each seat's harness,
    the tasks as (index, key, name), and the interpreter's ``sys.base_prefix`` (mounted when it lies
    outside the system directories)."""

    verifiers: str
    taskset: str
    env: str
    harnesses: dict[str, str]
    infinite: bool
    tasks: tuple[tuple[int, str, str], ...]
    base_prefix: str


@contextlib.contextmanager
def _as_sandbox_user(sandbox_json: str) -> Iterator[tuple[int | None, str]]:
    """(uid, home) for a process that must see what the sandbox's code sees: a uid of the sandbox's own
    pool (when rollwise runs as root; reserved, so no sandbox shares or sweeps it meanwhile, and swept
    when given back) and a fresh home directory it owns."""
    sandbox = shared_sandbox(SandboxConfig.from_options(json.loads(sandbox_json)))
    uid = sandbox.take_uid()
    home = tempfile.mkdtemp(prefix="rollwise-verifiers-")
    try:
        if uid is not None:
            os.chown(home, uid, uid)
        yield uid, home
    finally:
        sandbox.give_uid(uid)
        shutil.rmtree(home, ignore_errors=True)


def _run_as(
    argv: list[str], uid: int | None, home: str, variables: Mapping[str, str]
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=LIST_TIMEOUT_S,
        cwd=home,
        env={"PATH": PATH_INSIDE, "HOME": home, "LANG": "C.UTF-8", **variables},
        check=False,
        user=uid,
        group=uid,
        extra_groups=no_groups(uid),
    )


@functools.cache
def list_taskset(python: str, spec_json: str, sandbox_json: str) -> TasksetListing:
    """The runner's ``list`` for ``spec_json`` under ``python``, run as the user of the sandbox that
    ``sandbox_json`` configures (cached per process).

    Raises ValueError with the runner's own message: the taskset, the exception, and what to change.
    """
    with _as_sandbox_user(sandbox_json) as (uid, home):
        try:
            # The source, not the file: the sandbox's user may not be able to read rollwise's checkout.
            done = _run_as([python, "-c", RUNNER.read_text(), "list"], uid, home, {SPEC_VARIABLE: spec_json})
        except subprocess.TimeoutExpired:
            raise ValueError(f"listing the taskset took over {LIST_TIMEOUT_S:.0f} s") from None
        except OSError as exc:
            raise ValueError(_unreachable(python, uid, str(exc))) from None
    if done.returncode != 0:
        lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
        message = lines[-1] if lines else f"exit {done.returncode} without a message"
        if uid is not None and ("Permission denied" in done.stderr or done.returncode == 126):
            message = _unreachable(python, uid, message)
        raise ValueError(message.removeprefix("verifiers: "))
    document = json.loads(done.stdout.strip().splitlines()[-1])
    return TasksetListing(
        verifiers=document["verifiers"],
        taskset=document["taskset"],
        env=document["env"],
        harnesses=dict(document["harnesses"]),
        infinite=bool(document["infinite"]),
        tasks=tuple(
            (int(t["index"]), str(t["key"]), str(t["name"] or f"task-{t['index']}"))
            for t in document["tasks"]
        ),
        base_prefix=str(document["base_prefix"]),
    )


def sandbox_user_problem(python: str | Path, sandbox: Mapping[str, Any] | None = None) -> str | None:
    """Why the sandbox's user cannot import verifiers with ``python`` (None when it can): when rollwise
    runs as root, its sandboxes run as an unprivileged uid, out of reach of a venv under /root."""
    options = json.dumps({**SANDBOX_DEFAULTS, **dict(sandbox or {})}, sort_keys=True)
    with _as_sandbox_user(options) as (uid, home):
        try:
            done = _run_as([str(python), "-I", "-c", "import verifiers"], uid, home, {})
        except (OSError, subprocess.SubprocessError) as exc:
            return _unreachable(str(python), uid, str(exc))
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        return _unreachable(str(python), uid, lines[-1] if lines else f"exit {done.returncode}")
    return None


def _unreachable(python: str, uid: int | None, detail: str) -> str:
    if uid is None:
        return (
            f"{python} cannot import verifiers ({detail}): rebuild its venv with `{MAKE_TARGET}`, or set "
            "env.options.python to an interpreter that has verifiers 0.4"
        )
    return (
        f"the sandbox's user (uid {uid}) cannot run {python} ({detail}): rollwise runs as root and its "
        "sandboxes as an unprivileged uid, which cannot enter a private home such as /root; build the venv "
        f"where every user can read it, on a system interpreter (`{MAKE_TARGET}` does so for root: "
        "/opt/rollwise/venvs, /usr/bin/python3; or point ROLLWISE_ECOSYSTEM_VENVS at such a place for "
        "both make and rollwise, or set env.options.python)"
    )


def _under_system(path: str) -> bool:
    return any(path == d or path.startswith(d + "/") for d in SYSTEM_DIRS)


class VerifiersEnvironment(AgentProcessEnvironment):
    """An agent-process environment whose episode is one verifiers rollout (module docstring).

    ``member``: the environment's name after ``verifiers/`` and, without ``taskset``, the taskset id
    (a taskset package installed in the verifiers venv); ``taskset``: a module installed there or a
    ``.py`` file (``:Class`` picks one Taskset subclass);
    ``taskset_config`` / ``env_config``: verifiers' TasksetConfig / EnvConfig fields; ``harness``: a
    harness id or HarnessConfig table for every seat (default: the taskset's own, else verifiers'
    ``bash``); ``sampling``: verifiers' SamplingConfig fields (the endpoint refuses what it cannot
    reproduce); ``max_tasks``: tasks listed from the taskset (the first ones); ``python``: the
    interpreter that has verifiers (default: the venv `make env-verifiers` builds); the rest as for
    ``AgentProcessEnvironment``.
    """

    def __init__(
        self,
        member: str,
        *,
        taskset: str | None = None,
        taskset_config: Mapping[str, Any] | None = None,
        env_config: Mapping[str, Any] | None = None,
        harness: str | Mapping[str, Any] | None = None,
        sampling: Mapping[str, Any] | None = None,
        max_tasks: int = 1000,
        python: str | None = None,
        mounts: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        sandbox: Mapping[str, Any] | None = None,
        max_turns: int = 16,
        episode_timeout_s: float = 300.0,
        model: str = "policy",
        max_refused_requests: int = 8,
    ) -> None:
        if isinstance(max_tasks, bool) or not isinstance(max_tasks, int) or max_tasks < 1:
            raise ValueError(f"max_tasks must be an integer >= 1, got {max_tasks!r}")
        table = isinstance(harness, Mapping) and isinstance(harness.get("id"), str)
        if not (harness is None or isinstance(harness, str) or table):
            raise ValueError(f'harness must be a harness id or a table with an "id", got {harness!r}')
        interpreter = venv_python("verifiers", python)
        reference, taskset_dir = _taskset_reference(member, taskset)
        spec = {
            "taskset": reference,
            "taskset_config": dict(taskset_config or {}),
            "env_config": dict(env_config or {}),
            "harness": harness if isinstance(harness, str | None) else dict(harness),
            "sampling": dict(sampling or {}),
            "max_tasks": max_tasks,
        }
        spec_json = json.dumps(spec, sort_keys=True)
        sandbox_options = {**SANDBOX_DEFAULTS, **dict(sandbox or {})}
        # The venv's own directory (not its bin/python link's target) is what the sandbox mounts.
        venv = interpreter.parent.parent
        try:
            self.listing = list_taskset(
                str(interpreter), spec_json, json.dumps(sandbox_options, sort_keys=True)
            )
        except ValueError as exc:
            where = f"env.options.taskset = {taskset!r}" if taskset else f"verifiers/{member}"
            raise ValueError(f"{where}: {exc}") from None
        needed = [str(venv)]
        if not _under_system(self.listing.base_prefix):
            needed.append(self.listing.base_prefix)
        if taskset_dir is not None:
            needed.append(taskset_dir)
        super().__init__(
            [str(interpreter), RUNNER_NAME, "run"],
            self._task_stream,
            files={RUNNER_NAME: str(RUNNER)},
            mounts=[*dict.fromkeys([*needed, *mounts])],
            env={**dict(env or {}), SPEC_VARIABLE: spec_json},
            sandbox=sandbox_options,
            name=f"verifiers/{member}",
            version=self.listing.verifiers,
            max_turns=max_turns,
            episode_timeout_s=episode_timeout_s,
            model=model,
            max_refused_requests=max_refused_requests,
        )

    def _task_stream(self, seed: int) -> Iterator[Task]:
        rng = random.Random(seed)
        order = list(self.listing.tasks)
        for cycle in itertools.count():
            rng.shuffle(order)
            for index, key, name in order:
                yield Task(id=f"{name}#{cycle}", seed=seed, data={"index": index, "key": key})


def _taskset_reference(member: str, taskset: str | None) -> tuple[str, str | None]:
    """(what the runner loads, the directory to mount): the member as an installed taskset id, or the
    ``taskset`` option, a ``.py`` file made absolute (its directory mounted) or a module name."""
    if taskset is None:
        return member, None
    if not isinstance(taskset, str) or not taskset.strip():
        raise ValueError(f"taskset must be a module name or a .py file, got {taskset!r}")
    target, colon, attr = taskset.partition(":")
    if not target.endswith(".py"):
        return taskset, None
    path = Path(target).expanduser().resolve()
    if not path.is_file():
        raise ValueError(f"taskset: {target!r} is not a file")
    return f"{path}{colon}{attr}", str(path.parent)


def factory_for(member: str) -> EnvFactory:
    """The factory of ``verifiers/<member>``. Calling it lists the taskset (once per process): a missing
    venv raises EcosystemMissing naming the make target, a taskset that does not load ValueError."""
    return functools.partial(VerifiersEnvironment, member)


def members() -> list[FamilyMember]:
    """The tasksets verifiers ships (read from the venv's files, nothing imported); any taskset package
    installed in the venv, or a ``taskset`` file, works too."""
    venv = venv_python("verifiers").parent.parent
    found = sorted(
        path.parent.name
        for path in venv.glob("lib/python*/site-packages/verifiers/v1/tasksets/*/__init__.py")
    )
    if not found:
        raise EcosystemMissing(f"no verifiers v1 tasksets under {venv}: rebuild it with `{MAKE_TARGET}`")
    return [FamilyMember(name, BUILTIN_NOTES.get(name, "")) for name in found]


FAMILY = EnvFamily(name="verifiers", factory_for=factory_for, members=members)
