"""Smoke test of `rollwise bench engine` on the tiny preset: every section runs and its numbers hold
together (the prefix cache's counts are exact in fp32, where cached and uncached outputs agree)."""

from __future__ import annotations

import json

import pytest
import torch

from pipeline.tools.bench.engine_throughput import main


def test_bench_engine_reports_throughput_prefix_cache_and_agreement(
    capsys: pytest.CaptureFixture[str],
) -> None:
    threads = torch.get_num_threads()
    try:
        code = main(
            [
                "--dtype", "float32", "--threads", "1", "--concurrency", "1", "3", "--max-new-tokens", "4",
                "--repeats", "1", "--sequential-requests", "1", "--episodes", "2", "--group", "2",
                "--turns", "2", "--mt-prompt-len", "20", "--mt-new-tokens", "5", "--reply-len", "3",
                "--agreement", "2", "--json",
            ]
        )  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["dtype"] == "float32" and result["dtype_reason"] == "--dtype given"
    assert [row["concurrency"] for row in result["engine"]] == [1, 3]
    assert [row["tokens"] for row in result["engine"]] == [4, 12]
    assert all(row["ratio"] > 0 and row["baseline_tokens_per_s"] > 0 for row in result["engine"])
    turns = result["multi_turn"]
    # Turn 1: the group's second episode reuses all but the last prompt token (19). Turn 2: each episode
    # reuses its whole first turn but the last sampled token (20 + 5 - 1), then prefills the reply.
    assert turns["requests"] == 4 and turns["prompt_tokens"] == 2 * 20 + 2 * (20 + 5 + 3)
    assert turns["cached_tokens"] == 19 + 2 * 24 and turns["hits"] == 3
    assert turns["hit_rate"] == pytest.approx(67 / 96)
    assert turns["identical_outputs"] == "4/4"
    agreement = {a["dtype"]: a for a in result["agreement"]}
    assert agreement["float32"]["tokens"] == 8 and agreement["float32"]["max_abs"] < 1e-4
    assert 0 < agreement["bfloat16"]["mean_abs"] < 0.05
