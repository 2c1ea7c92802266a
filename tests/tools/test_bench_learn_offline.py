"""`rollwise bench learn --offline-eval`: evaluation off the training clock (snapshots kept while the daemon
trains, scored after it), its report of finished runs, and a smoke run of a tiny daemon."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pipeline.contracts.config import load_config
from pipeline.tools.bench.learning_curve import (
    collect_runs,
    evaluates_during_training,
    evaluation_off,
    main,
    parse_args,
    read_manifest,
)
from tests.e2e.test_run_e2e import TINY

REPO = Path(__file__).resolve().parents[2]


def _row(version: int, at_s: float, success: float) -> dict[str, Any]:
    return {"event": "eval", "version": version, "elapsed_s": at_s, "greedy": {"success": success}}


def test_offline_eval_turns_every_evaluation_trigger_off() -> None:
    cfg = load_config(REPO / "examples" / "smollm2_arithmetic.toml", evaluation_off())
    assert "eval.every_versions=0" in evaluation_off() and not evaluates_during_training(cfg)
    assert evaluates_during_training(load_config(REPO / "examples" / "smollm2_arithmetic.toml"))


def test_a_scored_run_is_reported_from_its_snapshots_not_its_eval_log(tmp_path: Path) -> None:
    scored, live = tmp_path / "seed0", tmp_path / "seed1"
    (scored / "snapshots").mkdir(parents=True)
    (scored / "logs").mkdir()
    (scored / "logs" / "eval.jsonl").write_text("")  # the daemon evaluated nothing
    rows = [_row(3, 60.0, 0.5), _row(0, 0.0, 0.25)]  # scored out of order
    (scored / "snapshots" / "scores.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (live / "logs").mkdir(parents=True)
    (live / "logs" / "eval.jsonl").write_text(json.dumps(_row(0, 5.0, 0.75)) + "\n")
    runs = collect_runs([tmp_path])
    assert runs == {0: [rows[1], rows[0]], 1: [_row(0, 5.0, 0.75)]}


def test_offline_eval_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse_args(["--seeds", "1", "--minutes", "2", "--offline-eval"])
    assert args.offline_eval and args.snapshot_every_s == 30.0 and args.eval_threads is None
    with pytest.raises(SystemExit):
        parse_args(["--seeds", "1", "--minutes", "2", "--offline-eval", "--snapshot-every-s", "0"])
    assert "--snapshot-every-s must be > 0" in capsys.readouterr().err


@pytest.mark.integration
@pytest.mark.slow
def test_smoke_a_tiny_daemon_scored_off_the_clock(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sets = [s for item in TINY for s in ("--set", item)]
    argv = [
        "--config", str(REPO / "examples" / "guess_number.toml"), "--seeds", "1", "--max-steps", "4",
        "--bucket-versions", "1", "--out", str(tmp_path), "--json", "--offline-eval",
        "--snapshot-every-s", "1", "--eval-threads", "1", *sets, "--set", "eval.tasks=2",
    ]  # fmt: skip
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["seeds"] == [0]
    run_dir = tmp_path / "seed0"
    assert not (run_dir / "logs" / "eval.jsonl").exists() or not (run_dir / "logs" / "eval.jsonl").read_text()
    kept = read_manifest(run_dir / "snapshots")
    assert kept[0].version == 0 and kept[0].at_s == 0.0 and len(kept) >= 2
    assert [s.version for s in kept] == sorted({s.version for s in kept})  # each version kept once, in order
    assert kept[-1].version == 4  # the version it ended with
    scored = [json.loads(line) for line in (run_dir / "snapshots" / "scores.jsonl").read_text().splitlines()]
    assert [r["version"] for r in scored] == [s.version for s in kept]
    assert all(r["tasks"] == 2 and r["greedy"]["episodes"] == 2 for r in scored)
    assert summary["per_minute"][-1]["interval"]["n"] == 1
