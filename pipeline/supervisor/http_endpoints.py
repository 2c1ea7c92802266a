"""The supervisor's HTTP endpoint: /metrics (Prometheus), /healthz (liveness), /readyz (readiness),
/doctor (the run-health advisor's findings as JSON: pipeline.tools.doctor).

/healthz answers 200 while the event loop turns (a wedged loop cannot answer at all). /readyz answers
200 once the learner reported ready and every engine answered /health, else 503 with the reasons, so
an orchestrator can tell "starting" from "stuck".

With `api_key` every route but the two probes wants `Authorization: Bearer <key>`; a host that is not
loopback refuses to start without one (pipeline.contracts.http_guard). Connections that never complete a
request
are closed after DoorLimits.idle_timeout_s.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
from collections.abc import Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pipeline.contracts.http_guard import (
    DoorLimits,
    api_key_middleware,
    bind_notice,
    listen,
    require_key_off_loopback,
    runner_options,
)
from pipeline.supervisor.observability.metrics import REGISTRY

log = logging.getLogger("rollwise.http")
OPEN_PATHS = frozenset({"/healthz", "/readyz"})

ReadinessProbe = Callable[[], list[str]]
"""Returns what is not ready yet (empty list = ready)."""


def make_app(
    not_ready: ReadinessProbe, api_key: str | None = None, doctor: Callable[[], str] | None = None
) -> web.Application:
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

    app = web.Application(
        middlewares=[api_key_middleware(api_key, OPEN_PATHS)] if api_key else [],
        client_max_size=DoorLimits().max_body_bytes,
    )
    app.router.add_get("/metrics", metrics_handler)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    if doctor is not None:
        # The checks read the run's logs (files of a few MB at most): a thread keeps the loop turning.
        async def doctor_handler(request: web.Request) -> web.Response:
            body = await asyncio.to_thread(doctor)
            return web.Response(text=body + "\n", content_type="application/json")

        app.router.add_get("/doctor", doctor_handler)
    return app


class HttpEndpoints:
    """Serve `make_app` on host:port (port 0 = any free port; `port` tells which after `start`)."""

    def __init__(
        self,
        host: str,
        port: int,
        not_ready: ReadinessProbe,
        *,
        api_key: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
        doctor: Callable[[], str] | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.api_key = api_key
        self.ssl_context = ssl_context  # TLS (pipeline.contracts.tls.context_for), None = plain
        self._runner = web.AppRunner(
            make_app(not_ready, api_key, doctor), access_log=None, **runner_options(DoorLimits())
        )

    async def start(self) -> None:
        """Bind and serve. ExposedWithoutKey for a non-loopback host without a key (nothing bound)."""
        require_key_off_loopback("the metrics endpoint", self.host, self.api_key, "metrics.api_key")
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, ssl_context=self.ssl_context)
        await listen(site, "the metrics endpoint", self.host, self.port, "metrics.port")
        server = site._server
        sockets = getattr(server, "sockets", None) or []
        if sockets:
            self.port = int(sockets[0].getsockname()[1])
        log.info("%s", bind_notice("metrics endpoint", self.host, self.port, self.api_key, OPEN_PATHS))

    async def stop(self) -> None:
        await self._runner.cleanup()

    @property
    def url(self) -> str:
        return f"{'https' if self.ssl_context else 'http'}://{self.host}:{self.port}"
