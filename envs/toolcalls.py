"""Tool-call parsers: assistant text -> `envs.api.Action`.

A parser is a plain function `(text) -> Action`; `PARSERS` maps config names to them. The environment
always receives the raw text as well, so games that read free text ignore the parsed calls.

"hermes" (the default; Qwen/Hermes chat templates) reads every `<tool_call>{json}</tool_call>` block:
the JSON must be an object with a non-empty string "name" and an "arguments" object (a JSON string
holding an object is accepted too, as some models write it; a missing "arguments" means no
arguments). A block that breaks these rules becomes an entry of `tool_call_errors` instead of a call,
so the environment can tell the agent what was wrong. "none" parses nothing.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from envs.api import Action, ToolCall

ToolParser = Callable[[str], Action]

_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_HERMES_OPEN = "<tool_call>"


def _hermes_call(body: str, index: int) -> ToolCall | str:
    """One block's body -> a ToolCall, or the error string describing why it is not one."""
    where = f"tool call {index}"
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        return f"{where}: invalid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
    if not isinstance(obj, dict):
        return f"{where}: expected a JSON object with 'name' and 'arguments', got {type(obj).__name__}"
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return f"{where}: missing 'name' (a non-empty string)"
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return f"{where} ({name}): 'arguments' is a string that is not JSON"
    if not isinstance(arguments, dict):
        return f"{where} ({name}): 'arguments' must be a JSON object, got {type(arguments).__name__}"
    return ToolCall(name=name, arguments=arguments)


def parse_hermes(text: str) -> Action:
    """Every `<tool_call>...</tool_call>` block of `text`, in order; an unclosed last block is an error."""
    calls: list[ToolCall] = []
    errors: list[str] = []
    end_of_last = 0
    for index, match in enumerate(_HERMES_BLOCK.finditer(text)):
        parsed = _hermes_call(match.group(1), index)
        if isinstance(parsed, ToolCall):
            calls.append(parsed)
        else:
            errors.append(parsed)
        end_of_last = match.end()
    if _HERMES_OPEN in text[end_of_last:]:
        errors.append(f"tool call {len(calls) + len(errors)}: <tool_call> without a closing </tool_call>")
    return Action(text=text, tool_calls=tuple(calls), tool_call_errors=tuple(errors))


def parse_none(text: str) -> Action:
    """No tool calls: the environment reads the raw text."""
    return Action(text=text)


PARSERS: dict[str, ToolParser] = {"hermes": parse_hermes, "none": parse_none}


def text_without_calls(text: str, parser: str = "hermes") -> str:
    """`text` without the tool-call markup `parser` reads (an OpenAI message's `content` next to its
    parsed `tool_calls`), stripped of surrounding whitespace."""
    get_parser(parser)
    if parser == "hermes":
        return _HERMES_BLOCK.sub("", text).strip()
    return text.strip()


def get_parser(name: str) -> ToolParser:
    """The parser registered as `name`; ValueError naming the known parsers otherwise."""
    try:
        return PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; known parsers: {sorted(PARSERS)}") from None


def parse_action(text: str, parser: str = "hermes") -> Action:
    return get_parser(parser)(text)
