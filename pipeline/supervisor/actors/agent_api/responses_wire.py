"""OpenAI Responses API wire format (`POST /v1/responses`): a request as one chat turn, and that turn as a
`response` object or its event stream. Pure functions; the endpoint (openai_endpoint.py) does the rest.

What a request may contain, field by field:
- `model` (required), `input` (a string, or a list of items: `message` items with role user, system,
  developer or assistant and text content (`input_text` / `output_text` parts or a string),
  `function_call` items (`call_id`, `name`, `arguments`) and `function_call_output` items (`call_id`,
  `output`)), `instructions` (a system message before the input; not carried over by
  `previous_response_id`, as OpenAI's), function `tools` (`name`, `description`, `parameters`),
  `tool_choice` "auto", "none" or "required" (accepted, not enforced: see openai_wire.py),
  `max_output_tokens`, `stream` (+ `stream_options`), `store`,
  `previous_response_id` (the endpoint keeps an episode's stored responses: the new input continues that
  conversation), `temperature` and `top_p` (the run's own win, as for chat completions), `include`
  ("message.output_text.logprobs" fills the output text's log-probs), and the inert `metadata`, `user`,
  `safety_identifier`, `prompt_cache_key`, `prompt_cache_retention`, `service_tier`,
  `parallel_tool_calls`, `reasoning` (the policy has no reasoning-effort control: reported in
  x-rollwise-clamped), `text` with format "text", `truncation` "disabled", `top_logprobs` 0,
  `background` false.
- The Responses API has no stop sequences. Anything else (hosted tools, images and files, reasoning
  items, forced tool choice, JSON formats, conversations, prompt templates) is a 400 naming the field.

Consecutive assistant `message` and `function_call` items are one assistant turn (the model's output of
one response is exactly such a run of items), so a response sent back as input is recognised as the
turn the model generated and its recorded tokens are reused (agent_session.py).

The response: `output` is an assistant `message` item (when the turn has text, or has nothing at all)
followed by one `function_call` item per tool call; `status` "completed", or "incomplete" with reason
"max_output_tokens" when the turn was cut. Streaming sends the real event sequence (response.created,
response.in_progress, then per item output_item.added, content_part.added, output_text.delta,
output_text.done, content_part.done, output_item.done, or function_call_arguments.delta/.done, and
finally response.completed or response.incomplete), each as `event: <type>` + `data: <json>`, numbered
by `sequence_number`.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

from pipeline.supervisor.actors.agent_api.openai_wire import (
    ChatRequest,
    Completion,
    Message,
    OpenAIRequestError,
    normalise_messages,
    request_model,
    tool_call_objects,
)

LOGPROBS_INCLUDE = "message.output_text.logprobs"
_INERT = frozenset(
    {
        "metadata",
        "user",
        "safety_identifier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "service_tier",
        "parallel_tool_calls",
        "reasoning",
    }
)
_SUPPORTED = _INERT | frozenset(
    {
        "model",
        "input",
        "instructions",
        "tools",
        "tool_choice",
        "max_output_tokens",
        "stream",
        "stream_options",
        "store",
        "previous_response_id",
        "temperature",
        "top_p",
        "include",
        "text",
        "truncation",
        "top_logprobs",
        "background",
        "max_tool_calls",
    }
)
_INCLUDABLE = frozenset(
    {
        LOGPROBS_INCLUDE,
        "reasoning.encrypted_content",  # asked by agents that keep reasoning items; the policy has none
    }
)
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})


def _bad(message: str, param: str, code: str = "invalid_value") -> OpenAIRequestError:
    return OpenAIRequestError(400, message, param=param, code=code)


def _unsupported(param: str, value: Any, why: str) -> OpenAIRequestError:
    return OpenAIRequestError(
        400, f"unsupported {param}={value!r:.200}: {why}", param=param, code="unsupported_parameter"
    )


@dataclass(frozen=True)
class ResponsesRequest:
    """A validated Responses request: the turn as chat messages (`chat`, without what
    `previous_response_id` adds) and what the response object echoes back."""

    chat: ChatRequest
    input_messages: list[Message]  # the conversation this request adds (input items), instructions apart
    instructions: str | None
    previous_response_id: str | None
    store: bool
    tools: list[dict[str, Any]]  # as the request gave them (the response echoes them)
    tool_choice: str
    max_output_tokens: int | None
    include_logprobs: bool
    metadata: dict[str, Any] = field(default_factory=dict)
    parallel_tool_calls: bool = True
    user: str | None = None
    ignored: tuple[str, ...] = ()  # inert parameters that ask for something the policy cannot do


def _text_of_parts(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where} must be a string or a list of text parts", where)
    texts = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
            continue
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise OpenAIRequestError(
                400,
                f"{where}[{index}] is a {kind!r} part; only text parts are supported",
                param=f"{where}[{index}]",
                code="unsupported_content",
            )
        texts.append(part["text"])
    return "".join(texts)


def _arguments(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False)
    raise _bad(f"{where}.arguments must be a JSON string", f"{where}.arguments")


def input_messages(raw: Any) -> list[Message]:
    """`input` as chat messages (module docstring); 400 naming `input[i]...` for an item it cannot take."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list):
        raise _bad("input must be a string or a list of input items", "input")
    messages: list[Message] = []
    open_turn = False  # the last message is an assistant turn that later items of the run extend
    for index, item in enumerate(raw):
        where = f"input[{index}]"
        if not isinstance(item, dict):
            raise _bad(f"{where} must be an object", where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise _bad(
                    f"{where}.role {role!r} is not user, system, developer or assistant", f"{where}.role"
                )
            text = _text_of_parts(item.get("content"), f"{where}.content")
            if role == "assistant" and open_turn and not messages[-1].get("tool_calls"):
                messages[-1]["content"] += text  # one turn's text split over items
            elif role == "assistant":
                messages.append({"role": "assistant", "content": text})
            else:
                messages.append({"role": role, "content": text})
            open_turn = role == "assistant"
        elif kind == "function_call":
            call_id, name = item.get("call_id"), item.get("name")
            if not isinstance(call_id, str) or not isinstance(name, str) or not name:
                raise _bad(f"{where} needs call_id and name (strings)", where)
            function = {"name": name, "arguments": _arguments(item.get("arguments", "{}"), where)}
            call = {"id": call_id, "type": "function", "function": function}
            if not open_turn:
                messages.append({"role": "assistant", "content": ""})
            messages[-1].setdefault("tool_calls", []).append(call)
            open_turn = True
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise _bad(f"{where}.call_id must be a string", f"{where}.call_id")
            output = _text_of_parts(item.get("output"), f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
            open_turn = False
        else:
            raise OpenAIRequestError(
                400,
                f"{where}.type {kind!r} is not supported (message, function_call, function_call_output)",
                param=f"{where}.type",
                code="unsupported_content",
            )
    return messages


def _tools(raw: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(the tools as given, the same as chat-completions function tools)."""
    if raw is None:
        return [], []
    if not isinstance(raw, list):
        raise _bad("tools must be a list of function tools", "tools")
    chat_tools = []
    for index, tool in enumerate(raw):
        where = f"tools[{index}]"
        if not isinstance(tool, dict):
            raise _bad(f"{where} must be an object", where)
        if tool.get("type") != "function":
            raise _unsupported(f"{where}.type", tool.get("type"), "only function tools (no hosted tools)")
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise _bad(f"{where}.name must be a non-empty string", f"{where}.name")
        function: dict[str, Any] = {"name": name}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        parameters = tool.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise _bad(f"{where}.parameters must be a JSON schema object", f"{where}.parameters")
        function["parameters"] = parameters or {"type": "object", "properties": {}}
        chat_tools.append({"type": "function", "function": function})
    return list(raw), chat_tools


def _optional_number(body: dict[str, Any], key: str, low: float, high: float) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _bad(f"{key} must be a number, got {value!r:.100}", key)
    if not low <= value <= high:
        raise _bad(f"{key} must be in [{low}, {high}], got {value}", key)
    return float(value)


def _check_inert_values(body: dict[str, Any]) -> list[str]:
    """Refuse values that ask for what the endpoint does not do; returns the ignored parameter names."""
    for key in ("stream", "store", "parallel_tool_calls", "background"):
        if body.get(key) is not None and not isinstance(body.get(key), bool):
            raise _bad(f"{key} must be a boolean", key)
    if body.get("background"):
        raise _unsupported("background", True, "every response is answered in the request")
    if body.get("top_logprobs") not in (None, 0):
        raise _unsupported("top_logprobs", body.get("top_logprobs"), "the engine returns no top-k")
    if body.get("max_tool_calls") is not None:
        raise _unsupported("max_tool_calls", body.get("max_tool_calls"), "tool calls are not capped")
    if body.get("truncation") not in (None, "disabled"):
        raise _unsupported("truncation", body.get("truncation"), "the conversation is never truncated")
    text = body.get("text")
    if text is not None:
        fmt = text.get("format") if isinstance(text, dict) else None
        if not isinstance(text, dict) or (fmt is not None and fmt != {"type": "text"}):
            raise _unsupported("text", text, 'only {"format": {"type": "text"}} (no constrained decoding)')
    reasoning = body.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, dict):
        raise _bad("reasoning must be an object", "reasoning")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_obfuscation"}):
        raise _bad("stream_options is only {'include_obfuscation': bool}", "stream_options")
    for key in ("metadata",):
        if body.get(key) is not None and not isinstance(body.get(key), dict):
            raise _bad(f"{key} must be an object", key)
    return ["reasoning"] if reasoning and any(v is not None for v in reasoning.values()) else []


def parse_responses_request(body: Any) -> ResponsesRequest:
    """Validate a request body (module docstring); OpenAIRequestError (400) naming the offending field."""
    model = request_model(body, _SUPPORTED)
    ignored = _check_inert_values(body)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _bad("instructions must be a string", "instructions")
    previous = body.get("previous_response_id")
    if previous is not None and (not isinstance(previous, str) or not previous):
        raise _bad("previous_response_id must be a non-empty string", "previous_response_id")
    if body.get("input") is None and previous is None:
        raise _bad("input is required", "input")
    added = input_messages(body.get("input") if body.get("input") is not None else [])
    tool_choice = body.get("tool_choice", "auto")
    if tool_choice not in (None, "auto", "none", "required"):
        raise _unsupported(
            "tool_choice",
            tool_choice,
            "only 'auto', 'none' and 'required' (not enforced); no constrained decoding",
        )
    if tool_choice == "required":
        ignored.append("tool_choice")
    include = body.get("include") or []
    if not isinstance(include, list) or not all(isinstance(i, str) for i in include):
        raise _bad("include must be a list of strings", "include")
    refused = [i for i in include if i not in _INCLUDABLE]
    if refused:
        raise _unsupported("include", refused[0], f"only {sorted(_INCLUDABLE)}")
    limit = body.get("max_output_tokens")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise _bad(f"max_output_tokens must be an integer >= 1, got {limit!r:.50}", "max_output_tokens")
    top_p = _optional_number(body, "top_p", 0.0, 1.0)
    if top_p == 0.0:
        raise _bad("top_p must be > 0", "top_p")
    given_tools, chat_tools = _tools(body.get("tools"))
    system = [{"role": "system", "content": instructions}] if instructions else []
    messages = normalise_messages([*system, *added]) if system or added else []
    chat = ChatRequest(
        model=model,
        messages=messages,
        tools=chat_tools or None,
        parse_tools=tool_choice != "none",
        max_tokens=limit,
        logprobs=LOGPROBS_INCLUDE in include,
        stream=bool(body.get("stream")),
        temperature=_optional_number(body, "temperature", 0.0, 2.0),
        top_p=top_p,
    )
    user = body.get("user")
    return ResponsesRequest(
        chat=chat,
        input_messages=added,
        instructions=instructions,
        previous_response_id=previous,
        store=body.get("store") is not False,
        tools=given_tools,
        tool_choice=tool_choice or "auto",
        max_output_tokens=limit,
        include_logprobs=LOGPROBS_INCLUDE in include,
        metadata=dict(body.get("metadata") or {}),
        parallel_tool_calls=body.get("parallel_tool_calls") is not False,
        user=user if isinstance(user, str) else None,
        ignored=tuple(ignored),
    )


# --------------------------------------------------------------------------------------- responses
def assistant_message(completion: Completion) -> Message:
    """The turn as the chat-format assistant message a later request's history holds."""
    message: Message = {"role": "assistant", "content": completion.content or ""}
    if completion.tool_calls:
        message["tool_calls"] = tool_call_objects(completion)
    return message


def _output_items(completion: Completion, response_id: str, include_logprobs: bool) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    suffix = response_id.removeprefix("resp_")
    if completion.content or not completion.tool_calls:
        logprobs = [
            {"token": token, "bytes": list(token.encode()), "logprob": logprob, "top_logprobs": []}
            for token, logprob in (completion.logprobs or [])
        ]
        items.append(
            {
                "id": f"msg_{suffix}",
                "type": "message",
                "role": "assistant",
                "status": "completed",
                "content": [
                    {
                        "type": "output_text",
                        "text": completion.content or "",
                        "annotations": [],
                        "logprobs": logprobs if include_logprobs else [],
                    }
                ],
            }
        )
    for index, call in enumerate(tool_call_objects(completion)):
        items.append(
            {
                "id": f"fc_{suffix}_{index}",
                "type": "function_call",
                "status": "completed",
                "call_id": call["id"],
                "name": call["function"]["name"],
                "arguments": call["function"]["arguments"],
            }
        )
    return items


def _usage(completion: Completion) -> dict[str, Any]:
    return {
        "input_tokens": completion.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": completion.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": completion.prompt_tokens + completion.completion_tokens,
    }


def response_object(
    request: ResponsesRequest,
    completion: Completion | None,
    *,
    response_id: str,
    model: str,
    temperature: float,
    top_p: float,
    created_at: int | None = None,
) -> dict[str, Any]:
    """The `response` object; `completion` None = the in-progress shell the stream starts with."""
    cut = completion is not None and completion.finish_reason == "length"
    status = "in_progress" if completion is None else "incomplete" if cut else "completed"
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at if created_at is not None else int(time.time()),
        "status": status,
        "background": False,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "max_tool_calls": None,
        "model": model,
        "output": []
        if completion is None
        else _output_items(completion, response_id, request.include_logprobs),
        "parallel_tool_calls": request.parallel_tool_calls,
        "previous_response_id": request.previous_response_id,
        "reasoning": {"effort": None, "summary": None},
        "service_tier": "default",
        "store": request.store,
        "temperature": temperature,
        "text": {"format": {"type": "text"}},
        "tool_choice": request.tool_choice,
        "tools": request.tools,
        "top_logprobs": 0,
        "top_p": top_p,
        "truncation": "disabled",
        "usage": None if completion is None else _usage(completion),
        "user": request.user,
        "metadata": request.metadata,
    }


def response_events(
    request: ResponsesRequest,
    completion: Completion,
    *,
    response_id: str,
    model: str,
    temperature: float,
    top_p: float,
) -> list[dict[str, Any]]:
    """The streamed events of a finished turn (module docstring), `sequence_number` from 0."""
    created = int(time.time())
    shell = response_object(
        request, None, response_id=response_id, model=model, temperature=temperature, top_p=top_p,
        created_at=created,
    )  # fmt: skip
    final = response_object(
        request, completion, response_id=response_id, model=model, temperature=temperature, top_p=top_p,
        created_at=created,
    )  # fmt: skip
    events: list[dict[str, Any]] = [
        {"type": "response.created", "response": shell},
        {"type": "response.in_progress", "response": shell},
    ]
    for index, item in enumerate(final["output"]):
        events += _item_events(item, index)
    events.append({"type": "response.completed" if final["status"] == "completed" else "response.incomplete",
                   "response": final})  # fmt: skip
    return [{**event, "sequence_number": number} for number, event in enumerate(events)]


def _item_events(item: dict[str, Any], index: int) -> list[dict[str, Any]]:
    where = {"output_index": index, "item_id": item["id"]}
    if item["type"] == "function_call":
        return [
            {"type": "response.output_item.added", "output_index": index,
             "item": {**item, "status": "in_progress", "arguments": ""}},
            {"type": "response.function_call_arguments.delta", **where, "delta": item["arguments"]},
            {"type": "response.function_call_arguments.done", **where, "arguments": item["arguments"],
             "name": item["name"]},
            {"type": "response.output_item.done", "output_index": index, "item": item},
        ]  # fmt: skip
    part = item["content"][0]
    empty_part = {**part, "text": "", "logprobs": []}
    return [
        {"type": "response.output_item.added", "output_index": index,
         "item": {**item, "status": "in_progress", "content": []}},
        {"type": "response.content_part.added", **where, "content_index": 0, "part": empty_part},
        {"type": "response.output_text.delta", **where, "content_index": 0, "delta": part["text"],
         "logprobs": part["logprobs"]},
        {"type": "response.output_text.done", **where, "content_index": 0, "text": part["text"],
         "logprobs": part["logprobs"]},
        {"type": "response.content_part.done", **where, "content_index": 0, "part": part},
        {"type": "response.output_item.done", "output_index": index, "item": item},
    ]  # fmt: skip


def sse(events: list[dict[str, Any]]) -> bytes:
    """Server-sent events with their `event:` names (the Responses and Messages streams both carry them)."""
    dumps = json.dumps
    return "".join(
        f"event: {event['type']}\ndata: {dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n"
        for event in events
    ).encode()
