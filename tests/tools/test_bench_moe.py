"""`rollwise bench moe`: the per-variant summary of known step metrics and eval rows, its report, the
arguments it refuses, and a smoke run of the real command in its short mode (3 tiny MoE daemons)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from pipeline.tools.bench.moe_comparison import (
    BENCH_SETTINGS,
    VARIANTS,
    collect,
    format_report,
    main,
    overrides_for,
    parse_args,
    seed_means,
    summarise_variant,
)


def _eval(version: int, success: float) -> dict[str, Any]:
    return {"event": "eval", "version": version, "elapsed_s": 10.0 * version, "greedy": {"success": success}}


def _runs() -> dict[int, tuple[list[dict[str, Any]], list[dict[str, Any]]]]:
    return {
        0: (
            [
                {"moe_routing_change": 0.1, "clip_fraction": 0.5, "clip_fraction_token": 0.2},
                {"moe_routing_change": 0.3, "clip_fraction": 0.5, "clip_fraction_token": None},
            ],
            [_eval(10, 0.25), _eval(20, 0.5)],
        ),
        1: ([{"moe_routing_change": 0.4, "clip_fraction": 1.0}], [_eval(10, 0.75)]),
    }


def test_a_seeds_value_is_its_mean_over_the_steps_that_report_it() -> None:
    means = seed_means(_runs()[0][0])
    assert means == {
        "moe_routing_change": pytest.approx(0.2),
        "clip_fraction": 0.5,
        "clip_fraction_token": 0.2,
    }


def test_a_variant_is_summarised_over_seeds_with_t_intervals() -> None:
    summary = summarise_variant(_runs(), bucket_versions=10)
    change = summary["metrics"]["moe_routing_change"]
    half = 12.706 * math.sqrt(((0.2 - 0.3) ** 2 + (0.4 - 0.3) ** 2) / 1) / math.sqrt(2)
    assert change["n"] == 2 and change["mean"] == pytest.approx(0.3)
    assert change["low"] == 0.0 and change["high"] == 1.0  # clipped: a share stays in [0, 1]
    assert half > 0.3
    assert summary["metrics"]["clip_fraction_token"] == {"n": 1, "mean": 0.2, "low": 0.2, "high": 0.2}
    assert summary["metrics"]["router_mismatch_share"] is None
    assert summary["steps"] == [2, 1]
    # by version 10 both seeds had an evaluation (0.25, 0.75); by 20 seed 1 still only its first
    assert [p["version"] for p in summary["success_per_version"]] == [10, 20]
    assert summary["success_per_version"][0]["interval"]["mean"] == pytest.approx(0.5)
    assert summary["success_per_version"][1]["interval"]["mean"] == pytest.approx(0.625)
    assert summary["final_success"]["mean"] == pytest.approx(0.625) and summary["final_version"] == [20, 10]


def test_the_report_has_a_column_per_variant_and_a_row_per_metric() -> None:
    variants = {name: summarise_variant(_runs(), bucket_versions=10) for name in ("grpo", "gspo")}
    report = format_report({"variants": variants})
    assert "routing change / update" in report and "clipped tokens" in report
    assert report.splitlines()[1].split() == ["grpo", "gspo"]
    assert "  v10" in report and "steps per seed: grpo: [2, 1]; gspo: [2, 1]" in report


def test_the_variants_change_only_the_loss_and_replay() -> None:
    args = parse_args([])
    grpo, replay, gspo = (overrides_for(v, args) for v in ("grpo", "grpo-replay", "gspo"))
    assert grpo[: len(BENCH_SETTINGS)] == list(BENCH_SETTINGS)
    assert set(replay) - set(grpo) == {"learner.moe.routing_replay=true"}
    assert "learner.loss.clip_low=3e-4" in gspo and "learner.loss.clip_high=4e-4" in gspo
    assert "learner.loss.clip_low=0.2" in grpo and "learner.loss.clip_high=0.27" in grpo
    assert list(VARIANTS) == ["grpo", "grpo-replay", "gspo"]
    short = parse_args(["--short"])
    assert (short.seeds, short.max_steps) == (1, 2) and "learner.batch_groups=2" in overrides_for(
        "gspo", short
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--variants", "ppo"], "--variants: unknown ['ppo']"),
        (["--seeds", "0"], "must be >= 1"),
        (["--minutes", "0"], "--minutes must be > 0"),
    ],
)
def test_bad_arguments_are_refused(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


def test_a_bad_override_is_refused_before_any_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--out", str(tmp_path), "--set", "learner.moe.replay=true"]) == 2
    assert "learner.moe.replay" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_from_reads_the_runs_already_made(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    logs = tmp_path / "gspo" / "seed0" / "logs"
    logs.mkdir(parents=True)
    steps = [{"event": "step", "metrics": {"clip_fraction": 0.9, "moe_routing_change": 0.05}}]
    (logs / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps) + "{cut")
    (logs / "eval.jsonl").write_text(json.dumps(_eval(10, 0.5)) + "\n")
    assert set(collect(tmp_path, ["grpo", "gspo"])) == {"gspo"}
    assert main(["--from", str(tmp_path), "--variants", "gspo", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["variants"]["gspo"]["metrics"]["clip_fraction"]["mean"] == 0.9
    assert (tmp_path / "summary.json").is_file()


@pytest.mark.slow
@pytest.mark.integration
def test_the_short_bench_runs_every_variant_end_to_end(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--short", "--out", str(tmp_path), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert list(summary["variants"]) == ["grpo", "grpo-replay", "gspo"]
    for name, variant in summary["variants"].items():
        assert variant["steps"] == [2], name
        assert variant["metrics"]["moe_routing_change"] is not None, name
        assert variant["metrics"]["clip_fraction_token"] is not None, name
        assert variant["final_success"] is not None, name
    assert summary["variants"]["grpo-replay"]["metrics"]["router_mismatch_share"] is not None
    assert summary["variants"]["grpo"]["metrics"]["router_mismatch_share"] is None
