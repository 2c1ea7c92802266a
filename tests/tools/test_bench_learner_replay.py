"""`rollwise bench learner --replay`: a real learner process trains three steps on a tiny model; the replay
runs the same steps alone and must reproduce their losses bit for bit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pipeline.tools.bench.learner_replay import (
    ReplayError,
    StepPair,
    daemon_steps,
    main,
    replay,
    summary,
)
from pipeline.transport.spool import SpoolWriter
from tests.learner.process.test_learner_worker import Worker, event_is, write_group

B = 2
# No checkpoint within the three steps, so the spool keeps every group (the learner prunes what its
# retained checkpoints consumed).
CONFIG = """
[env]
group_size = 2
[learner]
batch_groups = 2
mini_batches = 2
checkpoint_every = 100
device = "cpu"
[learner.optim]
lr = 0.01
[async]
max_staleness = 3
sync_every_steps = 1
"""


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """A run directory whose learner trained 3 steps: its spool, config and logs/steps.jsonl (written from
    the learner's step events, as the supervisor writes them)."""
    run_dir = tmp_path_factory.mktemp("replay") / "run"
    shutil.copytree(tiny_model_dir, run_dir / "model")
    (run_dir / "config.toml").write_text(CONFIG)
    spool = SpoolWriter(run_dir / "spool")
    for k in range(3 * B):
        write_group(spool, f"g{k}", version=k // B, members=2)
    worker = Worker(run_dir)
    try:
        worker.wait_for(event_is("step", step=3))
        worker.send({"cmd": "stop"})
        assert worker.finish() == 0
    finally:
        if worker.proc.poll() is None:
            worker.proc.kill()
            worker.finish()
    logs = run_dir / "logs"
    logs.mkdir(exist_ok=True)
    with (logs / "steps.jsonl").open("w") as out:
        out.write('{"event": "sync", "version": 1}\n')  # other lines of the log are skipped
        for event in worker.of("step"):
            out.write(json.dumps(event) + "\n")
        out.write('{"event": "step", "st')  # a line cut by a kill
    return run_dir


@pytest.mark.integration
def test_a_replay_reproduces_the_daemons_steps_bit_for_bit(trained_run: Path) -> None:
    pairs = replay(trained_run, steps=3)
    assert [p.step for p in pairs] == [1, 2, 3]
    assert all(p.same_numbers for p in pairs), pairs
    assert all(p.replay_s > 0 and p.daemon_s > 0 for p in pairs)
    assert summary(pairs)["same_numbers"] is True


@pytest.mark.integration
def test_the_command_prints_both_speeds_and_their_ratio(
    trained_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--replay", str(trained_run), "--steps", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [p["step"] for p in report["pairs"]] == [1, 2]
    assert report["timed_steps"] == 1 and report["same_numbers"] is True
    assert report["ratio"] == pytest.approx(report["daemon_tokens_per_s"] / report["replay_tokens_per_s"])


@pytest.mark.integration
def test_another_attention_replays_the_same_steps_to_float_rounding(trained_run: Path) -> None:
    pairs = replay(trained_run, steps=2, attention="sdpa")
    assert [p.step for p in pairs] == [1, 2]
    assert not all(p.same_numbers for p in pairs)  # the option took effect: other kernels, other rounding
    for p in pairs:
        # The loss nearly cancels (a group's advantages sum to zero), so its rounding is measured against
        # its terms' scale (~1), not its own small value.
        assert p.replay_loss == pytest.approx(p.daemon_loss, abs=1e-4)


@pytest.mark.integration
def test_a_group_gone_from_the_spool_is_named(trained_run: Path, tmp_path: Path) -> None:
    copy = tmp_path / "run"
    shutil.copytree(trained_run, copy)
    second = daemon_steps(copy / "logs" / "steps.jsonl")[1]
    for path in (copy / "spool").glob("g*.arrow"):
        from pipeline.transport.spool import read_group_file

        if read_group_file(path)[0] == second.group_ids[0]:
            path.unlink()
    with pytest.raises(ReplayError, match=rf"step 2.s group {second.group_ids[0]} .*\(--steps 1\)"):
        replay(copy, steps=3)
    assert len(replay(copy, steps=1)) == 1


def test_daemon_steps_keep_trained_steps_only_and_the_last_record_of_a_step(tmp_path: Path) -> None:
    log = tmp_path / "steps.jsonl"

    def step(n: int, seconds: float, groups: int = 2) -> str:
        metrics = {"step_time_s": seconds, "tokens": 100.0, "loss": 0.5}
        return json.dumps(
            {"event": "step", "step": n, "groups": groups, "group_ids": ["a"], "metrics": metrics}
        )

    log.write_text("\n".join([step(1, 1.0), step(2, 9.0), step(2, 2.0), step(3, 3.0, groups=0), "{cut"]))
    steps = daemon_steps(log)
    assert [(s.step, s.seconds) for s in steps] == [(1, 1.0), (2, 2.0)]
    with pytest.raises(ReplayError, match="does not exist"):
        daemon_steps(tmp_path / "missing.jsonl")


def test_the_summary_leaves_out_the_first_step_and_compares_tokens_per_second() -> None:
    pairs = [
        StepPair(step=1, tokens=100, daemon_s=10.0, replay_s=5.0, daemon_loss=0.1, replay_loss=0.1),
        StepPair(step=2, tokens=200, daemon_s=4.0, replay_s=2.0, daemon_loss=0.2, replay_loss=0.2),
        StepPair(step=3, tokens=200, daemon_s=6.0, replay_s=2.0, daemon_loss=0.3, replay_loss=0.4),
    ]
    s = summary(pairs)
    assert s["timed_steps"] == 2
    assert s["daemon_tokens_per_s"] == pytest.approx(400 / 10.0)
    assert s["replay_tokens_per_s"] == pytest.approx(400 / 4.0)
    assert s["ratio"] == pytest.approx(0.4)
    assert s["same_numbers"] is False
