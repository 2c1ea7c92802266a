"""The guess game of guess_env behind an MCP tool: `guess(n)` answers "higher", "lower" or "correct".

An MCPEnvironment (OpenEnv RFC 003): its tool observations carry no reward, so the score lives in the
state field `score` (1.0 once the number is found, else 0.0). Served only by the OpenEnv venv.
"""

from __future__ import annotations

import random
from typing import Any

from fastmcp import FastMCP
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
from openenv.core.env_server.types import Action, Observation, State

LOW, HIGH = 1, 8


class GuessToolsState(State):
    target: int = 0
    score: float = 0.0


class GuessToolsEnvironment(MCPEnvironment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        mcp = FastMCP("guess_tools_env")
        self._state = GuessToolsState()

        @mcp.tool
        def guess(n: int) -> str:
            """Guess the hidden number; the answer is "higher", "lower" or "correct"."""
            if n == self._state.target:
                self._state.score = 1.0
                return "correct"
            return "higher" if n < self._state.target else "lower"

        super().__init__(mcp)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> Observation:
        self._state = GuessToolsState(episode_id=episode_id, target=random.Random(seed).randint(LOW, HIGH))
        return Observation(metadata={"message": f"Find the number from {LOW} to {HIGH} with the guess tool."})

    def _step_impl(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return Observation(
            metadata={"error": f"only MCP tool calls are understood, not {type(action).__name__}"}
        )

    @property
    def state(self) -> GuessToolsState:
        return self._state


app = create_app(
    GuessToolsEnvironment,
    CallToolAction,
    CallToolObservation,
    env_name="guess_tools_env",
    max_concurrent_envs=1,
)
