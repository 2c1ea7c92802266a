"""`rollwise doctor --run-dir D [--prometheus URL] [--json]`: a run's findings, ranked
(docs/design/run_health.md). Exit code 0 with no alarm, 1 with at least one, 2 for a bad argument or a
run directory that is not there."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path

from pipeline.contracts.run_endpoints import running_endpoints
from pipeline.supervisor.observability.run_health.findings import held_back, ranked, render_json, render_text
from pipeline.supervisor.observability.run_health.health_checks import examine
from pipeline.supervisor.observability.run_health.run_view import load, scrape


def live_metrics(root: Path) -> tuple[str | None, str | None]:
    """A scrape of the daemon running on `root` and its URL; (None, None) when none runs or it does not
    answer (the snapshot in logs/ is read instead)."""
    running = running_endpoints(root)
    url = f"{running['metrics']}/metrics" if running and "metrics" in running else None
    if url is None:
        return None, None
    try:
        return scrape(url), url
    except OSError:
        return None, None


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rollwise doctor", description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", required=True, help="the run directory (logs/, config.toml)")
    p.add_argument(
        "--prometheus",
        help="a /metrics URL to scrape (default: the running daemon's, from its endpoints.json; a stopped "
        "run's last snapshot, logs/metrics.prom)",
    )
    p.add_argument(
        "--stalled-after",
        type=float,
        metavar="SECONDS",
        help="call a running run stalled after this long without a step (default: 10 median steps, and "
        "at least 300 s)",
    )
    p.add_argument("--json", action="store_true", help="one JSON object instead of the report")
    args = p.parse_args(list(argv or []))
    if args.stalled_after is not None and not args.stalled_after > 0:
        p.error(f"--stalled-after must be a positive number of seconds, got {args.stalled_after}")
    source = args.run_dir
    try:
        text = scrape(args.prometheus) if args.prometheus else None
        if text is not None:
            source += f" + {args.prometheus}"
        else:
            text, live = live_metrics(Path(args.run_dir))
            source += f" + {live}" if live else ""
        view = dataclasses.replace(load(args.run_dir, metrics_text=text), stall_after_s=args.stalled_after)
    except (OSError, ValueError) as exc:
        print(f"rollwise doctor: {exc}", file=sys.stderr)
        return 2
    found = examine(view)
    shown, held = ranked(found), held_back(found)
    print(render_json(shown, held, source) if args.json else render_text(shown, held, source), end="")
    return 1 if any(f.level == "alarm" for f in shown) else 0
