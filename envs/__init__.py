"""rollwise environments: the plugin API, discovery, the checker and the built-in environments.

Importing this package imports only the API; built-in environments and plugins are imported when
resolved by name (``envs.discovery.resolve_env``), so loading one never runs another's code.
"""

from __future__ import annotations

import importlib

from envs.api import (
    Action,
    EnvError,
    EnvFactory,
    Environment,
    EnvSpec,
    Message,
    StepResult,
    Task,
    ToolCall,
)

BUILTIN_ENV_MODULES: tuple[str, ...] = (
    "envs.guess_number",
    "envs.calculator",
    "envs.grid_nav",
    "envs.word_guess",
)

__all__ = [
    "BUILTIN_ENV_MODULES",
    "Action",
    "EnvError",
    "EnvFactory",
    "EnvSpec",
    "Environment",
    "Message",
    "StepResult",
    "Task",
    "ToolCall",
    "builtin_vocab_hints",
]


def builtin_vocab_hints() -> list[str]:
    """Words, phrases and number strings the built-in environments produce or expect.

    Union of every built-in module's ``VOCAB_HINTS``, first occurrence order, no duplicates; the tiny
    tokenizer preset makes each of them a single token.
    """
    hints: dict[str, None] = {}
    for module_name in BUILTIN_ENV_MODULES:
        for hint in importlib.import_module(module_name).VOCAB_HINTS:
            hints.setdefault(hint, None)
    return list(hints)
