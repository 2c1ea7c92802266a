"""The doors other hosts come through (docs/scale_out.md, "A fleet across machines"): the admin endpoint
(engines join and drain; the published weights the engines' fetchers copy) and, with
`transport.kind = "flight"`, the spool's Arrow Flight service, which a learner on another host reads.

Both open before the children start, so a taken port is one line before any work, and a learner may read
the spool as soon as it is up.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from pipeline.contracts.config import Config, FlightTransport, reveal
from pipeline.contracts.run_dir import RunDir
from pipeline.contracts.tls import context_for, pem_pair
from pipeline.supervisor.fleet.admin import AdminEndpoint, make_admin_app
from pipeline.supervisor.fleet.engine_fleet import EngineFleet
from pipeline.supervisor.fleet.fleet_membership import FleetMembership
from pipeline.transport.flight import SpoolFlightService
from pipeline.transport.weights_http import WeightServer


class FleetServices:
    def __init__(self, cfg: Config, run_dir: RunDir, membership: FleetMembership) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        app = make_admin_app(membership, WeightServer(run_dir.weights_of), reveal(cfg.admin.token))
        self.admin = AdminEndpoint(
            cfg.admin.host, cfg.admin.port, app, ssl_context=context_for(cfg.admin.host, cfg.tls.files())
        )
        self.flight: SpoolFlightService | None = None

    async def start(self, engines: EngineFleet, message: Callable[[str], None]) -> None:
        """Open the doors and tell the engines' fetchers where the published weights are."""
        cfg = self.cfg
        await self.admin.start()
        engines.weight_source = cfg.admin.advertise_url or self.admin.url
        engines.weight_token = reveal(cfg.admin.token)
        t = cfg.transport
        if isinstance(t, FlightTransport):
            tls = cfg.tls.files()
            pem = pem_pair(tls) if context_for(t.flight_host, tls) is not None else None
            self.flight = SpoolFlightService(
                self.run_dir.spool, host=t.flight_host, port=t.flight_port, token=reveal(t.token), tls=pem
            )
            self.flight.start()
            message(f"spool served over Arrow Flight at {self.flight.url}")

    def urls(self) -> dict[str, str | None]:
        """The doors' URLs as bound (for the run directory's endpoints.json)."""
        return {"admin": self.admin.url, "flight": self.flight.url if self.flight is not None else None}

    async def stop(self) -> None:
        await self.admin.stop()
        if self.flight is not None:
            await asyncio.to_thread(self.flight.stop)
