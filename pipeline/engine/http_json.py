"""JSON in and out of the engine's handlers, in SGLang's shapes: compact replies, `{"error": {"message"}}`
for a bad request, and request bodies read through the door (pipeline.contracts.http_guard)."""

from __future__ import annotations

import json
import math
from typing import Any

from aiohttp import web

from pipeline.contracts.http_guard import BadBody, read_json
from pipeline.engine.engine_state import state_of


def dumps(obj: object) -> str:
    """Compact JSON. A non-finite float (a log-prob of -inf) is written as null, as SGLang's orjson
    writes it: NaN and Infinity are not JSON, and a client's strict parser would refuse the reply."""
    try:
        return json.dumps(obj, separators=(",", ":"), allow_nan=False)
    except ValueError:
        return json.dumps(_finite(obj), separators=(",", ":"), allow_nan=False)


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {key: _finite(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(value) for value in obj]
    return obj


def json_reply(obj: object, status: int = 200) -> web.Response:
    return web.json_response(obj, status=status, dumps=dumps)


def error_reply(message: str, status: int = 400) -> web.Response:
    return json_reply({"error": {"message": message}}, status=status)


async def json_body(request: web.Request, *, required: bool) -> dict[str, Any]:
    """The JSON object body; an empty body is {} unless required. Raises BadBody (a ValueError with the
    status to answer: 400, 408 for a body too slow to arrive, 413 for one too large)."""
    body = await read_json(request, state_of(request).config.limits)
    if body is None:
        if required:
            raise BadBody("request body is empty, expected a JSON object")
        return {}
    if not isinstance(body, dict):
        raise BadBody(f"request body must be a JSON object, got {type(body).__name__}")
    return body


def bad_reply(exc: ValueError) -> web.Response:
    return error_reply(str(exc), exc.status if isinstance(exc, BadBody) else 400)
