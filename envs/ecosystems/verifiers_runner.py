"""The verifiers side of `verifiers/<taskset>` (envs/ecosystems/verifiers_env.py): run by the verifiers
venv's interpreter, never imported by rollwise (verifiers' mcp/openai pins conflict with rollwise's).

    python verifiers_runner.py list     # the taskset's tasks, one JSON document on stdout
    python verifiers_runner.py run      # one episode, as an agent-process command

Both read the spec from ``$ROLLWISE_VERIFIERS`` (JSON): ``taskset`` (an installed taskset id, a module
name, or a ``.py`` file, optionally ``:ClassName`` for the Taskset subclass when its module exports
several), ``taskset_config`` (its TasksetConfig fields), ``env_config`` (EnvConfig fields: an Env
subclass's own knobs and seats), ``harness`` (an id or a HarnessConfig table, for every seat; none: the
taskset's default), ``sampling`` (SamplingConfig fields), ``max_tasks`` (how many tasks ``list`` reads).

``list`` prints ``{"verifiers", "taskset", "env", "harnesses", "infinite", "tasks": [{"index", "key",
"name"}], "base_prefix"}``. ``run`` takes the task (``{"data": {"index", "key"}}``) on stdin, plays it
as verifiers' own Env does (``Env.run_episode``: its seats, harness program and scoring) with every
seat on the local subprocess runtime and every model call through the episode's endpoint
(``$OPENAI_BASE_URL``, ``$ROLLWISE_MODEL``), and writes ``{"outcome": <the trainable seats' reward>,
"info": {...}}`` to ``$ROLLWISE_OUTCOME_FILE``. Rules:

- a rollout is never retried (its requests are the episode's turns: a retry would train one attempt's
  tokens on another's reward);
- an episode that verifiers records as failed (any error, a trace not ok, a reward not scored) exits 1
  with the error on the last line of stderr: the episode costs only itself;
- a taskset that cannot be loaded exits 2, naming the taskset and the exception.

Only the standard library at import time: verifiers is imported inside the functions.
"""

from __future__ import annotations

import asyncio
import atexit
import importlib
import importlib.metadata
import importlib.util
import json
import os
import sys
import time
import traceback
import types
from pathlib import Path
from typing import Any

STARTED = time.time()
SPEC_VARIABLE = "ROLLWISE_VERIFIERS"
MODULE_PREFIX = "rollwise_verifiers_taskset_"
LOAD_FAILED = 2
EPISODE_FAILED = 1


class LoadError(Exception):
    """The taskset (or its env, harness) cannot be loaded; the message names it and what to fix."""


class EpisodeFailed(Exception):
    """verifiers recorded the episode as failed; the message holds its errors."""


def _verifiers() -> Any:
    """``verifiers.v1``, imported by name: rollwise's own interpreter (and its type checker) never has it."""
    return importlib.import_module("verifiers.v1")


def _spec() -> dict[str, Any]:
    raw = os.environ.get(SPEC_VARIABLE)
    if not raw:
        raise LoadError(f"${SPEC_VARIABLE} is not set")
    spec = json.loads(raw)
    if not isinstance(spec, dict) or not isinstance(spec.get("taskset"), str):
        raise LoadError(f"${SPEC_VARIABLE} must be a JSON object with a 'taskset' string")
    return spec


def _module_from_file(path: Path) -> str:
    """Import a taskset file under a module name of its own, importable by name from the children
    verifiers starts (a Toolset runs as ``python -m <its module>``): its directory joins PYTHONPATH."""
    name = path.stem
    if not name.isidentifier():
        raise LoadError(f"taskset file {str(path)!r}: its name must be a Python identifier (it is imported)")
    directory = str(path.parent)
    if directory not in sys.path:
        sys.path.insert(0, directory)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join([directory, *[p for p in paths if p != directory]])
    if name in sys.modules:
        loaded = getattr(sys.modules[name], "__file__", None)
        if loaded is None or Path(loaded).resolve() != path:
            raise LoadError(f"taskset file {str(path)!r}: module name {name!r} is taken by {loaded!r}")
        return name
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise LoadError(f"taskset file {str(path)!r} cannot be imported")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return name


def _taskset_id(reference: str) -> str:
    """The id verifiers' loader imports: an installed id or module as given, a file imported first.
    ``:ClassName`` selects one Taskset subclass of a module that exports several (a module of our own
    exports just that class, and the module's Env and Harness subclasses, if any)."""
    target, _, attr = reference.partition(":")
    module_name = target
    if target.endswith(".py"):
        path = Path(target).expanduser().resolve()
        if not os.access(path, os.R_OK) or not path.is_file():
            raise LoadError(f"taskset file {target!r} does not exist or uid {os.getuid()} cannot read it")
        module_name = _module_from_file(path)
    if not attr:
        return module_name
    vf = _verifiers()
    module = importlib.import_module(module_name)
    chosen = getattr(module, attr, None)
    if not (isinstance(chosen, type) and issubclass(chosen, vf.Taskset)):
        raise LoadError(f"taskset {reference!r}: {attr!r} is not a verifiers Taskset subclass")
    alias = types.ModuleType(MODULE_PREFIX + module_name.replace(".", "_") + "_" + attr)
    alias.__file__ = getattr(module, "__file__", None)
    exported = [attr]
    for name in getattr(module, "__all__", ()):
        value = getattr(module, name, None)
        if isinstance(value, type) and issubclass(value, vf.Env | vf.Harness):
            exported.append(name)
    for name in exported:
        setattr(alias, name, getattr(module, name))
    alias.__all__ = exported  # type: ignore[attr-defined]
    sys.modules[alias.__name__] = alias
    return alias.__name__


def _config(spec: dict[str, Any]) -> Any:
    """The EnvConfig of the spec: the taskset's env (its own, else SingleAgentEnv) with every seat on
    the local subprocess runtime, the spec's harness, and no retries."""
    vf = _verifiers()
    agent_config_fields = importlib.import_module("verifiers.v1.configs.agent").agent_config_fields

    taskset = {**dict(spec.get("taskset_config") or {}), "id": _taskset_id(spec["taskset"])}
    raw = {**dict(spec.get("env_config") or {}), "taskset": taskset}
    config = vf.resolve_env_config(raw)
    harness = spec.get("harness")
    seats = {}
    for name, seat in agent_config_fields(config).items():
        update: dict[str, Any] = {"runtime": vf.SubprocessConfig(), "retries": vf.RetryConfig()}
        if harness is not None:
            table = {"id": harness} if isinstance(harness, str) else dict(harness)
            update["harness"] = vf.harness_config_type(table["id"]).model_validate(table)
        seats[name] = seat.model_copy(update=update)
    return config.model_copy(update={**seats, "retries": vf.RetryConfig()})


def _environment(spec: dict[str, Any]) -> Any:
    vf = _verifiers()

    try:
        return vf.load_environment(_config(spec))
    except LoadError:
        raise
    except Exception as exc:
        raise LoadError(
            f"verifiers cannot load taskset {spec['taskset']!r}: {type(exc).__name__}: {exc}"
        ) from exc


def _toolset_problems(env: Any) -> list[str]:
    """Tool servers verifiers would start as ``python -m <module>`` but that could never report their
    port (a module without a ``__main__`` block, a Toolset without its config type): verifiers waits
    180 s for the port of a server that died, so say it at listing."""
    task_type = type(env.taskset).task_type()
    servers = [*task_type.toolsets(env.taskset.config.task), *type(env.taskset).toolsets(env.taskset.config)]
    problems = []
    for server in servers:
        try:  # the check Toolset.run() makes first in its process, where a failure is never seen
            type(server)._config_cls()
        except TypeError as exc:
            problems.append(f"toolset {type(server).__name__}: {exc}")
        except AttributeError:
            pass
        module = sys.modules.get(type(server).__module__)
        source = getattr(module, "__file__", None)
        if source and hasattr(module, "__path__"):  # a package runs its __main__.py
            if not (Path(source).parent / "__main__.py").is_file():
                problems.append(
                    f"toolset {type(server).__name__}: package {type(server).__module__} has no __main__.py"
                )
        elif source and "__main__" not in Path(source).read_text(errors="replace"):
            problems.append(
                f'toolset {type(server).__name__} ({source}) has no `if __name__ == "__main__": '
                f"{type(server).__name__}.run()` block; verifiers runs it as `python -m "
                f"{type(server).__module__}`"
            )
    return problems


def list_tasks(spec: dict[str, Any]) -> dict[str, Any]:
    """The document ``list`` prints (module docstring)."""
    agent_config_fields = importlib.import_module("verifiers.v1.configs.agent").agent_config_fields

    env = _environment(spec)
    problems = _toolset_problems(env)
    if problems:
        raise LoadError("; ".join(problems))
    limit = int(spec.get("max_tasks") or 1000)
    tasks = []
    try:
        for task in env.taskset.take(limit):
            tasks.append({"index": task.data.idx, "key": task.key, "name": task.data.name or task.data.id})
    except Exception as exc:
        raise LoadError(f"taskset {spec['taskset']!r}: load() raised {type(exc).__name__}: {exc}") from exc
    if not tasks:
        raise LoadError(f"taskset {spec['taskset']!r} yields no task")
    harnesses = {
        name: seat.harness.id if seat.harness is not None else env._default_harness.id
        for name, seat in agent_config_fields(env.config).items()
    }
    return {
        "verifiers": importlib.metadata.version("verifiers"),
        "taskset": env.config.taskset.id,
        "env": type(env).__name__,
        "harnesses": harnesses,
        "infinite": not env.taskset.bounded,
        "tasks": tasks,
        "base_prefix": sys.base_prefix,
    }


def _task(env: Any, index: int, key: str) -> Any:
    for task in env.taskset.include(idx=[f"{index}:{index + 1}"]):
        if task.key != key:
            raise LoadError(
                f"task {index} of taskset {env.config.taskset.id!r} changed since it was listed (its key "
                f"{task.key[:12]} is not {key[:12]}): load() must yield the same tasks every time"
            )
        return task
    raise LoadError(f"taskset {env.config.taskset.id!r} has no task {index} any more")


def _reward_parts(trace: Any) -> tuple[dict[str, float | None], dict[str, float | None]]:
    rewards = {name: None if r is None else r.score for name, r in trace.rewards.items()}
    return rewards, dict(trace.metrics)


def _seconds(trace: Any) -> dict[str, float]:
    """The trace's stages in seconds (setup: the harness program's environment, by uv)."""
    stages = ("boot", "setup", "agent", "finalize", "scoring")
    return {name: round(getattr(trace.timing, name).duration, 3) for name in stages}


def outcome_of(episode: Any) -> dict[str, Any]:
    """The episode's outcome document; EpisodeFailed naming verifiers' errors when it failed."""
    errors = [f"{e.type}: {e.message}" for e in episode.errors]
    for trace in episode.traces:
        errors += [f"{trace.agent.name or 'agent'}: {e.type}: {e.message}" for e in trace.errors]
        if not trace.ok and not trace.errors:
            errors.append(f"{trace.agent.name or 'agent'}: stopped by {trace.stop_condition}")
    if errors or not episode.ok:
        raise EpisodeFailed("verifiers recorded the episode as failed: " + " | ".join(errors or ["not ok"]))
    scored = [t for t in episode.traces if t.agent.trainable]
    if not scored:
        raise EpisodeFailed("the episode has no trace of a trainable seat")
    unscored = [name for t in scored for name, r in t.rewards.items() if r is None]
    if unscored:
        raise EpisodeFailed(f"verifiers did not score the rewards {unscored}")
    seats = {}
    for trace in scored:
        rewards, metrics = _reward_parts(trace)
        seats[trace.agent.name or "agent"] = {
            "reward": trace.reward,
            "rewards": rewards,
            "metrics": metrics,
            "stop": trace.stop_condition,
            "turns": len(trace.calls),
            "seconds": _seconds(trace),
        }
    info: dict[str, Any] = next(iter(seats.values())) if len(seats) == 1 else {"seats": seats}
    outcome = sum(t.reward for t in scored) / len(scored)
    return {"outcome": outcome, "info": info}


async def run_episode(spec: dict[str, Any], data: dict[str, Any]) -> dict[str, Any]:
    """Play one task (``data``: ``{"index", "key"}``) against the episode's endpoint."""
    vf = _verifiers()

    env = _environment(spec)
    task = _task(env, int(data["index"]), str(data["key"]))
    client = vf.EvalClientConfig(base_url=os.environ["OPENAI_BASE_URL"], api_key_var="OPENAI_API_KEY")
    sampling = vf.SamplingConfig.model_validate(spec.get("sampling") or {})
    ctx = vf.ModelContext(model=os.environ["ROLLWISE_MODEL"], client=client, sampling=sampling)
    loaded = time.time()
    async with env.serving():
        episode = await env.run_episode(task, ctx)
    outcome = outcome_of(episode)
    # Where the episode's time went: starting verifiers and loading the taskset, then the episode.
    outcome["info"]["process_seconds"] = {
        "load": round(loaded - STARTED, 3),
        "episode": round(time.time() - loaded, 3),
    }
    return outcome


def _prepare_uv() -> None:
    """verifiers prepares each harness program (a PEP 723 script) with ``uv sync --script``: uv is the
    venv's own, and the scripts' dependencies come from the wheel index the make target built in the
    venv (envs/ecosystems/after-install-verifiers.sh), so no run needs the network."""
    venv = Path(sys.prefix)
    os.environ["PATH"] = os.pathsep.join([str(venv / "bin"), os.environ.get("PATH", "")])
    index = venv / "wheelhouse-index"
    if "UV_DEFAULT_INDEX" in os.environ:
        pass
    elif index.is_dir():
        os.environ["UV_DEFAULT_INDEX"] = index.as_uri()
    else:
        print(
            f"verifiers: no wheel index in {venv}, so uv fetches the harness program's dependencies from "
            f"PyPI, out of the sandbox's reach: run envs/ecosystems/after-install-verifiers.sh {venv}",
            file=sys.stderr,
        )
    os.environ.setdefault("UV_PYTHON", sys.executable)
    os.environ.setdefault("UV_PYTHON_DOWNLOADS", "never")
    os.environ.setdefault("UV_NO_PROGRESS", "1")


def main(argv: list[str]) -> int:
    command = argv[1] if len(argv) > 1 else ""
    if command not in ("list", "run"):
        print(f"usage: {argv[0]} list|run", file=sys.stderr)
        return LOAD_FAILED
    try:
        spec = _spec()
        if command == "list":
            print(json.dumps(list_tasks(spec)))
            return 0
        _prepare_uv()
        task = json.load(sys.stdin)
        outcome = asyncio.run(run_episode(spec, dict(task["data"])))
    except LoadError as exc:
        print(f"verifiers: {exc}", file=sys.stderr)
        return LOAD_FAILED
    except EpisodeFailed as exc:
        print(f"verifiers: {exc}", file=sys.stderr)
        return EPISODE_FAILED
    except Exception as exc:
        traceback.print_exc(file=sys.stderr)
        print(f"verifiers: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EPISODE_FAILED
    with open(os.environ["ROLLWISE_OUTCOME_FILE"], "w") as handle:
        json.dump(outcome, handle)
    return 0


def exit_now(code: int) -> None:
    """Exit after the atexit hooks (verifiers frees its runtimes there) but without tearing the
    interpreter's modules down, which costs every episode over a second of CPU for nothing."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main(sys.argv))
