from __future__ import annotations

import json
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from pipeline.tools import report


def _write_steps(run_dir: Path, n: int) -> None:
    (run_dir / "logs").mkdir(parents=True)
    lines = [
        json.dumps(
            {
                "event": "step",
                "step": s,
                "metrics": {
                    "success_rate": s / n,
                    "loss": 1.0 / (s + 1),
                    "clip_fraction": 0.1,
                    "reward_mean": s / n,
                },
            }
        )
        for s in range(1, n + 1)
    ]
    # a line cut by a crash must not break the report
    (run_dir / "logs" / "steps.jsonl").write_text("\n".join(lines) + '\n{"event": "st')


def test_step_log_report_plots_each_metric(tmp_path: Path) -> None:
    _write_steps(tmp_path, 12)
    panels = report.from_step_log(tmp_path)
    by_title = {p.title: p for p in panels}
    success = by_title["Success rate"].series[0]
    assert success.x == [float(s) for s in range(1, 13)] and success.y[-1] == 1.0
    assert by_title["Entropy"].series == []  # not logged: shown as "no data", not invented
    assert report.main(["--run-dir", str(tmp_path)]) == 0
    png = (tmp_path / "report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_missing_step_log_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert report.main(["--run-dir", str(tmp_path)]) == 1
    step_log = tmp_path / "logs" / "steps.jsonl"
    assert capsys.readouterr().err == (
        f"rollwise report: {step_log} does not exist (and no --prometheus given)\n"
    )
    assert not (tmp_path / "report.png").exists()


class FakePrometheus:
    """/api/v1/query_range on 127.0.0.1: records each query's parameters and answers every query with
    one series (labels env, engine and instance; one NaN point among its values)."""

    def __init__(self) -> None:
        self.requests: list[dict[str, str]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                url = urllib.parse.urlsplit(self.path)
                fake.requests.append({"path": url.path, **dict(urllib.parse.parse_qsl(url.query))})
                series = {
                    "metric": {"env": "guess", "engine": "e0", "instance": "a:1"},
                    "values": [[1000.0, "0.5"], [1015.0, "NaN"], [1030.0, "0.75"]],
                }
                body = json.dumps({"status": "success", "data": {"result": [series]}}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakePrometheus:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


# The dashboards' variables as the report fills them in: every instance and env, and at --step 15 a
# rate window of max(4 x 15 s, 30 s).
ALL = 'instance=~".*"'
ALL_ENV = 'instance=~".*", env=~".*"'


def by_env_rate(metric: str) -> str:
    return f"sum by (env) (rate({metric}{{{ALL_ENV}}}[60s]))"


def quantile(q: str, histogram: str) -> str:
    return f"histogram_quantile({q}, sum by (le) (rate({histogram}_bucket{{{ALL}}}[60s])))"


# (unit, [(query, legend)]) of key panels, as in grafana/dashboards/{overview,learner}.json, with the
# variables filled in and the fake's labels in the legends.
KNOWN_PANELS = {
    "Success rate": (
        "percentunit",
        [
            (
                f"{by_env_rate('rollwise_episode_successes_total')}"
                f" / {by_env_rate('rollwise_episodes_total')}",
                "guess",
            )
        ],
    ),
    "Episode reward (mean)": (
        "none",
        [
            (
                f"({by_env_rate('rollwise_episode_reward_positive_total')}"
                f" - {by_env_rate('rollwise_episode_reward_negative_total')})"
                f" / {by_env_rate('rollwise_episode_reward_count')}",
                "guess",
            )
        ],
    ),
    "Policy version": (
        "none",
        [
            (f"max(rollwise_policy_version{{{ALL}}})", "published"),
            (f"max by (engine) (rollwise_engine_policy_version{{{ALL}}})", "served e0"),
        ],
    ),
    "Staleness of trained tokens": (
        "short",
        [
            (quantile(q, "rollwise_trained_token_staleness_versions"), f"p{p}")
            for q, p in [("0.5", 50), ("0.9", 90), ("1.0", 100)]
        ],
    ),
    "Loss": ("none", [(f"rollwise_learner_loss{{{ALL}}}", "loss")]),
    "Step duration": (
        "s",
        [
            (quantile(q, "rollwise_learner_step_duration_seconds"), f"p{p}")
            for q, p in [("0.5", 50), ("0.9", 90)]
        ],
    ),
}


def test_prometheus_report_queries_the_key_panels_promql_with_their_units_and_legends() -> None:
    with FakePrometheus() as prometheus:
        panels = report.from_prometheus(prometheus.url, since_s=600.0, step_s=15.0)
    assert [p.title for p in panels] == [
        "Success rate",
        "Episode reward (mean)",
        "Policy version",
        "Staleness of trained tokens",
        "Loss",
        "Clip fraction",
        "Train vs engine log-prob mismatch",
        "Step duration",
        "Held-out eval success",
    ]
    # The fake answers each query with one series, so the panels' series follow the queries in order.
    queries = iter(r["query"] for r in prometheus.requests)
    sent = {p.title: (p.unit, [(next(queries), s.label) for s in p.series]) for p in panels}
    assert next(queries, None) is None
    for title, expected in KNOWN_PANELS.items():
        assert sent[title] == expected, title
    # Every key panel, those above and the rest: its dashboard's own PromQL and unit.
    for file, title in report.KEY_PANELS:
        [panel] = [
            p
            for p in json.loads((report.DASHBOARD_DIR / file).read_text())["panels"]
            if p.get("title") == title
        ]
        unit, sent_queries = sent[title]
        assert unit == panel["fieldConfig"]["defaults"]["unit"]
        assert [query for query, _ in sent_queries] == [
            t["expr"]
            .replace("$__rate_interval", "60s")
            .replace('"$instance"', '".*"')
            .replace('"$env"', '".*"')
            for t in panel["targets"]
        ]
    assert {(r["path"], r["step"], float(r["end"]) - float(r["start"])) for r in prometheus.requests} == {
        ("/api/v1/query_range", "15.0", 600.0)
    }
    # Each series: the finite points only, at times relative to the end of the range.
    series = panels[0].series[0]
    assert series.y == [0.5, 0.75] and series.x[1] - series.x[0] == 30.0
