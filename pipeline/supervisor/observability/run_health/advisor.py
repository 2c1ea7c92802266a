"""The advisor on the running daemon's own state: its run directory and its registry, as `GET /doctor`
serves it (pipeline.supervisor.http_endpoints)."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import generate_latest

from pipeline.supervisor.observability.metrics import REGISTRY
from pipeline.supervisor.observability.run_health.findings import held_back, ranked, render_json
from pipeline.supervisor.observability.run_health.health_checks import examine
from pipeline.supervisor.observability.run_health.run_view import load


def doctor_json(run_dir: Path) -> str:
    """The findings of the run in `run_dir`, counters from this process's registry, as JSON. The daemon
    holds its own lock, so the view reads as running."""
    view = load(run_dir, metrics_text=generate_latest(REGISTRY).decode())
    found = examine(view)
    return render_json(ranked(found), held_back(found), str(run_dir))
