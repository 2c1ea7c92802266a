"""The multi-turn episode runner (token-in/token-out) and the group runner.

One group: `run_group` runs G episodes of a task concurrently (`run_episode`, or the agent runner for an
agent-function environment). One episode: `env.reset(task)` -> messages; the chat template renders the
first prompt once (chat.ChatBuffer); then per turn k = 0, 1, ... (`_EpisodeRun`): `/generate` with the
buffer's ids (rid `"{episode_id}-t{k}"`, affinity key = the group id, so a group's turns hit one server
and its prefix cache), the output ids appended verbatim, the decoded text parsed into an Action
(envs.toolcalls), `env.step(action)`, and only the reply's new tokens appended. Its metrics
(episode_metrics), spans (episode_trace) and routing records (expert_routing) are chosen once per
episode, each with a do-nothing twin where it is off.

Per-token columns (pipeline.contracts.schema.EpisodeSegment):
- prompt tokens (and the whole re-rendered prompt of a later segment): turn_index -1;
- tokens generated in turn k: turn_index k, loss mask 1, the engine's log-probs verbatim, versions =
  version_to_int of each token's weight version;
- environment reply (and template glue) appended after turn k: turn_index k, loss mask 0, log-prob 0,
  version -1. The final environment reply is not appended (chat.py).

Turns: a turn counts once the engine returned tokens for it or the environment stepped on it;
`turn_rewards` has one entry per counted turn (0.0 when the step never answered), `outcome` is the last
step's outcome.

finish_reason says why the episode ended:
- "stop": the environment ended it (done) after a turn the model closed itself;
- "length": the environment ended it (done) right after a turn cut by max_new_tokens;
- "truncated": the environment truncated it, the runner's cap of spec.max_turns steps was reached, or
  the context budget ran out (`max_new_tokens` is capped to `max_context_tokens - len(buffer)`; when
  nothing is left, or the next reply would not leave room for one token, the episode ends);
- "timeout": a reset/step exceeded spec.step_timeout_s (ENV_ERRORS kind "timeout"), or the episode
  exceeded spec.episode_timeout_s;
- "env_error": reset/step/the factory raised (ENV_ERRORS kind "error" or the EnvError's kind), or
  returned something unusable: a non-finite reward/outcome, not a StepResult, messages the chat
  template cannot render (kind "invalid");
- "engine_error": any EngineError (ENGINE_ERRORS kind protocol, http, unavailable) or an aborted
  generation that is not resubmitted (kind "abort");
- "cut": the scheduler cut its group (late_cut); the error says at which learner version.
Rows of failed episodes are kept for accounting (the learner skips them); an episode whose reset failed
has no row. `env.close()` is always awaited, also on cancellation; its failure is counted (kind "close").
With `retry_aborted`, an aborted generation is resubmitted as prompt + partial ids: the partial tokens
keep their log-probs and versions, the continuation gets the new version.
Metric labels: env = the `env_name` argument; engine = "pool" (the pool hides which member served).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from envs.agent import AgentEnvironment
from envs.api import FORMAT_ERROR, EnvFactory, Environment, StepResult, Task, is_finite_number
from envs.toolcalls import get_parser
from pipeline.contracts.schema import EpisodeSegment
from pipeline.supervisor.actors.chat import ChatBuffer, ChatTokenizer
from pipeline.supervisor.actors.env_calls import DeadlinePassed, close_env, within
from pipeline.supervisor.actors.episode_drive import drive_episode
from pipeline.supervisor.actors.episode_end import (
    ENGINE_LABEL,
    EpisodeEnded,
    engine_error_kind,
    engine_failure,
    env_failure,
    error_kind,
)
from pipeline.supervisor.actors.episode_metrics import (
    EpisodeMetrics,
    budget_cut,
    record_episode,
)
from pipeline.supervisor.actors.episode_trace import UNTRACED, Spans
from pipeline.supervisor.actors.expert_routing import expert_routing
from pipeline.supervisor.actors.late_cut import GroupCut
from pipeline.supervisor.actors.outcomes import EpisodeOutcome, GroupOutcome
from pipeline.supervisor.engines.protocol import (
    EngineError,
    GenerateResult,
    SamplingParams,
    version_to_int,
)
from pipeline.supervisor.observability import metrics

_ENGINE_LATENCY = metrics.ENGINE_REQUEST_LATENCY.labels(engine=ENGINE_LABEL)


class GenerateEngine(Protocol):
    """What the runner needs from an engine (pipeline.supervisor.engines.pool.EnginePool)."""

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, rid: str, *, affinity_key: str
    ) -> GenerateResult: ...


class AgentRunner(Protocol):
    """Runs the episodes of agent-function environments (agent_api.openai_endpoint.OpenAIEndpoint)."""

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
    (learner.moe; expert_routing). None = not asked.
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


def stop_token_ids(settings: RolloutSettings, tokenizer: ChatTokenizer) -> tuple[int, ...]:
    """The ids that end a turn: the configured ones, else the tokenizer's eos token."""
    if settings.sampling.stop_token_ids:
        return settings.sampling.stop_token_ids
    eos = getattr(tokenizer, "eos_token_id", None)
    if not isinstance(eos, int):
        raise ValueError("sampling.stop_token_ids is empty and the tokenizer has no eos_token_id")
    return (eos,)


class _EpisodeRun:
    """State of one running episode; `play` runs the turn loop and raises EpisodeEnded to stop. Its
    metrics and trace are chosen by whoever starts it, its routing record by the settings."""

    def __init__(
        self,
        engine: GenerateEngine,
        tokenizer: ChatTokenizer,
        env: Environment,
        settings: RolloutSettings,
        episode_id: str,
        *,
        metrics: EpisodeMetrics,
        trace: Spans = UNTRACED,
        affinity_key: str | None = None,
        group: GroupCut | None = None,
    ) -> None:
        self.engine = engine
        self.group = group or GroupCut(1)  # its group's shared handle: each answer is noted there
        self.affinity_key = affinity_key or episode_id
        self.tokenizer = tokenizer
        self.env = env
        self.settings = settings
        self.episode_id = episode_id
        self.metrics = metrics
        self.trace = trace
        self.routing = expert_routing(settings.routed_experts)
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
        self.matched: str | None = None  # the stop string that ended the last turn, if one did

    async def _call_env(self, what: str, call: Any) -> Any:
        """Await an env coroutine under the step timeout; failures become EpisodeEnded."""
        env_name = self.metrics.env_name
        try:
            return await within(call, self.step_timeout_s)
        except DeadlinePassed as exc:
            raise env_failure(
                env_name, "timeout", "timeout", f"env.{what} exceeded step_timeout_s={self.step_timeout_s}"
            ) from exc
        except Exception as exc:
            kind = error_kind(exc)
            raise env_failure(env_name, kind, "env_error", f"env.{what} raised {exc!r}") from exc

    async def play(self, task: Task) -> str:
        await self.start(task)
        finish = await self.play_turns(0, self.env.spec.max_turns)
        return "truncated" if finish is None else finish

    async def start(self, task: Task) -> None:
        """`env.reset(task)` and the first prompt rendered into the buffer."""
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

    async def play_turns(self, first: int, end: int) -> str | None:
        """Turns first, ..., end - 1 (after `start`); how the episode ended, None if it has not."""
        assert self.chat is not None, "start() comes first"
        for turn in range(first, min(end, self.env.spec.max_turns)):
            with self.trace.turn(turn) as span:
                finish = await self._turn(self.chat, turn, span)
            if finish is not None:
                return finish
        return None

    def branch(self, episode_id: str, env: Environment, metrics: EpisodeMetrics, trace: Spans) -> _EpisodeRun:
        """A twin of this episode at the end of its last turn, continuing in `env` (this one's fork) as
        `episode_id` (a tree rollout's branch, pipeline.supervisor.actors.tree_rollout). The tokens,
        log-probs, versions and turn rewards so far are copied; the counters of its own work start at 0."""
        assert self.chat is not None, "a branch starts after a turn"
        twin = _EpisodeRun(
            self.engine,
            self.tokenizer,
            env,
            self.settings,
            episode_id,
            metrics=metrics,
            trace=trace,
            affinity_key=self.affinity_key,
            group=self.group,
        )
        twin.chat = self.chat.branch()
        twin.turn_rewards = list(self.turn_rewards)
        twin.outcome = self.outcome
        return twin

    async def _turn(self, chat: ChatBuffer, turn: int, span: Any) -> str | None:
        """Turn `turn`: generate, parse, step, extend the buffer; how the episode ends, None to go on.
        `span`: the turn's span (the no-op one unless the episode is traced)."""
        started = time.perf_counter()
        engine_finish = await self._generate_turn(chat, turn)
        action = self.parser(chat.finish_turn())
        if engine_finish == "length" and budget_cut(action.text, self.env.spec.action_hints):
            self.metrics.turn_cut()
        if action.tool_calls or action.tool_call_errors:
            self.tool_calls += len(action.tool_calls)
            self.metrics.tool_calls(len(action.tool_calls), len(action.tool_call_errors))
        if len(self.turn_rewards) == turn:
            self.turn_rewards.append(0.0)
        step = await self._step(action)
        self.trace.stepped(span, step)
        self.turn_rewards[turn] = step.reward
        self.metrics.turn_reward(step.reward)
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

    def _invalid(self, message: str) -> EpisodeEnded:
        return env_failure(self.metrics.env_name, "invalid", "env_error", message)

    async def _step(self, action: Any) -> StepResult:
        started = time.perf_counter()
        step = await self._call_env("step", self.env.step(action))
        self.metrics.step_latency(time.perf_counter() - started)
        if not isinstance(step, StepResult):
            raise self._invalid(f"env.step returned {type(step).__name__}, expected StepResult")
        info = step.info
        if type(info) is dict and info.get(FORMAT_ERROR):
            self.metrics.format_error()
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
        produced = attempt = 0
        fruitless = 0  # aborts in a row that kept no new token
        engine_s = 0.0
        self.matched = None
        finish: str | None = None
        while finish is None:
            budget = self.settings.max_context_tokens - len(chat.input_ids)
            if budget <= 0:
                if not produced:
                    raise EpisodeEnded("truncated", "context budget exhausted")
                finish = "length"  # a resubmission with no room left: the turn ends cut, like "length"
                break
            rid = f"{self.episode_id}-t{turn}" + (f"-r{attempt}" if attempt else "")
            sampling = self._sampling(min(max_new - produced, budget), stop)
            result, seconds = await self._request(chat, turn, sampling, rid)
            engine_s += seconds
            n = len(result.output_ids)
            produced += n
            fruitless = fruitless + 1 if n == 0 else 0
            finish = self._turn_end(rid, result, fruitless, produced >= max_new)
            attempt += 1
        self.engine_seconds.append(engine_s)
        self.metrics.turn_generated(produced)
        return finish

    async def _request(
        self, chat: ChatBuffer, turn: int, sampling: SamplingParams, rid: str
    ) -> tuple[GenerateResult, float]:
        """One engine request of turn `turn`, its answer added to the buffer; (the answer, its seconds)."""
        started = time.perf_counter()
        try:
            with self.trace.request(rid) as span:
                result = await self.routing.generate(self.engine, chat, sampling, rid, self.affinity_key)
                versions = self._versions(result.token_versions)
                self.trace.answered(span, result, versions, chat.input_ids, started)
        except EngineError as exc:
            raise engine_failure(engine_error_kind(exc), str(exc)) from exc
        finally:
            elapsed = time.perf_counter() - started
            _ENGINE_LATENCY.observe(elapsed)
        n = len(result.output_ids)
        if n and len(self.turn_rewards) == turn:
            self.turn_rewards.append(0.0)  # the turn exists once it has tokens
        chat.add_generated(result.output_ids, result.logprobs, versions, turn)
        self.routing.record(chat, result)
        self.generated_tokens += n
        self.group.note(n, versions)
        self.metrics.generated(n, result.prompt_tokens, result.cached_tokens)
        return result, elapsed

    def _turn_end(self, rid: str, result: GenerateResult, fruitless: int, budget_spent: bool) -> str | None:
        """How the turn ended after an answer: "stop" or "length", None to resubmit an aborted one."""
        if result.finish_reason != "abort":
            self.matched = result.matched
            return "stop" if result.finish_reason == "stop" else "length"
        if not self.settings.retry_aborted:
            raise engine_failure("abort", f"generation {rid} aborted: {result.abort_message}")
        if fruitless > self.settings.max_abort_retries:
            raise engine_failure(
                "abort",
                f"generation {rid} aborted {fruitless} times in a row without a new token: "
                f"{result.abort_message}",
            )
        return "length" if budget_spent else None

    def rows(self, task: Task, group_id: str, env_name: str, finish_reason: str) -> list[EpisodeSegment]:
        if self.chat is None:
            return []
        trace_id = self.trace.trace_id
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
                routed_experts=self.routing.of(seg),
            )
            for index, seg in enumerate(self.chat.segments)
        ]


def _finish_after_step(step: StepResult, engine_finish: str) -> str | None:
    if step.truncated:
        return "truncated"
    if step.done:
        return "length" if engine_finish == "length" else "stop"
    return None


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

    def new_run(recorded: EpisodeMetrics, trace: Spans) -> _EpisodeRun:
        return _EpisodeRun(
            engine,
            tokenizer,
            env,
            settings,
            episode_id,
            metrics=recorded,
            trace=trace,
            affinity_key=group_id,
            group=cut,
        )

    return await drive_episode(
        new_run,
        lambda episode: episode.play(task),
        env,
        task,
        episode_id=episode_id,
        group_id=group_id,
        env_name=env_name,
        record_metrics=record_metrics,
        cut=cut,
    )


def failed_to_start(
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
    record_episode(outcome)
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
    first_index: int = 0,
) -> GroupOutcome:
    """Run `group_size` episodes of `task` concurrently, each with its own `factory(**env_options)`.

    `cut` fired ends the token-in/token-out episodes still running with finish reason `cut` (an agent
    function's episode runs on: its agent holds the conversation, and stopping it midway is its own call).

    Episode ids are `"{group_id}-{i}"`, i from `first_index` (a tree rollout's trunk is 0). An
    `AgentEnvironment`'s episodes are run by `agent_runner` (its agent function against the OpenAI
    endpoint); without one they fail as env_error. If the runner itself fails (a bug, not an env or engine
    failure), the other episodes are cancelled and the error propagates.
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
            return failed_to_start(episode_id, group_id, task, env_name, f"env factory raised {exc!r}")
        if isinstance(env, AgentEnvironment):
            if agent_runner is None:
                await close_env(env, env_name)
                message = "an agent environment needs an OpenAI endpoint (agent_runner), and none was given"
                return failed_to_start(episode_id, group_id, task, env_name, message)
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

    tasks = [asyncio.create_task(one(i)) for i in range(first_index, first_index + group_size)]
    try:
        episodes: Sequence[EpisodeOutcome] = await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    return GroupOutcome(group_id=group_id, task_id=task.id, env=env_name, episodes=list(episodes))
