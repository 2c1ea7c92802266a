"""Tool-call parsing: hermes blocks -> Action(tool_calls, tool_call_errors); the registry."""

from __future__ import annotations

import pytest

from envs.api import Action, ToolCall
from envs.toolcalls import PARSERS, get_parser, parse_action, parse_hermes


def test_hermes_parses_one_call_and_keeps_the_raw_text() -> None:
    text = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    action = parse_hermes(text)
    assert action == Action(text=text, tool_calls=(ToolCall("add", {"a": 1, "b": 2}),), tool_call_errors=())


def test_hermes_parses_several_calls_in_order() -> None:
    text = (
        '<tool_call>{"name": "a", "arguments": {}}</tool_call> and '
        '<tool_call>{"name": "b", "arguments": {"x": [1, 2]}}</tool_call>'
    )
    action = parse_hermes(text)
    assert action.tool_calls == (ToolCall("a", {}), ToolCall("b", {"x": [1, 2]}))
    assert action.tool_call_errors == ()


def test_hermes_reports_bad_json_and_keeps_the_good_calls() -> None:
    text = '<tool_call>{"name": "a", "arguments": {</tool_call><tool_call>{"name": "b"}</tool_call>'
    action = parse_hermes(text)
    assert action.tool_calls == (ToolCall("b", {}),)  # missing arguments = no arguments
    assert len(action.tool_call_errors) == 1
    assert action.tool_call_errors[0].startswith("tool call 0: invalid JSON")


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ('{"arguments": {}}', "tool call 0: missing 'name' (a non-empty string)"),
        ('{"name": "", "arguments": {}}', "tool call 0: missing 'name' (a non-empty string)"),
        ('{"name": 3, "arguments": {}}', "tool call 0: missing 'name' (a non-empty string)"),
        ('{"name": "f", "arguments": [1]}', "tool call 0 (f): 'arguments' must be a JSON object, got list"),
        ('{"name": "f", "arguments": "[1]"}', "tool call 0 (f): 'arguments' must be a JSON object, got list"),
        ('{"name": "f", "arguments": "{oops"}', "tool call 0 (f): 'arguments' is a string that is not JSON"),
        ("[1, 2]", "tool call 0: expected a JSON object with 'name' and 'arguments', got list"),
    ],
)
def test_hermes_names_what_is_wrong_with_a_call(body: str, expected: str) -> None:
    action = parse_hermes(f"<tool_call>{body}</tool_call>")
    assert action.tool_calls == ()
    assert action.tool_call_errors == (expected,)


def test_hermes_accepts_arguments_encoded_as_a_json_string() -> None:
    action = parse_hermes('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert action.tool_calls == (ToolCall("f", {"x": 1}),)


def test_hermes_reports_an_unclosed_block() -> None:
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call> then <tool_call>{"name": "b", "argu'
    action = parse_hermes(text)
    assert action.tool_calls == (ToolCall("a", {}),)
    assert action.tool_call_errors == ("tool call 1: <tool_call> without a closing </tool_call>",)


def test_text_without_calls_gives_no_calls_and_no_errors() -> None:
    assert parse_hermes("12") == Action(text="12")


def test_none_parser_ignores_tool_call_markup() -> None:
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call>'
    assert parse_action(text, "none") == Action(text=text)


def test_unknown_parser_name_lists_the_known_ones() -> None:
    with pytest.raises(
        ValueError, match=r"unknown tool-call parser 'xml'; known parsers: \['hermes', 'none'\]"
    ):
        get_parser("xml")
    assert set(PARSERS) == {"hermes", "none"}
