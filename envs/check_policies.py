"""The policies ``rollwise env check`` plays an environment with (envs.checker).

The random policy mixes integers, words, garbage, empty and very long text, and random (often wrong)
tool calls: an environment must answer all of them with observations, never by raising. The gold policy
plays the environment's own ``gold_action``.
"""

from __future__ import annotations

import json
import random
import string
from collections.abc import Callable
from typing import Any

from envs.api import Action, Environment, EnvSpec, ToolCall
from envs.toolcalls import parse_hermes

Policy = Callable[[Environment, random.Random, EnvSpec], Action]

_WORDS = ("up", "down", "left", "right", "yes", "no", "higher", "lower", "cat", "dog", "the answer is")
_UNICODE = "é漢🙂\x00\t\n"


def _random_text(rng: random.Random) -> str:
    kind = rng.randrange(6)
    if kind == 0:
        return str(rng.randint(-5, 120))
    if kind == 1:
        return f"I think {rng.randint(0, 40)} {rng.choice(_WORDS)}"
    if kind == 2:
        return rng.choice(_WORDS) if rng.random() < 0.5 else "".join(rng.choices(string.ascii_lowercase, k=3))
    if kind == 3:
        return "".join(rng.choices(string.printable + _UNICODE, k=rng.randint(0, 40)))
    if kind == 4:
        return "" if rng.random() < 0.5 else "9" * 300 + " " + "x" * 4000
    return " ".join(rng.choices(_WORDS, k=rng.randint(1, 5)))


def _schema_part(schema: Any, *keys: str) -> Any:
    """``schema[k1][k2]...`` or None; tolerates malformed schemas (spec_valid reports those)."""
    for key in keys:
        schema = schema.get(key) if isinstance(schema, dict) else None
    return schema


def _random_arguments(rng: random.Random, tool: dict[str, Any]) -> dict[str, Any]:
    properties = _schema_part(tool, "function", "parameters", "properties")
    if not isinstance(properties, dict):
        return {}
    arguments: dict[str, Any] = {}
    for name, schema in properties.items():
        if rng.random() < 0.1:
            continue  # a missing argument is a plausible agent mistake
        kind = schema.get("type") if isinstance(schema, dict) else None
        if kind == "string":
            arguments[name] = rng.choice(
                [f"{rng.randint(0, 50)}+{rng.randint(0, 50)}", "", "((", "2/0", "9" * 90, _random_text(rng)]
            )
        elif kind in ("integer", "number"):
            arguments[name] = rng.choice([rng.randint(-10, 100), 1e308, -0.5])
        else:
            arguments[name] = rng.choice([None, [], {"x": 1}, _random_text(rng)])
    return arguments


def random_action(_env: Environment, rng: random.Random, spec: EnvSpec) -> Action:
    """A random, sometimes plausible, often malformed assistant turn."""
    if rng.random() < 0.3:
        tools = [tool for tool in spec.tools if isinstance(tool, dict)]
        if tools and rng.random() < 0.8:
            tool = rng.choice(tools)
            call = ToolCall(str(_schema_part(tool, "function", "name")), _random_arguments(rng, tool))
        else:
            call = ToolCall(rng.choice(["nope", "calculator", ""]), {"expression": _random_text(rng)})
        errors = ("tool call 2 is not valid JSON",) if rng.random() < 0.2 else ()
        text = f"<tool_call>{json.dumps({'name': call.name, 'arguments': call.arguments})}</tool_call>"
        return Action(text, (call,), errors)
    if rng.random() < 0.05:
        return Action("<tool_call>{not json</tool_call>", (), ("invalid JSON in <tool_call>",))
    return Action(_random_text(rng))


def gold_policy_action(env: Environment, _rng: random.Random, _spec: EnvSpec) -> Action:
    return parse_hermes(env.gold_action() or "")
