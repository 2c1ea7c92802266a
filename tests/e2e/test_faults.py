"""Faults and bad input against the real daemon: kill -9, a dying engine, a flaky environment, a
corrupt spool, a bad config. Each test states what must survive and checks it on disk or in /metrics.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from envs.api import Action, EnvError, StepResult
from envs.guess_number import GuessNumberEnv
from pipeline.supervisor.observability.run_health.findings import ranked
from pipeline.supervisor.observability.run_health.health_checks import examine
from pipeline.supervisor.observability.run_health.run_view import load
from pipeline.transport.spool import read_group_file
from tests.e2e.test_run_e2e import REPO, TINY, DaemonRun, checkpoint_state, daemons, tiny_model

__all__ = ["FlakyEnv", "daemons", "tiny_model"]  # re-exported fixtures are used by name


class FlakyEnv(GuessNumberEnv):
    """guess-number whose step() fails on ~10% of calls: raises, hangs past the step timeout, or returns
    garbage (not a StepResult), chosen by a private RNG so the test does not depend on global state."""

    def __init__(self, fault_rate: float = 0.1, **options: int) -> None:
        super().__init__(**options)
        self.spec = dataclasses.replace(self.spec, step_timeout_s=0.5, episode_timeout_s=10.0)
        self.fault_rate = fault_rate
        self._rng = random.Random()

    async def step(self, action: Action) -> StepResult:
        if self._rng.random() < self.fault_rate:
            fault = self._rng.choice(["raise", "hang", "garbage"])
            if fault == "raise":
                raise EnvError("FlakyEnv: injected failure")
            if fault == "hang":
                await asyncio.sleep(30)
            garbage: Any = "garbage"
            return garbage
        return await super().step(action)


def _model_override(model: Path) -> str:
    return f"model.path={json.dumps(str(model))}"


def _child_pids(pid: int) -> list[int]:
    """Direct children of `pid` (Linux /proc)."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        found.extend(int(p) for p in text)
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except FileNotFoundError:
        return ""


@pytest.fixture
def run_dir(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "run"


def _checkpointed_step(run_dir: Path) -> int:
    return int(checkpoint_state(run_dir)["step"]) if (run_dir / "checkpoints" / "latest").exists() else 0


def _lineage_group_ids(run_dir: Path) -> list[str]:
    """Group ids consumed along the checkpoint chain on disk (each step dir records the ids consumed
    since the previous checkpoint; a resumed learner overwrites the steps it redoes)."""
    ids: list[str] = []
    for step_dir in sorted((run_dir / "checkpoints").glob("step*"), key=lambda p: int(p.name[4:])):
        state = json.loads((step_dir / "state.json").read_text())
        ids.extend(state["consumed"]["group_ids"])
    return ids


@pytest.mark.integration
@pytest.mark.slow
def test_kill_9_at_random_moments_loses_no_durable_group_and_trains_none_twice(
    run_dir: Path, tiny_model: Path, daemons: list[DaemonRun]
) -> None:
    rng = random.Random(5)
    # Keep every checkpoint (and so every spool file: retention prunes only what the oldest kept
    # checkpoint consumed), so the test can account for each group ever written.
    overrides = [
        *TINY,
        _model_override(tiny_model),
        "learner.checkpoint_every=2",
        "learner.keep_checkpoints=1000",
    ]
    resumes: list[tuple[int, int]] = []  # (checkpointed step at start, first step the run reported)
    for _ in range(3):
        checkpointed = _checkpointed_step(run_dir)
        run = DaemonRun(run_dir, overrides)
        daemons.append(run)
        run.wait_steps(1)
        resumes.append((checkpointed, run.steps()[0]))
        # A random moment within the next steps: mid-episode, mid-spool-write, mid-step or mid-checkpoint.
        run.wait_steps(1 + rng.randint(0, 2))
        time.sleep(rng.uniform(0.0, 1.5))
        run.proc.send_signal(signal.SIGKILL)
        run.wait(timeout_s=10)
    final = DaemonRun(run_dir, overrides, max_steps=_checkpointed_step(run_dir) + 2)
    daemons.append(final)
    assert final.wait(timeout_s=120) == 0, final.tail()

    for checkpointed, first in resumes:
        assert first == checkpointed + 1, "the learner's step counter must resume from the last checkpoint"
    trained = _lineage_group_ids(run_dir)
    assert len(trained) == len(set(trained)), "a consumed group was trained twice"
    consumed = checkpoint_state(run_dir)["consumed"]
    written = {seq: read_group_file(path)[0] for seq, path in _spool_files(run_dir / "spool")}
    # Every fsync'd group up to the resume point (the watermark and the seqs consumed after it) was
    # consumed exactly once along the chain (trained or dropped with a reason); the others wait in the
    # spool for the next start. None is lost.
    assert sorted(written) == list(range(1, max(written) + 1)), "a spool sequence number is missing"
    assert {gid for seq, gid in written.items() if _consumed(consumed, seq)} == set(trained)


def _consumed(consumed: dict[str, Any], seq: int) -> bool:
    """Whether a checkpoint's `consumed` record (learner.spool_cursor) covers spool seq `seq`."""
    return seq <= int(consumed["last_seq"]) or seq in consumed.get("after", [])


def _spool_files(spool: Path) -> list[tuple[int, Path]]:
    return sorted((int(p.name[1:13]), p) for p in spool.glob("g*.arrow"))


@pytest.mark.integration
@pytest.mark.slow
def test_killed_engine_costs_its_episodes_and_is_restarted(
    run_dir: Path, tiny_model: Path, daemons: list[DaemonRun]
) -> None:
    # Health checks every second: the frozen engine below is ejected after 3 s, not 15.
    run = DaemonRun(run_dir, [*TINY, _model_override(tiny_model), "engine.health_check_interval_s=1"])
    daemons.append(run)
    run.wait_steps(1)
    engines = [p for p in _child_pids(run.proc.pid) if "pipeline.engine" in _cmdline(p)]
    assert len(engines) == 1
    os.kill(engines[0], signal.SIGKILL)
    steps_at_kill = len(run.steps())
    run.wait_for(
        lambda r: r.metric("rollwise_process_restarts_total", {"component": "engine"}) >= 1, 30, "restart"
    )
    run.wait_steps(steps_at_kill + 2, timeout_s=90)
    assert run.metric("rollwise_episodes_total", {"reason": "engine_error"}) >= 1

    def new_engines() -> list[int]:
        return [p for p in _child_pids(run.proc.pid) if "pipeline.engine" in _cmdline(p)]

    # /proc can miss a child for a moment (its cmdline is read while the process list is walked).
    run.wait_for(lambda r: len(new_engines()) == 1, 30, "one engine process")
    assert new_engines() != engines

    # Frozen instead of killed, it stops answering without exiting: the pool ejects it, nothing is
    # generated, the learner runs dry. The advisor, on the live daemon, calls the run stalled (after the
    # limit an operator may set) and says the engines stopped answering.
    os.kill(new_engines()[0], signal.SIGSTOP)
    try:
        run.wait_for(lambda r: r.metric("rollwise_engines_serving") == 0, 45, "the frozen engine ejected")
        step_log = run_dir / "logs" / "steps.jsonl"
        run.wait_for(lambda r: time.time() - step_log.stat().st_mtime > 3.0, 45, "the learner to run dry")
        view = load(run_dir, metrics_text=run.scrape())
        found = ranked(examine(dataclasses.replace(view, stall_after_s=2.0)))
        assert found and found[0].check == "stalled", found
        assert any("rollwise_engines_serving = 0" in line for line in found[0].evidence), found[0]
    finally:
        os.kill(new_engines()[0], signal.SIGCONT)
    run.wait_for(lambda r: r.metric("rollwise_engines_serving") == 1, 45, "the thawed engine back")
    run.signal(signal.SIGTERM)
    assert run.wait(timeout_s=60) == 0, run.tail()


@pytest.mark.integration
@pytest.mark.slow
def test_flaky_environment_costs_only_its_episodes_and_a_stopped_learner_stops_admission(
    run_dir: Path, tiny_model: Path, daemons: list[DaemonRun]
) -> None:
    """A flaky environment costs its episodes only. Then the learner is frozen (SIGSTOP) for a while:
    admission stops at the staleness bound instead of generating on (no runaway, no livelock), and once it
    thaws the run ends at run.max_steps with every trained token within max_staleness and the books of
    generated tokens balanced to the token: trained, wasted by cause, or updating no weight. The
    advisor's rules (`rollwise doctor`) then name the environment first."""
    overrides = [*TINY, _model_override(tiny_model), "env.name='tests.e2e.test_faults:FlakyEnv'"]
    run = DaemonRun(run_dir, overrides, max_steps=6)
    daemons.append(run)
    run.wait_steps(3, timeout_s=120)
    text = run.scrape()  # one scrape: the counters below are read at one moment
    failed = run.metric("rollwise_episodes_total", {"reason": "env_error"}, text=text) + run.metric(
        "rollwise_episodes_total", {"reason": "timeout"}, text=text
    )
    total = run.metric("rollwise_episodes_total", text=text)
    assert failed >= 1
    assert failed / total < 0.6  # 10% of steps, up to 5 steps an episode: most episodes survive
    assert run.metric("rollwise_generated_tokens_wasted_total", {"cause": "failed"}, text=text) > 0

    learner = [p for p in _child_pids(run.proc.pid) if "learner.process" in _cmdline(p)]
    assert len(learner) == 1, [_cmdline(p) for p in _child_pids(run.proc.pid)]
    os.kill(learner[0], signal.SIGSTOP)
    try:
        time.sleep(3.0)  # the groups admitted before the freeze finish (a hung step times out at 0.5 s)
        admitted = run.metric("rollwise_groups_admitted_total")
        time.sleep(2.0)
        assert run.metric("rollwise_groups_admitted_total") == admitted, "admission ran on past its bound"
    finally:
        os.kill(learner[0], signal.SIGCONT)
    assert run.wait(timeout_s=120) == 0, run.tail()
    assert run.steps()[-1] == 6

    steps = run.snapshot("step")
    assert max(int(lag) for e in steps for lag in e["staleness"]) <= 1  # async.max_staleness in TINY
    trained = sum(int(tokens) for e in steps for tokens in e["staleness"].values())
    last = run.snapshot("status")[-1]  # the status after the drain (StatusReport.final)
    wasted = last["wasted_tokens"]
    assert wasted["failed"] > 0
    books = trained + sum(wasted.values()) + last["no_signal_tokens"]
    assert last["generated_tokens"] == books, (last, trained)
    # The advisor, from what the stopped daemon left (its logs and its last metrics snapshot), names the
    # broken environment first.
    found = ranked(examine(load(run_dir)))
    assert found and found[0].check == "env_failing", found


@pytest.mark.integration
@pytest.mark.slow
def test_corrupt_and_truncated_spool_files_are_quarantined_and_training_continues(
    run_dir: Path, tiny_model: Path, daemons: list[DaemonRun]
) -> None:
    overrides = [*TINY, _model_override(tiny_model)]
    first = DaemonRun(run_dir, overrides, max_steps=1)
    daemons.append(first)
    assert first.wait(timeout_s=120) == 0, first.tail()
    spool = run_dir / "spool"
    consumed = checkpoint_state(run_dir)["consumed"]
    # The next two groups the learner will read: one overwritten with garbage, one cut in half (they
    # may exist already, written during the first run's drain, or not yet).
    unconsumed = (s for s in itertools.count(int(consumed["last_seq"]) + 1) if not _consumed(consumed, s))
    garbage, truncated = (spool / f"g{s:012d}.arrow" for s in itertools.islice(unconsumed, 2))
    whole = sorted(spool.glob("g*.arrow"))[0].read_bytes()
    garbage.write_bytes(b"this is not arrow at all")
    truncated.write_bytes(whole[: len(whole) // 2])
    second = DaemonRun(run_dir, overrides, max_steps=3)
    daemons.append(second)
    assert second.wait(timeout_s=120) == 0, second.tail()
    assert second.steps() == [2, 3]
    reasons = {p.name: p.read_text() for p in (spool / "quarantine").glob("*.reason")}
    assert sorted(reasons) == [garbage.name + ".reason", truncated.name + ".reason"]
    assert all(text.strip() for text in reasons.values())
    assert any(e.get("event") == "message" and "quarantined" in str(e.get("text")) for e in second.events)


def test_bad_config_exits_2_naming_the_key_and_creates_nothing(tmp_path: Path) -> None:
    run_dir = tmp_path / "never"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline.cli",
            "run",
            "--run-dir",
            str(run_dir),
            "--set",
            "learner.loss.clip_low=-1",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "learner.loss.clip_low" in proc.stderr
    assert not run_dir.exists()
