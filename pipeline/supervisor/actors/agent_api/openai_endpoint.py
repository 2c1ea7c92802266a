"""rollwise's in-process model endpoint: agent episodes and judges on the run's engines, in three APIs.

An aiohttp server on 127.0.0.1 (a free port) and on a Unix socket (the same routes; what a sandboxed
agent process reaches), serving `/v1/models`, `/v1/chat/completions` (openai_wire.py), `/v1/responses`
(the OpenAI Responses API, responses_wire.py) and `/v1/messages` (the Anthropic Messages API,
messages_wire.py). Every request of any of them is one turn, token-in/token-out through the same engine
pool; an API's errors come in that API's shape. The key travels as `Authorization: Bearer` or
`x-api-key`. Two kinds of caller:

- an agent episode (`run_agent_episode`, the `AgentRunner` of pipeline.supervisor.actors.rollout): each
  episode gets its own key and base URL, `http://127.0.0.1:<port>/e/<key>/v1` (Anthropic clients take
  it without `/v1`), and an `openai.AsyncOpenAI` made for it, whose requests to that address are
  answered in-process (agent_run.shared_http_client); concurrent episodes never share a key, so their
  requests never mix. Requests are recorded token by token (agent_session.py) and the episode becomes
  trajectory rows like a native one. The agent runs as the environment says
  (`AgentEnvironment.play`: the agent function in this event loop, or in a worker process of
  `agent_workers` (agent_workers.py), or a command in the sandbox (envs/agent_process/)).
  Sampling is the run's: `temperature`, `top_p` (and `top_k`, `min_p`) always come from the `[sampling]`
  config, since the learner reproduces the engine's log-probs at that temperature and the trainer owns
  the behaviour policy; `max_tokens` is capped by `sampling.max_new_tokens` and the context budget;
  `seed` is ignored (G episodes of a group with one seed would sample alike). The names of the
  parameters the run overrode come back in the `x-rollwise-clamped` response header.
- a service caller (`service_key`, base URL `base_url`): a judge or evaluator using the policy; nothing
  is recorded, its `temperature`, `top_p`, `seed` and `max_tokens` (up to the context budget) are honoured;
  it has no stored responses (`previous_response_id` is a 400).

Every request goes through the same EnginePool as native episodes (SGLang or embedded), token-in /
token-out. An episode's requests are answered one at a time, in arrival order.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import os
import re
import secrets
import shutil
import ssl
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

from aiohttp import web

from envs.agent import (
    POLICY_MODEL,
    AgentEnvironment,
    AgentEpisode,
    AgentResult,
)
from envs.api import Task
from pipeline.contracts.tls import require_tls_off_loopback
from pipeline.supervisor.actors.agent_api.agent_run import (
    Problem,
    agent_outcome,
    episode_finish,
    shared_http_client,
    stop_agent,
)
from pipeline.supervisor.actors.agent_api.agent_session import AgentSession
from pipeline.supervisor.actors.agent_api.messages_wire import (
    anthropic_error,
    message_events,
    message_object,
    parse_messages_request,
)
from pipeline.supervisor.actors.agent_api.openai_wire import (
    ChatRequest,
    Completion,
    OpenAIRequestError,
    chat_completion,
    chat_completion_chunks,
    models_list,
    normalise_messages,
    parse_chat_request,
)
from pipeline.supervisor.actors.agent_api.reply import Reply, dumps
from pipeline.supervisor.actors.agent_api.responses_wire import (
    ResponsesRequest,
    assistant_message,
    parse_responses_request,
    response_events,
    response_object,
    sse,
)
from pipeline.supervisor.actors.agent_api.service_turn import ServiceTurns
from pipeline.supervisor.actors.chat import ChatTokenizer
from pipeline.supervisor.actors.env_calls import close_env
from pipeline.supervisor.actors.episode_metrics import record_episode
from pipeline.supervisor.actors.outcomes import EpisodeOutcome
from pipeline.supervisor.actors.rollout import GenerateEngine, RolloutSettings
from pipeline.supervisor.observability import metrics

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 1024 * 1024
APIS = ("chat", "responses", "messages")


class AgentPool(Protocol):
    """Runs agent functions off this process (agent_workers.AgentWorkerPool)."""

    def bind(self, handler: Callable[[str, str, Mapping[str, str], bytes], Awaitable[Reply]]) -> None: ...

    def accepts(self, env: AgentEnvironment) -> bool: ...

    async def run(self, env: AgentEnvironment, episode: AgentEpisode, task: Task) -> object: ...

    async def close(self) -> None: ...


class OpenAIEndpoint:
    """The endpoint (module docstring). `await start()` before use, `await close()` at the end."""

    def __init__(
        self,
        *,
        engine: GenerateEngine,
        tokenizer: ChatTokenizer,
        settings: RolloutSettings,
        host: str = "127.0.0.1",
        port: int = 0,
        agent_pool: AgentPool | None = None,
        ssl_context: ssl.SSLContext | None = None,
        allow_plaintext: bool = False,
    ) -> None:
        self.engine = engine
        self.agent_pool = agent_pool
        if agent_pool is not None:  # its workers' clients send their requests through `handle`
            agent_pool.bind(self.handle)
        self.tokenizer = tokenizer
        self.settings = settings
        self.host = host
        self.port = port
        # Beyond loopback it serves TLS (pipeline.contracts.tls): the episodes' keys are in every URL.
        self.ssl_context = ssl_context
        self.allow_plaintext = allow_plaintext
        self.service_key = secrets.token_urlsafe(18)
        self._sessions: dict[str, AgentSession] = {}
        self._runner: web.AppRunner | None = None
        self._http: Any = None
        self._service = ServiceTurns(engine, tokenizer, settings)
        self._unix_dir: str | None = None
        self.unix_socket: str | None = None

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> str:
        """Serve on host:port (0 = a free port) and on a Unix socket; returns `base_url`. PlaintextRefused
        beyond loopback without TLS (unless `allow_plaintext`)."""
        require_tls_off_loopback(
            "the OpenAI endpoint",
            self.host,
            self.ssl_context is not None,
            self.allow_plaintext,
            "ssl_context",
        )
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        for prefix in ("", "/e/{key}"):
            app.router.add_get(prefix + "/v1/models", self._models)
            app.router.add_post(prefix + "/v1/chat/completions", self._api("chat"))
            app.router.add_post(prefix + "/v1/responses", self._api("responses"))
            app.router.add_post(prefix + "/v1/messages", self._api("messages"))
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, backlog=4096, ssl_context=self.ssl_context)
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        # The Unix socket: a sandboxed agent process has no network, only this file mounted in. Anyone
        # who can reach it still needs a running episode's key.
        self._unix_dir = tempfile.mkdtemp(prefix="rollwise-endpoint-")
        os.chmod(self._unix_dir, 0o711)
        self.unix_socket = os.path.join(self._unix_dir, "endpoint.sock")
        await web.UnixSite(self._runner, self.unix_socket, backlog=4096).start()
        os.chmod(self.unix_socket, 0o666)
        return self.base_url

    @property
    def base_url(self) -> str:
        """The service base URL (use with `service_key`)."""
        return f"{self.origin}/v1"

    def episode_base_url(self, key: str) -> str:
        return f"{self.origin}/e/{key}/v1"

    @property
    def origin(self) -> str:
        return f"{'https' if self.ssl_context else 'http'}://{self.host}:{self.port}"

    async def close(self) -> None:
        """Stop serving; episodes still open are refused from now on. Idempotent."""
        for session in list(self._sessions.values()):
            session.close()
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()
        if self._http is not None:
            http, self._http = self._http, None
            await http.close_shared()
        if self._unix_dir is not None:
            shutil.rmtree(self._unix_dir, ignore_errors=True)
            self._unix_dir = None
        if self.agent_pool is not None:  # owned: its workers' episodes are over
            pool, self.agent_pool = self.agent_pool, None
            await pool.close()

    # ------------------------------------------------------------------ agent episodes
    def _client_for(self, session: AgentSession) -> Any:
        import openai

        if self._http is None:
            self._http = shared_http_client(self.origin, self.handle)
            # httpx logs every request at INFO: thousands of lines a minute in supervisor.log.
            for name in ("httpx", "httpx2"):
                if logging.getLogger(name).level == logging.NOTSET:
                    logging.getLogger(name).setLevel(logging.WARNING)
        return openai.AsyncOpenAI(
            base_url=self.episode_base_url(session.key),
            api_key=session.key,
            max_retries=0,  # a resent generation would be a second turn
            timeout=session.env.spec.episode_timeout_s,
            http_client=self._http,
        )

    def _episode(self, session: AgentSession) -> AgentEpisode:
        base = self.episode_base_url(session.key)
        return AgentEpisode(
            episode_id=session.episode_id,
            openai_base_url=base,
            anthropic_base_url=base.removesuffix("/v1"),
            api_key=session.key,
            model=session.model,
            unix_socket=self.unix_socket,
            client=lambda: self._client_for(session),
        )

    def _agent_run(self, env: AgentEnvironment, episode: AgentEpisode, task: Task) -> Awaitable[object]:
        if self.agent_pool is not None and self.agent_pool.accepts(env):
            return self.agent_pool.run(env, episode, task)
        return env.play(episode, task)

    async def run_agent_episode(
        self, env: AgentEnvironment, task: Task, *, episode_id: str, group_id: str, env_name: str
    ) -> EpisodeOutcome:
        """Run the environment's agent (`env.play`) as one episode; never raises for agent, engine or
        endpoint failures (they become the finish reason, counted); cancellation propagates after
        cleanup."""
        started = time.perf_counter()
        metrics.EPISODES_IN_FLIGHT.inc()
        session = AgentSession(
            engine=self.engine,
            tokenizer=self.tokenizer,
            settings=self.settings,
            env=env,
            episode_id=episode_id,
            env_name=env_name,
            group_id=group_id,
        )
        self._sessions[session.key] = session
        result: AgentResult | None = None
        problem: Problem | None = None
        try:
            agent = asyncio.ensure_future(self._agent_run(env, self._episode(session), task))
            session.stop_agent = functools.partial(agent.cancel, "the endpoint stopped the agent")
            try:
                async with asyncio.timeout(env.spec.episode_timeout_s):
                    await asyncio.wait({agent})  # unlike `await agent`, never cancels it on our behalf
            except TimeoutError:
                problem = (
                    "timeout",
                    "timeout",
                    f"the agent exceeded episode_timeout_s={env.spec.episode_timeout_s}",
                )
            finally:
                await stop_agent(agent)
            if problem is None:
                problem, result = agent_outcome(agent, env_name)
        finally:
            session.stop_agent = None
            session.close()
            self._sessions.pop(session.key, None)
            close_error = await close_env(env, env_name)
            metrics.EPISODES_IN_FLIGHT.dec()
        finish, error = episode_finish(session, problem, result)
        rewards = [0.0] * session.num_turns
        if result is not None and len(result.turn_rewards) <= len(rewards):
            rewards[: len(result.turn_rewards)] = result.turn_rewards
        outcome_value = result.outcome if result is not None else (0.0 if finish == "truncated" else None)
        outcome = EpisodeOutcome(
            episode_id=episode_id,
            group_id=group_id,
            task_id=task.id,
            env=env_name,
            finish_reason=finish,
            rows=session.rows(task, group_id, finish, rewards, outcome_value),
            turn_rewards=rewards,
            outcome=outcome_value,
            generated_tokens=session.run.generated_tokens,
            duration_s=time.perf_counter() - started,
            turn_seconds=session.turn_seconds,
            engine_seconds=session.run.engine_seconds,
            error=error or close_error,
        )
        record_episode(outcome)
        return outcome

    def _overridden(self, chat: ChatRequest) -> list[str]:
        """The sampling parameters an episode request set that the run's config replaces."""
        run = self.settings.sampling
        asked = {"temperature": (chat.temperature, run.temperature), "top_p": (chat.top_p, run.top_p)}
        names = [name for name, (value, used) in asked.items() if value is not None and value != used]
        return [*names, *(["seed"] if chat.seed is not None else []), *chat.unenforced]

    def _sampling_used(self, chat: ChatRequest, session: AgentSession | None) -> tuple[float, float]:
        """(temperature, top_p) the turn was sampled with (a Responses object reports them)."""
        run = self.settings.sampling
        if session is not None:
            return run.temperature, run.top_p
        return (
            run.temperature if chat.temperature is None else chat.temperature,
            run.top_p if chat.top_p is None else chat.top_p,
        )

    # ------------------------------------------------------------------ requests, whatever carried them
    def _caller(self, path_key: str | None, authorization: str, api_key: str = "") -> AgentSession | None:
        """The episode the request belongs to, None for the service key; 401 otherwise. The key comes as
        `Authorization: Bearer <key>` (OpenAI clients) or `x-api-key: <key>` (Anthropic clients)."""
        bearer = authorization[7:].strip() if authorization.lower().startswith("bearer ") else None
        presented = {k for k in (bearer, api_key.strip()) if k}
        if path_key is not None and presented - {path_key}:
            raise OpenAIRequestError(
                401, "the API key does not match this episode's base URL", code="invalid_api_key"
            )
        if len(presented) > 1:
            raise OpenAIRequestError(
                401, "Authorization and x-api-key name different keys", code="invalid_api_key"
            )
        key = path_key or next(iter(presented), None)
        if key is not None and key == self.service_key and path_key is None:
            return None
        session = self._sessions.get(key or "")
        if session is None:
            if path_key is not None:
                raise OpenAIRequestError(
                    404, "no running episode has this base URL (it ended)", code="episode_ended"
                )
            raise OpenAIRequestError(401, "unknown API key", code="invalid_api_key")
        return session

    async def handle(self, method: str, path: str, headers: Mapping[str, str], body: bytes) -> Reply:
        """A request to the endpoint's own address that reached it without HTTP (the in-process client,
        an agent worker's client): routed as the server routes it. `headers`: lower-case names."""
        match = _ROUTE.fullmatch(path)
        authorization = headers.get("authorization", "")
        api_key = headers.get("x-api-key", "")
        if match is None or method != ("GET" if match["what"] == "models" else "POST"):
            status, problem = (404, "no route") if match is None else (405, "method not allowed:")
            refused = OpenAIRequestError(status, f"{problem} {method} {path}")
            return Reply.json(refused.body(), status=status)
        if match["what"] == "models":
            return self.answer_models(match["key"], authorization, api_key)
        return await self.answer(_ROUTE_APIS[match["what"]], match["key"], authorization, body, api_key)

    def answer_models(self, path_key: str | None, authorization: str, api_key: str = "") -> Reply:
        """GET [/e/<key>]/v1/models."""
        try:
            session = self._caller(path_key, authorization, api_key)
        except OpenAIRequestError as err:
            return Reply.json(err.body(), status=err.status)
        return Reply.json(models_list([POLICY_MODEL if session is None else session.model]))

    async def answer_chat(self, path_key: str | None, authorization: str, raw: bytes) -> Reply:
        """POST [/e/<key>]/v1/chat/completions with body `raw`."""
        return await self.answer("chat", path_key, authorization, raw)

    async def answer(
        self, api: str, path_key: str | None, authorization: str, raw: bytes, api_key: str = ""
    ) -> Reply:
        """POST [/e/<key>]/v1/<api's route> with body `raw`: one turn, answered in `api`'s format."""
        started = time.perf_counter()
        route = "episode"
        session: AgentSession | None = None
        try:
            session = self._caller(path_key, authorization, api_key)
            route = "episode" if session is not None else "service"
            try:
                body = json.loads(raw)
            except ValueError as exc:
                raise OpenAIRequestError(400, f"the body is not JSON: {exc}", param="body") from exc
            reply = await _ANSWERS[api](self, session, body)
        except OpenAIRequestError as err:
            status = "engine_error" if err.status >= 500 else "rejected"
            metrics.OPENAI_REQUESTS.labels(route=route, api=api, status=status).inc()
            if session is not None and err.status < 500:
                session.refused(err)
                # A refusal suspends once: an agent retrying in a tight loop through the in-process
                # client would otherwise never yield, and never see the cancellation that stops it.
                await asyncio.sleep(0)
            error_body = anthropic_error(err) if api == "messages" else err.body()
            return Reply.json(error_body, status=err.status)
        finally:
            metrics.OPENAI_REQUEST_LATENCY.labels(route=route).observe(time.perf_counter() - started)
        metrics.OPENAI_REQUESTS.labels(route=route, api=api, status="ok").inc()
        return reply

    def _served(self, requested: str, session: AgentSession | None) -> str:
        served = POLICY_MODEL if session is None else session.model
        if requested != served:
            raise OpenAIRequestError(
                404,
                f"the model {requested!r} does not exist; this endpoint serves {served!r}",
                param="model",
                code="model_not_found",
            )
        return served

    async def _turn(self, session: AgentSession | None, chat: ChatRequest) -> tuple[Completion, str]:
        """Generate one turn; (completion, the turn's id suffix: "<episode>-t<k>" or "svc-...")."""
        if session is not None:
            completion = await session.complete(chat)
            return completion, f"{session.episode_id}-t{session.num_turns - 1}"
        return await self._service.complete(chat)

    @staticmethod
    def _headers(clamped: list[str]) -> dict[str, str]:
        return {"x-rollwise-clamped": ",".join(clamped)} if clamped else {}

    async def _answer_chat(self, session: AgentSession | None, body: Any) -> Reply:
        chat = parse_chat_request(body)
        served = self._served(chat.model, session)
        clamped = self._overridden(chat) if session is not None else []
        completion, suffix = await self._turn(session, chat)
        completion_id = f"chatcmpl-{suffix}"
        headers = self._headers(clamped)
        if not chat.stream:
            return Reply.json(
                chat_completion(completion, completion_id=completion_id, model=served), headers=headers
            )
        # The engine call is token-in/token-out, not streamed: the whole completion exists before its
        # first chunk, so the event stream is one body; clients parse it chunk by chunk all the same.
        chunks = chat_completion_chunks(
            completion, completion_id=completion_id, model=served, include_usage=chat.include_usage
        )
        events = "".join(f"data: {dumps(chunk)}\n\n" for chunk in chunks) + "data: [DONE]\n\n"
        return Reply(200, events.encode(), "text/event-stream", headers)

    async def _answer_responses(self, session: AgentSession | None, body: Any) -> Reply:
        request = parse_responses_request(body)
        served = self._served(request.chat.model, session)
        history = self._stored_history(session, request)
        system = [{"role": "system", "content": request.instructions}] if request.instructions else []
        conversation = [*history, *request.input_messages]
        if not conversation:
            raise OpenAIRequestError(400, "input is empty: there is nothing to answer", param="input")
        chat = dataclasses.replace(request.chat, messages=normalise_messages([*system, *conversation]))
        clamped = (
            [*self._overridden(chat), *request.ignored] if session is not None else list(request.ignored)
        )
        completion, suffix = await self._turn(session, chat)
        response_id = f"resp_{suffix}"
        if session is not None and request.store:
            session.responses[response_id] = [*conversation, assistant_message(completion)]
        temperature, top_p = self._sampling_used(chat, session)
        if not request.chat.stream:
            obj = response_object(
                request,
                completion,
                response_id=response_id,
                model=served,
                temperature=temperature,
                top_p=top_p,
            )
            return Reply.json(obj, headers=self._headers(clamped))
        events = response_events(
            request, completion, response_id=response_id, model=served, temperature=temperature, top_p=top_p
        )
        body_bytes = sse(events)
        return Reply(200, body_bytes, "text/event-stream", self._headers(clamped))

    @staticmethod
    def _stored_history(session: AgentSession | None, request: ResponsesRequest) -> list[dict[str, Any]]:
        """The conversation `previous_response_id` continues (instructions apart, as OpenAI's)."""
        previous = request.previous_response_id
        if previous is None:
            return []
        if session is None:
            raise OpenAIRequestError(
                400,
                "previous_response_id: a service caller has no stored responses; send the whole input",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        stored = session.responses.get(previous)
        if stored is None:
            raise OpenAIRequestError(
                400,
                f"previous_response_id {previous!r} is not a stored response of this episode (responses "
                "are kept per episode, and not at all with store=false)",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        return [dict(message) for message in stored]

    async def _answer_messages(self, session: AgentSession | None, body: Any) -> Reply:
        request = parse_messages_request(body)
        served = self._served(request.chat.model, session)
        clamped = self._overridden(request.chat) if session is not None else []
        if request.top_k is not None and session is not None:
            clamped.append("top_k")
        completion, suffix = await self._turn(session, request.chat)
        completion = dataclasses.replace(
            completion, call_ids=[f"toolu_{c.removeprefix('call_')}" for c in completion.call_ids]
        )
        message_id = f"msg_{suffix}"
        if not request.chat.stream:
            return Reply.json(
                message_object(completion, message_id=message_id, model=served),
                headers=self._headers(clamped),
            )
        body_bytes = sse(message_events(completion, message_id=message_id, model=served))
        return Reply(200, body_bytes, "text/event-stream", self._headers(clamped))

    # ------------------------------------------------------------------ over HTTP (aiohttp)
    async def _models(self, request: web.Request) -> web.Response:
        headers = request.headers
        reply = self.answer_models(
            request.match_info.get("key"), headers.get("Authorization", ""), headers.get("x-api-key", "")
        )
        return reply.to_aiohttp()

    def _api(self, api: str) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handle(request: web.Request) -> web.Response:
            headers = request.headers
            reply = await self.answer(
                api,
                request.match_info.get("key"),
                headers.get("Authorization", ""),
                await request.read(),
                headers.get("x-api-key", ""),
            )
            return reply.to_aiohttp()

        return handle


_ANSWERS: dict[str, Callable[[OpenAIEndpoint, AgentSession | None, Any], Awaitable[Reply]]] = {
    "chat": OpenAIEndpoint._answer_chat,
    "responses": OpenAIEndpoint._answer_responses,
    "messages": OpenAIEndpoint._answer_messages,
}
_ROUTE = re.compile(r"(?:/e/(?P<key>[^/]+))?/v1/(?P<what>chat/completions|responses|messages|models)")
_ROUTE_APIS = {"chat/completions": "chat", "responses": "responses", "messages": "messages"}
