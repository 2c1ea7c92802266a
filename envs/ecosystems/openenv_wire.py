"""OpenEnv's ``/ws`` session protocol, spoken by rollwise itself over aiohttp (no openenv code imported).

One WebSocket connection to ``<server>/ws`` is one environment instance on the server, kept for the
connection's life: the only way an OpenEnv episode keeps its state across turns (the HTTP ``/reset`` and
``/step`` routes build a fresh instance per request). The messages, as openenv 0.10.0 defines them:

- sent: ``{"type": "reset", "data": {<reset kwargs: seed, episode_id, anything the env's reset accepts>}}``
  (WSResetMessage), ``{"type": "step", "data": {<the action's fields>}}`` (WSStepMessage),
  ``{"type": "state"}`` (WSStateMessage), ``{"type": "close"}`` (WSCloseMessage); classes in
  openenv/core/env_server/types.py. MCP actions are steps too: ``{"type": "list_tools"}`` and
  ``{"type": "call_tool", "tool_name": ..., "arguments": {...}}`` (ListToolsAction, CallToolAction in
  openenv/core/env_server/mcp_types.py, recognised by ``deserialize_action`` in serialization.py).
- received: ``{"type": "observation", "data": {"observation": {<fields but reward and done>},
  "reward": number | bool | null, "done": bool[, "metadata": {...}]}}`` (WSObservationResponse, built by
  ``serialize_observation`` in serialization.py), ``{"type": "state", "data": {...}}`` (WSStateResponse),
  ``{"type": "error", "data": {"message": str, "code": str, ...}}`` (WSErrorResponse) with ``code`` one
  of WSErrorCode: INVALID_JSON, UNKNOWN_TYPE, VALIDATION_ERROR (the action or reset data did not validate;
  ``errors`` lists pydantic's), EXECUTION_ERROR (the environment raised), CAPACITY_REACHED (the
  session was refused: ``active_sessions``/``max_sessions``; the server then closes the connection),
  FACTORY_ERROR, SESSION_ERROR.
- The server loop is ``websocket_endpoint`` in openenv/core/env_server/http_server.py (``HTTPEnvServer.
  register_routes``): it answers each message with exactly one message, in order. ``GET /health`` answers
  ``{"status": "healthy"}``, ``GET /schema`` the JSON schemas ``action``, ``observation``, ``state``,
  ``GET /metadata`` ``name``, ``version``, ``description``.

Rules here: every network call has a timeout; a refused connection, a dropped connection, a timeout or
an answer that is not one of the above raises SessionLost; an error message raises ServerRefused with
its code, so the caller decides which codes are the agent's mistake (VALIDATION_ERROR on a step) and
which are the environment's failure (every other).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from typing import Any

import aiohttp

VALIDATION_ERROR = "VALIDATION_ERROR"
CAPACITY_REACHED = "CAPACITY_REACHED"


class SessionLost(Exception):
    """The connection failed, dropped or timed out, or the server said something outside the protocol."""


class ServerRefused(Exception):
    """The server answered with an error message (``code`` is its WSErrorCode)."""

    def __init__(self, code: str, message: str, data: Mapping[str, Any]) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.data = dict(data)


def ws_url(base_url: str) -> str:
    """The ``/ws`` URL of a server given by its http(s) base URL."""
    scheme, sep, rest = base_url.rstrip("/").partition("://")
    if not sep or scheme not in ("http", "https", "ws", "wss"):
        raise ValueError(f"{base_url!r} is not an http:// or https:// URL")
    return {"http": "ws", "https": "wss"}.get(scheme, scheme) + "://" + rest + "/ws"


def validation_details(data: Mapping[str, Any]) -> str:
    """pydantic's errors of a VALIDATION_ERROR as one line: ``field: message; ...``."""
    errors = data.get("errors")
    if not isinstance(errors, list) or not errors:
        return str(data.get("message", "invalid"))
    parts = []
    for error in errors[:5]:
        if isinstance(error, Mapping):
            where = ".".join(str(p) for p in error.get("loc", ())) or "action"
            parts.append(f"{where}: {error.get('msg', 'invalid')}")
    return "; ".join(parts) or str(data.get("message", "invalid"))


async def get_json(base_url: str, route: str, timeout_s: float) -> Any:
    """``GET <base_url><route>`` as JSON; SessionLost on any failure (names the URL)."""
    url = base_url.rstrip("/") + route
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as http,
            http.get(url) as response,
        ):
            if response.status != 200:
                raise SessionLost(f"GET {url} answered HTTP {response.status}")
            return await response.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        raise SessionLost(f"GET {url} failed: {type(exc).__name__}: {exc}") from exc


class WsSession:
    """One ``/ws`` session: ``await connect()``, then ``send`` one message at a time, ``close()`` always."""

    def __init__(self, base_url: str, timeout_s: float) -> None:
        self.url = ws_url(base_url)
        self.timeout_s = timeout_s
        self._http: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None

    async def connect(self) -> None:
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, connect=self.timeout_s))
        try:
            self._ws = await self._http.ws_connect(
                self.url, timeout=aiohttp.ClientWSTimeout(ws_receive=None, ws_close=2.0), max_msg_size=0
            )
        except (aiohttp.ClientError, TimeoutError) as exc:
            await self.close()
            raise SessionLost(f"cannot open {self.url}: {type(exc).__name__}: {exc}") from exc

    async def send(self, message: Mapping[str, Any]) -> dict[str, Any]:
        """Send one message and return the answer's ``data`` (type ``observation`` or ``state``)."""
        if self._ws is None:
            raise SessionLost(f"{self.url}: not connected")
        try:
            await self._ws.send_str(json.dumps(message))
            reply = await self._ws.receive(timeout=self.timeout_s)
        except (aiohttp.ClientError, ConnectionError) as exc:
            raise SessionLost(f"{self.url}: connection lost: {type(exc).__name__}: {exc}") from exc
        except TimeoutError as exc:
            raise SessionLost(
                f"{self.url}: no answer to {message.get('type')!r} within {self.timeout_s} s"
            ) from exc
        if reply.type != aiohttp.WSMsgType.TEXT:
            code = self._ws.close_code
            raise SessionLost(f"{self.url}: connection closed ({reply.type.name}, close code {code})")
        try:
            answer = json.loads(reply.data)
            kind, data = answer["type"], answer["data"]
        except (ValueError, KeyError, TypeError) as exc:
            raise SessionLost(f"{self.url}: an answer outside the protocol: {reply.data[:200]!r}") from exc
        if not isinstance(data, dict):
            raise SessionLost(f"{self.url}: an answer whose data is not an object: {reply.data[:200]!r}")
        if kind == "error":
            raise ServerRefused(str(data.get("code", "?")), str(data.get("message", "")), data)
        if kind not in ("observation", "state"):
            raise SessionLost(f"{self.url}: an answer of unknown type {kind!r}")
        return data

    async def close(self) -> None:
        """Say ``close`` (the server then frees the instance) and drop the connection; idempotent."""
        ws, http, self._ws, self._http = self._ws, self._http, None, None
        if ws is not None and not ws.closed:
            with contextlib.suppress(aiohttp.ClientError, ConnectionError):
                await ws.send_str(json.dumps({"type": "close"}))
            await ws.close()
        if http is not None:
            await http.close()
