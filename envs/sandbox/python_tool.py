"""The ``python`` tool: an OpenAI function any environment can declare, answered by a sandbox.

Declare ``PYTHON_TOOL`` in ``EnvSpec(tools=...)`` and answer each parsed call with
``await python_tool_message(sandbox, call)``: the tool message's content is JSON with the program's
``stdout``, ``stderr``, ``exit_code``, ``stdout_truncated``, ``stderr_truncated`` and ``stopped_by``
(the limit that ended it, or null). Bad arguments are answered with ``error: ...`` like every other
agent mistake; a failure of the sandbox itself raises ``EnvError`` (the episode is not the agent's).
"""

from __future__ import annotations

import json
from typing import Any

from envs.api import Message, ToolCall
from envs.sandbox.runner import Sandbox, SandboxResult

PYTHON_TOOL_NAME = "python"
MAX_CODE_CHARS = 100_000

PYTHON_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": PYTHON_TOOL_NAME,
        "description": (
            "Run a Python 3 program in a fresh sandbox (no network, nothing kept between calls, "
            "time and memory limits) and get its stdout, stderr and exit code. Print what you want to see."
        ),
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The complete program to run."}},
            "required": ["code"],
        },
    },
}


def tool_reply(result: SandboxResult) -> dict[str, Any]:
    """What the model sees of one execution (the JSON content of the tool message)."""
    return {
        "exit_code": result.exit_code,
        "stdout": result.stdout,
        "stderr": result.stderr,
        "stdout_truncated": result.stdout_truncated,
        "stderr_truncated": result.stderr_truncated,
        "stopped_by": result.stopped_by,
    }


def tool_message(content: str) -> Message:
    return {"role": "tool", "name": PYTHON_TOOL_NAME, "content": content}


def python_call_error(call: ToolCall) -> str | None:
    """Why ``call`` is not a valid ``python`` call (an ``error: ...`` text), or None."""
    if call.name != PYTHON_TOOL_NAME:
        return f"error: unknown tool {call.name!r}; the tool is {PYTHON_TOOL_NAME!r}"
    code = call.arguments.get("code")
    if not isinstance(code, str):
        return 'error: "code" must be a string holding the program'
    if not code.strip():
        return 'error: "code" is empty'
    if len(code) > MAX_CODE_CHARS:
        return f'error: "code" is longer than {MAX_CODE_CHARS} characters'
    return None


async def python_tool_message(sandbox: Sandbox, call: ToolCall) -> tuple[Message, SandboxResult | None]:
    """The tool message answering ``call``, and the execution (None when the call was invalid)."""
    error = python_call_error(call)
    if error is not None:
        return tool_message(error), None
    result = await sandbox.run_python(call.arguments["code"])
    return tool_message(json.dumps(tool_reply(result), ensure_ascii=False)), result
