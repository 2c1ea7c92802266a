"""Harbor task directories read without Harbor: what a task asks for, and why one cannot run here.

A task (Harbor's format, terminal-bench's successor) is a directory:

    task.toml            [task] name, [verifier] timeout_sec, [agent] timeout_sec,
                         [environment] docker_image | cpus, memory_mb, storage_mb, gpus, allow_internet, env
    instruction.md       the prompt
    environment/         Dockerfile (or docker-compose.yaml) and the files it copies
    tests/test.sh        the verifier: writes /logs/verifier/reward.txt (a number) or reward.json
    solution/solve.sh    the oracle (optional)

rollwise runs a task on the host's own userland inside bubblewrap, without building an image: the
Dockerfile may say FROM (any base: the host's /usr stands in for it), WORKDIR (required: the task's
directory, where the episode starts), COPY (files of environment/ into the WORKDIR tree) and ENV;
instructions that only describe a container (CMD, ENTRYPOINT, EXPOSE, LABEL, ARG, SHELL, STOPSIGNAL,
HEALTHCHECK, VOLUME) are ignored. Anything that changes the image (RUN, ADD, USER, ONBUILD), a
prebuilt `docker_image`, a docker-compose environment, or GPUs make a task unrunnable here; `problems`
says which line or key and why, so `rollwise env check` refuses the task set with the reason.

Limits: `memory_mb` caps each process's address space, `storage_mb` each file's size; `cpus` is not
enforced (the sandbox's commands run one at a time); the sandbox has no network, whatever
`allow_internet` says.
"""

from __future__ import annotations

import shlex
import tomllib
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

DEFAULT_AGENT_TIMEOUT_S = 600.0
DEFAULT_VERIFIER_TIMEOUT_S = 600.0
IGNORED = frozenset(
    {
        "CMD",
        "ENTRYPOINT",
        "EXPOSE",
        "LABEL",
        "ARG",
        "SHELL",
        "STOPSIGNAL",
        "HEALTHCHECK",
        "VOLUME",
        "MAINTAINER",
    }
)
IMAGE_CHANGES = frozenset({"RUN", "ADD", "USER", "ONBUILD"})


@dataclass(frozen=True)
class HarborTask:
    """One task directory as rollwise runs it (module docstring). `copies` maps a file of environment/
    to its path relative to `workdir`; `problems` is empty when the task can run here."""

    path: Path
    name: str
    instruction: str
    workdir: str
    copies: tuple[tuple[Path, str], ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    agent_timeout_s: float = DEFAULT_AGENT_TIMEOUT_S
    verifier_timeout_s: float = DEFAULT_VERIFIER_TIMEOUT_S
    memory_bytes: int | None = None
    file_bytes: int | None = None
    solution: str | None = None
    problems: tuple[str, ...] = ()

    @property
    def test_files(self) -> dict[str, bytes]:
        """tests/ as {relative path: content}: what the verifier finds under /tests."""
        root = self.path / "tests"
        return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def find_task_dirs(root: Path) -> list[Path]:
    """`root` when it is a task (holds task.toml), else every task directory below it, sorted."""
    if (root / "task.toml").is_file():
        return [root]
    return sorted(p.parent for p in root.rglob("task.toml"))


def _dockerfile_lines(text: str) -> list[tuple[int, str]]:
    """(first line number, instruction) with continuations joined and comments dropped."""
    lines: list[tuple[int, str]] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending.append(stripped[:-1].strip())
            continue
        pending.append(stripped)
        lines.append((start, " ".join(part for part in pending if part)))
        pending = []
    if pending:
        lines.append((start, " ".join(pending)))
    return lines


def _inside_workdir(workdir: str, destination: str) -> str | None:
    """`destination` relative to `workdir` ("" for the workdir itself), or None when it is outside."""
    target = PurePosixPath(workdir) / destination
    parts: list[str] = []
    for part in target.parts[1:]:
        if part == "..":
            if not parts:
                return None
            parts.pop()
        elif part != ".":
            parts.append(part)
    resolved = PurePosixPath("/", *parts)
    if resolved != PurePosixPath(workdir) and not resolved.is_relative_to(workdir):
        return None
    return str(resolved.relative_to(workdir)) if resolved != PurePosixPath(workdir) else ""


def _copies(
    context: Path, sources: list[str], destination: str, workdir: str, where: str
) -> tuple[list[tuple[Path, str]], list[str]]:
    relative = _inside_workdir(workdir, destination)
    if relative is None:
        return [], [
            f"{where}: COPY to {destination} leaves WORKDIR {workdir} (only the WORKDIR tree is the task's)"
        ]
    copies: list[tuple[Path, str]] = []
    for source in sources:
        path = (context / source).resolve()
        if not path.is_relative_to(context.resolve()) or not path.exists():
            return [], [f"{where}: COPY source {source!r} is not a file or directory of environment/"]
        into_dir = destination.endswith("/") or len(sources) > 1 or path.is_dir()
        if path.is_dir():
            for file in sorted(p for p in path.rglob("*") if p.is_file()):
                copies.append((file, str(PurePosixPath(relative) / file.relative_to(path).as_posix())))
        else:
            copies.append((path, str(PurePosixPath(relative) / path.name) if into_dir else relative))
    return copies, []


def read_dockerfile(context: Path) -> tuple[str, list[tuple[Path, str]], dict[str, str], list[str]]:
    """(workdir, copies, env, problems) of `context`/Dockerfile (module docstring)."""
    dockerfile = context / "Dockerfile"
    if (context / "docker-compose.yaml").exists() or (context / "docker-compose.yml").exists():
        return "", [], {}, ["environment/docker-compose.yaml: several containers need Docker"]
    if not dockerfile.is_file():
        return "", [], {}, ["environment/Dockerfile is missing"]
    workdir = ""
    copies: list[tuple[Path, str]] = []
    env: dict[str, str] = {}
    problems: list[str] = []
    for number, line in _dockerfile_lines(dockerfile.read_text()):
        where = f"environment/Dockerfile line {number}"
        words = shlex.split(line, posix=True)
        keyword, args = words[0].upper(), words[1:]
        if keyword == "FROM" or keyword in IGNORED:
            continue
        if keyword in IMAGE_CHANGES:
            problems.append(
                f"{where}: `{line[:80]}` changes the image; rollwise runs tasks on the host's userland "
                "without building one"
            )
        elif keyword == "WORKDIR" and args:
            workdir = str(PurePosixPath(workdir or "/") / args[0])
        elif keyword == "ENV" and args:
            pairs = [a.split("=", 1) for a in args] if "=" in args[0] else [[args[0], " ".join(args[1:])]]
            env.update({k: v for k, v in (p if len(p) == 2 else (p[0], "") for p in pairs)})
        elif keyword == "COPY" and len(args) >= 2:
            args = [a for a in args if not a.startswith("--")]
            if not workdir:
                problems.append(f"{where}: COPY before WORKDIR (the destination has no directory)")
                continue
            found, wrong = _copies(context, args[:-1], args[-1], workdir, where)
            copies += found
            problems += wrong
        else:
            problems.append(f"{where}: `{line[:80]}` is not an instruction rollwise can apply")
    if not workdir:
        problems.append("environment/Dockerfile: no WORKDIR (rollwise needs the task's directory)")
    elif workdir.rstrip("/") in (
        "",
        "/tmp",
        "/proc",
        "/dev",
        "/tests",
        "/logs",
        "/usr",
        "/etc",
        "/bin",
        "/lib",
    ):
        problems.append(
            f"environment/Dockerfile: WORKDIR {workdir} is a system path; use a directory of its own"
        )
    return workdir, copies, env, problems


def _number(
    table: dict[str, Any], key: str, default: float | None, where: str, problems: list[str]
) -> float | None:
    value = table.get(key, default)
    if value is None or (isinstance(value, int | float) and not isinstance(value, bool) and value > 0):
        return None if value is None else float(value)
    problems.append(f"task.toml [{where}] {key} must be a positive number, got {value!r}")
    return default


def read_task(path: Path) -> HarborTask:
    """The task in directory `path`; its `problems` say why it cannot run here (none: it can)."""
    problems: list[str] = []
    try:
        config = tomllib.loads((path / "task.toml").read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        config = {}
        problems.append(f"task.toml: {exc}")
    instruction_file = path / "instruction.md"
    instruction = instruction_file.read_text().strip() if instruction_file.is_file() else ""
    if not instruction:
        problems.append("instruction.md is missing or empty")
    if not (path / "tests" / "test.sh").is_file():
        problems.append("tests/test.sh is missing (the verifier that writes the reward)")
    environment = config.get("environment", {})
    if environment.get("docker_image"):
        problems.append(
            f"task.toml [environment] docker_image = {environment['docker_image']!r}: a prebuilt image"
        )
    if environment.get("gpus"):
        problems.append(f"task.toml [environment] gpus = {environment['gpus']!r}: the sandbox has no GPU")
    workdir, copies, env, dockerfile_problems = read_dockerfile(path / "environment")
    problems += dockerfile_problems
    env.update({str(k): str(v) for k, v in environment.get("env", {}).items()})
    memory_mb = _number(environment, "memory_mb", None, "environment", problems)
    storage_mb = _number(environment, "storage_mb", None, "environment", problems)
    agent_s = _number(config.get("agent", {}), "timeout_sec", DEFAULT_AGENT_TIMEOUT_S, "agent", problems)
    verifier_s = _number(
        config.get("verifier", {}), "timeout_sec", DEFAULT_VERIFIER_TIMEOUT_S, "verifier", problems
    )
    solution = path / "solution" / "solve.sh"
    return HarborTask(
        path=path,
        name=str(config.get("task", {}).get("name") or path.name),
        instruction=instruction,
        workdir=workdir,
        copies=tuple(copies),
        env=env,
        agent_timeout_s=agent_s or DEFAULT_AGENT_TIMEOUT_S,
        verifier_timeout_s=verifier_s or DEFAULT_VERIFIER_TIMEOUT_S,
        memory_bytes=int(memory_mb * 2**20) if memory_mb else None,
        file_bytes=int(storage_mb * 2**20) if storage_mb else None,
        solution=solution.read_text() if solution.is_file() else None,
        problems=tuple(problems),
    )
