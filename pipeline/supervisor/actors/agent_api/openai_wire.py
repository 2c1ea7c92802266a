"""OpenAI chat-completions wire format: request validation and response bodies (pure functions).

What rollwise's endpoint accepts (pipeline/supervisor/actors/agent_api/openai_endpoint.py), field by field:
- `model` (required; the endpoint checks the name), `messages` (required, non-empty; roles system,
  developer (= system), user, assistant, tool; content a string or a list of text parts; assistant
  `tool_calls` with `function.name` and `function.arguments`), `tools` (function tools), `tool_choice`
  "auto", "none" or "required" (accepted, not enforced: the policy samples as it always does, since
  constrained decoding would change the distribution the trainer recomputes; the reply may hold no tool
  call, and the header x-rollwise-clamped says so), `parallel_tool_calls`, `n` = 1, `stream`
  (+ `stream_options.include_usage`), `logprobs`, `top_logprobs` 0, `max_tokens` /
  `max_completion_tokens`, `temperature`, `top_p`, `seed`, `stop` (a string or up to 16 non-empty
  strings: the engine stops on them, SGLang's `stop`; every token it sampled is recorded, the returned
  text ends before the stop string, as OpenAI's does), and the inert `user`, `metadata`, `store` (false),
  `service_tier`, `response_format` {"type": "text"}, `logit_bias` {}, `presence_penalty` 0,
  `frequency_penalty` 0.
- Anything else, or one of those with a value that would change what the model samples in a way the
  trainer cannot reproduce (penalties, logit bias, JSON mode, a named tool choice, n > 1, top log-probs),
  is a 400 naming the parameter.
Errors have OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Responses are `chat.completion` objects (or `chat.completion.chunk` events when streaming: the whole
completion is generated first, then sent as a role/content chunk, tool-call chunks, a finish chunk and an
optional usage chunk).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

from envs.api import ToolCall

Message = dict[str, Any]

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
_PLAIN_ROLES = frozenset({"system", "user", "assistant", "tool"})
_SUPPORTED = frozenset(
    {
        "model",
        "messages",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "n",
        "stream",
        "stream_options",
        "logprobs",
        "top_logprobs",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "seed",
        "user",
        "metadata",
        "store",
        "service_tier",
        "response_format",
        "logit_bias",
        "presence_penalty",
        "frequency_penalty",
        "stop",
    }
)


class OpenAIRequestError(Exception):
    """A request the endpoint refuses: HTTP `status` with OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.kind = kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def _bad(message: str, param: str, code: str = "invalid_value") -> OpenAIRequestError:
    return OpenAIRequestError(400, message, param=param, code=code)


@dataclass(frozen=True)
class ChatRequest:
    """A validated chat-completions request. `temperature`, `top_p` and `seed` are what the client asked
    for (None when absent); the endpoint decides which it honours."""

    model: str
    messages: list[Message]
    tools: list[dict[str, Any]] | None = None
    parse_tools: bool = True
    max_tokens: int | None = None
    logprobs: bool = False
    stream: bool = False
    include_usage: bool = False
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    unenforced: tuple[str, ...] = ()  # parameters accepted but not honoured (reported, x-rollwise-clamped)


MAX_STOP_STRINGS = 16


def stop_strings(value: Any, param: str) -> tuple[str, ...]:
    """A `stop` value (None, a string, or a list of strings) as a tuple of non-empty strings; 400 naming
    `param` otherwise (an empty string would end every turn at its first token)."""
    if value is None or value == []:
        return ()
    strings = [value] if isinstance(value, str) else value
    if not isinstance(strings, list) or not all(isinstance(s, str) for s in strings):
        raise _bad(f"{param} must be a string or a list of strings, got {value!r:.200}", param)
    if not all(strings):
        raise _bad(f"{param} holds an empty string, which would end every turn at once", param)
    if len(strings) > MAX_STOP_STRINGS:
        raise _bad(f"{param} has {len(strings)} strings; at most {MAX_STOP_STRINGS}", param)
    return tuple(dict.fromkeys(strings))


def _number(body: dict[str, Any], key: str, low: float, high: float) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _bad(f"{key} must be a number, got {value!r}", key)
    if not low <= value <= high:
        raise _bad(f"{key} must be in [{low}, {high}], got {value}", key)
    return float(value)


def _positive_int(body: dict[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _bad(f"{key} must be an integer >= 1, got {value!r}", key)
    return value


def _refuse_unless(ok: bool, key: str, why: str, value: Any) -> None:
    if not ok:
        raise OpenAIRequestError(
            400, f"unsupported {key}={value!r}: {why}", param=key, code="unsupported_parameter"
        )


def _text_of(content: Any, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for index, part in enumerate(content):
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise OpenAIRequestError(
                    400,
                    f"{where}.content[{index}] is a {kind!r} part; only text parts are supported",
                    param=f"{where}.content",
                    code="unsupported_content",
                )
            parts.append(part["text"])
        return "".join(parts)
    raise _bad(f"{where}.content must be a string or a list of text parts", f"{where}.content")


def _tool_calls_of(raw: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(raw, list):
        raise _bad(f"{where}.tool_calls must be a list", f"{where}.tool_calls")
    calls = []
    for index, call in enumerate(raw):
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        arguments = function.get("arguments", "{}") if isinstance(function, dict) else None
        if not isinstance(name, str) or not isinstance(arguments, str | dict):
            raise _bad(
                f"{where}.tool_calls[{index}] needs function.name (a string) and function.arguments (JSON)",
                f"{where}.tool_calls",
            )
        entry: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": arguments}}
        if isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        calls.append(entry)
    return calls


def normalise_messages(raw: Any) -> list[Message]:
    """Plain-dict messages the chat template can render: text content, known roles (developer -> system),
    None-valued fields dropped. OpenAIRequestError (400) naming the first bad message."""
    if not isinstance(raw, list) or not raw:
        raise _bad("messages must be a non-empty list", "messages")
    messages: list[Message] = []
    for index, message in enumerate(raw):
        if (
            type(message) is dict
            and len(message) == 2
            and message.get("role") in _PLAIN_ROLES
            and type(message.get("content")) is str
        ):
            messages.append(message)  # the usual {"role", "content": str}: already what the template takes
            continue
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise _bad(f"{where} must be an object", where)
        role = message.get("role")
        if role not in ROLES:
            raise _bad(f"{where}.role {role!r} is not one of {sorted(ROLES)}", f"{where}.role")
        out: Message = {
            key: value
            for key, value in message.items()
            if value is not None and key not in ("content", "tool_calls")
        }
        out["role"] = "system" if role == "developer" else role
        content = _text_of(message.get("content"), where)
        calls = _tool_calls_of(message["tool_calls"], where) if message.get("tool_calls") else []
        if role == "assistant":
            out["content"] = content or ""
            if calls:
                out["tool_calls"] = calls
        elif content is None:
            raise _bad(f"{where}.content is required for role {role!r}", f"{where}.content")
        else:
            out["content"] = content
        messages.append(out)
    return messages


def _tools_of(raw: Any) -> list[dict[str, Any]] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise _bad("tools must be a list of function tools", "tools")
    for index, tool in enumerate(raw):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise _bad(f'tools[{index}] must be {{"type": "function", "function": {{...}}}}', "tools")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise _bad(f"tools[{index}].function.name must be a non-empty string", "tools")
    return list(raw) or None


def request_model(body: Any, supported: AbstractSet[str]) -> str:
    """The `model` of a request body, after the checks every OpenAI route makes first (a JSON object,
    no parameter outside `supported`, a non-empty model name); OpenAIRequestError (400) naming the field."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object", "body")
    unknown = sorted(set(body) - supported)
    if unknown:
        raise OpenAIRequestError(
            400,
            f"unsupported parameter(s): {', '.join(unknown)}",
            param=unknown[0],
            code="unsupported_parameter",
        )
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model must be a non-empty string", "model")
    return model


def parse_chat_request(body: Any) -> ChatRequest:
    """Validate a request body (module docstring); OpenAIRequestError (400) naming the offending field."""
    model = request_model(body, _SUPPORTED)
    _refuse_unless(body.get("n") in (None, 1), "n", "one choice per request", body.get("n"))
    _refuse_unless(
        body.get("top_logprobs") in (None, 0),
        "top_logprobs",
        "the engine returns no top-k",
        body.get("top_logprobs"),
    )
    for key in ("presence_penalty", "frequency_penalty"):
        _refuse_unless(
            body.get(key) in (None, 0, 0.0), key, "penalties change the sampling distribution", body.get(key)
        )
    _refuse_unless(
        body.get("logit_bias") in (None, {}),
        "logit_bias",
        "it changes the sampling distribution",
        body.get("logit_bias"),
    )
    stop = () if body.get("stop") == "" else stop_strings(body.get("stop"), "stop")
    response_format = body.get("response_format")
    _refuse_unless(
        response_format is None or response_format == {"type": "text"},
        "response_format",
        "constrained decoding is not supported",
        response_format,
    )
    _refuse_unless(body.get("store") in (None, False), "store", "nothing is stored", body.get("store"))
    tool_choice = body.get("tool_choice")
    _refuse_unless(
        tool_choice in (None, "auto", "none", "required"),
        "tool_choice",
        "only 'auto', 'none' and 'required' (not enforced); no constrained decoding",
        tool_choice,
    )
    for key in ("stream", "logprobs", "parallel_tool_calls"):
        if body.get(key) is not None and not isinstance(body.get(key), bool):
            raise _bad(f"{key} must be a boolean", key)
    stream = bool(body.get("stream"))
    options = body.get("stream_options")
    if options is not None and (
        not isinstance(options, dict) or not stream or set(options) - {"include_usage"}
    ):
        raise _bad("stream_options is only {'include_usage': bool}, with stream = true", "stream_options")
    limits = [
        n
        for n in (_positive_int(body, "max_tokens"), _positive_int(body, "max_completion_tokens"))
        if n is not None
    ]
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise _bad(f"seed must be an integer, got {seed!r}", "seed")
    top_p = _number(body, "top_p", 0.0, 1.0)
    if top_p == 0.0:
        raise _bad("top_p must be > 0", "top_p")
    return ChatRequest(
        model=model,
        messages=normalise_messages(body.get("messages")),
        tools=_tools_of(body.get("tools")),
        parse_tools=tool_choice != "none",
        max_tokens=min(limits) if limits else None,
        logprobs=bool(body.get("logprobs")),
        stream=stream,
        include_usage=bool(options and options.get("include_usage")),
        temperature=_number(body, "temperature", 0.0, 2.0),
        top_p=top_p,
        seed=seed,
        stop=stop,
        unenforced=("tool_choice",) if tool_choice == "required" else (),
    )


# --------------------------------------------------------------------------------------- responses
@dataclass(frozen=True)
class Completion:
    """One generated assistant message and what the response reports about it."""

    content: str | None
    tool_calls: Sequence[ToolCall]
    call_ids: Sequence[str]
    finish_reason: str  # stop | length | tool_calls
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[tuple[str, float]] | None = None  # (token text, log-prob) per content token
    fingerprint: str | None = None
    stop_sequence: str | None = None  # the stop string that ended the turn (not in `content`)
    extra: dict[str, Any] = field(default_factory=dict)


def tool_call_objects(completion: Completion) -> list[dict[str, Any]]:
    return [
        {
            "id": call_id,
            "type": "function",
            "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)},
        }
        for call, call_id in zip(completion.tool_calls, completion.call_ids, strict=True)
    ]


def _logprobs_object(completion: Completion) -> dict[str, Any] | None:
    if completion.logprobs is None:
        return None
    return {
        "content": [
            {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8")), "top_logprobs": []}
            for token, logprob in completion.logprobs
        ],
        "refusal": None,
    }


def _usage(completion: Completion) -> dict[str, int]:
    return {
        "prompt_tokens": completion.prompt_tokens,
        "completion_tokens": completion.completion_tokens,
        "total_tokens": completion.prompt_tokens + completion.completion_tokens,
    }


def chat_completion(completion: Completion, *, completion_id: str, model: str) -> dict[str, Any]:
    """The `chat.completion` object."""
    message: dict[str, Any] = {"role": "assistant", "content": completion.content}
    if completion.tool_calls:
        message["tool_calls"] = tool_call_objects(completion)
    body: dict[str, Any] = {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": _logprobs_object(completion),
                "finish_reason": completion.finish_reason,
            }
        ],
        "usage": _usage(completion),
    }
    if completion.fingerprint is not None:
        body["system_fingerprint"] = completion.fingerprint
    return body


def chat_completion_chunks(
    completion: Completion, *, completion_id: str, model: str, include_usage: bool
) -> list[dict[str, Any]]:
    """The same completion as `chat.completion.chunk` events (the whole message is known already)."""
    created = int(time.time())

    def chunk(delta: dict[str, Any], finish: str | None, logprobs: Any = None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
        }
        if completion.fingerprint is not None:
            body["system_fingerprint"] = completion.fingerprint
        return body

    chunks = [
        chunk({"role": "assistant", "content": completion.content or ""}, None, _logprobs_object(completion))
    ]
    for index, call in enumerate(tool_call_objects(completion)):
        chunks.append(chunk({"tool_calls": [{"index": index, **call}]}, None))
    chunks.append(chunk({}, completion.finish_reason))
    if include_usage:
        usage = chunk({}, None)
        usage["choices"] = []
        usage["usage"] = _usage(completion)
        chunks.append(usage)
    return chunks


def models_list(names: Sequence[str]) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [{"id": name, "object": "model", "created": 0, "owned_by": "rollwise"} for name in names],
    }
