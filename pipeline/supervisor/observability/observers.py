"""What watches the run without steering it: traces ([tracing]), experiment trackers ([trackers]) and
the engine fleet's gauges. All are optional and none can stop the run: a failure is logged once and
counted in rollwise_tracker_errors_total."""

from __future__ import annotations

import asyncio

from pipeline.contracts import tracing
from pipeline.contracts.config import Config
from pipeline.supervisor.observability import metrics
from pipeline.supervisor.observability.service_health import Fleet, watch_fleet
from pipeline.supervisor.observability.trackers import Trackers


def start_observers(cfg: Config, trackers: Trackers | None, fleet: Fleet) -> None:
    otlp_errors = metrics.TRACKER_ERRORS.labels(tracker="otlp")
    tracing.configure(cfg.tracing, process="supervisor", on_error=otlp_errors.inc)
    if trackers is not None:
        trackers.start(cfg)
    watch_fleet(fleet)


async def stop_observers(trackers: Trackers | None) -> None:
    """Flush what the trackers and the trace exporter still hold (both may block on the network)."""
    if trackers is not None:
        await asyncio.to_thread(trackers.close)
    await asyncio.to_thread(tracing.shutdown)
