"""The model endpoint ``rollwise env check`` gives agent environments: env check's own random policy behind
a minimal OpenAI chat-completions server. It is not a model, and not the run's endpoint
(pipeline/supervisor/actors/agent_api/, which envs/ may not import): every request is answered with the
random policy's turn (envs.check_policies.random_action: numbers, words, garbage, empty and very long
text, tool calls with random arguments, malformed tool-call markup), so that an agent meets what an
untrained policy writes.

Served on 127.0.0.1 (a free port) and on a Unix socket with the same routes (what an agent process under
bubblewrap reaches through its relay, envs/agent_process/agent_relay.py):

- ``[/e/<key>]/v1/models``: the episode's model;
- ``[/e/<key>]/v1/chat/completions``: one turn. ``stream: true`` gives ``chat.completion.chunk`` events
  (role, the content in pieces, one chunk per tool call, the finish chunk, a usage chunk with
  ``stream_options.include_usage``) and ``data: [DONE]``. With ``tools`` and a ``tool_choice`` other than
  "none", a well-formed random call comes back in ``tool_calls`` (content null, finish "tool_calls"), as
  the run's endpoint parses one; otherwise the text is the content, markup and all. ``logprobs: true``
  gives a random log-prob per word; ``usage`` counts words, not tokens (there is no tokenizer here).

Rules the run's endpoint enforces too: each episode has its own key (the ``/e/<key>`` path, or
``Authorization: Bearer`` / ``x-api-key`` on ``/v1``); ``model`` must be the episode's (404
``model_not_found``); ``messages`` a non-empty list (400); a request past the episode's ``max_turns`` is
refused (400 ``max_turns_exceeded``); an ended episode's requests get 404 ``episode_ended``; the
env's ``max_refused_requests`` refusals in a row stop the agent (``EndpointEpisode.stop_agent``). Sampling
parameters are accepted and ignored. The Responses and Anthropic Messages APIs are not served (404
naming the route). Every refusal is recorded on its episode for the checker's report.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiohttp import web

from envs.agent import AgentEnvironment, AgentEpisode
from envs.check_policies import random_action

if TYPE_CHECKING:
    from openai import AsyncOpenAI

MAX_BODY_BYTES = 64 * 1024 * 1024
_PIECE = re.compile(r"\s*\S+\s*|\s+")


class Refused(Exception):
    """A request the endpoint refuses: HTTP ``status`` with OpenAI's error body."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    def response(self) -> web.Response:
        error = {
            "message": self.message,
            "type": "invalid_request_error",
            "param": self.param,
            "code": self.code,
        }
        return web.json_response({"error": error}, status=self.status)


@dataclass
class EndpointEpisode:
    """One agent episode's line to the endpoint: its key, its policy's random generator, and what the
    agent asked. ``requests``: chat completions answered (the episode's turns); ``refusals``: one line per
    refused request; ``past_max_turns``: the first turn number asked for beyond ``max_turns``."""

    env: AgentEnvironment
    episode_id: str
    key: str
    rng: random.Random
    requests: int = 0
    refusals: list[str] = field(default_factory=list)
    refused_in_a_row: int = 0
    past_max_turns: int | None = None
    ended: bool = False
    clients: list[Any] = field(default_factory=list)
    stop_agent: Callable[[], object] | None = None  # set by whoever runs the agent

    def refuse(self, refused: Refused) -> Refused:
        """Record a refusal; the env's ``max_refused_requests``-th in a row stops the agent (as the run's
        endpoint stops an agent looping on refusals)."""
        self.refusals.append(f"HTTP {refused.status} {refused.code}: {refused.message}")
        self.refused_in_a_row += 1
        if self.refused_in_a_row >= self.env.max_refused_requests and self.stop_agent is not None:
            stop, self.stop_agent = self.stop_agent, None
            stop()
        return refused


class CheckEndpoint:
    """The endpoint (module docstring). ``await start()`` before ``open``, ``await close()`` at the end."""

    def __init__(self) -> None:
        self.port = 0
        self.unix_socket: str | None = None
        self._episodes: dict[str, EndpointEpisode] = {}
        self._runner: web.AppRunner | None = None
        self._unix_dir: str | None = None

    @property
    def origin(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        """Serve on 127.0.0.1 (a free port) and on a Unix socket in a fresh directory."""
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        for prefix in ("", "/e/{key}"):
            app.router.add_get(prefix + "/v1/models", self._models)
            app.router.add_post(prefix + "/v1/chat/completions", self._chat)
        app.router.add_route("*", "/{tail:.*}", self._unserved)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.port = int(self._runner.addresses[0][1])
        # A sandboxed agent runs as another uid: it may traverse the directory and use the socket.
        self._unix_dir = tempfile.mkdtemp(prefix="rollwise-check-")
        os.chmod(self._unix_dir, 0o711)
        self.unix_socket = os.path.join(self._unix_dir, "endpoint.sock")
        await web.UnixSite(self._runner, self.unix_socket).start()
        os.chmod(self.unix_socket, 0o666)

    def open(self, env: AgentEnvironment, episode_id: str, seed: str) -> tuple[EndpointEpisode, AgentEpisode]:
        """A new episode of ``env``, its random policy seeded with ``seed``: its line (what it asked)
        and the AgentEpisode to hand ``env.play``."""
        line = EndpointEpisode(env, episode_id, secrets.token_urlsafe(18), random.Random(seed))
        self._episodes[line.key] = line
        base = f"{self.origin}/e/{line.key}/v1"
        episode = AgentEpisode(
            episode_id=episode_id,
            openai_base_url=base,
            anthropic_base_url=base.removesuffix("/v1"),
            api_key=line.key,
            model=env.model,
            unix_socket=self.unix_socket,
            client=lambda: self._client(line, base),
        )
        return line, episode

    async def end(self, line: EndpointEpisode) -> None:
        """The episode is over: its requests are refused from now on, the clients made for it closed."""
        line.ended = True
        for client in line.clients:
            await client.close()
        line.clients.clear()

    async def close(self) -> None:
        """Stop serving (idempotent)."""
        for line in list(self._episodes.values()):
            await self.end(line)
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()
        if self._unix_dir is not None:
            shutil.rmtree(self._unix_dir, ignore_errors=True)
            self._unix_dir = None

    @staticmethod
    def _client(line: EndpointEpisode, base: str) -> AsyncOpenAI:
        import openai  # only agent functions need it (the `agents` extra)

        client = openai.AsyncOpenAI(
            base_url=base,
            api_key=line.key,
            max_retries=0,  # as the run's: a resent generation would be a second turn
            timeout=line.env.spec.episode_timeout_s,
        )
        line.clients.append(client)
        return client

    # ------------------------------------------------------------------ requests
    def _caller(self, request: web.Request) -> EndpointEpisode:
        path_key = request.match_info.get("key")
        authorization = request.headers.get("Authorization", "")
        bearer = authorization[7:].strip() if authorization.lower().startswith("bearer ") else ""
        presented = {k for k in (bearer, request.headers.get("x-api-key", "").strip()) if k}
        if path_key is not None and presented - {path_key}:
            raise Refused(401, "the API key does not match this episode's base URL", "invalid_api_key")
        key = path_key or (next(iter(presented)) if len(presented) == 1 else "")
        line = self._episodes.get(key)
        if line is None:
            raise Refused(401, "unknown API key (each episode has its own)", "invalid_api_key")
        if line.ended:
            raise line.refuse(Refused(404, "this episode has ended", "episode_ended"))
        return line

    async def _models(self, request: web.Request) -> web.Response:
        try:
            line = self._caller(request)
        except Refused as refused:
            return refused.response()
        model = {"id": line.env.model, "object": "model", "created": 0, "owned_by": "rollwise-env-check"}
        return web.json_response({"object": "list", "data": [model]})

    async def _unserved(self, request: web.Request) -> web.Response:
        parts = request.path.split("/")
        key = parts[2] if len(parts) > 2 and parts[1] == "e" else ""
        route = "/".join(["", "e", "<key>", *parts[3:]]) if key else request.path
        refused = Refused(
            404,
            f"env check's endpoint does not serve {request.method} {route} (only /v1/chat/completions and "
            "/v1/models; the run's endpoint also serves /v1/responses and /v1/messages)",
            "unsupported_route",
        )
        line = self._episodes.get(key)
        return (line.refuse(refused) if line is not None else refused).response()

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        try:
            line = self._caller(request)
            try:
                body = json.loads(await request.read())
            except ValueError as exc:
                raise line.refuse(Refused(400, f"the body is not JSON: {exc}", "invalid_json")) from None
            reply = self._turn(line, body)
        except Refused as refused:
            return refused.response()
        if not body.get("stream"):
            return web.json_response(reply, dumps=_dumps)
        options = body.get("stream_options")
        usage = isinstance(options, dict) and bool(options.get("include_usage"))
        events = "".join(f"data: {_dumps(chunk)}\n\n" for chunk in _chunks(reply, usage))
        return web.Response(body=(events + "data: [DONE]\n\n").encode(), content_type="text/event-stream")

    def _turn(self, line: EndpointEpisode, body: Any) -> dict[str, Any]:
        """One turn of the random policy as a ``chat.completion`` object; Refused (recorded) otherwise."""
        if not isinstance(body, dict):
            raise line.refuse(Refused(400, "the request body must be a JSON object", "invalid_value", "body"))
        if body.get("model") != line.env.model:
            wrong = f"the model {body.get('model')!r} does not exist; this endpoint serves {line.env.model!r}"
            raise line.refuse(Refused(404, wrong, "model_not_found", "model"))
        if not isinstance(body.get("messages"), list) or not body["messages"]:
            raise line.refuse(Refused(400, "messages must be a non-empty list", "invalid_value", "messages"))
        turn, max_turns = line.requests + 1, line.env.spec.max_turns
        if turn > max_turns:
            line.past_max_turns = line.past_max_turns or turn
            limit = f"this episode reached its turn limit (max_turns={max_turns})"
            raise line.refuse(Refused(400, limit, "max_turns_exceeded"))
        line.requests, line.refused_in_a_row = turn, 0
        return _random_completion(line, body, f"chatcmpl-{line.episode_id}-t{turn - 1}")


def _random_completion(line: EndpointEpisode, body: dict[str, Any], completion_id: str) -> dict[str, Any]:
    """The random policy's next turn for the request ``body`` (module docstring), as a ``chat.completion``."""
    raw_tools = body.get("tools")
    tools: list[Any] = raw_tools if isinstance(raw_tools, list) else []
    spec = dataclasses.replace(line.env.spec, tools=tuple(tools))
    action = random_action(line.env, line.rng, spec)
    content: str | None = action.text
    message: dict[str, Any] = {"role": "assistant"}
    finish = "stop"
    if tools and body.get("tool_choice") != "none" and action.tool_calls and not action.tool_call_errors:
        content, finish = None, "tool_calls"
        message["tool_calls"] = [
            {
                "id": f"call_{secrets.token_hex(8)}",
                "type": "function",
                "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
            }
            for call in action.tool_calls
        ]
    message["content"] = content
    logprobs = None
    if body.get("logprobs") is True and content:
        logprobs = {
            "content": [
                {"token": p, "logprob": -5 * line.rng.random(), "bytes": list(p.encode()), "top_logprobs": []}
                for p in _PIECE.findall(content)
            ],
            "refusal": None,
        }
    messages = [m for m in body["messages"] if isinstance(m, dict)]
    prompt_words = sum(len(str(m.get("content") or "").split()) for m in messages)
    completion_words = len(action.text.split())
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": line.env.model,
        "choices": [{"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish}],
        "usage": {
            "prompt_tokens": prompt_words,
            "completion_tokens": completion_words,
            "total_tokens": prompt_words + completion_words,
        },
    }


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _chunks(completion: dict[str, Any], include_usage: bool) -> list[dict[str, Any]]:
    """``completion`` as ``chat.completion.chunk`` events (module docstring)."""
    choice = completion["choices"][0]
    message = choice["message"]

    def chunk(delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> dict[str, Any]:
        head = {key: completion[key] for key in ("id", "created", "model")}
        return {
            **head,
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
        }

    pieces = _PIECE.findall(message["content"] or "") or [""]
    logprobs = (choice["logprobs"] or {}).get("content")
    chunks = [chunk({"role": "assistant", "content": pieces[0]}, logprobs=_piece_logprobs(logprobs, 0))]
    chunks += [
        chunk({"content": p}, logprobs=_piece_logprobs(logprobs, i)) for i, p in enumerate(pieces[1:], 1)
    ]
    for index, call in enumerate(message.get("tool_calls") or []):
        chunks.append(chunk({"tool_calls": [{"index": index, **call}]}))
    chunks.append(chunk({}, choice["finish_reason"]))
    if include_usage:
        usage = chunk({})
        usage["choices"], usage["usage"] = [], completion["usage"]
        chunks.append(usage)
    return chunks


def _piece_logprobs(content: list[dict[str, Any]] | None, index: int) -> dict[str, Any] | None:
    if not content or index >= len(content):
        return None
    return {"content": [content[index]], "refusal": None}
