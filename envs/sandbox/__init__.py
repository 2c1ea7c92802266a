"""Untrusted code for environments (docs/plugins.md, "Running code"): `Sandbox.run_python` in a fresh
working directory under resource limits, isolated by bubblewrap where the machine has it, and the
`python` tool an environment declares to let its agent run code.

    runner.py       Sandbox, SandboxResult, shared_sandbox (one queue per event loop)
    limits.py       SandboxConfig and Limits, validated from an env's `sandbox` option
    isolation.py    which isolation the machine gives (tried once), the bubblewrap command line
    process.py      one process from the event loop: pidfd, bounded pipe readers, stop and sweep
    launcher.py     runs inside the sandbox (passed with -c): limits, then the code
    python_tool.py  the `python` tool: its OpenAI schema, a call -> a tool message
    sessions.py     a working directory that outlives a command: SandboxBackend, LocalBackend, snapshots
    sandbox_paths.py  the names a caller gives inside a working directory, and the files written there
"""

from envs.sandbox.isolation import SandboxUnavailable
from envs.sandbox.limits import Limits, SandboxConfig
from envs.sandbox.process import SandboxError
from envs.sandbox.python_tool import PYTHON_TOOL, python_tool_message
from envs.sandbox.runner import Sandbox, SandboxResult, shared_sandbox
from envs.sandbox.sessions import (
    LocalBackend,
    SandboxBackend,
    SandboxSession,
    SessionSnapshot,
    SnapshotUnsupported,
)

__all__ = [
    "PYTHON_TOOL",
    "Limits",
    "LocalBackend",
    "Sandbox",
    "SandboxBackend",
    "SandboxConfig",
    "SandboxError",
    "SandboxResult",
    "SandboxSession",
    "SandboxUnavailable",
    "SessionSnapshot",
    "SnapshotUnsupported",
    "python_tool_message",
    "shared_sandbox",
]
