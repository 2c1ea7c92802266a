"""Anthropic Messages API wire format (`POST /v1/messages`): a request as one chat turn, the turn as a
`message` object or its event stream, and errors in Anthropic's shape. Pure functions.

What a request may contain: `model`, `max_tokens` (both required), `messages` (roles user and assistant;
content a string or blocks: `text`, `tool_use` (assistant: `id`, `name`, `input`) and `tool_result`
(user: `tool_use_id`, `content` as a string or text blocks, `is_error`)), `system` (a string or text
blocks), `tools` (client tools: `name`, `description`, `input_schema`), `tool_choice` auto, none or
any (accepted, not enforced: see openai_wire.py),
`stop_sequences` (the engine stops on them, SGLang's `stop`; the text ends before the sequence and the
response says which one in `stop_sequence`, as Anthropic's does; every sampled token is recorded),
`stream`, `temperature`, `top_p`, `top_k` (the run's own win: reported in x-rollwise-clamped), and the
inert `metadata`, `service_tier`, `thinking` {"type": "disabled"}, `cache_control` on blocks. Anything
else (images, documents, thinking blocks, server tools, forced tool choice) is a 400 whose message names
the field (`messages.2.content.0.type: ...`; Anthropic's errors carry no `param`).

A user message's blocks become, in order, one `tool` message per `tool_result` and one user message per
run of text blocks; an assistant message's text blocks and `tool_use` blocks are one assistant turn (its
content and tool calls), so a reply sent back in the history is recognised as the turn the model
generated (agent_session.py).

The reply: `content` is a text block (when the turn has text, or has nothing at all) and one `tool_use`
block per tool call; `stop_reason` "tool_use", "max_tokens", "stop_sequence" or "end_turn". Streaming
sends message_start, per block content_block_start / content_block_delta (text_delta or
input_json_delta) / content_block_stop, then message_delta (stop reason, output tokens) and
message_stop, each as `event: <type>` + `data: <json>`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from pipeline.supervisor.actors.agent_api.openai_wire import (
    ChatRequest,
    Completion,
    Message,
    OpenAIRequestError,
    normalise_messages,
    stop_strings,
)

_SUPPORTED = frozenset(
    {
        "model",
        "max_tokens",
        "messages",
        "system",
        "tools",
        "tool_choice",
        "stop_sequences",
        "stream",
        "temperature",
        "top_p",
        "top_k",
        "metadata",
        "service_tier",
        "thinking",
    }
)
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
}


def anthropic_error(err: OpenAIRequestError) -> dict[str, Any]:
    """An endpoint refusal in Anthropic's error shape (the message names the field)."""
    kind = _ERROR_TYPES.get(err.status, "api_error")
    message = err.message if err.param is None or err.param in err.message else f"{err.param}: {err.message}"
    return {"type": "error", "error": {"type": kind, "message": message}}


def _bad(message: str, param: str) -> OpenAIRequestError:
    return OpenAIRequestError(400, f"{param}: {message}", param=param)


@dataclass(frozen=True)
class MessagesRequest:
    """A validated Messages request: the turn as chat messages and what the reply needs."""

    chat: ChatRequest
    stop_sequences: tuple[str, ...]
    top_k: int | None = None


def _text(block: dict[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise _bad("a text block needs a string `text`", f"{where}.text")
    return text


def _tool_result_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad("must be a string or a list of text blocks", where)
    texts = []
    for index, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else type(block).__name__
        if kind != "text":
            raise _bad(f"a {kind!r} block is not supported here (text only)", f"{where}.{index}.type")
        texts.append(_text(block, f"{where}.{index}"))
    return "".join(texts)


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise _bad("must be a string or a list of content blocks", where)
    for index, block in enumerate(content):
        if not isinstance(block, dict):
            raise _bad("must be an object", f"{where}.{index}")
    return content


def _user_messages(blocks: list[dict[str, Any]], where: str) -> list[Message]:
    out: list[Message] = []
    for index, block in enumerate(blocks):
        here = f"{where}.{index}"
        kind = block.get("type")
        if kind == "text":
            text = _text(block, here)
            if out and out[-1]["role"] == "user":
                out[-1]["content"] += text
            else:
                out.append({"role": "user", "content": text})
        elif kind == "tool_result":
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str):
                raise _bad("a tool_result needs a string `tool_use_id`", f"{here}.tool_use_id")
            text = _tool_result_text(block.get("content"), f"{here}.content")
            out.append({"role": "tool", "tool_call_id": call_id, "content": text})
        else:
            raise _bad(
                f"a {kind!r} block is not supported in a user message (text, tool_result)", f"{here}.type"
            )
    return out


def _assistant_message(blocks: list[dict[str, Any]], where: str) -> Message:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for index, block in enumerate(blocks):
        here = f"{where}.{index}"
        kind = block.get("type")
        if kind == "text":
            texts.append(_text(block, here))
        elif kind == "tool_use":
            call_id, name, arguments = block.get("id"), block.get("name"), block.get("input", {})
            if not isinstance(call_id, str) or not isinstance(name, str) or not name:
                raise _bad("a tool_use block needs string `id` and `name`", here)
            if not isinstance(arguments, dict):
                raise _bad("must be an object", f"{here}.input")
            function = {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}
            calls.append({"id": call_id, "type": "function", "function": function})
        else:
            raise _bad(
                f"a {kind!r} block is not supported in an assistant message (text, tool_use)", f"{here}.type"
            )
    message: Message = {"role": "assistant", "content": "".join(texts)}
    if calls:
        message["tool_calls"] = calls
    return message


def chat_messages(system: Any, raw: Any) -> list[Message]:
    """`system` and `messages` as chat messages (module docstring); 400 naming the field otherwise."""
    out: list[Message] = []
    if system is not None:
        if isinstance(system, str):
            text = system
        elif isinstance(system, list):
            text = "".join(
                _text(b, f"system.{i}") if isinstance(b, dict) and b.get("type") == "text"
                else _raise(_bad("only text blocks", f"system.{i}.type"))
                for i, b in enumerate(system)
            )  # fmt: skip
        else:
            raise _bad("must be a string or a list of text blocks", "system")
        if text:
            out.append({"role": "system", "content": text})
    if not isinstance(raw, list) or not raw:
        raise _bad("must be a non-empty list", "messages")
    for index, message in enumerate(raw):
        where = f"messages.{index}"
        if not isinstance(message, dict):
            raise _bad("must be an object", where)
        role = message.get("role")
        blocks = _blocks(message.get("content"), f"{where}.content")
        if role == "user":
            out += _user_messages(blocks, f"{where}.content")
        elif role == "assistant":
            out.append(_assistant_message(blocks, f"{where}.content"))
        else:
            raise _bad(f"role {role!r} is not user or assistant", f"{where}.role")
    return out


def _raise(err: OpenAIRequestError) -> str:
    raise err


def _tools(raw: Any) -> list[dict[str, Any]] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise _bad("must be a list of tools", "tools")
    tools = []
    for index, tool in enumerate(raw):
        where = f"tools.{index}"
        if not isinstance(tool, dict):
            raise _bad("must be an object", where)
        if tool.get("type") not in (None, "custom"):
            raise _bad(f"{tool.get('type')!r} tools are not supported (client tools only)", f"{where}.type")
        name, schema = tool.get("name"), tool.get("input_schema")
        if not isinstance(name, str) or not name:
            raise _bad("must be a non-empty string", f"{where}.name")
        if not isinstance(schema, dict):
            raise _bad("must be a JSON schema object", f"{where}.input_schema")
        function: dict[str, Any] = {"name": name, "parameters": schema}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        tools.append({"type": "function", "function": function})
    return tools or None


def _number(body: dict[str, Any], key: str, low: float, high: float) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _bad(f"must be a number, got {value!r:.100}", key)
    if not low <= value <= high:
        raise _bad(f"must be in [{low}, {high}], got {value}", key)
    return float(value)


def parse_messages_request(body: Any) -> MessagesRequest:
    """Validate a request body (module docstring); OpenAIRequestError (400) naming the field."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object", "body")
    unknown = sorted(set(body) - _SUPPORTED)
    if unknown:
        raise _bad(f"unsupported parameter(s): {', '.join(unknown)}", unknown[0])
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("must be a non-empty string", "model")
    limit = body.get("max_tokens")
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise _bad(f"must be an integer >= 1, got {limit!r:.50}", "max_tokens")
    if body.get("stream") is not None and not isinstance(body.get("stream"), bool):
        raise _bad("must be a boolean", "stream")
    choice = body.get("tool_choice")
    kind = choice.get("type") if isinstance(choice, dict) else choice
    if choice is not None and kind not in ("auto", "none", "any"):
        raise _bad(f"{kind!r} is not supported: only auto, none and any (not enforced)", "tool_choice")
    thinking = body.get("thinking")
    if thinking is not None and (not isinstance(thinking, dict) or thinking.get("type") != "disabled"):
        raise _bad("only {'type': 'disabled'}: the policy has no thinking budget", "thinking")
    if body.get("metadata") is not None and not isinstance(body.get("metadata"), dict):
        raise _bad("must be an object", "metadata")
    top_k = body.get("top_k")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise _bad(f"must be an integer >= 1, got {top_k!r:.50}", "top_k")
    top_p = _number(body, "top_p", 0.0, 1.0)
    if top_p == 0.0:
        raise _bad("must be > 0", "top_p")
    stops = stop_strings(body.get("stop_sequences"), "stop_sequences")
    messages = normalise_messages(chat_messages(body.get("system"), body.get("messages")))
    chat = ChatRequest(
        model=model,
        messages=messages,
        tools=_tools(body.get("tools")),
        parse_tools=kind != "none",
        max_tokens=limit,
        stream=bool(body.get("stream")),
        temperature=_number(body, "temperature", 0.0, 1.0),
        top_p=top_p,
        stop=stops,
        unenforced=("tool_choice",) if kind == "any" else (),
    )
    return MessagesRequest(chat=chat, stop_sequences=stops, top_k=top_k)


# --------------------------------------------------------------------------------------- replies
def _stop_reason(completion: Completion) -> str:
    if completion.tool_calls:
        return "tool_use"
    if completion.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if completion.stop_sequence is not None else "end_turn"


def _content(completion: Completion) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if completion.content or not completion.tool_calls:
        blocks.append({"type": "text", "text": completion.content or ""})
    for call, call_id in zip(completion.tool_calls, completion.call_ids, strict=True):
        blocks.append({"type": "tool_use", "id": call_id, "name": call.name, "input": call.arguments})
    return blocks


def _usage(completion: Completion, output_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": completion.prompt_tokens,
        "output_tokens": output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


def message_object(completion: Completion, *, message_id: str, model: str) -> dict[str, Any]:
    """The `message` reply."""
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": _content(completion),
        "stop_reason": _stop_reason(completion),
        "stop_sequence": completion.stop_sequence,
        "usage": _usage(completion, completion.completion_tokens),
    }


def message_events(completion: Completion, *, message_id: str, model: str) -> list[dict[str, Any]]:
    """The streamed events of a finished turn (module docstring)."""
    start = message_object(completion, message_id=message_id, model=model)
    start = {
        **start,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": _usage(completion, 0),
    }
    events: list[dict[str, Any]] = [{"type": "message_start", "message": start}, {"type": "ping"}]
    for index, block in enumerate(_content(completion)):
        opened: dict[str, Any]
        delta: dict[str, Any]
        if block["type"] == "text":
            opened, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": block["text"]}
        else:
            opened = {**block, "input": {}}
            delta = {
                "type": "input_json_delta",
                "partial_json": json.dumps(block["input"], ensure_ascii=False),
            }
        events += [
            {"type": "content_block_start", "index": index, "content_block": opened},
            {"type": "content_block_delta", "index": index, "delta": delta},
            {"type": "content_block_stop", "index": index},
        ]
    stop = {"stop_reason": _stop_reason(completion), "stop_sequence": completion.stop_sequence}
    events += [
        {"type": "message_delta", "delta": stop, "usage": {"output_tokens": completion.completion_tokens}},
        {"type": "message_stop"},
    ]
    return events
