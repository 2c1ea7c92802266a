"""What ``rollwise env check`` reports, and the bookkeeping its two paths share: stepped environments
(envs.checker) and agent environments (envs.check_agents).

Every criterion in CRITERIA is reported by name, pass or fail; a failure's detail names the episode
(and step) at fault, at most MAX_DETAILS problems per criterion; a passing criterion shows its note.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import json
import threading
import time
from collections.abc import Awaitable, Coroutine, Generator
from dataclasses import asdict, dataclass, field
from typing import Any, Generic, TypeVar

from envs.api import EnvFactory, Environment, Task, is_finite_number
from envs.sync_adapter import is_pool_thread

CRITERIA: tuple[str, ...] = (
    "spec_valid",
    "deterministic_tasks",
    "deterministic_reset",
    "observations_well_formed",
    "survives_random_actions",
    "rewards_finite",
    "ends_within_max_turns",
    "info_json_serializable",
    "close_idempotent",
    "no_leaked_tasks",
    "no_leaked_threads",
    "step_timeout_enforced",
    "gold_policy_scores",
    "forks_independent",
)
LEAK_GRACE_S = 0.5
MAX_DETAILS = 3

# asyncio.TimeoutError is builtins.TimeoutError only from Python 3.11 on.
TIMEOUTS = (asyncio.TimeoutError, TimeoutError)
T = TypeVar("T")


@dataclass
class CriterionResult:
    name: str
    passed: bool
    detail: str


@dataclass
class CheckReport:
    """Outcome of ``check_env``: one CriterionResult per name in CRITERIA, plus policy statistics."""

    env: str
    episodes: int
    seed: int
    criteria: list[CriterionResult]
    stats: dict[str, float] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(criterion.passed for criterion in self.criteria)

    def failures(self) -> list[CriterionResult]:
        return [criterion for criterion in self.criteria if not criterion.passed]

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, **asdict(self)}


class Findings:
    """Problems found so far, by criterion, plus the note shown when a criterion passes."""

    def __init__(self) -> None:
        self.problems: dict[str, list[str]] = {name: [] for name in CRITERIA}
        self.notes: dict[str, str] = {}

    def add(self, criterion: str, problem: str) -> None:
        self.problems[criterion].append(problem)

    def extend(self, other: Findings) -> None:
        """Add ``other``'s problems after these (notes are not taken)."""
        for name, problems in other.problems.items():
            self.problems[name].extend(problems)

    def results(self) -> list[CriterionResult]:
        results = []
        for name in CRITERIA:
            problems = self.problems[name]
            detail = "; ".join(problems[:MAX_DETAILS])
            if len(problems) > MAX_DETAILS:
                detail += f" (+{len(problems) - MAX_DETAILS} more)"
            results.append(CriterionResult(name, not problems, detail or self.notes.get(name, "ok")))
        return results


@dataclass
class EpisodeRecord:
    label: str
    turns: int = 0
    ended: bool = False
    outcome: float | None = None


def aborted(label: str, episodes: int, seed: int, reason: str) -> CheckReport:
    """The report of a check that could not start: ``spec_valid`` fails with ``reason``, the rest with
    "not run"."""
    criteria = [CriterionResult("spec_valid", False, reason)]
    criteria += [CriterionResult(name, False, "not run: no usable spec") for name in CRITERIA[1:]]
    return CheckReport(label, episodes, seed, criteria)


class SliceTimer(Generic[T]):
    """Awaitable around a coroutine that measures its longest synchronous stretch (seconds).

    Wall time of the whole await would also count other episodes' work; a stretch between two
    suspensions is time only this coroutine held the event loop.
    """

    def __init__(self, awaitable: Awaitable[T], what: str = "step()") -> None:
        if not inspect.isawaitable(awaitable):
            raise TypeError(f"{what} returned {type(awaitable).__name__}, not an awaitable (not async def?)")
        self.coroutine: Coroutine[Any, Any, T] = (
            awaitable if asyncio.iscoroutine(awaitable) else awaited(awaitable)
        )
        self.longest_s = 0.0

    def __await__(self) -> Generator[Any, Any, T]:
        to_send: Any = None
        to_throw: BaseException | None = None
        while True:
            started = time.perf_counter()
            try:
                yielded = self.coroutine.send(to_send) if to_throw is None else self.coroutine.throw(to_throw)
            except StopIteration as stop:
                self.longest_s = max(self.longest_s, time.perf_counter() - started)
                result: T = stop.value
                return result
            self.longest_s = max(self.longest_s, time.perf_counter() - started)
            try:
                to_send, to_throw = (yield yielded), None
            except GeneratorExit:
                self.coroutine.close()
                raise
            except BaseException as exc:  # cancellation included: the coroutine decides what to do
                to_send, to_throw = None, exc


async def awaited(awaitable: Awaitable[T]) -> T:
    return await awaitable


async def close_twice(env: Environment, label: str, timeout_s: float, findings: Findings) -> None:
    for attempt in ("first", "second"):
        try:
            await asyncio.wait_for(env.close(), timeout_s)
        except Exception as exc:
            findings.add("close_idempotent", f"{label}: {attempt} close() raised {exc!r}")
            return


def _task_key(task: Any) -> Any:
    if not isinstance(task, Task):
        return ("not a Task", repr(task))
    return (task.id, task.seed, json.dumps(dict(task.data), sort_keys=True, default=repr))


async def check_tasks(
    factory: EnvFactory,
    options: dict[str, Any],
    probe: Environment,
    count: int,
    seed: int,
    findings: Findings,
) -> list[Task]:
    """The first ``count`` tasks of ``probe.tasks(seed)``, judged (``deterministic_tasks``) against a
    second instance's stream."""
    first = list(itertools.islice(probe.tasks(seed), count))
    other = factory(**options)
    try:
        second = list(itertools.islice(other.tasks(seed), count))
    finally:
        await close_twice(other, "task stream probe", probe.spec.step_timeout_s, findings)
    bad = [task for task in first if not isinstance(task, Task)]
    if bad:
        findings.add("deterministic_tasks", f"tasks({seed}) yielded {type(bad[0]).__name__}, not Task")
    if len(first) < count:
        findings.add(
            "deterministic_tasks", f"tasks({seed}) ended after {len(first)} tasks (needs an infinite stream)"
        )
    if [_task_key(t) for t in first] != [_task_key(t) for t in second]:
        findings.add("deterministic_tasks", f"tasks({seed}) differs between two instances")
    findings.notes["deterministic_tasks"] = f"{len(first)} tasks identical across two instances"
    return [task for task in first if isinstance(task, Task)]


def policy_stats(prefix: str, episodes: list[EpisodeRecord]) -> dict[str, float]:
    # A missing or non-finite outcome scores 0 (rewards_finite reports the latter).
    outcomes = [
        ep.outcome if ep.outcome is not None and is_finite_number(ep.outcome) else 0.0 for ep in episodes
    ]
    count = max(len(episodes), 1)
    return {
        f"{prefix}_mean_outcome": sum(outcomes) / count,
        f"{prefix}_success_rate": sum(1 for o in outcomes if o >= 1.0) / count,
        f"{prefix}_mean_turns": sum(ep.turns for ep in episodes) / count,
    }


async def collect_leaked_tasks(before: set[asyncio.Task[Any]], findings: Findings) -> None:
    """Report (``no_leaked_tasks``) and cancel the tasks started since ``before`` that still run after
    LEAK_GRACE_S."""
    current = asyncio.current_task()
    deadline = time.monotonic() + LEAK_GRACE_S
    leaked: list[asyncio.Task[Any]] = []
    while True:
        leaked = [t for t in asyncio.all_tasks() if t not in before and t is not current and not t.done()]
        if not leaked or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.02)
    for task in leaked:
        findings.add(
            "no_leaked_tasks", f"task {task.get_name()} running {task.get_coro()!r:.80} outlived its episode"
        )
        task.cancel()  # the checker must not leave them behind either
    await asyncio.gather(*leaked, return_exceptions=True)


def collect_leaked_threads(before: set[threading.Thread], findings: Findings) -> None:
    """Report (``no_leaked_threads``) the threads started since ``before`` that outlive LEAK_GRACE_S;
    shared adapter pools and the loop's default executor live as long as the process / loop."""
    deadline = time.monotonic() + LEAK_GRACE_S
    for thread in threading.enumerate():
        if thread in before or is_pool_thread(thread) or thread.name.startswith("asyncio_"):
            continue
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            findings.add("no_leaked_threads", f"thread {thread.name!r} outlived its episode")
