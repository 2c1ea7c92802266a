"""`rollwise bench learn`: the interval maths on known numbers, the report of known eval rows, and a smoke
run of the real command (two seeds of a tiny daemon)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from pipeline.tools.bench.learning_curve import (
    first_crossing,
    format_report,
    last_by,
    main,
    parse_args,
    summarise,
    t_interval,
    t_quantile_975,
)
from tests.e2e.test_run_e2e import TINY


def test_t_interval_is_mean_plus_minus_t_times_standard_error() -> None:
    iv = t_interval([0.6, 0.8, 1.0])
    assert iv is not None and iv.n == 3 and iv.mean == pytest.approx(0.8)
    half = 4.303 * 0.2 / math.sqrt(3)  # t(0.975, 2) * s / sqrt(n), s = 0.2
    assert (iv.low, iv.high) == (pytest.approx(0.8 - half), pytest.approx(0.8 + half))
    clipped = t_interval([0.6, 0.8, 1.0], bounds=(0.0, 1.0))
    assert clipped is not None and clipped.high == 1.0 and clipped.low == pytest.approx(0.8 - half)
    one = t_interval([0.5])
    assert one is not None and (one.low, one.mean, one.high) == (0.5, 0.5, 0.5)
    assert t_interval([]) is None


def test_t_quantiles_come_from_the_table_and_stay_conservative_beyond_it() -> None:
    assert (t_quantile_975(1), t_quantile_975(9), t_quantile_975(30)) == (12.706, 2.262, 2.042)
    assert (t_quantile_975(35), t_quantile_975(59), t_quantile_975(1000)) == (2.042, 2.021, 1.980)
    with pytest.raises(ValueError, match="degrees of freedom"):
        t_quantile_975(0)


def _row(version: int, minutes: float, success: float) -> dict[str, Any]:
    return {
        "event": "eval",
        "version": version,
        "step": version,
        "elapsed_s": minutes * 60,
        "greedy": {"success": success},
    }


RUNS = {
    0: [_row(0, 0.2, 0.1), _row(50, 0.9, 0.5), _row(100, 1.8, 0.95)],
    1: [_row(0, 0.3, 0.0), _row(50, 1.1, 0.3), _row(100, 2.2, 0.6)],
}


def test_curves_take_the_last_evaluation_by_each_minute_and_version() -> None:
    assert last_by(RUNS[0], "elapsed_s", 60.0, "greedy") == 0.5
    assert last_by(RUNS[1], "elapsed_s", 60.0, "greedy") == 0.0
    assert last_by(RUNS[1], "elapsed_s", 10.0, "greedy") is None  # no evaluation finished yet
    assert first_crossing(RUNS[0], 0.9, "greedy") == {"minutes": pytest.approx(1.8), "version": 100.0}
    assert first_crossing(RUNS[1], 0.9, "greedy") is None

    summary = summarise(RUNS, mode="greedy", threshold=0.9, minutes=3, bucket_versions=50)
    minute1, minute2, minute3 = summary["per_minute"]
    assert minute1["interval"]["n"] == 2 and minute1["interval"]["mean"] == pytest.approx(0.25)
    assert minute2["interval"]["mean"] == pytest.approx((0.95 + 0.3) / 2) and minute2["crossed"] == 1
    assert minute3["interval"]["mean"] == pytest.approx((0.95 + 0.6) / 2)
    assert [b["at"] for b in summary["per_version"]] == [50.0, 100.0]
    assert summary["per_version"][1]["interval"]["mean"] == pytest.approx((0.95 + 0.6) / 2)
    assert summary["crossed"] == 1 and summary["crossings"]["1"] is None
    assert summary["versions_to_threshold"] == {"n": 1, "mean": 100.0, "low": 100.0, "high": 100.0}
    text = format_report(summary)
    assert "crossed 0.9: 1/2 seeds (seed 0: 1.8 min, v100; seed 1: not crossed)" in text
    assert "two-sided 95% Student-t over seeds" in text.splitlines()[0]


def test_arguments_a_run_must_end_and_a_config_must_evaluate(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--seeds", "2"])
    assert "give --minutes and/or --max-steps" in capsys.readouterr().err
    assert main(["--seeds", "1", "--max-steps", "1"]) == 2  # the built-in defaults evaluate nothing
    assert "the config evaluates nothing: set eval.every_versions > 0" in capsys.readouterr().err


def test_from_reports_seeds_run_separately_as_one_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for out, seed in (("a", 0), ("b", 1)):
        log = tmp_path / out / f"seed{seed}" / "logs" / "eval.jsonl"
        log.parent.mkdir(parents=True)
        log.write_text("".join(json.dumps(row) + "\n" for row in RUNS[seed]) + '{"event": "eval", "vers')
    argv = ["--from", str(tmp_path / "a"), "--from", str(tmp_path / "b"), "--bucket-versions", "50"]
    assert main([*argv, "--minutes", "3", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    expected = summarise(RUNS, mode="greedy", threshold=0.9, minutes=3, bucket_versions=50)
    assert {k: v for k, v in summary.items() if k != "command"} == expected  # the cut last line is skipped

    assert main([*argv, "--from", str(tmp_path / "a")]) == 2
    assert "seed 0 appears twice" in capsys.readouterr().err
    assert main(["--from", str(tmp_path)]) == 2
    assert f"{tmp_path}: no seed<s>/logs/eval.jsonl" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--from", str(tmp_path / "a"), "--seeds", "2"])
    assert "--from reports finished runs" in capsys.readouterr().err


@pytest.mark.integration
@pytest.mark.slow
def test_smoke_two_seeds_of_a_tiny_daemon(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sets = [s for item in TINY for s in ("--set", item)]
    argv = [
        "--config", str(Path(__file__).resolve().parents[2] / "examples" / "guess_number.toml"),
        "--seeds", "2", "--max-steps", "2", "--bucket-versions", "1", "--out", str(tmp_path), "--json",
        *sets, "--set", "eval.every_versions=1", "--set", "eval.tasks=2",
        "--set", "eval.max_engine_share=1",  # an evaluation every version: no budget spacing them out
    ]  # fmt: skip
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["seeds"] == [0, 1] and summary["mode"] == "greedy"
    assert json.loads((tmp_path / "summary.json").read_text())["seeds"] == [0, 1]
    assert summary["per_minute"][-1]["interval"]["n"] == 2  # both seeds evaluated by their last minute
    assert [b["at"] for b in summary["per_version"]][:1] == [1.0]
    for seed in (0, 1):
        rows = [
            json.loads(line)
            for line in (tmp_path / f"seed{seed}" / "logs" / "eval.jsonl").read_text().splitlines()
        ]
        assert rows[0]["version"] == 0 and all(r["tasks"] == 2 for r in rows)
        config = (tmp_path / f"seed{seed}" / "config.toml").read_text()
        assert f"seed = {seed}\n" in config  # run.seed differs per run; eval.seed is the config's
        assert "seed = 1000003" in config
        # The run's budgets: the learner's two steps, and the engines' CPU share while it ran.
        budgets = (tmp_path / f"seed{seed}" / "logs" / "budgets.txt").read_text()
        assert budgets.startswith(f"seed {seed}: learner: 2 steps (") and "engines: idle " in budgets


def test_a_seed_that_outlives_the_sigterm_grace_is_killed_and_its_evaluations_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A daemon mid-step when its minutes end may not exit within the grace: the bench used to raise
    TimeoutExpired there and leave the remaining seeds unrun."""
    import signal
    import subprocess

    from pipeline.tools.bench import learning_curve

    row = {"event": "eval", "elapsed_s": 30.0, "version": 2, "greedy": {"success": 0.5}}
    signals: list[str] = []

    class Stubborn:
        """A daemon that has written one evaluation and ignores SIGTERM."""

        returncode: int | None = None
        pid = -1  # no process has it: the engines' CPU sampler finds no child

        def __init__(self, argv: list[str], **_: Any) -> None:
            logs = Path(argv[argv.index("--run-dir") + 1]) / "logs"
            logs.mkdir(parents=True)
            (logs / "eval.jsonl").write_text(json.dumps(row) + "\n")

        def poll(self) -> int | None:
            return self.returncode

        def send_signal(self, sig: int) -> None:
            signals.append(signal.Signals(sig).name)

        def wait(self, timeout: float | None = None) -> int:
            if self.returncode is None:
                raise subprocess.TimeoutExpired("rollwise run", timeout or 0.0)
            return self.returncode

        def kill(self) -> None:
            signals.append("SIGKILL")
            self.returncode = -signal.SIGKILL

    monkeypatch.setattr(learning_curve.subprocess, "Popen", Stubborn)
    rows = learning_curve.run_seed(None, 3, tmp_path, minutes=0.0, max_steps=None, overrides=[], grace_s=0.01)
    assert rows == [row]
    assert signals == ["SIGTERM", "SIGKILL"]
    assert "seed 3: no exit 0 s after SIGTERM; killed" in capsys.readouterr().err
