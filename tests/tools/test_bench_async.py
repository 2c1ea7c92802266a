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
    # The books: every generated token is trained, wasted by a cause, or still unconsumed at the end
    # (in the spool, or in groups the drain cancelled); η = 0 wastes nothing to staleness.
    for arm in (sync, overlapped):
        assert (
            arm.trained_tokens > 0
            and arm.trained_tokens + sum(arm.wasted_tokens.values()) <= arm.generated_tokens
        )
        assert set(arm.wasted_tokens) == {"stale", "rejected", "cut", "aborted", "failed", "lost"}
    assert sync.wasted_tokens["stale"] == 0
    assert (overlapped.wasted_tokens["stale"] > 0) == (overlapped.dropped_stale > 0)
    # The learner is modelled at 0.1 s a step: it allows 36,000 steps/h; the engines' bound comes from
    # their busy token rate; the efficiency is achieved over the lower one.
    assert sync.bounds.learner_steps_per_hour == pytest.approx(36000.0)
    assert sync.bounds.engine_steps_per_hour is not None and sync.bounds.engine_steps_per_hour > 0
    assert sync.efficiency == pytest.approx(sync.steps_per_hour / sync.bounds.bound)
    assert 0.0 < sync.efficiency < overlapped.efficiency <= 1.05  # a rate measured over a short run


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
    for arm in report["results"]:
        assert arm["binding"] in ("learner", "engines")
        assert arm["efficiency"] == pytest.approx(arm["steps_per_hour"] / arm["bound_steps_per_hour"])
        assert arm["bounds"]["learner_steps_per_hour"] == pytest.approx(36000.0)
        assert 0.0 <= arm["waste_share"] < 1.0
        # What the engine delivered: at least about the latency model's 2 ms a token (a busy host adds).
        assert 0.001 < arm["delivered_per_token_s"] < 0.01


def test_the_table_names_the_binding_resource_and_the_waste_by_cause(
    capsys: pytest.CaptureFixture[str],
) -> None:
    main(["--seconds", "1.0", "--step-s", "0.1", "--median-tokens", "8", "--max-new-tokens", "30"])
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if "binds" in line)
    assert lines[header].split()[:5] == ["eta", "binds", "bound/h", "efficiency", "wasted"]
    for line in lines[header + 1 : header + 3]:
        eta, binds, *_ = line.split()
        assert eta in ("0", "2") and binds in ("learner", "engines")
        assert "generated)" in line
