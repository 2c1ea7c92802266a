"""`rollwise report`: the key dashboard panels as one PNG, for people without Grafana.

Two sources, same picture:
- `--prometheus URL`: range queries of the dashboards' own PromQL (read from grafana/dashboards, so
  the report and Grafana can never show different things);
- otherwise the run's step log (`<run_dir>/logs/steps.jsonl`, one JSON line per learner step, written
  by the supervisor), plotted against the learner step.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.contracts.run_dir import RunDir, log_lines, rotated_parts

DASHBOARD_DIR = Path(__file__).resolve().parents[2] / "grafana" / "dashboards"
# (dashboard file, panel title): the panels that answer "is it learning, and is it healthy?"
KEY_PANELS = (
    ("overview.json", "Success rate"),
    ("overview.json", "Episode reward (mean)"),
    ("overview.json", "Policy version"),
    ("overview.json", "Staleness of trained tokens"),
    ("learner.json", "Loss"),
    ("learner.json", "Clip fraction"),
    ("learner.json", "Train vs engine log-prob mismatch"),
    ("learner.json", "Step duration"),
    ("overview.json", "Held-out eval success"),
)
# step-log fallback: panel title -> keys of the learner's step metrics
STEP_LOG_PANELS = (
    ("Success rate", ("success_rate",)),
    ("Episode reward (mean)", ("reward_mean",)),
    ("Loss", ("loss",)),
    ("Clip fraction", ("clip_fraction",)),
    ("Train vs engine log-prob mismatch", ("mismatch_abs_mean", "mismatch_k3")),
    ("Entropy", ("entropy",)),
    ("Gradient norm", ("grad_norm",)),
    ("Step duration (s)", ("step_time_s",)),
)
# eval-log panel: series label -> (mode block, key) of each logs/eval.jsonl row, against its learner step
EVAL_LOG_PANEL = "Held-out eval success"
EVAL_LOG_SERIES = (
    ("greedy success", "greedy", "success"),
    ("sampled success", "sampled", "success"),
    ("sampled pass@k", "sampled", "pass_at_k"),
)


@dataclass
class Series:
    label: str
    x: list[float]
    y: list[float]


@dataclass
class Panel:
    title: str
    unit: str
    series: list[Series]


class ReportError(RuntimeError):
    pass


def _panel_queries(file: str, title: str) -> tuple[str, list[tuple[str, str]]]:
    dash = json.loads((DASHBOARD_DIR / file).read_text())
    for p in dash["panels"]:
        if p.get("title") == title:
            unit = p["fieldConfig"]["defaults"].get("unit", "none")
            return unit, [(t["expr"], t.get("legendFormat", "")) for t in p["targets"]]
    raise ReportError(f"panel {title!r} not found in {file}")


def _substitute(expr: str, step_s: float) -> str:
    window = f"{max(4 * step_s, 30):.0f}s"
    return expr.replace("$__rate_interval", window).replace('"$instance"', '".*"').replace('"$env"', '".*"')


def _legend(fmt: str, labels: dict[str, str]) -> str:
    if not fmt or fmt == "__auto":
        return ",".join(f"{k}={v}" for k, v in labels.items() if k not in ("job", "instance")) or "value"
    out = fmt
    for k, v in labels.items():
        out = out.replace("{{" + k + "}}", v)
    return out


def from_prometheus(base: str, since_s: float, step_s: float) -> list[Panel]:
    end = time.time()
    panels = []
    for file, title in KEY_PANELS:
        unit, queries = _panel_queries(file, title)
        series: list[Series] = []
        for expr, legend in queries:
            params = {"query": _substitute(expr, step_s), "start": end - since_s, "end": end, "step": step_s}
            url = f"{base.rstrip('/')}/api/v1/query_range?" + urllib.parse.urlencode(params)
            try:
                with urllib.request.urlopen(url, timeout=30) as resp:
                    body = json.loads(resp.read())
            except OSError as e:
                raise ReportError(f"cannot query Prometheus at {base}: {e}") from e
            if body.get("status") != "success":
                raise ReportError(f"Prometheus rejected {expr!r}: {body.get('error')}")
            for result in body["data"]["result"]:
                points = [(float(t) - end, float(v)) for t, v in result["values"] if math.isfinite(float(v))]
                if points:
                    xs, ys = zip(*points, strict=True)
                    series.append(Series(_legend(legend, result["metric"]), list(xs), list(ys)))
        panels.append(Panel(title, unit, series))
    return panels


def from_step_log(run_dir: Path) -> list[Panel]:
    path = RunDir.at(run_dir).step_log
    if not rotated_parts(path):
        raise ReportError(f"{path} does not exist (and no --prometheus given)")
    steps: list[dict[str, Any]] = []
    for line in log_lines(path):
        try:
            steps.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by a crash; the rest of the log is still good
    panels = []
    for title, keys in STEP_LOG_PANELS:
        series = []
        for key in keys:
            pts = [
                (float(s["step"]), float(s["metrics"][key]))
                for s in steps
                if isinstance(s.get("metrics"), dict) and isinstance(s["metrics"].get(key), (int, float))
            ]
            if pts:
                xs, ys = zip(*pts, strict=True)
                series.append(Series(key, list(xs), list(ys)))
        panels.append(Panel(title, "none", series))
    panels.append(eval_panel(RunDir.at(run_dir).eval_log))
    return panels


def eval_panel(path: Path) -> Panel:
    """The held-out evaluation curve from logs/eval.jsonl (empty when the run evaluated nothing)."""
    from pipeline.supervisor.eval_schedule import read_eval_log

    rows = [r for r in read_eval_log(path) if isinstance(r.get("step"), int)]
    series = []
    for label, mode, key in EVAL_LOG_SERIES:
        pts = [
            (float(r["step"]), float(r[mode][key]))
            for r in rows
            if isinstance(r.get(mode), dict) and isinstance(r[mode].get(key), (int, float))
        ]
        if pts:
            xs, ys = zip(*pts, strict=True)
            series.append(Series(label, list(xs), list(ys)))
    return Panel(EVAL_LOG_PANEL, "percentunit", series)


def render(panels: list[Panel], out: Path, *, title: str, xlabel: str) -> int:
    """Write the PNG; returns the number of plotted series."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 4
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    plotted = 0
    for ax, panel in zip(axes.flat, panels, strict=False):
        ax.set_title(
            panel.title + ("" if panel.unit in ("none", "short") else f" [{panel.unit}]"), fontsize=9
        )
        for s in panel.series:
            ax.plot(s.x, s.y, label=s.label, linewidth=1.2)
            plotted += 1
        if not panel.series:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="grey")
        elif len(panel.series) <= 6:
            ax.legend(fontsize=7)
        ax.set_xlabel(xlabel, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return plotted


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rollwise report", description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", type=Path, help="run directory (step log source; default output place)")
    parser.add_argument("--prometheus", help="Prometheus base URL, e.g. http://127.0.0.1:9090")
    parser.add_argument("--since", type=float, default=1800.0, help="seconds of history (Prometheus)")
    parser.add_argument("--step", type=float, default=15.0, help="resolution in seconds (Prometheus)")
    parser.add_argument("--out", type=Path, help="PNG path (default: RUN_DIR/report.png or ./report.png)")
    args = parser.parse_args(argv)
    if args.prometheus is None and args.run_dir is None:
        parser.error("give --run-dir (step log) and/or --prometheus URL")
    out = args.out or ((args.run_dir or Path(".")) / "report.png")
    try:
        if args.prometheus:
            panels = from_prometheus(args.prometheus, args.since, args.step)
            n = render(panels, out, title=f"rollwise — last {args.since / 60:.0f} min", xlabel="seconds")
        else:
            panels = from_step_log(args.run_dir)
            n = render(panels, out, title=f"rollwise — {args.run_dir}", xlabel="learner step")
    except ReportError as e:
        print(f"rollwise report: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out} ({n} series in {len(panels)} panels)")
    return 0
