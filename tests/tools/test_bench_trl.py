"""`rollwise bench trl` and the evaluation off the clock it shares with `rollwise bench learn --offline-eval`:
the snapshot cadence, curves -> time to a threshold, the table, the missing-TRL message, the TRL side's
settings and reward, the scoring of snapshots on the tiny preset, and (slow, with TRL) the TRL script."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from pipeline.contracts.config import load_config
from pipeline.tools.bench import trl_grpo_run
from pipeline.tools.bench.learning_curve import (
    MANIFEST,
    Snapshot,
    VersionSnapshots,
    cadence_index,
    read_manifest,
    score_snapshots,
)
from pipeline.tools.bench.trl_compare import (
    format_table,
    main,
    parse_args,
    seed_ratio,
    seed_result,
    summarise,
    training_prompts,
    trl_missing,
)

REPO = Path(__file__).resolve().parents[2]
ARITHMETIC = REPO / "examples" / "smollm2_arithmetic.toml"
HAS_REASONING_GYM = importlib.util.find_spec("reasoning_gym") is not None
HAS_TRL = importlib.util.find_spec("trl") is not None
needs_reasoning_gym = pytest.mark.skipif(
    not HAS_REASONING_GYM, reason="reasoning-gym is not installed (pip install 'rollwise[reasoning-gym]')"
)


# --- the cadence --------------------------------------------------------------------------------------------
def test_a_snapshot_is_due_each_time_the_clock_passes_a_multiple_of_the_interval() -> None:
    assert [cadence_index(t, 30.0) for t in (0.0, 29.9, 30.0, 59.0, 61.0, 125.0)] == [0, 0, 1, 1, 2, 4]
    assert cadence_index(-1.0, 30.0) == 0
    with pytest.raises(ValueError, match="snapshot interval must be > 0"):
        cadence_index(1.0, 0.0)


def _publish(weights: Path, version: int, written_at: float) -> None:
    """A published adapter version as the learner leaves it, its files written at `written_at`."""
    target = weights / f"v{version}"
    target.mkdir(parents=True)
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        (target / name).write_text(f"v{version}")
        os.utime(target / name, (written_at, written_at))


def test_version_snapshots_keep_the_newest_version_at_each_point_with_its_write_time(tmp_path: Path) -> None:
    run_dir, dest = tmp_path / "run", tmp_path / "run" / "snapshots"
    snapshots = VersionSnapshots(run_dir, dest, 30.0, run_dir / "model")
    snapshots.start()
    t0 = snapshots.launched_at
    snapshots.poll(10.0)  # nothing published, no point passed
    _publish(run_dir / "weights", 1, t0 + 12.0)
    _publish(run_dir / "weights", 2, t0 + 25.0)
    snapshots.poll(29.0)  # before the first point: nothing kept yet
    assert [s.version for s in read_manifest(dest)] == [0]
    snapshots.poll(30.5)  # point 1: the newest version, v2
    snapshots.poll(45.0)  # still point 1
    _publish(run_dir / "weights", 3, t0 + 50.0)
    snapshots.poll(95.0)  # points 2 and 3 passed at once: one copy, v3
    snapshots.poll(130.0)  # point 4, nothing newer: nothing copied
    kept = read_manifest(dest)
    assert [(s.version, s.path) for s in kept] == [
        (0, str(run_dir / "model")),
        (2, str(dest / "v2")),
        (3, str(dest / "v3")),
    ]
    spent_before_v3 = kept[1].save_s
    assert kept[0].at_s == 0.0 and kept[1].at_s == pytest.approx(25.0, abs=1e-3)
    assert kept[2].at_s == pytest.approx(50.0 - spent_before_v3, abs=1e-3)  # copying time left out
    assert (dest / "v2" / "adapter_config.json").read_text() == "v2"
    assert snapshots.spent_s >= kept[1].save_s + kept[2].save_s


# --- curves, ratios and the table ---------------------------------------------------------------------------
def _row(at_s: float, success: float) -> dict[str, Any]:
    return {"event": "eval", "elapsed_s": at_s, "version": int(at_s), "greedy": {"success": success}}


CURVES = {
    "rollwise": {
        0: [_row(0, 0.45), _row(60, 0.6), _row(120, 0.75), _row(180, 0.7), _row(240, 0.85)],
        1: [_row(0, 0.5), _row(90, 0.72), _row(150, 0.81), _row(300, 0.9)],
    },
    "trl": {
        0: [_row(0, 0.45), _row(120, 0.5), _row(300, 0.71)],
        1: [_row(0, 0.5), _row(150, 0.55), _row(300, 0.6)],
    },
}


def test_a_curve_gives_start_final_and_the_first_snapshot_at_or_above_each_threshold() -> None:
    shuffled = list(reversed(CURVES["rollwise"][0]))
    assert seed_result(shuffled, [0.7, 0.8]) == {
        "start": 0.45,
        "final": 0.85,
        "final_minutes": 4.0,
        "final_step": 240,
        "minutes_to": {"0.7": 2.0, "0.8": 4.0},
        "snapshots": 5,
    }
    assert seed_result(CURVES["trl"][1], [0.7])["minutes_to"] == {"0.7": None}
    assert seed_result([], [0.7]) == {
        "start": None,
        "final": None,
        "final_minutes": None,
        "final_step": None,
        "minutes_to": {"0.7": None},
        "snapshots": 0,
    }


def test_the_ratio_is_exact_when_both_reached_and_a_bound_when_one_did_not() -> None:
    assert seed_ratio(2.0, 5.0, 10.0) == {"ratio": 0.4}
    assert seed_ratio(2.0, None, 10.0) == {"below": 0.2}
    assert seed_ratio(None, 5.0, 10.0) == {"above": 2.0}
    assert seed_ratio(None, None, 10.0) == {}


def test_summary_and_table_of_two_sides_over_two_seeds() -> None:
    summary = summarise(CURVES, thresholds=[0.7, 0.8], minutes=5.0)
    ours, theirs = summary["sides"]["rollwise"], summary["sides"]["trl"]
    assert ours["minutes_to"]["0.7"]["reached"] == 2
    assert ours["minutes_to"]["0.7"]["interval"]["mean"] == pytest.approx((2.0 + 1.5) / 2)
    assert theirs["minutes_to"]["0.7"] == {
        "reached": 1,
        "interval": {"n": 1, "mean": 5.0, "low": 5.0, "high": 5.0},
    }
    assert theirs["minutes_to"]["0.8"] == {"reached": 0, "interval": None}
    assert summary["ratio_rollwise_over_trl"]["0.7"] == {
        "per_seed": {"0": {"ratio": 0.4}, "1": {"below": 0.3}},
        "both_reached": 1,
        "ratio_of_means": 0.4,
    }
    assert summary["ratio_rollwise_over_trl"]["0.8"]["ratio_of_means"] is None
    timed = {
        **summary,
        "timings": {"TRL seed 0": {"wall_s": 330.4, "snapshot_save_s": 4.25, "scoring_s": 61.0}},
    }
    assert format_table(timed).splitlines()[-1] == (
        "TRL seed 0: training 330 s wall (keeping snapshots 4.2 s, off the clock), scoring 61 s"
    )
    assert format_table(summary).splitlines() == [
        "rollwise vs TRL GRPOTrainer (GSPO settings): held-out greedy success, 5 min per side per seed",
        "side      seed  start       to 0.7       to 0.8  final  steps  snapshots",
        "rollwise     0   0.45      2.0 min      4.0 min   0.85    240          5",
        "rollwise     1   0.50      1.5 min      2.5 min   0.90    300          4",
        "TRL          0   0.45      5.0 min  not reached   0.71    300          3",
        "TRL          1   0.50  not reached  not reached   0.60    300          3",
        "mean over seeds (two-sided 95% Student-t over seeds; times over the seeds that reached it):",
        "  rollwise  start 0.47 [0.16, 0.79]; to 0.7 1.8 [0.0, 4.9] min (2/2); "
        "to 0.8 3.2 [0.0, 12.8] min (2/2); final 0.88 [0.56, 1.00]",
        "  TRL       start 0.47 [0.16, 0.79]; to 0.7 5.0 [5.0, 5.0] min (1/2); to 0.8 not reached (0/2); "
        "final 0.66 [0.00, 1.00]",
        "time to 0.7, rollwise/TRL: 0.40 over the 1 seed(s) where both reached it "
        "(seed 0 0.40, seed 1 < 0.30 (TRL not reached))",
        "time to 0.8, rollwise/TRL: no seed where both reached it "
        "(seed 0 < 0.80 (TRL not reached), seed 1 < 0.50 (TRL not reached))",
    ]


def test_from_reports_the_scores_an_out_directory_holds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for side, runs in CURVES.items():
        for seed, rows in runs.items():
            scores = tmp_path / side / f"seed{seed}" / "snapshots" / "scores.jsonl"
            scores.parent.mkdir(parents=True)
            scores.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["--from", str(tmp_path), "--minutes", "5", "--json"]) == 0
    reported = json.loads(capsys.readouterr().out)
    assert reported["sides"] == summarise(CURVES, thresholds=[0.7, 0.8], minutes=5.0)["sides"]
    assert not (tmp_path / "summary.json").exists()  # --from only reports
    assert main(["--from", str(tmp_path / "nothing")]) == 2
    assert "holds no <side>/seed<s>/snapshots/scores.jsonl" in capsys.readouterr().err


# --- arguments and the missing-TRL message ------------------------------------------------------------------
def test_arguments_need_minutes_distinct_seeds_and_sane_thresholds(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = parse_args(["--minutes", "10", "--seeds", "0", "1", "2"])
    assert (args.seeds, args.max_new_tokens, args.sides, args.thresholds) == (
        [0, 1, 2],
        48,
        ["rollwise", "trl"],
        [0.7, 0.8],
    )
    assert args.config == str(ARITHMETIC) and args.snapshot_every_s == 30.0
    assert (args.eval_concurrency, args.eval_dtype) == (8, "float32")
    for bad in (
        ["--seeds", "0"],
        ["--minutes", "1", "--seeds", "1", "1"],
        ["--minutes", "1", "--thresholds", "2"],
    ):
        with pytest.raises(SystemExit):
            parse_args(bad)
    assert "--minutes must be given" in capsys.readouterr().err


def test_a_python_without_trl_gets_the_install_command_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    no_trl = tmp_path / "python-without-trl"
    no_trl.write_text("#!/bin/sh\nexit 1\n")
    no_trl.chmod(0o755)
    message = trl_missing(str(no_trl))
    assert message == (
        f"TRL is not installed for {no_trl}: install the optional extra with `pip install -e '.[trl]'` "
        "(TRL 1.16, beside rollwise in its virtualenv), or pass --trl-python, a Python that has it "
        "(or run only the rollwise side: --sides rollwise)"
    )
    assert trl_missing(str(tmp_path / "absent")) is not None
    assert main(["--minutes", "1", "--trl-python", str(no_trl), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == f"rollwise bench trl: {message}\n"
    assert not (tmp_path / "out").exists()  # nothing ran


# --- the TRL side's pieces ----------------------------------------------------------------------------------
def test_the_trl_side_asks_grpo_for_gspo_settings_fp32_and_two_prompts_of_eight() -> None:
    args = trl_grpo_run.parse_args(
        ["--model", "m", "--tasks", "t.jsonl", "--env", "e", "--out", "o", "--minutes", "10"]
    )
    settings = trl_grpo_run.grpo_settings(args)
    expected = {
        "importance_sampling_level": "sequence",
        "loss_type": "dapo",
        "beta": 0.0,
        "epsilon": 3e-4,
        "epsilon_high": 4e-4,
        "learning_rate": 2e-6,
        "per_device_train_batch_size": 16,
        "num_generations": 8,
        "gradient_accumulation_steps": 1,
        "num_iterations": 1,
        "max_completion_length": 48,
        "temperature": 1.0,
        "shuffle_dataset": False,
        "bf16": False,
        "use_cpu": True,
    }
    assert {k: settings[k] for k in expected} == expected
    assert args.threads == 2 and args.snapshot_every_s == 30.0


def test_the_trl_clock_leaves_snapshot_saving_out() -> None:
    now = [1000.0]
    watch = trl_grpo_run.Stopwatch(990.0, clock=lambda: now[0])
    assert watch.training_s() == 10.0
    watch.saving_s += 2.5
    now[0] = 1030.0
    assert watch.training_s() == 37.5


def test_the_trl_callback_keeps_the_cadence_and_the_policy_at_the_time_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps end at 20, 35, 50, 58 and 66 s of a 60 s run, snapshots every 30 s: step 2 is the first past
    a point; steps 3 and 4 are kept because the next step, as long as theirs, would end past the limit;
    step 5 ends past it and stops training unkept, so the policy at the limit is step 4's."""
    import types

    now = [0.0]
    watch = trl_grpo_run.Stopwatch(0.0, clock=lambda: now[0])
    saved: list[str] = []
    monkeypatch.setattr(trl_grpo_run, "save_snapshot", lambda model, base, target: saved.append(target.name))
    opts = types.SimpleNamespace(minutes=1.0, snapshot_every_s=30.0, max_steps=-1, model="m")
    keep = trl_grpo_run.snapshot_callback(opts, watch, tmp_path)  # type: ignore[arg-type]
    control = types.SimpleNamespace(should_training_stop=False)
    keep.on_train_begin(None, None, control)
    for step, end in enumerate((20.0, 35.0, 50.0, 58.0, 66.0), start=1):
        now[0] = end
        keep.on_step_end(None, types.SimpleNamespace(global_step=step), control, model=None)
        assert control.should_training_stop == (step == 5)
    assert saved == ["s2", "s3", "s4"]
    kept = read_manifest(tmp_path)  # saving time (real, tiny here) comes off the clock
    assert [(s.step, s.at_s) for s in kept] == [
        (2, 35.0),
        (3, pytest.approx(50.0, abs=0.1)),
        (4, pytest.approx(58.0, abs=0.1)),
    ]


@needs_reasoning_gym
def test_the_trl_side_trains_on_rollwise_s_task_stream_with_the_env_s_reward(tmp_path: Path) -> None:
    cfg = load_config(ARITHMETIC, ["run.seed=3"])
    rows = training_prompts(cfg, 4)
    # The first of them is what rollwise's scheduler plays first at seed 3: the question alone, no system.
    from envs.discovery import resolve_env

    env = resolve_env(cfg.env.name)(**cfg.env.options)
    first = next(iter(env.tasks(3)))
    assert rows[0]["task"] == {"id": first.id, "seed": first.seed, "data": dict(first.data)}
    assert [m["role"] for m in rows[0]["prompt"]] == ["user"]
    question = rows[0]["prompt"][0]["content"]
    assert question.startswith("Calculate ") and question.endswith(".")
    a, b = (int(x) for x in question.removeprefix("Calculate ").removesuffix(".").split(" + "))

    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = trl_grpo_run.read_tasks(tasks)
    reward = trl_grpo_run.env_reward(cfg.env.name, dict(cfg.env.options))
    completions = [
        [{"role": "assistant", "content": f"{a} + {b} = {a + b}"}],
        [{"role": "assistant", "content": f"The answer is {a + b + 1}."}],
        [{"role": "assistant", "content": "I cannot tell."}],
        f"{a + b}",  # a plain-text completion
    ]
    assert reward(None, completions, task=[data[0]["task"]] * 4) == [1.0, 0.0, 0.0, 1.0]


def test_a_multi_turn_env_is_refused_for_the_trl_side() -> None:
    cfg = load_config(REPO / "examples" / "guess_number.toml")
    with pytest.raises(ValueError, match="needs a single-turn env"):
        training_prompts(cfg, 1)


# --- scoring snapshots --------------------------------------------------------------------------------------
@pytest.fixture
def tiny_run(tmp_path: Path, tiny_model_dir: Path) -> tuple[Path, list[str]]:
    """A tiny guess-number run directory (config and initial model), as the daemon leaves it."""
    import shutil

    from pipeline.contracts.config import write_resolved

    root = tmp_path / "run"
    overrides = [f"run.run_dir={json.dumps(str(root))}", "eval.tasks=2", "engine.dtype=float32"]
    write_resolved(load_config(REPO / "examples" / "guess_number.toml", overrides), root)
    shutil.copytree(tiny_model_dir, root / "model")
    return root, [f"run.run_dir={json.dumps(str(root))}"]


def test_snapshots_are_scored_greedy_on_the_eval_tasks_once_each(tiny_run: tuple[Path, list[str]]) -> None:
    root, overrides = tiny_run
    scores = root / "snapshots" / "scores.jsonl"
    kept = [Snapshot(at_s=0.0, path=str(root / "model"), version=0)]
    rows = score_snapshots(root / "config.toml", overrides, kept, root / "model", scores, threads=1)
    assert len(rows) == 1
    row = rows[0]
    assert (row["elapsed_s"], row["version"], row["snapshot"], row["tasks"]) == (
        0.0,
        0,
        str(root / "model"),
        2,
    )
    assert "sampled" not in row and row["greedy"]["episodes"] == 2 and 0.0 <= row["greedy"]["success"] <= 1.0
    again = score_snapshots(root / "config.toml", overrides, kept, root / "model", scores, threads=1)
    assert again == rows and len(scores.read_text().splitlines()) == 1  # not scored twice


def test_a_snapshot_whose_episodes_time_out_is_scored_again_with_fewer_in_flight(
    tiny_run: tuple[Path, list[str]], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A loaded CPU engine with 32 episodes in flight can outlast the env's episode timeout: those episodes
    measure the machine, so the snapshot is scored again with half as many until none times out."""
    import sys as system

    from pipeline.supervisor.actors.heldout import ModeResult
    from pipeline.tools import offline_eval

    root, overrides = tiny_run
    in_flight: list[int] = []

    async def fake_evaluate(cfg: Any, setup: Any, model: Path, **_: Any) -> tuple[dict[str, Any], float]:
        in_flight.append(setup.max_concurrent)
        timeouts = 1 if setup.max_concurrent > 8 else 0
        reasons = {"stop": 2 - timeouts, **({"timeout": timeouts} if timeouts else {})}
        result = ModeResult("greedy", 1, 2, 2, 2 - timeouts, (2 - timeouts) / 2, 0.5, 0.0, 1.0, reasons, None)
        return {"greedy": result}, 1.0

    monkeypatch.setattr(offline_eval, "evaluate_weights", fake_evaluate)
    kept = [Snapshot(at_s=0.0, path=str(root / "model"), version=0)]
    scores = root / "snapshots" / "scores.jsonl"
    overrides = [*overrides, "eval.max_concurrent_episodes=32"]
    rows = score_snapshots(root / "config.toml", overrides, kept, root / "model", scores, log=system.stderr)
    assert in_flight == [32, 16, 8]
    assert (rows[0]["greedy"]["success"], rows[0]["concurrency"], rows[0]["unmeasured"]) == (1.0, 8, 0)
    assert "1 episodes timed out or failed at the engine with 32 in flight" in capsys.readouterr().err


def test_an_adapter_snapshot_is_served_over_the_initial_model(tiny_run: tuple[Path, list[str]]) -> None:
    from learner.model.lora import apply_lora
    from learner.model.model_io import load_policy
    from pipeline.contracts.learner_config import LoraConfig

    root, overrides = tiny_run
    model, _ = load_policy(root / "model")
    adapter = apply_lora(model, LoraConfig(enabled=True)).publish_adapter(root / "snapshots" / "v4", 4)
    kept = [Snapshot(at_s=42.0, path=str(adapter), version=4)]
    overrides = [*overrides, "learner.lora.enabled=true"]
    rows = score_snapshots(
        root / "config.toml", overrides, kept, root / "model", root / "snapshots" / "scores.jsonl", threads=1
    )
    assert (rows[0]["elapsed_s"], rows[0]["version"]) == (42.0, 4)
    assert set(rows[0]["greedy"]["versions"]) == {4}  # the adapter's tokens, labelled with its version


def test_rollwise_eval_scores_a_published_adapter_version_over_the_initial_model(
    tiny_run: tuple[Path, list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    """`rollwise eval` of a LoRA run: weights/v<n> holds an adapter, not an HF directory."""
    from learner.model.lora import apply_lora
    from learner.model.model_io import load_policy
    from pipeline.contracts.config import write_resolved
    from pipeline.contracts.learner_config import LoraConfig
    from pipeline.tools.offline_eval import main as eval_main

    root, overrides = tiny_run
    cfg = load_config(root / "config.toml", [*overrides, "learner.lora.enabled=true"])
    write_resolved(cfg, root)
    model, _ = load_policy(root / "model")
    apply_lora(model, LoraConfig(enabled=True)).publish_adapter(root / "weights" / "v2", 2)
    assert eval_main(["--run-dir", str(root), "--greedy", "--tasks", "1", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["version"] == 2 and set(row["greedy"]["versions"]) == {2}


# --- the TRL script for real (slow) -------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRL, reason="TRL is not installed (pip install -e '.[trl]')")
@needs_reasoning_gym
def test_the_trl_script_trains_two_steps_on_the_tiny_preset_and_keeps_snapshots(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    cfg = load_config(ARITHMETIC, ["model.preset=tiny"])
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(r) + "\n" for r in training_prompts(cfg, 8)))
    argv = [
        sys.executable, "-m", "pipeline.tools.bench.trl_grpo_run", "--model", str(tiny_model_dir),
        "--tasks", str(tasks), "--env", cfg.env.name, "--env-options", json.dumps(dict(cfg.env.options)),
        "--out", str(tmp_path / "out"), "--minutes", "5", "--snapshot-every-s", "0.001", "--max-steps", "2",
        "--max-new-tokens", "8", "--generations", "2", "--threads", "1", "--launched-at", repr(time.time()),
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=280, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 2 and summary["snapshots"] == 2 and summary["save_s"] > 0
    kept = read_manifest(tmp_path / "out" / "snapshots")
    assert [s.step for s in kept] == [0, 1, 2] and kept[0].path == str(tiny_model_dir.resolve())
    assert kept[0].at_s == 0.0 and 0 < kept[1].at_s <= kept[2].at_s
    for snap in kept[1:]:
        files = {p.name for p in Path(snap.path).iterdir()}
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= files
    logged = [json.loads(line) for line in (tmp_path / "out" / "trl_log.jsonl").read_text().splitlines()]
    assert any("reward" in line for line in logged)
    assert (tmp_path / "out" / "snapshots" / MANIFEST).is_file()


def test_each_seed_runs_rollwise_then_trl_then_scores_both_and_writes_the_summary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from pipeline.tools.bench import trl_compare

    calls: list[str] = []

    def fake_run(side: str) -> Any:
        def run(args: Any, cfg: Any, seed: int, out: Path) -> Path:
            calls.append(f"{side} train {seed}")
            assert cfg.run.seed == seed and cfg.sampling.max_new_tokens == 24 and not cfg.eval.every_versions
            snapshots = out / "snapshots" if side == "trl" else out / f"seed{seed}" / "snapshots"
            snapshots.mkdir(parents=True)
            (snapshots / MANIFEST).write_text(json.dumps({"at_s": 0.0, "path": "m", "save_s": 0.5}) + "\n")
            return snapshots

        return run

    def fake_score(args: Any, side: str, seed: int, snapshots: Path) -> list[dict[str, Any]]:
        calls.append(f"{side} score {seed}")
        return CURVES[side][seed]

    monkeypatch.setattr(trl_compare, "trl_missing", lambda python: None)
    monkeypatch.setattr(trl_compare, "run_rollwise", fake_run("rollwise"))
    monkeypatch.setattr(trl_compare, "run_trl", fake_run("trl"))
    monkeypatch.setattr(trl_compare, "score_side", fake_score)
    argv = ["--minutes", "5", "--seeds", "0", "1", "--max-new-tokens", "24", "--out", str(tmp_path)]
    assert main(argv) == 0
    assert calls == [
        "rollwise train 0", "trl train 0", "rollwise score 0", "trl score 0",
        "rollwise train 1", "trl train 1", "rollwise score 1", "trl score 1",
    ]  # fmt: skip
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written["sides"] == summarise(CURVES, thresholds=[0.7, 0.8], minutes=5.0)["sides"]
    assert written["command"] == ["rollwise", "bench", "trl", *argv]
    assert sorted(written["timings"]) == ["TRL seed 0", "TRL seed 1", "rollwise seed 0", "rollwise seed 1"]
    assert written["timings"]["TRL seed 1"]["snapshot_save_s"] == 0.5
    assert capsys.readouterr().out.startswith("rollwise vs TRL GRPOTrainer (GSPO settings)")
