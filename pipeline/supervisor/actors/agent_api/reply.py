"""An endpoint response before any transport (aiohttp, the in-process client, an agent worker's pipe)
carries it; JSON bodies are compact UTF-8."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass(frozen=True)
class Reply:
    """An endpoint response before any transport carries it."""

    status: int
    body: bytes
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)

    @classmethod
    def json(cls, obj: Any, *, status: int = 200, headers: dict[str, str] | None = None) -> Reply:
        return cls(status, dumps(obj).encode(), "application/json", headers or {})

    def to_aiohttp(self) -> web.Response:
        return web.Response(
            status=self.status, body=self.body, content_type=self.content_type, headers=self.headers
        )


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
