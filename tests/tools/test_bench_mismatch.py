"""`rollwise bench mismatch` on the tiny preset: fp32 engine and fp32 learner agree to float rounding, a bf16
engine does not, and the correction takes the step-start mismatch out of the clip band."""

from __future__ import annotations

import json

import pytest
import torch

from pipeline.tools.bench.mismatch_clip import PAIRINGS, main


@pytest.mark.slow
def test_bench_mismatch_reports_agreement_and_clip_with_and_without_correction(
    capsys: pytest.CaptureFixture[str],
) -> None:
    threads = torch.get_num_threads()
    try:
        code = main(
            ["--preset", "tiny", "--prompts", "2", "--group-size", "4", "--max-new-tokens", "6", "--threads",
             "1", "--json"]
        )  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    rows = {(r["engine"], r["learner"]): r for r in report["agreement"]}
    assert list(rows) == list(PAIRINGS)
    same = rows[("float32", "fp32")]
    assert same["sequences"] == 8 and same["token_abs_max"] < 1e-4 and same["outside_band"] == 0.0
    assert 1e-4 < rows[("bfloat16", "fp32")]["token_abs_mean"] < 0.05
    assert all(r["ratio_min"] <= r["ratio_p05"] <= r["ratio_p95"] <= r["ratio_max"] for r in rows.values())
    clip = {(c["engine"], c["learner"], c["correction"]): c for c in report["clip"]}
    assert len(clip) == 2 * len(PAIRINGS)
    # With the correction the first mini-batch's ratio is exactly 1: only the updates move it.
    for engine, learner in PAIRINGS:
        on, off = clip[(engine, learner, "on")], clip[(engine, learner, "off")]
        assert on["seq_log_ratio_abs_mean"] <= off["seq_log_ratio_abs_mean"] + 1e-6
    assert clip[("float32", "fp32", "off")]["is_weight_mean"] == 1.0
