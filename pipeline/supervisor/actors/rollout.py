"""The multi-turn episode runner (token-in/token-out) and the group runner.

One episode: `env.reset(task)` -> messages; the chat template renders the first prompt once
(pipeline.supervisor.actors.chat.ChatBuffer); then per turn k = 0, 1, ...: `/generate` with the buffer's ids
(rid `"{episode_id}-t{k}"`, affinity key = the group id, so every turn of the group's episodes hits the
same server, whose prefix cache holds their shared first prompt and each episode's history), the
output ids are appended verbatim, the decoded text is parsed into an Action (envs.toolcalls),
`env.step(action)` answers, and only the reply's new tokens are appended.

Per-token columns (pipeline.contracts.schema.EpisodeSegment):
- prompt tokens (and the whole re-rendered prompt of a later segment): turn_index -1;
- tokens generated in turn k: turn_index k, loss mask 1, the engine's log-probs verbatim, versions =
  version_to_int of each token's weight version;
- environment reply (and template glue) appended after turn k: turn_index k (it is turn k's transition),
  loss mask 0, log-prob 0, version -1.

Turns: a turn counts once the engine returned tokens for it or the environment stepped on it;
`turn_rewards` has one entry per counted turn (the step's reward; 0.0 when the step never answered),
`outcome` is the last step's outcome. The final environment reply is not appended (see
pipeline.supervisor.actors.chat).

finish_reason says why the episode ended:
- "stop": the environment ended it (done) after a turn the model closed itself;
- "length": the environment ended it (done) right after a turn cut by max_new_tokens;
- "truncated": the environment truncated it (its turn limit), the runner's own cap of spec.max_turns
  steps was reached, or the context budget ran out (before a request, `max_new_tokens` is capped to
  `max_context_tokens - len(buffer)`; when nothing is left, or the next environment reply would not
  leave room for one token, the episode ends);
- "timeout": a reset/step exceeded spec.step_timeout_s (ENV_ERRORS kind "timeout"), or the episode
  exceeded spec.episode_timeout_s;
- "env_error": reset/step/the factory raised (EnvError or anything else; ENV_ERRORS kind "error"), or
  returned something unusable: a non-finite reward/outcome, not a StepResult, messages the chat
  template cannot render (kind "invalid");
- "engine_error": any EngineError (ENGINE_ERRORS kind protocol, http, unavailable) or an aborted
  generation that is not resubmitted (kind "abort").
- "cut": the scheduler cut its group so that the episodes already finished are trained before the group
  goes stale (pipeline.supervisor.actors.late_cut); the error says at which learner version.
Rows of failed episodes are kept for accounting (the learner skips them); an episode whose reset
failed has no tokens and so no row. A failing `env.close()` is counted (kind "close"), not raised.
With `retry_aborted`, a generation aborted with partial output (SGLang's abort-mode weight sync) is
resubmitted as prompt + partial ids (AReaL-style partial rollout): the partial tokens keep their
log-probs and versions, the continuation gets the new version (a turn fails after `max_abort_retries`
aborts in a row that kept no new token).
`env.close()` is always awaited, also when the episode is cancelled.
Metric labels: env = the `env_name` argument; engine = "pool" (the pool hides which member served).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Awaitable, Coroutine, Generator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from types import CoroutineType
from typing import Any, Protocol, cast

import pyarrow as pa

from envs.agent import AgentEnvironment
from envs.api import FORMAT_ERROR, EnvError, EnvFactory, Environment, StepResult, Task, is_finite_number
from envs.toolcalls import get_parser
from pipeline.contracts import tracing
from pipeline.contracts.schema import (
    TRAINABLE_FINISH_REASONS,
    EpisodeSegment,
    RoutedExperts,
    segments_to_batch,
)
from pipeline.supervisor.actors.chat import ChatBuffer, ChatTokenizer
from pipeline.supervisor.actors.late_cut import GroupCut
from pipeline.supervisor.engines.protocol import (
    EngineError,
    EngineHTTPError,
    EngineProtocolError,
    EngineUnavailable,
    GenerateResult,
    RoutedExpertsRequest,
    SamplingParams,
    version_to_int,
)
from pipeline.supervisor.observability import metrics

ENGINE_LABEL = "pool"


class GenerateEngine(Protocol):
    """What the runner needs from an engine (pipeline.supervisor.engines.pool.EnginePool)."""

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, rid: str, *, affinity_key: str
    ) -> GenerateResult: ...


class RoutingEngine(Protocol):
    """A GenerateEngine that can return routed experts (the EnginePool; RolloutSettings.routed_experts)."""

    async def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        rid: str,
        *,
        affinity_key: str,
        routed_experts: RoutedExpertsRequest | None = None,
    ) -> GenerateResult: ...


class AgentRunner(Protocol):
    """Runs the episodes of agent-function environments
    (pipeline.supervisor.actors.openai_endpoint.OpenAIEndpoint)."""

    async def run_agent_episode(
        self, env: AgentEnvironment, task: Task, *, episode_id: str, group_id: str, env_name: str
    ) -> EpisodeOutcome: ...


@dataclass(frozen=True)
class RolloutSettings:
    """How episodes are run.

    `max_context_tokens` bounds every segment's length (prompt + generated + replies);
    `sampling.stop_token_ids` empty = the tokenizer's eos token; `tool_parser` names an entry of
    envs.toolcalls.PARSERS. `retry_aborted` resubmits a generation the engine aborted (SGLang's
    abort-mode weight sync) as prompt + partial output, as often as each resubmission makes progress: a
    turn fails after `max_abort_retries` aborts in a row that kept no new token; set it when the weight
    sync aborts requests, leave it off otherwise (an abort is then an error).
    `routed_experts` = (layers, topk, num_experts) of an MoE model whose engines return routed experts
    (learner.moe): each turn asks for the positions its segment has no record of yet, and every row
    carries its segment's record (Contract 1's routed_experts column). None = not asked.
    """

    sampling: SamplingParams
    max_context_tokens: int
    tool_parser: str = "hermes"
    system_prompt: str | None = None
    retry_aborted: bool = False
    max_abort_retries: int = 3
    routed_experts: tuple[int, int, int] | None = None

    def __post_init__(self) -> None:
        get_parser(self.tool_parser)  # fail at configuration time, not in the first episode
        if self.max_context_tokens < 2:
            raise ValueError(
                f"RolloutSettings.max_context_tokens must be >= 2, got {self.max_context_tokens}"
            )
        if self.max_abort_retries < 0:
            raise ValueError(f"RolloutSettings.max_abort_retries must be >= 0, got {self.max_abort_retries}")


@dataclass
class EpisodeOutcome:
    """Result of one episode: its rows (one per segment; none when reset failed) and statistics.

    `turn_seconds[k]` is the wall time of turn k (request to the end of the step and the buffer
    update); `engine_seconds[k]` the part spent waiting for /generate.
    """

    episode_id: str
    group_id: str
    task_id: str
    env: str
    finish_reason: str
    rows: list[EpisodeSegment]
    turn_rewards: list[float]
    outcome: float | None
    generated_tokens: int
    duration_s: float
    turn_seconds: list[float] = field(default_factory=list)
    engine_seconds: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def num_turns(self) -> int:
        return len(self.turn_rewards)

    @property
    def num_segments(self) -> int:
        return len(self.rows)

    @property
    def success(self) -> bool:
        return self.outcome is not None and self.outcome >= 1.0

    @property
    def trainable(self) -> bool:
        return self.finish_reason in TRAINABLE_FINISH_REASONS

    @property
    def score(self) -> float:
        """The outcome, or the sum of turn rewards when the environment set none."""
        return self.outcome if self.outcome is not None else sum(self.turn_rewards)


@dataclass
class GroupOutcome:
    """G episodes of one task; `to_record_batch()` is the group's Arrow batch (Contract 1)."""

    group_id: str
    task_id: str
    env: str
    episodes: list[EpisodeOutcome]

    @property
    def rows(self) -> list[EpisodeSegment]:
        return [row for ep in self.episodes for row in ep.rows]

    def to_record_batch(self) -> pa.RecordBatch:
        return segments_to_batch(self.rows)


class _EpisodeEnded(Exception):
    """Internal: ends the turn loop with a finish reason."""

    def __init__(self, finish_reason: str, message: str | None = None) -> None:
        super().__init__(message or finish_reason)
        self.finish_reason = finish_reason
        self.message = message


@dataclass(frozen=True)
class _EnvMetrics:
    """Prometheus children bound to one env label (labels() per turn would cost a lock and a lookup)."""

    turns: Any
    generated_tokens: Any
    prompt_tokens: Any
    prompt_tokens_cached: Any
    turn_tokens: Any
    turn_reward: Any
    step_latency: Any
    episode_turns: Any
    episode_duration: Any
    episode_reward: Any
    reward_positive: Any
    reward_negative: Any
    successes: Any
    tool_calls: Any
    tool_call_errors: Any
    without_tool_calls: Any
    format_errors: Any
    env_name: str


@lru_cache(maxsize=256)
def _env_metrics(env_name: str) -> _EnvMetrics:
    return _EnvMetrics(
        turns=metrics.TURNS.labels(env=env_name),
        generated_tokens=metrics.GENERATED_TOKENS.labels(env=env_name),
        prompt_tokens=metrics.PROMPT_TOKENS.labels(env=env_name),
        prompt_tokens_cached=metrics.PROMPT_TOKENS_CACHED.labels(env=env_name),
        turn_tokens=metrics.TURN_TOKENS.labels(env=env_name),
        turn_reward=metrics.TURN_REWARD.labels(env=env_name),
        step_latency=metrics.ENV_STEP_LATENCY.labels(env=env_name),
        episode_turns=metrics.EPISODE_TURNS.labels(env=env_name),
        episode_duration=metrics.EPISODE_DURATION.labels(env=env_name),
        episode_reward=metrics.EPISODE_REWARD.labels(env=env_name),
        reward_positive=metrics.EPISODE_REWARD_POSITIVE.labels(env=env_name),
        reward_negative=metrics.EPISODE_REWARD_NEGATIVE.labels(env=env_name),
        successes=metrics.EPISODE_SUCCESSES.labels(env=env_name),
        tool_calls=metrics.TOOL_CALLS.labels(env=env_name),
        tool_call_errors=metrics.TOOL_CALL_ERRORS.labels(env=env_name),
        without_tool_calls=metrics.EPISODES_WITHOUT_TOOL_CALLS.labels(env=env_name),
        format_errors=metrics.ANSWER_FORMAT_ERRORS.labels(env=env_name),
        env_name=env_name,
    )


@lru_cache(maxsize=1024)
def _episodes_counter(env_name: str, finish_reason: str) -> Any:
    return metrics.EPISODES.labels(env=env_name, reason=finish_reason)


_ENGINE_LATENCY = metrics.ENGINE_REQUEST_LATENCY.labels(engine=ENGINE_LABEL)


class _Unrecorded:
    """A metric child that records nothing: the turn-level metrics of an evaluation episode."""

    def inc(self, amount: float = 1.0) -> None:
        pass

    def observe(self, amount: float) -> None:
        pass


@lru_cache(maxsize=64)
def _unrecorded(env_name: str) -> _EnvMetrics:
    fields = [f.name for f in dataclasses.fields(_EnvMetrics) if f.name != "env_name"]
    return _EnvMetrics(**dict.fromkeys(fields, _Unrecorded()), env_name=env_name)


class _Started:
    """Awaiting this finishes a coroutine that was already advanced to its first suspension, where it
    handed `pending` to the event loop: the same as awaiting the coroutine from there (`yield from`)."""

    __slots__ = ("_coro", "_pending")

    def __init__(self, coro: Coroutine[Any, Any, Any], pending: Any) -> None:
        self._coro = coro
        self._pending = pending

    def __await__(self) -> Generator[Any, Any, Any]:
        coro, value = self._coro, self._pending
        while True:
            try:
                sent = yield value
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:  # a cancellation (the timeout) or anything thrown into the task
                try:
                    value = coro.throw(exc)
                except StopIteration as done:
                    return done.value
            else:
                try:
                    value = coro.send(sent)
                except StopIteration as done:
                    return done.value


class _DeadlinePassed(TimeoutError):
    """`_within`'s bound was exceeded (unlike a TimeoutError the awaited call raised itself)."""


async def _within(call: Awaitable[Any], timeout_s: float) -> Any:
    """`await call` bounded by `timeout_s` seconds from now; _DeadlinePassed when exceeded.

    A coroutine is first run up to its first suspension: most environment calls never suspend, and
    one that returns before yielding to the event loop cannot be timed out by asyncio anyway (the
    timer only fires from the loop), so it needs no timer. One that suspends finishes under a
    deadline taken before it started, as `asyncio.timeout(timeout_s)` around the whole call would.
    """
    deadline = asyncio.get_running_loop().time() + timeout_s
    if isinstance(call, CoroutineType):
        try:
            pending = call.send(None)
        except StopIteration as done:
            return done.value
        call = _Started(call, pending)
    bound = asyncio.timeout_at(deadline)
    try:
        async with bound:
            return await call
    except TimeoutError as exc:
        if bound.expired():
            raise _DeadlinePassed(f"not done within {timeout_s} s") from exc
        raise


def _engine_error_kind(exc: EngineError) -> str:
    if isinstance(exc, EngineProtocolError):
        return "protocol"
    if isinstance(exc, EngineHTTPError):
        return "http"
    if isinstance(exc, EngineUnavailable):
        return "unavailable"
    return "error"


def error_kind(exc: BaseException) -> str:
    """The ENV_ERRORS kind of an exception an environment raised: an EnvError's own `kind` when it is one
    of the known kinds (a bounded label set), else "error"."""
    kind = getattr(exc, "kind", "error") if isinstance(exc, EnvError) else "error"
    return kind if kind in metrics.ENV_ERROR_KINDS else "error"


def _engine_failure(kind: str, message: str) -> _EpisodeEnded:
    metrics.ENGINE_ERRORS.labels(engine=ENGINE_LABEL, kind=kind).inc()
    return _EpisodeEnded("engine_error", message)


def _env_failure(env_name: str, kind: str, finish_reason: str, message: str) -> _EpisodeEnded:
    metrics.ENV_ERRORS.labels(env=env_name, kind=kind).inc()
    return _EpisodeEnded(finish_reason, message)


def stop_token_ids(settings: RolloutSettings, tokenizer: ChatTokenizer) -> tuple[int, ...]:
    """The ids that end a turn: the configured ones, else the tokenizer's eos token."""
    if settings.sampling.stop_token_ids:
        return settings.sampling.stop_token_ids
    eos = getattr(tokenizer, "eos_token_id", None)
    if not isinstance(eos, int):
        raise ValueError("sampling.stop_token_ids is empty and the tokenizer has no eos_token_id")
    return (eos,)


class _EpisodeRun:
    """State of one running episode; `play` runs the turn loop and raises _EpisodeEnded to stop."""

    def __init__(
        self,
        engine: GenerateEngine,
        tokenizer: ChatTokenizer,
        env: Environment,
        settings: RolloutSettings,
        episode_id: str,
        env_name: str,
        record_metrics: bool = True,
        affinity_key: str | None = None,
    ) -> None:
        self.engine = engine
        self.affinity_key = affinity_key or episode_id
        self.tokenizer = tokenizer
        self.env = env
        self.settings = settings
        self.episode_id = episode_id
        self.metrics = _env_metrics(env_name) if record_metrics else _unrecorded(env_name)
        self.parser = get_parser(settings.tool_parser)
        self.stops = stop_token_ids(settings, tokenizer)
        self.sampling = dataclasses.replace(settings.sampling, stop_token_ids=self.stops)
        self.step_timeout_s = env.spec.step_timeout_s
        self._version_ints: dict[str, int] = {}
        self.chat: ChatBuffer | None = None
        self.turn_rewards: list[float] = []
        self.outcome: float | None = None
        self.generated_tokens = 0
        self.turn_seconds: list[float] = []
        self.engine_seconds: list[float] = []
        self.tool_calls = 0
        self.span: Any = tracing.NO_SPAN  # the episode's span (run_episode), when tracing is on
        self.trace_id: str | None = None  # its trace, stored with the rows (sampled traces only)
        self._linked: set[int] = set()  # policy versions the episode span links to
        self.matched: str | None = None  # the stop string that ended the last turn, if one did

    async def _call_env(self, what: str, call: Any) -> Any:
        """Await an env coroutine under the step timeout; failures become _EpisodeEnded."""
        env_name = self.metrics.env_name
        try:
            return await _within(call, self.step_timeout_s)
        except _DeadlinePassed as exc:
            raise _env_failure(
                env_name, "timeout", "timeout", f"env.{what} exceeded step_timeout_s={self.step_timeout_s}"
            ) from exc
        except Exception as exc:
            kind = error_kind(exc)
            raise _env_failure(env_name, kind, "env_error", f"env.{what} raised {exc!r}") from exc

    async def play(self, task: Task) -> str:
        spec = self.env.spec
        messages = await self._call_env("reset", self.env.reset(task))
        if not isinstance(messages, list):
            raise self._invalid(f"env.reset returned {type(messages).__name__}, expected a list of messages")
        if self.settings.system_prompt is not None:
            messages = [{"role": "system", "content": self.settings.system_prompt}, *messages]
        try:
            self.chat = ChatBuffer(self.tokenizer, messages, tools=spec.tools, stop_token_ids=self.stops)
        except Exception as exc:
            raise self._invalid(f"the chat template cannot render env.reset's messages: {exc!r}") from exc
        chat = self.chat
        for turn in range(spec.max_turns):
            # An unsampled or untraced episode opens no child spans: they would cost time, record nothing.
            span = tracing.span("turn", {"rollwise.turn": turn}) if self.trace_id else tracing.NO_SPAN
            with span as current:
                finish = await self._turn(chat, turn, current)
            if finish is not None:
                return finish
        return "truncated"

    async def _turn(self, chat: ChatBuffer, turn: int, span: Any) -> str | None:
        """Turn `turn`: generate, parse, step, extend the buffer; how the episode ends, None to go on.
        `span`: the turn's span (the no-op one unless the episode is traced)."""
        started = time.perf_counter()
        engine_finish = await self._generate_turn(chat, turn)
        action = self.parser(chat.finish_turn())
        if action.tool_calls:
            self.tool_calls += len(action.tool_calls)
            self.metrics.tool_calls.inc(len(action.tool_calls))
        if action.tool_call_errors:
            self.metrics.tool_call_errors.inc(len(action.tool_call_errors))
        if len(self.turn_rewards) == turn:
            self.turn_rewards.append(0.0)
        step = await self._step(action)
        if span.is_recording():
            span.set_attributes(
                {"rollwise.reward": step.reward, "rollwise.done": bool(step.done or step.truncated)}
            )
        self.turn_rewards[turn] = step.reward
        self.metrics.turn_reward.observe(step.reward)
        if step.outcome is not None:
            self.outcome = step.outcome
        finish = _finish_after_step(step, engine_finish)
        if finish is None:
            try:
                extended = chat.add_env_messages(step.messages, turn, self.settings.max_context_tokens)
            except Exception as exc:
                raise self._invalid(f"the chat template cannot render env.step's messages: {exc!r}") from exc
            if extended == "overflow":
                finish = "truncated"
        self.turn_seconds.append(time.perf_counter() - started)
        return finish

    def _invalid(self, message: str) -> _EpisodeEnded:
        return _env_failure(self.metrics.env_name, "invalid", "env_error", message)

    async def _step(self, action: Any) -> StepResult:
        started = time.perf_counter()
        step = await self._call_env("step", self.env.step(action))
        self.metrics.step_latency.observe(time.perf_counter() - started)
        if not isinstance(step, StepResult):
            raise self._invalid(f"env.step returned {type(step).__name__}, expected StepResult")
        info = step.info
        if type(info) is dict and info.get(FORMAT_ERROR):
            self.metrics.format_errors.inc()
        if not isinstance(step.messages, list):
            raise self._invalid(f"env.step returned messages of type {type(step.messages).__name__}")
        # A non-finite score would make the row invalid for the learner: it is the env's failure.
        if not is_finite_number(step.reward):
            raise self._invalid(f"env.step returned reward {step.reward!r}, expected a finite number")
        if step.outcome is not None and not is_finite_number(step.outcome):
            raise self._invalid(f"env.step returned outcome {step.outcome!r}, expected a finite number")
        step.reward = float(step.reward)
        step.outcome = None if step.outcome is None else float(step.outcome)
        return step

    def _sampling(self, max_new_tokens: int, stop: tuple[str, ...] | None = None) -> SamplingParams:
        if max_new_tokens == self.sampling.max_new_tokens and stop is None:
            return self.sampling
        if stop is None:
            return dataclasses.replace(self.sampling, max_new_tokens=max_new_tokens)
        return dataclasses.replace(self.sampling, max_new_tokens=max_new_tokens, stop=stop)

    def _versions(self, token_versions: list[str]) -> list[int]:
        """Policy version of every token; a response carries few distinct strings, so parse each once."""
        cache = self._version_ints
        n = len(token_versions)
        if n and token_versions.count(token_versions[0]) == n:  # one version for all: the usual reply
            number = cache.get(token_versions[0])
            if number is None:
                number = cache[token_versions[0]] = version_to_int(token_versions[0])
            return [number] * n
        out: list[int] = []
        for v in token_versions:
            number = cache.get(v)
            if number is None:
                number = cache[v] = version_to_int(v)
            out.append(number)
        return out

    async def _generate_turn(
        self,
        chat: ChatBuffer,
        turn: int,
        max_new_tokens: int | None = None,
        stop: tuple[str, ...] | None = None,
    ) -> str:
        """Generate turn `turn` into the buffer (at most `max_new_tokens`, default the sampling config's;
        `stop` strings instead of the config's); returns how the turn ended: "stop" or "length".
        `self.matched` is then the stop string that ended it, or None."""
        max_new = self.settings.sampling.max_new_tokens if max_new_tokens is None else max_new_tokens
        produced = 0
        engine_s = 0.0
        attempt = 0
        fruitless = 0  # aborts in a row that kept no new token
        self.matched = None
        while True:
            budget = self.settings.max_context_tokens - len(chat.input_ids)
            if budget <= 0:
                if produced:  # a resubmission with no room left: the turn ends cut, like "length"
                    finish = "length"
                    break
                raise _EpisodeEnded("truncated", "context budget exhausted")
            sampling = self._sampling(min(max_new - produced, budget), stop)
            rid = f"{self.episode_id}-t{turn}" + (f"-r{attempt}" if attempt else "")
            started = time.perf_counter()
            routing = self._routing_request(chat)
            span = (
                tracing.span("engine.generate", {"rollwise.rid": rid}) if self.trace_id else tracing.NO_SPAN
            )
            try:
                with span as current:
                    if routing is None:
                        result = await self.engine.generate(
                            chat.input_ids, sampling, rid, affinity_key=self.affinity_key
                        )
                    else:
                        result = await cast(RoutingEngine, self.engine).generate(
                            chat.input_ids,
                            sampling,
                            rid,
                            affinity_key=self.affinity_key,
                            routed_experts=routing,
                        )
                    versions = self._versions(result.token_versions)
                    if current.is_recording():
                        self._trace_request(current, result, versions, len(chat.input_ids), started)
            except EngineError as exc:
                raise _engine_failure(_engine_error_kind(exc), str(exc)) from exc
            finally:
                elapsed = time.perf_counter() - started
                engine_s += elapsed
                _ENGINE_LATENCY.observe(elapsed)
            n = len(result.output_ids)
            if n and len(self.turn_rewards) == turn:
                self.turn_rewards.append(0.0)  # the turn exists once it has tokens
            chat.add_generated(result.output_ids, result.logprobs, versions, turn)
            if routing is not None and result.routed_experts is not None and result.finish_reason != "abort":
                self._record_routing(chat, routing, result)
            produced += n
            self.generated_tokens += n
            self.metrics.generated_tokens.inc(n)
            if result.prompt_tokens is not None:  # None: aborted while waiting, nothing was prefilled
                self.metrics.prompt_tokens.inc(result.prompt_tokens)
                self.metrics.prompt_tokens_cached.inc(result.cached_tokens)
            if result.finish_reason != "abort":
                finish = "stop" if result.finish_reason == "stop" else "length"
                self.matched = result.matched
                break
            if not self.settings.retry_aborted:
                raise _engine_failure("abort", f"generation {rid} aborted: {result.abort_message}")
            fruitless = fruitless + 1 if n == 0 else 0
            if fruitless > self.settings.max_abort_retries:
                raise _engine_failure(
                    "abort",
                    f"generation {rid} aborted {fruitless} times in a row without a new token: "
                    f"{result.abort_message}",
                )
            if produced >= max_new:
                finish = "length"
                break
            attempt += 1
        self.engine_seconds.append(engine_s)
        self.metrics.turns.inc()
        self.metrics.turn_tokens.observe(produced)
        return finish

    def _routing_request(self, chat: ChatBuffer) -> RoutedExpertsRequest | None:
        """Ask for the positions of the current segment without a record yet (RolloutSettings)."""
        shape = self.settings.routed_experts
        if shape is None:
            return None
        return RoutedExpertsRequest(start_len=chat.current.routed_positions, per_position=shape[0] * shape[1])

    def _record_routing(
        self, chat: ChatBuffer, request: RoutedExpertsRequest, result: GenerateResult
    ) -> None:
        """Append a finished turn's routed experts to its segment's record (an aborted attempt's are
        not kept: its resubmission asks again from the same position)."""
        assert self.settings.routed_experts is not None and result.routed_experts is not None
        layers, topk, experts = self.settings.routed_experts
        if max(result.routed_experts, default=0) >= experts:
            raise _engine_failure(
                "protocol", f"{result.rid}: meta_info.routed_experts names an expert >= the model's {experts}"
            )
        width = RoutedExperts.width_for(experts)
        ids = RoutedExperts.encode(result.routed_experts, layers=layers, topk=topk, width=width)
        chat.current.append_routed(request.start_len, len(result.routed_experts) // (layers * topk), ids)

    def _routing_of(self, seg: Any) -> RoutedExperts | None:
        shape = self.settings.routed_experts
        if shape is None:
            return None
        layers, topk, experts = shape
        return RoutedExperts(
            layers=layers, topk=topk, width=RoutedExperts.width_for(experts), ids=bytes(seg.routed)
        )

    def _trace_request(
        self, current: Any, result: GenerateResult, versions: list[int], prompt: int, started: float
    ) -> None:
        """The attributes of an engine request's span (only computed when it is recorded)."""
        version = versions[0] if versions else -1
        current.set_attributes(
            {
                "rollwise.policy_version": version,
                "rollwise.finish_reason": result.finish_reason,
                "rollwise.latency_s": time.perf_counter() - started,
                "gen_ai.usage.input_tokens": prompt,
                "gen_ai.usage.output_tokens": len(result.output_ids),
            }
        )
        if version >= 0 and version not in self._linked:
            self._linked.add(version)
            tracing.link_version(self.span, version)

    def rows(self, task: Task, group_id: str, env_name: str, finish_reason: str) -> list[EpisodeSegment]:
        if self.chat is None:
            return []
        trace_id = self.trace_id
        return [
            EpisodeSegment(
                episode_id=self.episode_id,
                group_id=group_id,
                task_id=task.id,
                env=env_name,
                token_ids=seg.token_ids,
                prompt_len=seg.prompt_len,
                loss_mask=seg.loss_mask,
                logprobs=seg.logprobs,
                turn_index=seg.turn_index,
                versions=seg.versions,
                turn_rewards=list(self.turn_rewards),
                outcome=self.outcome,
                num_turns=len(self.turn_rewards),
                finish_reason=finish_reason,
                segment=index,
                trace_id=trace_id,
                routed_experts=self._routing_of(seg),
            )
            for index, seg in enumerate(self.chat.segments)
        ]


def _finish_after_step(step: StepResult, engine_finish: str) -> str | None:
    if step.truncated:
        return "truncated"
    if step.done:
        return "length" if engine_finish == "length" else "stop"
    return None


async def _close_env(env: Environment, env_name: str) -> str | None:
    """Await env.close() (bounded by the step timeout); a failure is counted and reported, not raised."""
    try:
        await _within(env.close(), env.spec.step_timeout_s)
    except Exception as exc:
        metrics.ENV_ERRORS.labels(env=env_name, kind="close").inc()
        return f"env.close raised {exc!r}"
    return None


def _record_episode(outcome: EpisodeOutcome) -> None:
    children = _env_metrics(outcome.env)
    _episodes_counter(outcome.env, outcome.finish_reason).inc()
    children.episode_turns.observe(outcome.num_turns)
    children.episode_duration.observe(outcome.duration_s)
    if outcome.trainable:
        score = outcome.score
        children.episode_reward.observe(score)
        if score >= 0:
            children.reward_positive.inc(score)
        else:
            children.reward_negative.inc(-score)
    if outcome.success:
        children.successes.inc()


async def run_episode(
    engine: GenerateEngine,
    tokenizer: ChatTokenizer,
    env: Environment,
    task: Task,
    settings: RolloutSettings,
    *,
    episode_id: str,
    group_id: str,
    env_name: str,
    record_metrics: bool = True,
    cut: GroupCut | None = None,
) -> EpisodeOutcome:
    """Run one episode to its end (see the module docstring); never raises for env or engine failures.

    Cancellation propagates (after env.close()). The rows are the episode's segments, in order.
    `record_metrics = False` (evaluation) keeps the episode out of the training episodes' metrics
    (episodes, turns, rewards, successes, in flight); engine and env failures are still counted.
    `cut` (its group's, pipeline.supervisor.actors.late_cut) ends the episode where it stands when it
    fires, as its timeout would, with finish reason `cut`.
    """
    started = time.perf_counter()
    in_flight = metrics.EPISODES_IN_FLIGHT if record_metrics else None
    if in_flight is not None:
        in_flight.inc()
    error: str | None = None
    span = tracing.root_span(
        "episode", {"rollwise.episode_id": episode_id, "rollwise.env": env_name, "rollwise.task_id": task.id}
    )
    try:
        with span as current:
            episode = _EpisodeRun(
                engine, tokenizer, env, settings, episode_id, env_name, record_metrics, affinity_key=group_id
            )
            episode.span, episode.trace_id = current, tracing.trace_id(current)
            try:
                async with asyncio.timeout(env.spec.episode_timeout_s) as scope:
                    with cut.watching(scope) if cut is not None else contextlib.nullcontext():
                        finish_reason = await episode.play(task)
            except _EpisodeEnded as ended:
                finish_reason, error = ended.finish_reason, ended.message
            except TimeoutError:
                if cut is not None and cut.fired:
                    finish_reason, error = "cut", cut.reason
                else:
                    finish_reason = "timeout"
                    error = f"episode exceeded episode_timeout_s={env.spec.episode_timeout_s}"
            if current.is_recording():
                current.set_attributes(_episode_attributes(episode, finish_reason))
    finally:
        close_error = await _close_env(env, env_name)
        if in_flight is not None:
            in_flight.dec()
    outcome = EpisodeOutcome(
        episode_id=episode_id,
        group_id=group_id,
        task_id=task.id,
        env=env_name,
        finish_reason=finish_reason,
        rows=episode.rows(task, group_id, env_name, finish_reason),
        turn_rewards=list(episode.turn_rewards),
        outcome=episode.outcome,
        generated_tokens=episode.generated_tokens,
        duration_s=time.perf_counter() - started,
        turn_seconds=episode.turn_seconds,
        engine_seconds=episode.engine_seconds,
        error=error or close_error,
    )
    if record_metrics:
        _record_episode(outcome)
        if episode.tool_calls == 0 and env.spec.tools and outcome.trainable:
            episode.metrics.without_tool_calls.inc()
    return outcome


def _episode_attributes(episode: _EpisodeRun, finish_reason: str) -> dict[str, str | int | float]:
    attributes: dict[str, str | int | float] = {
        "rollwise.finish_reason": finish_reason,
        "rollwise.turns": len(episode.turn_rewards),
        "rollwise.tool_calls": episode.tool_calls,
        "gen_ai.usage.output_tokens": episode.generated_tokens,
    }
    if episode.outcome is not None:
        attributes["rollwise.outcome"] = episode.outcome
    return attributes


def _failed_to_start(
    episode_id: str, group_id: str, task: Task, env_name: str, message: str
) -> EpisodeOutcome:
    metrics.ENV_ERRORS.labels(env=env_name, kind="error").inc()
    outcome = EpisodeOutcome(
        episode_id=episode_id,
        group_id=group_id,
        task_id=task.id,
        env=env_name,
        finish_reason="env_error",
        rows=[],
        turn_rewards=[],
        outcome=None,
        generated_tokens=0,
        duration_s=0.0,
        error=message,
    )
    _record_episode(outcome)
    return outcome


async def run_group(
    engine: GenerateEngine,
    tokenizer: ChatTokenizer,
    factory: EnvFactory,
    task: Task,
    settings: RolloutSettings,
    *,
    group_size: int,
    group_id: str,
    env_name: str,
    env_options: Mapping[str, Any] | None = None,
    agent_runner: AgentRunner | None = None,
    cut: GroupCut | None = None,
) -> GroupOutcome:
    """Run `group_size` episodes of `task` concurrently, each with its own `factory(**env_options)`.

    `cut` fired ends the token-in/token-out episodes still running with finish reason `cut` (an agent
    function's episode runs on: its agent holds the conversation, and stopping it midway is its own call).

    Episode ids are `"{group_id}-{i}"`. An `AgentEnvironment`'s episodes are run by `agent_runner` (its
    agent function against the OpenAI endpoint); without one they fail as env_error. If the runner itself
    fails (a bug, not an env or engine failure), the other episodes are cancelled and the error propagates.
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    options = dict(env_options or {})

    async def one(index: int) -> EpisodeOutcome:
        try:
            return await play(index)
        finally:
            if cut is not None:
                cut.finished += 1

    async def play(index: int) -> EpisodeOutcome:
        episode_id = f"{group_id}-{index}"
        try:
            env = factory(**options)
        except Exception as exc:
            return _failed_to_start(episode_id, group_id, task, env_name, f"env factory raised {exc!r}")
        if isinstance(env, AgentEnvironment):
            if agent_runner is None:
                await _close_env(env, env_name)
                message = "an agent environment needs an OpenAI endpoint (agent_runner), and none was given"
                return _failed_to_start(episode_id, group_id, task, env_name, message)
            if cut is not None:
                cut.uncuttable = True
            return await agent_runner.run_agent_episode(
                env, task, episode_id=episode_id, group_id=group_id, env_name=env_name
            )
        return await run_episode(
            engine,
            tokenizer,
            env,
            task,
            settings,
            episode_id=episode_id,
            group_id=group_id,
            env_name=env_name,
            cut=cut,
        )

    tasks = [asyncio.create_task(one(i)) for i in range(group_size)]
    try:
        episodes: Sequence[EpisodeOutcome] = await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    return GroupOutcome(group_id=group_id, task_id=task.id, env=env_name, episodes=list(episodes))
