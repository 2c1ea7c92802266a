"""Smoke test of `rollwise bench actors` on a tiny workload (real child server, real HTTP)."""

from __future__ import annotations

import json

import pytest

from envs.api import Action
from pipeline.tools.bench import runner_overhead as actors


def test_bench_actors_runs_both_sides_and_reports_a_ratio(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--episodes", "10", "--turns", "3", "--group-size", "4", "--repeats", "1", "--no-pin", "--json"]
    assert actors.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    # 10 episodes in groups of 4, 4 and 2; every one of them takes exactly 3 turns.
    assert report["runner"]["turns"] == 30 and report["bare"]["turns"] == 30
    assert report["transport"]["turns"] == 30  # the bare loop again, through rollwise's HTTP client
    sizes = report["runner"]["payload_sizes"]
    assert len(sizes) == 3 and sizes[0] < sizes[1] < sizes[2]  # the buffer grows every turn
    assert report["ratio"] == pytest.approx(report["runner"]["turns_per_s"] / report["bare"]["turns_per_s"])
    unique = report["unique"]
    assert unique["runner"]["turns"] == 30 and unique["bare"]["turns"] == 30
    assert report["meets_goal"] == (min(report["ratio"], unique["ratio"]) >= 0.6)
    assert report["runner"]["overhead_p50_us"] <= report["runner"]["overhead_p99_us"]
    # A prefix cache that sees a whole group prefills far less than the requests' whole prompts.
    for section in (report, unique):
        assert 0 < section["prefill_per_generated_cached"] < section["prefill_per_generated_uncached"]
    text = actors.format_report(report)
    assert "ratio runner/bare" in text and "p99" in text and "replies never repeat" in text
    assert "prefill tokens per generated token" in text
    assert "runner's own CPU per turn above its transport" in text and "transport " in text


def test_prefill_tokens_counts_a_groups_first_prompt_once_and_then_what_each_turn_appended() -> None:
    # Requests start where a generated run starts: at 3 (prompt of 3 ids) and at 7 (after 2 generated
    # ids and 2 appended ones).
    mask = [0, 0, 0, 1, 1, 0, 0, 1]
    uncached, cached = actors.prefill_tokens([[(3, mask), (3, mask)]])
    assert uncached == 2 * (3 + 7)
    # Episode 0: the prompt (3), then the 2 appended ids; episode 1: its cached prompt's last token (1),
    # then its own 2 appended ids.
    assert cached == (3 + 2) + (1 + 2)


def test_bench_actors_rejects_a_non_positive_count(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        actors.main(["--episodes", "0"])
    assert "--episodes" in capsys.readouterr().err


async def test_echo_env_ends_after_its_turns() -> None:
    env = actors.EchoEnv(turns=2)
    task = next(env.tasks(0))
    assert await env.reset(task) == [{"role": "user", "content": actors.ECHO_PROMPT}]
    first = await env.step(Action(text="hi"))
    second = await env.step(Action(text="ho"))
    assert (first.done, first.messages) == (False, [{"role": "user", "content": "hi"}])
    assert (second.done, second.outcome) == (True, 1.0)


async def test_echo_env_with_unique_replies_never_says_the_same_thing_twice() -> None:
    replies = []
    for _ in range(2):
        env = actors.EchoEnv(turns=3, unique=True)
        await env.reset(next(env.tasks(0)))
        for _ in range(2):
            replies.append((await env.step(Action(text="hi"))).messages[0]["content"])
    assert len(set(replies)) == 4 and all(r.startswith("hi #") for r in replies)


def test_bench_actors_agent_mode_compares_the_endpoint_with_the_native_runner(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = [
        "--agent",
        "--episodes",
        "6",
        "--turns",
        "2",
        "--group-size",
        "3",
        "--repeats",
        "1",
        "--no-pin",
        "--json",
    ]
    assert actors.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    # The same 6 x 2 conversation on each side; an agent side that split a trajectory would have raised.
    sides = ("native", "sdk", "http", "none", "sdk_1w", "sdk_2w")
    assert [report[side]["turns"] for side in sides] == [12] * 6
    for side in sides[1:]:
        assert report[f"ratio_{side}"] == pytest.approx(
            report[side]["turns_per_s"] / report["native"]["turns_per_s"]
        )
    # The workers ran the agents: they used CPU in the measured window (the in-loop side has no workers).
    assert report["sdk_1w"]["worker_cpu_us_per_turn"] > 0 and report["sdk_2w"]["worker_cpu_us_per_turn"] > 0
    assert report["sdk"]["worker_cpu_us_per_turn"] == 0
    assert report["meets_goal"] == (report["ratio_none"] >= 0.5)
    assert report["sdk_alone_cpu_us_per_request"] > 0
    text = actors.format_agent_report(report)
    assert (
        "agent, openai SDK client" in text and "agent, no client" in text and "agent/native turns/s" in text
    )
    assert "agent, SDK, 2 workers" in text and "SDK agent in agent worker processes" in text
