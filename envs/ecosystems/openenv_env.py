"""openenv/<name>: an OpenEnv environment played turn by turn over its ``/ws`` session (docs/plugins.md).

    [env]
    name = "openenv/echo_env"        # an installed openenv-echo_env, or any module <name> with a
    options = { max_turns = 4 }      # server/app.py, found under options.path when it is not installed

The server is a local one this process starts with the OpenEnv venv's interpreter (`make env-openenv`;
envs.ecosystems.openenv_server), or the one at ``base_url``. rollwise never imports openenv: the
messages are envs.ecosystems.openenv_wire's. Construction reads the server once (starting it), so a
missing venv, a module that does not import or a server that cannot be reached stops `rollwise env
check` and `rollwise run` before anything else starts, with the reason.

- Tasks: ``reset`` sends ``{"seed": task.seed, **reset_kwargs, **task.data}``. With ``split`` and
  ``num_tasks`` (OpenEnv 0.10's task API) a task is ``{"split", "index"}``, every index once per cycle in
  a seeded order; otherwise every task is a fresh seed.
- Messages: an observation becomes one user message: the field ``observation_field`` when given, else
  its only field, else its fields as JSON (``metadata`` aside; an observation with no other field shows
  its metadata). ``prompt``, when given, comes before the first one. Metadata goes to ``info``.
- Actions (plain environments): when the action schema has a single string field (or
  ``action_field`` names one), the reply text is that field; otherwise the reply must be a JSON object
  of the action's fields. A reply that is not one, or that the server's validation rejects, is the
  agent's mistake: answered with the reason (``info["format_error"]``), reward 0, the turn counts.
- Tools (MCP environments, whose action is CallToolAction): the tools the server lists become
  ``spec.tools``; each parsed tool call (at most ``max_calls_per_turn`` a turn) is a ``call_tool`` step
  answered by a tool message (its text, or ``error: ...``); a turn without tool calls ends the episode.
- Rewards: a turn's reward is its observation's ``reward`` (none = 0; a turn's tool calls add up),
  or with ``reward_from`` (for MCP environments, whose tool observations carry no reward) the change of
  the state field of that name, read after reset and after every turn. rollwise adds an episode's turn
  rewards and its outcome (two channels of the learner), so they go to one: by default the outcome is
  their sum (``outcome = "last"``: the last one) and the turn rewards given to rollwise are 0;
  ``outcome = "none"`` gives them as the turns' rewards and sets no outcome. ``info["env_reward"]``
  holds each turn's. ``done`` ends the episode, ``max_turns`` truncates it.
- Failures of the environment cost only the episode, as EnvError naming the server: it cannot be
  reached or dies (its exit code and log tail), an answer outside the protocol, a refused session
  (CAPACITY_REACHED), or the environment raising (EXECUTION_ERROR, FACTORY_ERROR, SESSION_ERROR).
"""

from __future__ import annotations

import json
import math
import random
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from envs.api import FORMAT_ERROR, Action, EnvError, Environment, EnvSpec, Message, StepResult, Task
from envs.ecosystems.ecosystem_venvs import venv_python
from envs.ecosystems.openenv_server import (
    Launch,
    LocalServer,
    Server,
    ServerFailed,
    ServerInfo,
    ServerSpec,
    describe,
    run_blocking,
    server_for,
)
from envs.ecosystems.openenv_wire import (
    CAPACITY_REACHED,
    VALIDATION_ERROR,
    ServerRefused,
    SessionLost,
    WsSession,
    validation_details,
    ws_url,
)

MODULE_PATTERN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
OUTCOMES = ("sum", "last", "none")
_FENCE = re.compile(r"^```[A-Za-z]*\s*(.*?)\s*```$", re.DOTALL)


class OpenEnvError(EnvError):
    """The OpenEnv server failed this episode (the message names it and why)."""


class _Rejected(Exception):
    """The server's validation rejected the agent's action (an agent mistake, not an env failure)."""


def module_of(member: str) -> str:
    """The Python module an ``openenv/<member>`` name stands for (a distribution's ``-`` is ``_``)."""
    module = member.replace("-", "_")
    if not MODULE_PATTERN.match(module):
        raise ValueError(f"{member!r} is not an OpenEnv environment name or a dotted Python module path")
    return module


def as_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def observation_text(payload: Mapping[str, Any], field: str | None = None) -> str:
    """The user message for one observation answer (module docstring, "Messages")."""
    observation = payload.get("observation")
    observation = observation if isinstance(observation, Mapping) else {}
    fields = {k: v for k, v in observation.items() if k != "metadata"}
    if field is not None:
        if field not in fields:
            raise OpenEnvError(
                f"observation_field {field!r} is not in the observation (it has {sorted(fields)})"
            )
        return as_text(fields[field])
    if not fields:
        metadata = observation.get("metadata") or payload.get("metadata") or {}
        fields = dict(metadata) if isinstance(metadata, Mapping) else {"metadata": metadata}
    if len(fields) == 1:
        return as_text(next(iter(fields.values())))
    return json.dumps(fields, ensure_ascii=False)


def tool_result_text(payload: Mapping[str, Any]) -> str:
    """The tool message for a CallToolObservation: the result's text content, or ``error: ...``."""
    observation = payload.get("observation")
    observation = observation if isinstance(observation, Mapping) else {}
    error = observation.get("error")
    if error:
        return f"error: {error.get('message', error) if isinstance(error, Mapping) else error}"
    result = observation.get("result")
    if isinstance(result, Mapping) and isinstance(result.get("content"), list):
        texts = [
            c.get("text") for c in result["content"] if isinstance(c, Mapping) and c.get("type") == "text"
        ]
        text = "\n".join(t for t in texts if isinstance(t, str))
        if not texts:
            text = as_text(result.get("structured_content") or result.get("data"))
        return f"error: {text}" if result.get("is_error") else text
    return as_text(result)


def openai_tool(tool: Mapping[str, Any]) -> dict[str, Any]:
    """An MCP tool as listed (``name``, ``description``, ``input_schema``) as an OpenAI function schema."""
    parameters = dict(tool.get("input_schema") or tool.get("inputSchema") or {})
    parameters.setdefault("type", "object")
    parameters.setdefault("properties", {})
    function = {
        "name": str(tool.get("name")),
        "description": str(tool.get("description") or ""),
        "parameters": parameters,
    }
    return {"type": "function", "function": function}


def action_fields(schema: Mapping[str, Any]) -> dict[str, Any]:
    """The action's own fields (``metadata`` is OpenEnv's, not the agent's)."""
    properties = schema.get("properties")
    return {k: v for k, v in properties.items() if k != "metadata"} if isinstance(properties, Mapping) else {}


def text_field_of(schema: Mapping[str, Any]) -> str | None:
    """The action's field that takes the reply text: its only field, when that is a string."""
    fields = action_fields(schema)
    if len(fields) == 1:
        name, prop = next(iter(fields.items()))
        if isinstance(prop, Mapping) and prop.get("type") == "string":
            return name
    return None


def reward_value(value: Any, where: str) -> float:
    """An observation's reward as a float (None = 0.0); OpenEnvError when it is not a finite number."""
    if value is None:
        return 0.0
    if isinstance(value, bool | int | float) and math.isfinite(value):
        return float(value)
    raise OpenEnvError(f"{where}: reward {value!r} is not a finite number")


class OpenEnvEnvironment(Environment):
    """One episode of an OpenEnv environment (module docstring)."""

    def __init__(
        self,
        member: str,
        base_url: str | None = None,
        path: str | None = None,
        app: str | None = None,
        python: str | None = None,
        max_turns: int = 8,
        outcome: str = "sum",
        reward_from: str | None = None,
        action_field: str | None = None,
        observation_field: str | None = None,
        prompt: str | None = None,
        reset_kwargs: Mapping[str, Any] | None = None,
        split: str | None = None,
        num_tasks: int | None = None,
        max_calls_per_turn: int = 8,
        max_sessions: int = 256,
        step_timeout_s: float = 60.0,
        start_timeout_s: float = 120.0,
        server_env: Mapping[str, str] | None = None,
    ) -> None:
        name = f"openenv/{member}"
        if outcome not in OUTCOMES:
            raise ValueError(f"{name}: outcome must be one of {OUTCOMES}, got {outcome!r}")
        if (split is None) != (num_tasks is None) or (num_tasks is not None and num_tasks < 1):
            raise ValueError(
                f"{name}: split and num_tasks (>= 1) go together, got {split!r} and {num_tasks!r}"
            )
        if max_calls_per_turn < 1 or max_sessions < 1 or step_timeout_s <= 0 or start_timeout_s <= 0:
            raise ValueError(
                f"{name}: max_calls_per_turn, max_sessions >= 1; step_timeout_s, start_timeout_s > 0"
            )
        self.server = self._server(
            member, base_url, path, app, python, max_sessions, start_timeout_s, server_env
        )
        info = self._describe(name, step_timeout_s)
        self.info = info
        self.text_field = action_field or text_field_of(info.action_schema)
        fields = action_fields(info.action_schema)
        if action_field is not None and action_field not in fields:
            raise ValueError(
                f"{name}: action_field {action_field!r} is not a field of the action ({sorted(fields)})"
            )
        observed = info.observation_schema.get("properties") or {}
        if observation_field is not None and observation_field not in observed:
            raise ValueError(
                f"{name}: observation_field {observation_field!r} is not a field ({sorted(observed)})"
            )
        self.name = name
        self.outcome_rule = outcome
        self.reward_from = reward_from
        self.observation_field = observation_field
        self.prompt = prompt
        self.reset_kwargs = dict(reset_kwargs or {})
        self.split, self.num_tasks = split, num_tasks
        self.max_calls = max_calls_per_turn
        self.spec = EnvSpec(
            name=name,
            version=info.version,
            max_turns=max_turns,
            step_timeout_s=step_timeout_s,
            episode_timeout_s=max_turns * step_timeout_s + start_timeout_s,
            tools=tuple(openai_tool(t) for t in info.tools),
        )
        self._session: WsSession | None = None
        self._launch: Launch | None = None
        self.turns = 0
        self.rewards: list[float] = []
        self.score = 0.0

    @staticmethod
    def _server(
        member: str,
        base_url: str | None,
        path: str | None,
        app: str | None,
        python: str | None,
        sessions: int,
        start_timeout_s: float,
        server_env: Mapping[str, str] | None,
    ) -> Server:
        if base_url is not None:
            ws_url(base_url)  # ValueError for a URL that is not http(s)
            return server_for(base_url.rstrip("/"))
        app = app or f"{module_of(member)}.server.app:app"
        if path is not None and not Path(path).expanduser().is_dir():
            raise ValueError(f"openenv/{member}: path {path!r} is not a directory")
        # EcosystemMissing (a ValueError) names `make env-openenv`
        interpreter = venv_python("openenv", python)
        resolved = str(Path(path).expanduser().resolve()) if path is not None else None
        env = tuple(sorted((str(k), str(v)) for k, v in (server_env or {}).items()))
        return server_for(ServerSpec(str(interpreter), app, resolved, sessions, start_timeout_s, env))

    def _describe(self, name: str, timeout_s: float) -> ServerInfo:
        server = self.server
        if server.info is not None:
            return server.info
        try:
            return run_blocking(lambda: describe(server, timeout_s))
        except ServerFailed as exc:
            hint = ""
            if isinstance(server, LocalServer):
                hint = (
                    f"\n({name} is served by the app {server.spec.app}: install the environment into the "
                    "OpenEnv venv, or give the directory above its module as env.options.path, or its app "
                    "as env.options.app)"
                )
            raise ValueError(f"{name}: {exc}{hint}") from None

    # -- tasks ----------------------------------------------------------------------------------------
    def tasks(self, seed: int) -> Iterator[Task]:
        rng = random.Random(seed)
        if self.split is None or self.num_tasks is None:
            while True:
                reset_seed = rng.randrange(2**31)
                yield Task(id=f"seed-{reset_seed}", seed=reset_seed, data={})
        cycle = 0
        while True:
            order = list(range(self.num_tasks))
            rng.shuffle(order)
            for index in order:
                yield Task(
                    id=f"{self.split}-{index}#{cycle}", seed=seed, data={"split": self.split, "index": index}
                )
            cycle += 1

    # -- the session ------------------------------------------------------------------------------------
    async def _send(self, message: Mapping[str, Any], what: str) -> dict[str, Any]:
        """One message on the episode's session; environment failures become OpenEnvError."""
        if self._session is None:
            raise OpenEnvError(f"{self.name}: {what} before reset")
        try:
            return await self._session.send(message)
        except SessionLost as exc:
            died = await self.server.lost_reason(self._launch)
            raise OpenEnvError(f"{self.name}: {what}: {died or exc}") from None
        except ServerRefused as exc:
            if exc.code == VALIDATION_ERROR and what == "step":
                raise _Rejected(validation_details(exc.data)) from None
            if exc.code == CAPACITY_REACHED:
                why = (
                    "its environment does not declare SUPPORTS_CONCURRENT_SESSIONS, so its app's own "
                    "session cap stands"
                    if isinstance(self.server, LocalServer)
                    else "its max_concurrent_envs is lower than the episodes run at once"
                )
                raise OpenEnvError(
                    f"{self.name}: {self.server.label} refused the session ({exc.message}): {why}; run "
                    "fewer episodes at once (rollout.max_concurrent_groups) or let the server take more"
                ) from None
            raise OpenEnvError(f"{self.name}: {self.server.label} answered {what} with {exc}") from None

    async def _read_score(self) -> float:
        assert self.reward_from is not None
        state = await self._send({"type": "state"}, "state")
        if self.reward_from not in state:
            raise OpenEnvError(
                f"{self.name}: reward_from {self.reward_from!r} is not in the state ({sorted(state)})"
            )
        return reward_value(state[self.reward_from], f"state field {self.reward_from!r}")

    async def reset(self, task: Task) -> list[Message]:
        await self.close()
        self.turns, self.rewards, self.score = 0, [], 0.0
        try:
            base_url, self._launch = await self.server.ensure_running()
        except ServerFailed as exc:
            raise OpenEnvError(f"{self.name}: {exc}") from None
        self._session = WsSession(base_url, self.spec.step_timeout_s)
        try:
            await self._session.connect()
        except SessionLost as exc:
            died = await self.server.lost_reason(self._launch)
            raise OpenEnvError(f"{self.name}: {died or exc}") from None
        data = {"seed": task.seed, **self.reset_kwargs, **task.data}
        payload = await self._send({"type": "reset", "data": data}, "reset")
        if self.reward_from is not None:
            self.score = await self._read_score()
        text = observation_text(payload, self.observation_field)
        if self.prompt:
            text = f"{self.prompt}\n\n{text}" if text else self.prompt
        return [{"role": "user", "content": text}]

    # -- turns ------------------------------------------------------------------------------------------
    async def step(self, action: Action) -> StepResult:
        if self._session is None:
            raise OpenEnvError(f"{self.name}: step before reset")
        self.turns += 1
        turn = self._tool_turn if self.info.mcp else self._plain_turn
        messages, scored, done, info = await turn(action)
        if self.reward_from is not None:
            score = await self._read_score()
            scored, self.score = score - self.score, score
        if scored is not None:
            self.rewards.append(scored)
            info["env_reward"] = scored
        truncated = not done and self.turns >= self.spec.max_turns
        outcome = None
        if self.outcome_rule == "none":
            return StepResult(messages, reward=scored or 0.0, done=done, truncated=truncated, info=info)
        if done or truncated:
            last = self.rewards[-1] if self.rewards else 0.0
            outcome = last if self.outcome_rule == "last" else sum(self.rewards)
        return StepResult(messages, done=done, truncated=truncated, outcome=outcome, info=info)

    def _action_data(self, text: str) -> tuple[dict[str, Any] | None, str]:
        if self.text_field is not None:
            return {self.text_field: text}, ""
        match = _FENCE.match(text.strip())
        try:
            data = json.loads(match.group(1) if match else text)
        except ValueError:
            data = None
        if isinstance(data, dict):
            return data, ""
        fields = ", ".join(
            f"{k} ({v.get('type', 'any') if isinstance(v, Mapping) else 'any'})"
            for k, v in action_fields(self.info.action_schema).items()
        )
        return None, f"Reply with a JSON object of the action's fields: {fields}."

    async def _plain_turn(self, action: Action) -> tuple[list[Message], float | None, bool, dict[str, Any]]:
        """(messages, the environment's reward or None for a mistake it never saw, done, info)."""
        data, problem = self._action_data(action.text)
        if data is not None:
            try:
                payload = await self._send({"type": "step", "data": data}, "step")
            except _Rejected as exc:
                problem = f"That action is not valid: {exc}"
            else:
                reward = reward_value(payload.get("reward"), f"{self.name} step {self.turns}")
                info = {"metadata": payload["metadata"]} if payload.get("metadata") else {}
                text = observation_text(payload, self.observation_field)
                return [{"role": "user", "content": text}], reward, bool(payload.get("done")), info
        return [{"role": "user", "content": problem}], None, False, {FORMAT_ERROR: problem}

    async def _tool_turn(self, action: Action) -> tuple[list[Message], float | None, bool, dict[str, Any]]:
        """(messages, the sum of the calls' rewards or None when no call ran, done, info)."""
        messages: list[Message] = [
            {"role": "tool", "name": "error", "content": f"error: {error}"}
            for error in action.tool_call_errors
        ]
        if not action.tool_calls and not action.tool_call_errors:
            return [], None, True, {}  # no tool call: the agent's final answer ends the episode
        reward: float | None = None
        done = False
        for call in action.tool_calls[: self.max_calls]:
            step = {"type": "call_tool", "tool_name": call.name, "arguments": call.arguments}
            try:
                payload = await self._send({"type": "step", "data": step}, "step")
            except _Rejected as exc:
                messages.append({"role": "tool", "name": call.name, "content": f"error: {exc}"})
                continue
            messages.append({"role": "tool", "name": call.name, "content": tool_result_text(payload)})
            reward = (reward or 0.0) + reward_value(
                payload.get("reward"), f"{self.name} step {self.turns} ({call.name})"
            )
            if payload.get("done"):
                done = True
                break
        if len(action.tool_calls) > self.max_calls:
            messages.append(
                {"role": "user", "content": f"Only the first {self.max_calls} tool calls of a turn run."}
            )
        return messages, reward, done, {}

    async def close(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    def gold_unavailable(self) -> str | None:
        return "an OpenEnv server keeps its state to itself and offers no solver"
