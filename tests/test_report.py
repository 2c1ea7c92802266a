import json
from pathlib import Path

from pipeline.observability import report


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


def test_missing_step_log_is_a_clear_error(tmp_path: Path) -> None:
    assert report.main(["--run-dir", str(tmp_path)]) == 1


def test_key_panels_exist_in_the_dashboards() -> None:
    for file, title in report.KEY_PANELS:
        unit, queries = report._panel_queries(file, title)
        assert queries and unit
