"""Smoke test of `rollwise bench async` on a short run (the real stack, a latency-modelled engine)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.tools.bench.async_speedup import BenchParams, CharTokenizer, main, run_bench
from pipeline.tools.fake_sglang import LatencyModel


def test_char_tokenizer_round_trips_template_text() -> None:
    tok = CharTokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert text == "user: hi<|end|>\nassistant: "
    ids = tok.encode(text)
    assert ids.count(tok.eos_token_id) == 1
    assert tok.decode(ids) == text
    with pytest.raises(ValueError, match="code point"):
        tok.encode("€")


async def test_eta_zero_trains_only_fresh_tokens_and_eta_two_stays_within_bound(tmp_path: Path) -> None:
    params = BenchParams(
        seconds=2.5,
        batch_groups=2,
        group_size=2,
        max_new_tokens=40,
        max_concurrent=6,
        step_s=0.1,
        median_tokens=10,
    )
    model = LatencyModel(per_token_s=0.001, prefill_s=0.005, load_s=0.01)
    sync, overlapped = await run_bench(params, model, [0, 2])
    assert sync.steps >= 2 and overlapped.steps >= 2
    assert (sync.mean_staleness, sync.max_staleness, sync.dropped_stale) == (0.0, 0, 0)
    assert overlapped.max_staleness <= 2
    assert sync.trained_groups == sync.steps * params.batch_groups
    assert 0.0 <= sync.learner_idle_fraction <= 1.0
    assert 0.0 < sync.actor_idle_fraction <= 1.0  # η = 0 holds actors back while the learner trains
    # η = 0: the engine has nothing to do while the learner trains (0.1 s of every step); η = 2 keeps it
    # busier.
    assert 0.05 < sync.engine_idle_fraction < 1.0
    assert 0.0 <= overlapped.engine_idle_fraction < sync.engine_idle_fraction


def test_main_prints_json_report(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        ["--seconds", "1.5", "--json", "--step-s", "0.1", "--median-tokens", "8", "--max-new-tokens", "30"]
    )
    report = json.loads(capsys.readouterr().out)
    assert [r["eta"] for r in report["results"]] == [0, 2]
    assert code == (0 if report["speedup"] >= report["goal"] else 1)
    # A learner that never waits makes 3600 / step_s steps an hour: the most any η can reach.
    eta0 = report["results"][0]["steps_per_hour"]
    assert report["ceiling"] == pytest.approx(36000.0 / eta0)
