"""A ReAct agent with a calculator tool, written against the openai SDK only.

rollwise trains it as an agent-function environment (`env.name = "agent"`, see react_agent.toml): every
episode calls `react_agent(client, task)` with an `openai.AsyncOpenAI` client that talks to the policy
being trained; each chat completion is one trained turn. The same function runs unchanged against any
OpenAI-compatible server, e.g.

    client = openai.AsyncOpenAI(base_url="http://localhost:30000/v1", api_key="-")
    print(asyncio.run(react_agent(client, next(tasks(0)))))

The loop: ask the model; when it calls the calculator, run the tool and send the result back (reason ->
act -> observe); when it answers in plain text, score the first integer of the answer against the task.
"""

from __future__ import annotations

import itertools
import json
import random
import re
from collections.abc import Iterator
from typing import Any

import openai

from envs.agent import POLICY_MODEL, AgentResult
from envs.api import Task

MAX_STEPS = 3
FIRST_TOOL_USE_REWARD = 0.2
SYSTEM = "Use the calculator tool, then answer with the number."
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
_BINARY = re.compile(r"^\s*(-?\d{1,9})\s*([-+*/])\s*(-?\d{1,9})\s*$")
_INTEGER = re.compile(r"-?\d+")


def calculate(arguments: str) -> str:
    """The tool: `a op b` for integers (no eval of model output), or an error message for the model."""
    try:
        expression = json.loads(arguments).get("expression", "")
    except (ValueError, AttributeError):
        return "error: arguments must be a JSON object with an 'expression' string"
    match = _BINARY.match(expression) if isinstance(expression, str) else None
    if match is None:
        return "error: expected 'a + b', 'a - b', 'a * b' or 'a / b' with integers"
    a, op, b = int(match.group(1)), match.group(2), int(match.group(3))
    if op == "/" and b == 0:
        return "error: division by zero"
    value = {"+": a + b, "-": a - b, "*": a * b, "/": a / b if b else 0}[op]
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


async def react_agent(client: openai.AsyncOpenAI, task: Task) -> AgentResult:
    a, op, b = task.data["a"], task.data["op"], task.data["b"]
    target = a + b if op == "+" else a - b
    messages: list[Any] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"What is {a} {op} {b}?"},
    ]
    rewards: list[float] = []
    used_tool = False
    for _ in range(MAX_STEPS):
        response = await client.chat.completions.create(model=POLICY_MODEL, messages=messages, tools=[CALCULATOR])
        message = response.choices[0].message
        messages.append(message)
        if message.tool_calls:
            worked = False
            for call in message.tool_calls:
                result = calculate(call.function.arguments)
                worked = worked or not result.startswith("error")
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
            rewards.append(FIRST_TOOL_USE_REWARD if worked and not used_tool else 0.0)
            used_tool = used_tool or worked
            continue
        rewards.append(0.0)
        found = _INTEGER.search(message.content or "")
        correct = found is not None and len(found.group()) < 12 and int(found.group()) == target
        return AgentResult(outcome=1.0 if correct else 0.0, turn_rewards=rewards)
    return AgentResult(outcome=0.0, turn_rewards=rewards)


def tasks(seed: int) -> Iterator[Task]:
    """Two-operand sums and differences with operands in 1..20 (non-negative results)."""
    for index in itertools.count():
        rng = random.Random(f"react-agent:{seed}:{index}")
        a, b, op = rng.randint(1, 20), rng.randint(1, 20), rng.choice("+-")
        if op == "-" and b > a:
            a, b = b, a
        yield Task(id=f"react-{seed}-{index}", seed=rng.getrandbits(31), data={"a": a, "b": b, "op": op})
