"""Agent-function environments: the episode is the user's own program, talking to an OpenAI client.

    async def agent(client: openai.AsyncOpenAI, task: Task) -> float | AgentResult

The runner hands every episode a fresh ``openai.AsyncOpenAI`` whose base URL and key belong to that
episode alone (rollwise's in-process endpoint, ``pipeline/supervisor/actors/agent_api/``). The agent calls
``client.chat.completions.create(model=POLICY_MODEL, ...)`` as often as it likes and returns the episode's
score: a number (the outcome) or an ``AgentResult`` (outcome and, optionally, one shaping reward per chat
completion). Every request is one *turn*; the generated tokens are recorded exactly as the engine made them.

The endpoint also speaks the Responses API (``{base}/responses``) and the Anthropic Messages API
(``anthropic_base_url(client)`` + ``/v1/messages``). A framework that builds its own client takes
``str(client.base_url)`` and ``client.api_key`` from the one it was given.

An agent that raises ends its episode as ``env_error``, one past ``episode_timeout_s`` as ``timeout``;
neither is scored 0. A request beyond ``max_turns`` gets HTTP 400 (``max_turns_exceeded``) and the episode
ends ``truncated``; ``max_refused_requests`` refused requests in a row stop the agent (``env_error``).

This module imports nothing of the pipeline and not ``openai``: the runner makes the client.
``AgentEnvironment`` is an ``Environment`` only so that the spec, task stream and ``close`` reach the
runner the usual way; its ``reset``/``step`` are never called.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from envs.api import Action, EnvError, Environment, EnvSpec, Message, StepResult, Task, is_finite_number

if TYPE_CHECKING:
    from openai import AsyncOpenAI

POLICY_MODEL = "policy"
"""The model name the endpoint serves the policy under (``/v1/models``); requests must use it."""


@dataclass(frozen=True)
class AgentResult:
    """What an agent returns when a bare number (the outcome) is not enough.

    ``outcome``: the task score (success means >= 1.0, as for every environment); None leaves the
    episode scored by its turn rewards. ``turn_rewards``: a shaping reward per chat completion the agent
    requested, in request order (fewer than the turns taken: the rest are 0.0). ``info``: JSON-serialisable
    extras, logged with the episode.
    """

    outcome: float | None = None
    turn_rewards: Sequence[float] = ()
    info: dict[str, Any] = field(default_factory=dict)


AgentFunction = Callable[["AsyncOpenAI", Task], Awaitable["float | AgentResult"]]
TaskSource = Callable[[int], Iterator[Task]]


def anthropic_base_url(client: AsyncOpenAI) -> str:
    """The episode's Anthropic base URL (for ``anthropic.AsyncAnthropic(base_url=..., api_key=...)``, which
    appends ``/v1/messages``), from the episode's openai client (whose base URL ends in ``/v1``)."""
    return str(client.base_url).rstrip("/").removesuffix("/v1")


@dataclass(frozen=True)
class AgentEpisode:
    """Where one episode's agent reaches the policy (what the runner hands ``AgentEnvironment.play``).

    ``openai_base_url`` ends in ``/v1``; ``anthropic_base_url`` is the same without it; ``api_key`` is the
    episode's own key (any of the ``Authorization: Bearer`` and ``x-api-key`` headers may carry it);
    ``unix_socket`` is the endpoint's Unix socket serving the same routes (for a sandbox without a
    network), None when the endpoint has none; ``client()`` makes the ``openai.AsyncOpenAI`` agent
    functions get."""

    episode_id: str
    openai_base_url: str
    anthropic_base_url: str
    api_key: str
    model: str
    unix_socket: str | None
    client: Callable[[], AsyncOpenAI]


class AgentFailure(Exception):
    """An agent run that failed in a known way: ``finish`` is the episode's finish reason ("env_error" or
    "timeout"), ``kind`` its ENV_ERRORS kind, ``reason`` a finer label (e.g. a process's exit)."""

    def __init__(
        self, message: str, *, finish: str = "env_error", kind: str = "agent", reason: str = ""
    ) -> None:
        super().__init__(message)
        self.finish = finish
        self.kind = kind
        self.reason = reason or kind


def as_agent_result(value: object) -> AgentResult:
    """The agent's return value as an AgentResult; ValueError naming what is wrong with it."""
    if isinstance(value, AgentResult):
        result = value
    elif is_finite_number(value):
        return AgentResult(outcome=float(value))  # type: ignore[arg-type]
    else:
        raise ValueError(f"the agent returned {value!r:.80}; expected a finite number or an AgentResult")
    if result.outcome is not None and not is_finite_number(result.outcome):
        raise ValueError(f"AgentResult.outcome is {result.outcome!r}; expected a finite number or None")
    rewards = list(result.turn_rewards)
    bad = [r for r in rewards if not is_finite_number(r)]
    if bad:
        raise ValueError(f"AgentResult.turn_rewards holds non-finite or non-numeric values {bad[:3]!r}")
    return AgentResult(
        outcome=None if result.outcome is None else float(result.outcome),
        turn_rewards=tuple(float(r) for r in rewards),
        info=dict(result.info),
    )


def _reference(function: Callable[..., Any]) -> str | None:
    """``module:qualname`` of a module-level function (importable by a worker process), else None."""
    module, qualname = getattr(function, "__module__", None), getattr(function, "__qualname__", "")
    if not module or not qualname or "<" in qualname:
        return None
    return f"{module}:{qualname}"


def _load(path_or_object: str | Callable[..., Any], option: str) -> Callable[..., Any]:
    if not isinstance(path_or_object, str):
        if not callable(path_or_object):
            raise ValueError(f"{option} must be callable or a 'module:attr' / 'file.py:attr' path")
        return path_or_object
    from envs.discovery import EnvDiscoveryError, load_object

    try:
        target = load_object(path_or_object)
    except EnvDiscoveryError as exc:
        raise ValueError(f"{option}: {exc}") from None
    if not callable(target):
        raise ValueError(f"{option}: {path_or_object!r} is {target!r}, which is not callable")
    return target


class AgentEnvironment(Environment):
    """An environment whose episode is ``agent(client, task)`` (see the module docstring).

    ``agent`` and ``tasks`` are callables or paths to them (``"pkg.module:attr"`` or
    ``"path/to/file.py:attr"``, relative to the working directory); as the ``agent`` entry point they come
    from ``env.options``. ``tasks(seed)`` must yield the same infinite stream for the same seed.
    ``max_turns`` caps the chat completions of one episode; ``episode_timeout_s`` bounds the whole agent
    run; ``model`` is the name requests must use (``/v1/models`` lists it); ``max_refused_requests``:
    refused requests in a row after which the agent is stopped (a loop on refusals ends the episode).
    ``agent_ref`` is the ``agent`` path when given as one (what a worker process imports), else
    ``module:qualname`` of the function.
    """

    def __init__(
        self,
        agent: str | AgentFunction,
        tasks: str | TaskSource,
        *,
        name: str = "agent",
        version: str = "1",
        max_turns: int = 16,
        episode_timeout_s: float = 300.0,
        model: str = POLICY_MODEL,
        tools: Sequence[dict[str, Any]] = (),
        max_refused_requests: int = 8,
    ) -> None:
        self.agent: AgentFunction = _load(agent, "agent")
        self.agent_ref = agent if isinstance(agent, str) else _reference(self.agent)
        self._tasks: TaskSource = _load(tasks, "tasks")
        if not isinstance(model, str) or not model.strip():
            raise ValueError(f"model must be a non-empty string, got {model!r}")
        if not is_finite_number(episode_timeout_s) or episode_timeout_s <= 0:
            raise ValueError(f"episode_timeout_s must be a positive number, got {episode_timeout_s!r}")
        self.model = model
        if isinstance(max_refused_requests, bool) or not isinstance(max_refused_requests, int):
            raise ValueError(f"max_refused_requests must be an integer, got {max_refused_requests!r}")
        if max_refused_requests < 1:
            raise ValueError(f"max_refused_requests must be >= 1, got {max_refused_requests}")
        self.max_refused_requests = max_refused_requests
        # step_timeout_s bounds close(); an agent's own time is bounded by episode_timeout_s alone.
        self.spec = EnvSpec(
            name=name,
            version=version,
            max_turns=max_turns,
            step_timeout_s=min(10.0, float(episode_timeout_s)),
            episode_timeout_s=float(episode_timeout_s),
            tools=tuple(tools),
        )

    def tasks(self, seed: int) -> Iterator[Task]:
        return iter(self._tasks(seed))

    async def run(self, client: AsyncOpenAI, task: Task) -> AgentResult:
        """Run the agent once; its return value checked (ValueError) and normalised."""
        return as_agent_result(await self.agent(client, task))

    async def play(self, episode: AgentEpisode, task: Task) -> object:
        """One episode's agent run (what the runner awaits): ``agent(episode.client(), task)``. Returns
        what the agent returned (checked by the runner); a subclass may run something else against the
        same endpoint (envs/agent_process/process_agent.py runs a command)."""
        return await self.agent(episode.client(), task)

    async def reset(self, task: Task) -> list[Message]:
        raise EnvError(_NOT_STEPPED)

    async def step(self, action: Action) -> StepResult:
        raise EnvError(_NOT_STEPPED)


_NOT_STEPPED = (
    "an agent environment runs its agent function against rollwise's OpenAI endpoint; reset/step are not "
    "part of it (run it with `rollwise run`, or pipeline.supervisor.actors.agent_api.openai_endpoint in code)"
)
