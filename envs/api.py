"""The environment plugin contract (docs/architecture.md, Contract 3).

An environment is asynchronous and lives for exactly one episode: the runner makes one instance
per episode with ``factory(**options)``, calls ``reset(task)`` once, then ``step(action)`` once per
assistant turn until a ``StepResult`` has ``done`` or ``truncated`` set, and always awaits ``close()``.

Agent mistakes (unparseable text, bad tool arguments) are *observations*: the step returns a message
that explains the mistake, optionally a negative ``reward``, and the turn counts. Failures of the
environment itself raise ``EnvError``; the runner then excludes the episode from training.
"""

from __future__ import annotations

import math
import numbers
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

Message = dict[str, Any]
"""A chat message: ``{"role": "system"|"user"|"assistant"|"tool", "content": str}``, optional ``"name"``."""

MESSAGE_ROLES = frozenset({"system", "user", "assistant", "tool"})
# One optional "/" separates a family from its member: "textarena/GuessTheNumber-v0" (see EnvFamily).
ENV_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


def is_finite_number(value: object) -> bool:
    """A reward, outcome or limit must be a finite real number (bool is not one)."""
    if type(value) is float or type(value) is int:  # the usual case, without the ABC check
        return math.isfinite(value)
    if isinstance(value, bool):
        return False
    return isinstance(value, numbers.Real) and math.isfinite(value)


class EnvError(Exception):
    """The environment itself failed (not the agent): the episode is excluded from training.

    ``kind`` is the reason the runner counts it under (``rollwise_env_errors_total{kind}``); subclasses
    for a known cause set one of the runner's kinds (e.g. ``envs.judge.JudgeError``: "judge").
    """

    kind: str = "error"


@dataclass(frozen=True)
class Task:
    """One initial condition. Every episode of a group receives the same Task.

    ``data`` holds whatever the environment needs to rebuild the start state (JSON-serialisable);
    ``reset(task)`` must be a pure function of this object.
    """

    id: str
    seed: int
    data: Mapping[str, Any]


@dataclass(frozen=True)
class ToolCall:
    """A tool call the runner parsed out of the assistant's text."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class Action:
    """One assistant turn.

    ``text`` is the assistant's raw text without the end-of-turn token (tool-call markup included).
    ``tool_calls`` are the calls the runner parsed from it; ``tool_call_errors`` describe call markup
    it found but could not parse (e.g. invalid JSON), so the environment can answer with the error.
    """

    text: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_errors: tuple[str, ...] = ()


FORMAT_ERROR = "format_error"
"""``StepResult.info`` key: the answer's format was wrong (see StepResult)."""


@dataclass
class StepResult:
    """What one ``step`` returns.

    ``messages`` are appended to the conversation (user or tool roles). ``reward`` is the shaping
    reward of the turn just taken. ``done`` means the task ended it (solved or failed); ``truncated``
    means a limit ended it (e.g. ``max_turns``). The episode ends when either is set. ``outcome`` is
    the task score, set on the final step (built-in environments: 1.0 solved, 0.0 not). ``info`` must
    be JSON-serialisable (metrics, reward parts).

    Optional convention: ``info[FORMAT_ERROR]`` (``"format_error"``) set to ``True`` or a short reason
    (``"no <answer> tag"``) says the turn's answer did not follow the format the environment asks for,
    as opposed to a wrong answer. The runner counts such steps (``rollwise_answer_format_errors_total``):
    a policy drifting away from the format is otherwise a silent failure. Absent or false: no error.
    """

    messages: list[Message]
    reward: float = 0.0
    done: bool = False
    truncated: bool = False
    outcome: float | None = None
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class EnvSpec:
    """Static description of an environment.

    ``max_turns``: the environment ends every episode (done or truncated) within this many steps.
    ``step_timeout_s`` / ``episode_timeout_s``: wall-clock limits the runner enforces (seconds).
    ``tools``: OpenAI function schemas, ``{"type": "function", "function": {"name", "parameters"}}``.
    ``action_hints``: the complete answers the environment accepts, when they are few enough to list
    (guess-number: the numbers low..high). Optional; the learner's action prior
    (``learner.regularizers.action_prior_coef``) keeps a floor of probability on their first tokens.

    Construction raises ``ValueError`` naming the field for values that can never work;
    ``validate()`` additionally reports softer problems (tool schema shape, name characters).
    """

    name: str
    version: str
    max_turns: int
    step_timeout_s: float = 10.0
    episode_timeout_s: float = 120.0
    tools: tuple[dict[str, Any], ...] = ()
    action_hints: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        problems = self._field_problems()
        if problems:
            raise ValueError("invalid EnvSpec: " + "; ".join(problems))

    def _field_problems(self) -> list[str]:
        problems: list[str] = []
        if not isinstance(self.name, str) or not self.name.strip():
            problems.append(f"name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.version, str) or not self.version.strip():
            problems.append(f"version must be a non-empty string, got {self.version!r}")
        if isinstance(self.max_turns, bool) or not isinstance(self.max_turns, int) or self.max_turns < 1:
            problems.append(f"max_turns must be an integer >= 1, got {self.max_turns!r}")
        for field_name in ("step_timeout_s", "episode_timeout_s"):
            value = getattr(self, field_name)
            if not is_finite_number(value):
                problems.append(f"{field_name} must be a finite number of seconds, got {value!r}")
            elif value <= 0:
                problems.append(f"{field_name} must be > 0, got {value!r}")
        tools: Any = self.tools  # typed as a tuple, but plugins may pass anything at runtime
        if not isinstance(tools, tuple):
            problems.append(f"tools must be a tuple of dicts, got {type(tools).__name__}")
        hints: Any = self.action_hints
        if not isinstance(hints, tuple):
            problems.append(f"action_hints must be a tuple of strings, got {type(hints).__name__}")
        else:
            bad = [h for h in hints if not isinstance(h, str) or not h.strip()]
            if bad:
                problems.append(f"action_hints must be non-empty strings, got {bad[:3]!r}")
        return problems

    def validate(self) -> list[str]:
        """Every problem with this spec, each naming its field; empty when the spec is sound."""
        problems = self._field_problems()
        timeouts_are_numbers = not problems
        if isinstance(self.name, str) and self.name and not ENV_NAME_PATTERN.match(self.name):
            problems.append(f"name {self.name!r} must match {ENV_NAME_PATTERN.pattern}")
        if timeouts_are_numbers and self.episode_timeout_s < self.step_timeout_s:
            problems.append(
                f"episode_timeout_s ({self.episode_timeout_s}) is shorter than step_timeout_s "
                f"({self.step_timeout_s})"
            )
        if isinstance(self.tools, tuple):
            problems.extend(_tool_schema_problems(self.tools))
        return problems


def _tool_schema_problems(tools: tuple[Any, ...]) -> list[str]:
    problems: list[str] = []
    seen: set[str] = set()
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            problems.append(f'{where} must be a dict with "type": "function"')
            continue
        function = tool.get("function")
        if not isinstance(function, dict):
            problems.append(f'{where}.function must be a dict with "name" and "parameters"')
            continue
        name = function.get("name")
        if not isinstance(name, str) or not name:
            problems.append(f"{where}.function.name must be a non-empty string")
        elif name in seen:
            problems.append(f"{where}.function.name {name!r} is declared twice")
        else:
            seen.add(name)
        parameters = function.get("parameters", {"type": "object"})
        if not isinstance(parameters, dict) or parameters.get("type") != "object":
            problems.append(f'{where}.function.parameters must be a JSON schema with "type": "object"')
    return problems


class Environment(ABC):
    """One episode of an asynchronous multi-turn environment (see the module docstring)."""

    spec: EnvSpec

    @abstractmethod
    def tasks(self, seed: int) -> Iterator[Task]:
        """An infinite stream of tasks; the same seed yields the same stream."""

    @abstractmethod
    async def reset(self, task: Task) -> list[Message]:
        """Start the episode; the initial messages are a pure function of ``task``."""

    @abstractmethod
    async def step(self, action: Action) -> StepResult:
        """Apply one assistant turn and return the environment's answer."""

    async def close(self) -> None:  # noqa: B027 - optional hook, a no-op unless overridden
        """Release resources. Safe to call more than once and before ``reset``."""

    async def fork(self) -> Environment:
        """A second environment in this one's state, taken between turns, that continues on its own: a
        tree rollout branches an episode here (`rollout.branch_turn`). Rule: stepping or closing either
        never changes the other. Optional: the default says this environment cannot fork."""
        raise NotImplementedError(f"{type(self).__name__} cannot fork: it does not define fork()")

    def gold_action(self) -> str | None:
        """The text an ideal agent would send next, given the hidden state; None if not provided."""
        return None

    def gold_unavailable(self) -> str | None:
        """Why `gold_action()` gives None (e.g. "the library has no solver"), for `env check`; optional."""
        return None


def can_fork(env: Environment) -> bool:
    """Whether ``env`` defines ``fork`` (a tree rollout needs it)."""
    return type(env).fork is not Environment.fork


EnvFactory = Callable[..., Environment]
"""``factory(**options) -> Environment``: makes one instance per episode (a class is a factory)."""


@dataclass(frozen=True)
class FamilyMember:
    """One environment of a family; ``note`` says what it needs or why it cannot run here ("" if nothing)."""

    name: str
    note: str = ""


@dataclass(frozen=True)
class EnvFamily:
    """Many environments behind one entry point (group ``rollwise.env_families``), named ``family/member``:
    the adapters for environment libraries (``reasoning-gym/<dataset>``, ``textarena/<EnvId>``).

    ``factory_for(member)`` returns the member's factory, or raises ValueError (unknown or unusable member,
    naming why) or ImportError (the library is not installed); ``members()`` lists what the library offers.
    Both may import the library; listing entry points does not call them.
    """

    name: str
    factory_for: Callable[[str], EnvFactory]
    members: Callable[[], list[FamilyMember]]
