"""`rollwise doctor --run-dir D [--prometheus URL] [--json]`: a run's findings, ranked
(docs/design/run_health.md). Exit code 0 with no alarm, 1 with at least one, 2 for a bad argument or a
run directory that is not there."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from pipeline.supervisor.observability.run_health.findings import held_back, ranked, render_json, render_text
from pipeline.supervisor.observability.run_health.health_checks import examine
from pipeline.supervisor.observability.run_health.run_view import load, scrape


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rollwise doctor", description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", required=True, help="the run directory (logs/, config.toml)")
    p.add_argument("--prometheus", help="the running daemon's /metrics URL (its 'metrics on' line)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the report")
    args = p.parse_args(list(argv or []))
    try:
        text = scrape(args.prometheus) if args.prometheus else None
        view = load(args.run_dir, metrics_text=text)
    except (OSError, ValueError) as exc:
        print(f"rollwise doctor: {exc}", file=sys.stderr)
        return 2
    found = examine(view)
    shown, held = ranked(found), held_back(found)
    source = args.run_dir + (f" + {args.prometheus}" if args.prometheus else "")
    print(render_json(shown, held, source) if args.json else render_text(shown, held, source), end="")
    return 1 if any(f.level == "alarm" for f in shown) else 0
