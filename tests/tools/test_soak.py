"""`rollwise bench soak`: its judgements on known data (books, growth, stalls) and one short chaos run of
the real daemon (SIGKILLs of the engine, the learner and the supervisor, a flaky environment)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pipeline.contracts.run_dir import RunDir, append_consumed
from pipeline.tools.bench.chaos import KillPlan
from pipeline.tools.bench.soak import longest_stalls, stale_share
from pipeline.tools.bench.soak_books import reconcile
from pipeline.tools.bench.soak_resources import daemon_processes, growth, sample_process
from pipeline.transport.spool import spool_name
from tests.e2e.test_run_e2e import REPO


def _checkpoint(
    run: RunDir,
    step: int,
    last_seq: int,
    ids: list[str],
    dropped: dict[str, str],
    after: tuple[int, ...] = (),
) -> None:
    state = {
        "format": 1,
        "step": step,
        "counters": {"policy_version": step},
        "consumed": {"last_seq": last_seq, "group_ids": ids, "after": list(after)},
        "extra": {"published_version": step, "dropped_groups": dropped},
        "rng": {},
    }
    append_consumed(run.consumed_log, state)  # the learner appends it before it commits the checkpoint
    path = run.checkpoints / f"step{step}"
    path.mkdir(parents=True)
    (path / "state.json").write_text(json.dumps(state))
    (run.checkpoints / "latest").write_text(f"step{step}\n")


def _spool(run: RunDir, *seqs: int, quarantined: tuple[int, ...] = ()) -> None:
    (run.spool / "quarantine").mkdir(parents=True, exist_ok=True)
    for seq in seqs:
        (run.spool / spool_name(seq)).write_bytes(b"x")
    for seq in quarantined:
        (run.spool / "quarantine" / spool_name(seq)).write_bytes(b"x")


def test_books_balance_across_a_redone_checkpoint_and_retention(tmp_path: Path) -> None:
    run = RunDir.at(tmp_path)
    _checkpoint(run, 2, 3, ["a", "b"], {})  # seq 2 was quarantined
    _checkpoint(run, 4, 7, ["c", "d", "e", "f"], {"d": "stale"})  # a lineage lost to a kill...
    (run.checkpoints / "step4" / "state.json").unlink()
    (run.checkpoints / "step4").rmdir()
    (run.checkpoints / "latest").write_text("step2\n")
    append_consumed(run.consumed_log, {"restored": 2})
    _checkpoint(run, 4, 6, ["c", "d", "e"], {"d": "stale", "e": "too_few_members"})  # ...redone
    _checkpoint(run, 6, 6, [], {})
    # Retention deleted step2 and step4 with their records; the ledger still holds them.
    for step in (2, 4):
        (run.checkpoints / f"step{step}" / "state.json").unlink()
        (run.checkpoints / f"step{step}").rmdir()
    (run.spool / "retention.json").parent.mkdir(parents=True, exist_ok=True)
    (run.spool / "retention.json").write_text(json.dumps({"deleted_through": 3}))
    _spool(run, 4, 5, 6, 7, 8, quarantined=(2,))
    books = reconcile(run)
    assert books.problems == []
    assert (books.written, books.consumed_seq, books.trained, books.quarantined, books.pending) == (
        8,
        6,
        3,
        1,
        2,
    )
    assert books.dropped == {"stale": 1, "too_few_members": 1}


def test_a_record_never_committed_is_superseded_by_the_restore_that_followed(tmp_path: Path) -> None:
    run = RunDir.at(tmp_path)
    _checkpoint(run, 2, 2, ["a", "b"], {})
    append_consumed(run.consumed_log, {"step": 4, "consumed": {"last_seq": 4, "group_ids": ["c", "d"]}})
    append_consumed(run.consumed_log, {"restored": 2})  # killed before step 4's checkpoint was committed
    _checkpoint(run, 5, 5, ["c", "d", "e"], {})  # the next checkpoint lands on another step
    with run.consumed_log.open("a") as f:
        f.write('{"step": 7, "cons')  # a kill mid-write: a torn last line
    _spool(run, 1, 2, 3, 4, 5)
    books = reconcile(run)
    assert books.problems == [] and books.trained_twice == []
    assert (books.written, books.consumed_seq, books.trained, books.pending) == (5, 5, 5, 0)


def test_books_count_groups_consumed_after_the_watermark_as_consumed_not_pending(tmp_path: Path) -> None:
    run = RunDir.at(tmp_path)
    # step 1 took seqs 4 and 5 (nearer their staleness deadline) while 1-3 waited; step 2 took 1 and 2
    _checkpoint(run, 1, 0, ["d", "e"], {}, after=(4, 5))
    _checkpoint(run, 2, 2, ["a", "b"], {"b": "stale"}, after=(4, 5))
    _spool(run, 1, 2, 3, 4, 5, 6, 7)
    books = reconcile(run)
    assert books.problems == []
    assert (books.written, books.consumed_seq, books.consumed_after, books.trained, books.pending) == (
        7,
        2,
        2,
        3,
        3,  # seqs 3, 6, 7
    )
    # the same chain without its `after` does not balance: two groups consumed beyond the watermark
    run2 = RunDir.at(tmp_path / "without")
    _checkpoint(run2, 1, 0, ["d", "e"], {})
    _checkpoint(run2, 2, 2, ["a", "b"], {"b": "stale"})
    _spool(run2, 1, 2, 3, 4, 5, 6, 7)
    assert any("consumed_seq is 2 with 0 consumed after it" in p for p in reconcile(run2).problems)


def test_books_name_a_group_trained_twice_and_a_lost_sequence_number(tmp_path: Path) -> None:
    run = RunDir.at(tmp_path)
    _checkpoint(run, 1, 2, ["a", "b"], {})
    _checkpoint(run, 2, 4, ["b", "c"], {})
    _spool(run, 1, 2, 4, 5)  # 3 vanished
    books = reconcile(run)
    assert books.trained_twice == ["b"]
    assert any("consumed twice" in p for p in books.problems)
    assert any("lost: [3]" in p for p in books.problems)
    assert not books.ok


def test_growth_is_judged_after_the_warmup_on_medians() -> None:
    flat = [(float(t), 100.0 + (5.0 if t == 500 else 0.0)) for t in range(0, 1200, 10)]
    g = growth(flat, warmup_s=600.0)
    assert g is not None and g.relative == 0.0 and g.samples == 60
    rising = [(float(t), 100.0 + t / 100.0) for t in range(0, 1200, 10)]  # +1 per 100 s
    g = growth(rising, warmup_s=600.0)
    assert g is not None
    assert (g.first, g.last) == (pytest.approx(106.25), pytest.approx(111.65))
    assert g.relative == pytest.approx(111.65 / 106.25 - 1.0)
    assert g.slope_per_hour == pytest.approx(36.0 / g.first, rel=1e-6)
    assert growth(rising[:50], warmup_s=600.0) is None  # nothing after the warm-up to judge


def test_the_worst_slope_is_reported_in_mib_per_hour_per_column() -> None:
    from pipeline.tools.bench.soak import _worst_mib_per_hour

    mib = 2**20
    lives = [
        {
            "rss": {"slope_per_hour": 0.01, "first": 500 * mib},
            "rss_anon": {"slope_per_hour": 0.0, "first": mib},
        },
        {"rss": {"slope_per_hour": 0.002, "first": 100 * mib}, "rss_anon": None},
    ]
    assert _worst_mib_per_hour(lives, "rss") == 5.0  # 1% an hour of 500 MiB
    assert _worst_mib_per_hour(lives, "rss_anon") == 0.0
    assert _worst_mib_per_hour([], "rss") is None


def test_a_stall_that_contains_a_restart_is_not_counted_as_outside_restarts() -> None:
    steps = [(0.0, 1), (1.0, 2), (31.0, 3), (32.0, 4), (52.0, 5)]
    assert longest_stalls(steps, kills=[10.0], starts=[]) == {
        "longest_s": 30.0,
        "longest_outside_restarts_s": 20.0,
    }


def test_kill_plan_hits_every_target_once_in_each_round() -> None:
    plan = KillPlan(every_s=10.0, seed=3)
    targets = [plan.next_target() for _ in range(9)]
    for i in range(0, 9, 3):
        assert sorted(targets[i : i + 3]) == ["engine", "learner", "supervisor"]
    assert all(5.0 <= plan.next_delay_s() <= 15.0 for _ in range(50))


def test_process_sampling_reads_this_process() -> None:
    import os

    me = sample_process(os.getpid())
    assert me is not None and me.rss_bytes > 10 * 2**20 and me.fds >= 3 and me.threads >= 1
    assert 0 < me.anon_bytes < me.rss_bytes  # the libraries' pages are the rest
    assert daemon_processes(os.getpid())[os.getpid()] == "supervisor"
    assert sample_process(2**22 + 12345) is None


@pytest.mark.integration
@pytest.mark.slow
def test_a_short_chaos_soak_survives_its_kills_and_its_books_balance(tmp_path: Path) -> None:
    out = tmp_path / "soak"
    tiny = [
        "env.group_size=4",
        "learner.batch_groups=2",
        "learner.mini_batches=1",
        "learner.checkpoint_every=1",
        "run.shutdown_grace_s=5",
    ]
    argv = [sys.executable, "-m", "pipeline.cli", "bench", "soak", "--minutes", "0.6", "--chaos"]
    argv += ["--kill-every-s", "8", "--sample-s", "1", "--warmup-minutes", "0.1", "--restart-delay-s", "0.5"]
    argv += ["--seed", "1", "--out", str(out)]
    for item in tiny:
        argv += ["--set", item]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    books = summary["books"]
    assert books["ok"], books["problems"]
    assert books["trained_twice"] == []
    assert books["trained"] > 0 and books["written"] >= books["trained"]
    assert summary["kills_survived"] >= 1, summary["kills"]
    assert summary["unexpected_exits"] == []
    assert summary["final_exit_code"] == 0
    roles = {
        p["role"]
        for line in (out / "resources.jsonl").read_text().splitlines()
        for p in json.loads(line)["procs"]
    }
    assert roles == {"supervisor", "engine", "learner"}
    samples = [
        p for line in (out / "resources.jsonl").read_text().splitlines() for p in json.loads(line)["procs"]
    ]
    # A process read the moment it starts may have no anonymous pages yet; none has more than its RSS.
    assert all(0 <= p["rss_anon"] <= p["rss"] for p in samples)
    assert sum(p["rss_anon"] > 0 for p in samples) > len(samples) / 2
    assert (out / "soak.png").stat().st_size > 10_000
    assert "BALANCED" in proc.stdout
    in_flight = summary["groups_dropped_in_flight"]
    assert in_flight >= 0
    assert summary["stale_share"] == stale_share(
        books["dropped"].get("stale", 0), in_flight, books["written"]
    )
    assert "dropped in flight" in proc.stdout
    # The advisor's word on the finished run, in the summary and printed.
    assert isinstance(summary["doctor"], list) and all(isinstance(line, str) for line in summary["doctor"])
    assert "rollwise doctor: " in proc.stdout


def test_the_stale_share_counts_groups_dropped_in_flight_among_the_groups_ended() -> None:
    assert stale_share(dropped_stale=3, dropped_in_flight=2, written=98) == 5 / 100
    assert stale_share(dropped_stale=0, dropped_in_flight=0, written=0) is None
