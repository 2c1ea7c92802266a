"""calculator: answer "What is 7 + 12?" by calling a ``calculator`` tool, then stating the number.

Turn protocol (max 3 turns by default):
- a turn with tool calls: each call is answered by a ``tool`` message (the value, or ``error: ...``);
  the first successful call of the episode earns +0.2, any bad call (unknown tool, bad arguments,
  unparseable markup reported in ``Action.tool_call_errors``) costs -0.1;
- a turn without tool calls is the final answer: its first integer is compared with the true value
  (done; outcome 1.0 if equal, else 0.0). Answering before any successful tool call, or writing no
  integer, is a mistake: the observation says so, the turn costs -0.1 and the episode goes on.
Running out of turns truncates the episode with outcome 0.0.

The tool evaluates digits, ``+ - * /`` and parentheses with a small recursive-descent parser over
exact fractions; nothing is ever passed to ``eval``.
"""

from __future__ import annotations

import itertools
import json
import random
import re
from collections.abc import Iterator
from fractions import Fraction
from typing import Any

from envs.api import FORMAT_ERROR, Action, EnvError, Environment, EnvSpec, Message, StepResult, Task

TOOL_NAME = "calculator"
FIRST_CALL_REWARD = 0.2
MISTAKE_PENALTY = -0.1
MAX_EXPRESSION_CHARS = 64
MAX_NESTING = 16
MAX_LITERAL_DIGITS = 12

CALCULATOR_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}

VOCAB_HINTS: list[str] = [
    "What",
    "is",
    "+",
    "-",
    "?",
    "calculator",
    "expression",
    "name",
    "arguments",
    "<tool_call>",
    "</tool_call>",
    "correct",
    "wrong",
    "invalid",
    "error",
    "use",
    "the",
    *(str(n) for n in range(0, 41)),
]

_INTEGER = re.compile(r"-?\d+")
_TOKEN = re.compile(r"\s*(\d+|[-+*/()])")


class CalculatorError(ValueError):
    """The expression is not one the calculator accepts; the message says why."""


def evaluate(expression: str) -> Fraction:
    """Exact value of an arithmetic expression (digits, + - * /, parentheses, unary minus).

    Raises CalculatorError for anything else: other characters, more than MAX_EXPRESSION_CHARS
    characters, nesting deeper than MAX_NESTING, division by zero.
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    tokens = _tokenize(expression)
    if not tokens:
        raise CalculatorError("empty expression")
    value, position = _parse_sum(tokens, 0, 0)
    if position != len(tokens):
        raise CalculatorError(f"unexpected {tokens[position]!r}")
    return value


def format_value(value: Fraction) -> str:
    """Integers as digits; other values rounded to 6 significant digits."""
    if value.denominator == 1:
        return str(value.numerator)
    return format(float(value), ".6g")


def _tokenize(expression: str) -> list[str]:
    tokens: list[str] = []
    position = 0
    stripped_end = len(expression.rstrip())
    while position < stripped_end:
        match = _TOKEN.match(expression, position)
        if match is None:
            raise CalculatorError(f"unsupported character {expression[position:].lstrip()[:1]!r}")
        token = match.group(1)
        if token.isdigit() and len(token) > MAX_LITERAL_DIGITS:
            raise CalculatorError(f"number longer than {MAX_LITERAL_DIGITS} digits")
        tokens.append(token)
        position = match.end()
    return tokens


def _parse_sum(tokens: list[str], position: int, depth: int) -> tuple[Fraction, int]:
    value, position = _parse_product(tokens, position, depth)
    while position < len(tokens) and tokens[position] in "+-":
        operator = tokens[position]
        right, position = _parse_product(tokens, position + 1, depth)
        value = value + right if operator == "+" else value - right
    return value, position


def _parse_product(tokens: list[str], position: int, depth: int) -> tuple[Fraction, int]:
    value, position = _parse_unary(tokens, position, depth)
    while position < len(tokens) and tokens[position] in "*/":
        operator = tokens[position]
        right, position = _parse_unary(tokens, position + 1, depth)
        if operator == "/" and right == 0:
            raise CalculatorError("division by zero")
        value = value * right if operator == "*" else value / right
    return value, position


def _parse_unary(tokens: list[str], position: int, depth: int) -> tuple[Fraction, int]:
    if depth > MAX_NESTING:
        raise CalculatorError(f"nesting deeper than {MAX_NESTING}")
    if position >= len(tokens):
        raise CalculatorError("expression ends early")
    token = tokens[position]
    if token == "-":
        value, position = _parse_unary(tokens, position + 1, depth + 1)
        return -value, position
    if token == "(":
        value, position = _parse_sum(tokens, position + 1, depth + 1)
        if position >= len(tokens) or tokens[position] != ")":
            raise CalculatorError("missing ')'")
        return value, position + 1
    if token.isdigit():
        return Fraction(int(token)), position + 1
    raise CalculatorError(f"unexpected {token!r}")


def _tool_message(content: str) -> Message:
    return {"role": "tool", "name": TOOL_NAME, "content": content}


class CalculatorEnv(Environment):
    """Two-operand arithmetic with operands in [1, max_operand]; the tool must be used."""

    def __init__(self, max_operand: int = 20, max_turns: int = 3) -> None:
        if max_operand < 1:
            raise ValueError(f"max_operand must be >= 1, got {max_operand}")
        self.max_operand = max_operand
        self.spec = EnvSpec(name="calculator", version="1", max_turns=max_turns, tools=(CALCULATOR_TOOL,))
        self._expression: str | None = None
        self._target = 0
        self._tool_used = False
        self._turns = 0
        self._finished = False

    def tasks(self, seed: int) -> Iterator[Task]:
        for index in itertools.count():
            rng = random.Random(f"calculator:{seed}:{index}")
            a, b = rng.randint(1, self.max_operand), rng.randint(1, self.max_operand)
            operator = rng.choice("+-")
            if operator == "-" and b > a:
                a, b = b, a  # keep answers non-negative: fewer distinct tokens to learn
            yield Task(
                id=f"calculator-{seed}-{index}",
                seed=rng.getrandbits(31),
                data={"a": a, "b": b, "op": operator},
            )

    async def reset(self, task: Task) -> list[Message]:
        try:
            a, b, operator = int(task.data["a"]), int(task.data["b"]), str(task.data["op"])
        except (KeyError, TypeError, ValueError) as exc:
            raise EnvError(f"calculator task {task.id!r} has bad data {dict(task.data)!r}: {exc}") from exc
        if operator not in ("+", "-", "*"):
            raise EnvError(f"calculator task {task.id!r}: unsupported operator {operator!r}")
        self._expression = f"{a}{operator}{b}"
        self._target = int(evaluate(self._expression))
        self._tool_used, self._turns, self._finished = False, 0, False
        return [{"role": "user", "content": f"What is {a} {operator} {b}?"}]

    async def step(self, action: Action) -> StepResult:
        if self._expression is None or self._finished:
            raise EnvError("calculator: step() called before reset() or after the episode ended")
        self._turns += 1
        if action.tool_calls or action.tool_call_errors:
            result = self._tool_turn(action)
        else:
            result = self._answer_turn(action.text)
        if not result.done and self._turns >= self.spec.max_turns:
            result.truncated, result.outcome = True, 0.0
        self._finished = result.done or result.truncated
        return result

    def _tool_turn(self, action: Action) -> StepResult:
        messages = [_tool_message(f"error: {error}") for error in action.tool_call_errors]
        succeeded, failed = False, bool(action.tool_call_errors)
        for call in action.tool_calls:
            reply = self._run_tool(call.name, call.arguments)
            ok = not reply.startswith("error:")
            succeeded, failed = succeeded or ok, failed or not ok
            messages.append(_tool_message(reply))
        reward = (FIRST_CALL_REWARD if succeeded and not self._tool_used else 0.0) + (
            MISTAKE_PENALTY if failed else 0.0
        )
        self._tool_used = self._tool_used or succeeded
        return StepResult(messages=messages, reward=reward, info={"tool_ok": succeeded, "tool_error": failed})

    @staticmethod
    def _run_tool(name: str, arguments: Any) -> str:
        expression = arguments.get("expression") if isinstance(arguments, dict) else None
        if name != TOOL_NAME:
            return f"error: unknown tool {name!r}"
        if not isinstance(expression, str):
            return 'error: "expression" must be a string'
        try:
            return format_value(evaluate(expression))
        except CalculatorError as exc:
            return f"error: {exc}"

    def _answer_turn(self, text: str) -> StepResult:
        if not self._tool_used:
            return StepResult([{"role": "user", "content": "use the calculator"}], reward=MISTAKE_PENALTY)
        match = _INTEGER.search(text)
        if match is None or len(match.group()) > 18:
            why = "no integer in the answer" if match is None else "an integer of more than 18 digits"
            return StepResult(
                [{"role": "user", "content": "invalid"}], reward=MISTAKE_PENALTY, info={FORMAT_ERROR: why}
            )
        correct = int(match.group()) == self._target
        return StepResult(
            messages=[{"role": "user", "content": "correct" if correct else "wrong"}],
            done=True,
            outcome=1.0 if correct else 0.0,
        )

    def gold_action(self) -> str | None:
        if self._expression is None or self._finished:
            return None
        if not self._tool_used:
            call = {"name": TOOL_NAME, "arguments": {"expression": self._expression}}
            return f"<tool_call>{json.dumps(call)}</tool_call>"
        return str(self._target)
