"""One agent episode's token record: every chat completion it requests becomes one turn of a ChatBuffer.

Per request k (turn k), in arrival order (one at a time per episode):
1. assistant messages the endpoint returned earlier are put back as the model wrote them: a message whose
   content and tool calls equal turn j's response becomes `{"role": "assistant", "content": <turn j's
   decoded text>}`, exactly what the buffer recorded, so the template reproduces the tokens the engine
   produced (an agent that edits a reply, or a template that renders parsed tool calls differently,
   would otherwise break the extension);
2. the first request opens the ChatBuffer (prompt tokens, turn_index -1); later ones go through
   `ChatBuffer.add_conversation(messages, k - 1)`: when the rendering extends what the engine saw and
   produced, only the new tokens are appended (loss mask 0: template glue, tool results, the agent's own
   messages); otherwise a new segment starts (counted in rollwise_agent_segments_total), never a silent
   re-tokenisation;
3. the turn is generated through the episode runner's own `_generate_turn` (same engine pool, affinity
   key, abort-and-resubmit, per-token versions, metrics; the request's stop strings as SGLang's `stop`)
   and its text becomes the response: cut before the stop string that ended it, if one did (every token
   sampled is recorded all the same, and the cut text maps back to the recorded one in step 1), then
   content and `tool_calls` parsed with the run's tool-call parser (envs/toolcalls.py).
Refusals that end the episode: a request past `spec.max_turns` (400 max_turns_exceeded) or over the
context budget (400 context_length_exceeded) -> "truncated"; an engine failure (502) -> "engine_error".
An agent that keeps sending requests the endpoint refuses (`max_refused_requests` in a row, those after
the episode ended included) is stopped: `stop_agent` is called and the episode ends "env_error" (counted
as ENV_ERRORS kind "refused") unless it had already ended otherwise.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from envs.agent import AgentEnvironment
from envs.api import Task, ToolCall
from envs.toolcalls import get_parser, text_without_calls
from pipeline.contracts.schema import EpisodeSegment
from pipeline.supervisor.actors.agent_api.openai_wire import (
    ChatRequest,
    Completion,
    Message,
    OpenAIRequestError,
)
from pipeline.supervisor.actors.chat import ChatBuffer, ChatTokenizer
from pipeline.supervisor.actors.episode_end import EpisodeEnded
from pipeline.supervisor.actors.episode_metrics import episode_metrics
from pipeline.supervisor.actors.rollout import GenerateEngine, RolloutSettings, _EpisodeRun
from pipeline.supervisor.observability import metrics


@dataclass(frozen=True)
class ReturnedTurn:
    """What the endpoint answered for one turn, and the assistant text the buffer recorded for it."""

    content: str | None
    calls: tuple[tuple[str, Any], ...]  # (name, arguments as parsed JSON)
    recorded: str

    def matches(self, message: Message) -> bool:
        """Whether `message` (a normalised assistant message) is this turn's response sent back."""
        if (message.get("content") or None) != (self.content or None):
            return False
        calls = []
        for call in message.get("tool_calls", ()):
            arguments = call["function"]["arguments"]
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments)
                except ValueError:
                    return False
            calls.append((call["function"]["name"], arguments))
        return tuple(calls) == self.calls


class AgentSession:
    """The endpoint side of one agent episode: `complete` answers its requests, `rows` records them."""

    def __init__(
        self,
        *,
        engine: GenerateEngine,
        tokenizer: ChatTokenizer,
        settings: RolloutSettings,
        env: AgentEnvironment,
        episode_id: str,
        env_name: str,
        group_id: str | None = None,
    ) -> None:
        self.env = env
        self.env_name = env_name
        self.episode_id = episode_id
        self.key = secrets.token_urlsafe(18)
        self.model = env.model
        # Affinity by group, as native episodes: the group's shared first prompt stays in one prefix cache.
        self.run = _EpisodeRun(
            engine,
            tokenizer,
            env,
            settings,
            episode_id,
            metrics=episode_metrics(env_name),
            affinity_key=group_id,
        )
        self.tokenizer = tokenizer
        self.settings = settings
        self.parser = get_parser(settings.tool_parser)
        self.turns: list[ReturnedTurn] = []
        self.last_engine_finish = "stop"
        self.finish: str | None = None  # set when the endpoint itself ended the episode
        self.error: str | None = None
        self.closed = False
        self.turn_seconds: list[float] = []
        self.refused_in_a_row = 0
        self.max_refused = max(1, int(getattr(env, "max_refused_requests", 8)))
        self.stop_agent: Callable[[], object] | None = None  # set by whoever runs the agent
        self.responses: dict[str, list[Message]] = {}  # stored Responses conversations, by response id
        self._lock = asyncio.Lock()
        self._inflight: set[asyncio.Task[Any]] = set()

    @property
    def num_turns(self) -> int:
        return len(self.run.turn_rewards)

    def _end(self, finish: str, message: str) -> None:
        if self.finish is None:
            self.finish, self.error = finish, message

    def refused(self, err: OpenAIRequestError) -> None:
        """The endpoint refused one of this episode's requests (any 4xx): after `max_refused` in a row the
        agent is looping on refusals; stop it."""
        self.refused_in_a_row += 1
        if self.refused_in_a_row < self.max_refused:
            return
        if self.finish is None:
            metrics.ENV_ERRORS.labels(env=self.env_name, kind="refused").inc()
            self._end(
                "env_error",
                f"the agent sent {self.refused_in_a_row} requests in a row that the endpoint refused; "
                f"the last: HTTP {err.status} {err.message}",
            )
        if self.stop_agent is not None:
            stop, self.stop_agent = self.stop_agent, None
            stop()

    def _restore(self, messages: list[Message]) -> list[Message]:
        restored = []
        for message in messages:
            if message["role"] == "assistant":
                turn = next((t for t in self.turns if t.matches(message)), None)
                if turn is not None:
                    message = {"role": "assistant", "content": turn.recorded}
            restored.append(message)
        return restored

    def _open_or_extend(self, request: ChatRequest, turn: int) -> ChatBuffer:
        messages = self._restore(request.messages)
        budget = self.settings.max_context_tokens
        chat = self.run.chat
        try:
            if chat is None:
                chat = ChatBuffer(
                    self.tokenizer, messages, tools=request.tools or (), stop_token_ids=self.run.stops
                )
                extended = "overflow" if len(chat.input_ids) >= budget else "appended"
            else:
                extended = chat.add_conversation(messages, turn - 1, budget, tools=request.tools or ())
        except Exception as exc:
            raise OpenAIRequestError(
                400, f"the model's chat template cannot render these messages: {exc!r}", param="messages"
            ) from exc
        if extended == "overflow":
            self._end("truncated", f"prompt of turn {turn} exceeds max_context_tokens={budget}")
            raise OpenAIRequestError(
                400,
                f"the conversation no longer fits the run's context budget ({budget} tokens): episode over",
                param="messages",
                code="context_length_exceeded",
            )
        if extended == "new_segment":
            metrics.AGENT_SEGMENTS.labels(env=self.env_name).inc()
        self.run.chat = chat
        return chat

    async def complete(self, request: ChatRequest) -> Completion:
        """Generate the next turn for `request`; OpenAIRequestError for a refusal (module docstring)."""
        task = asyncio.current_task()
        if task is not None:
            self._inflight.add(task)
        try:
            async with self._lock:
                return await self._complete(request)
        finally:
            if task is not None:
                self._inflight.discard(task)

    async def _complete(self, request: ChatRequest) -> Completion:
        if self.closed:
            raise OpenAIRequestError(404, "this episode has ended", code="episode_ended")
        if self.finish is not None:
            raise OpenAIRequestError(
                400, f"this episode already ended ({self.finish}: {self.error})", code="episode_ended"
            )
        turn = len(self.turns)
        if turn >= self.env.spec.max_turns:
            self._end(
                "truncated", f"the agent asked for turn {turn + 1} > max_turns={self.env.spec.max_turns}"
            )
            raise OpenAIRequestError(
                400,
                f"this episode reached its turn limit (max_turns={self.env.spec.max_turns})",
                code="max_turns_exceeded",
            )
        started = time.perf_counter()
        chat = self._open_or_extend(request, turn)
        prompt_tokens = len(chat.input_ids)
        limit = self.settings.sampling.max_new_tokens
        if request.max_tokens is not None:
            limit = min(limit, request.max_tokens)
        generated_from = len(chat.current)
        try:
            engine_finish = await self.run._generate_turn(chat, turn, max_new_tokens=limit, stop=request.stop)
        except EpisodeEnded as ended:
            self._end(ended.finish_reason, ended.message or ended.finish_reason)
            if ended.finish_reason == "truncated":
                raise OpenAIRequestError(
                    400, "no room left in the run's context budget", code="context_length_exceeded"
                ) from ended
            raise OpenAIRequestError(
                502, f"the engine failed: {ended.message}", code="engine_error", kind="server_error"
            ) from ended
        segment = chat.current
        ids = segment.token_ids[generated_from:]
        text = chat.finish_turn()
        matched = self.run.matched
        completion = self._completion(
            request, text, matched, engine_finish, prompt_tokens, ids, segment.logprobs[generated_from:]
        )
        self.last_engine_finish = engine_finish
        self.turn_seconds.append(time.perf_counter() - started)
        self.refused_in_a_row = 0
        return completion

    def _completion(
        self,
        request: ChatRequest,
        recorded: str,
        matched: str | None,
        engine_finish: str,
        prompt_tokens: int,
        ids: list[int],
        logprobs: list[float],
    ) -> Completion:
        text = recorded
        if matched is not None and matched in text:
            text = text[: text.index(matched)]  # the API's text ends before the stop string
        calls: tuple[ToolCall, ...] = ()
        content: str | None = text
        if request.parse_tools:
            action = self.parser(text)
            if action.tool_calls and not action.tool_call_errors:
                calls = action.tool_calls
                content = text_without_calls(text, self.settings.tool_parser) or None
        self.turns.append(ReturnedTurn(content, tuple((c.name, c.arguments) for c in calls), recorded))
        finish = "length" if engine_finish == "length" else "tool_calls" if calls else "stop"
        token_logprobs = None
        if request.logprobs:
            content_ids = ids[:-1] if ids and ids[-1] in self.run.stops else ids
            token_logprobs = [
                (self.tokenizer.decode([token], skip_special_tokens=False), logprob)
                for token, logprob in zip(content_ids, logprobs, strict=False)
            ]
        version = self.run.chat.current.versions[-1] if self.run.chat and ids else 0
        return Completion(
            content=content,
            tool_calls=calls,
            call_ids=[f"call_{secrets.token_hex(8)}" for _ in calls],
            finish_reason=finish,
            prompt_tokens=prompt_tokens,
            completion_tokens=len(ids),
            logprobs=token_logprobs,
            fingerprint=f"rollwise-v{version}",
            stop_sequence=matched,
        )

    def close(self) -> None:
        """The episode is over: refuse new requests and cancel those in flight (their engine calls too)."""
        self.closed = True
        for task in list(self._inflight):
            task.cancel()

    def rows(
        self, task: Task, group_id: str, finish_reason: str, turn_rewards: list[float], outcome: float | None
    ) -> list[EpisodeSegment]:
        """The episode's segments as trajectory rows (pipeline.supervisor.actors.rollout's layout)."""
        self.run.turn_rewards = list(turn_rewards)
        self.run.outcome = outcome
        return self.run.rows(task, group_id, self.env_name, finish_reason)
