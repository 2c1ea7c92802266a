"""Smoke test of `rollwise bench sandbox` on a tiny workload (real processes, both sides)."""

from __future__ import annotations

import json

import pytest

from pipeline.tools.bench import sandbox_latency as bench
from tests.envs.test_sandbox import BWRAP_PROBLEM


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert (bench.percentile(values, 0.5), bench.percentile(values, 0.99)) == (50.0, 99.0)
    assert bench.percentile([3.0], 0.99) == 3.0


def test_bench_sandbox_reports_every_side_at_every_level(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--calls", "4", "--levels", "1,2", "--repeats", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    sides = {"bare", "rlimits"} | (set() if BWRAP_PROBLEM else {"bwrap"})
    assert set(report["levels"]) == {"1", "2"}
    for level in report["levels"].values():
        assert set(level) == sides
        for side in sides:
            row = level[side]
            assert row["execs_per_s"] > 0 and 0 < row["p50_ms"] <= row["p99_ms"] and row["parent_cpu_ms"] >= 0
            if side != "bare":
                assert row["execs_ratio"] == pytest.approx(row["execs_per_s"] / level["bare"]["execs_per_s"])
                assert row["p50_ratio"] == pytest.approx(row["p50_ms"] / level["bare"]["p50_ms"])
    text = bench.format_report(report)
    assert "bare subprocess.run" in text and "sandbox, rlimits" in text and "CPU ms" in text


def test_bench_sandbox_rejects_bad_levels(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench.main(["--levels", "1,x"])
    assert "--levels must be comma-separated integers" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--levels", "0"])
    assert "every level must be >= 1" in capsys.readouterr().err
