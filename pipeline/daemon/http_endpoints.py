"""The supervisor's HTTP endpoint: /metrics (Prometheus), /healthz (liveness), /readyz (readiness).

/healthz answers 200 while the event loop turns (a wedged loop cannot answer at all). /readyz answers
200 once the learner reported ready and every engine answered /health, else 503 with the reasons, so
an orchestrator can tell "starting" from "stuck".
"""

from __future__ import annotations

import json
from collections.abc import Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pipeline.observability.metrics import REGISTRY

ReadinessProbe = Callable[[], list[str]]
"""Returns what is not ready yet (empty list = ready)."""


def make_app(not_ready: ReadinessProbe) -> web.Application:
    async def metrics_handler(request: web.Request) -> web.Response:
        body = generate_latest(REGISTRY)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def readyz(request: web.Request) -> web.Response:
        reasons = not_ready()
        if reasons:
            return web.Response(status=503, text=json.dumps({"ready": False, "waiting_for": reasons}) + "\n")
        return web.Response(text=json.dumps({"ready": True}) + "\n")

    app = web.Application()
    app.router.add_get("/metrics", metrics_handler)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    return app


class HttpEndpoints:
    """Serve `make_app` on host:port (port 0 = any free port; `port` tells which after `start`)."""

    def __init__(self, host: str, port: int, not_ready: ReadinessProbe) -> None:
        self.host = host
        self.port = port
        self._runner = web.AppRunner(make_app(not_ready), access_log=None)

    async def start(self) -> None:
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        server = site._server
        sockets = getattr(server, "sockets", None) or []
        if sockets:
            self.port = int(sockets[0].getsockname()[1])

    async def stop(self) -> None:
        await self._runner.cleanup()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"
