"""The learner on several ranks: torchrun with gloo on the CPU and FSDP2 (learner.distributed,
learner.sharding, learner.process.sharded_checkpoint), against the one-process learner on the same batches.

The two-rank side runs once per module (tests/helpers/distributed_step.py under
`python -m torch.distributed.run`); each test then compares one of its results with the same work done
here in one process.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from learner.distributed import join, share
from learner.loss.terms import PolicyStats
from learner.process.checkpoint import restore, save_checkpoint
from learner.process.checkpoint_state import ConsumedState, load_latest_checkpoint
from learner.step_stats import StepStats
from pipeline.contracts.config import ConfigError, load_config
from pipeline.contracts.run_dir import RunDir
from pipeline.supervisor.learner_child import learner_child_spec
from pipeline.transport.spool import read_group_file
from tests.e2e.test_run_e2e import REPO, TINY, DaemonRun, checkpoint_state, daemons, tiny_model
from tests.helpers.distributed_step import (
    CASES,
    batches,
    full_parameters,
    make_trainer,
    record_first_gradients,
)

__all__ = ["daemons", "tiny_model"]  # fixtures, used by name
# fp32 on a CPU: the two sides sum the same terms in a different order. AdamW's first update divides each
# gradient by its own magnitude, so a gradient entry near eps (1e-8) turns that rounding into up to ~lr x 1e-2
# (measured 3.5e-7 at lr = 1e-4; 1.3e-6 since the output layer runs on the scored positions alone, which
# changes its gradient's summation order); every other entry moves by lr to within float rounding.
PARAM_BOUND = 2e-6
GRAD_BOUND = 1e-7

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[name] - b[name]).abs().max()) for name in a)


# ---------------------------------------------------------------------------------------------- unit
def test_shares_are_disjoint_cover_the_batch_and_are_deterministic() -> None:
    indices = [4, 0, 3, 1, 2]
    parts = [share(indices, rank, 2) for rank in range(2)]
    assert parts == [[4, 3, 2], [0, 1]]
    assert sorted(parts[0] + parts[1]) == sorted(indices)
    assert [share([7], rank, 2) for rank in range(2)] == [[7], []]  # rank 1 then runs a placeholder
    with pytest.raises(ValueError, match="rank must be in"):
        share(indices, 2, 2)


def test_merged_statistics_add_counts_and_keep_the_shared_update_values() -> None:
    a = StepStats(losses=[0.25], grad_norms=[0.5], entropies=[1.0])
    a.terms["policy"] = PolicyStats(ratio_means=[1.0], ratio_min=0.9)
    a.terms["policy"].sequences, a.tokens, a.lr, a.applied, a.weight_max = 3, 30, 1e-4, 1, 1.5
    a.terms["policy"].seq_sums = {"clip_fraction": 1.0}
    a.mismatch["lag0"] = [2.0, 4.0]
    b = StepStats(losses=[0.5], grad_norms=[0.5], entropies=[3.0])
    b.terms["policy"] = PolicyStats(ratio_means=[1.1], ratio_max=1.2)
    b.terms["policy"].sequences, b.tokens, b.lr, b.applied, b.weight_max = 2, 20, 1e-4, 1, 2.0
    b.terms["policy"].seq_sums = {"clip_fraction": 2.0}
    b.mismatch["lag0"] = [1.0, 2.0]
    merged = StepStats.merged([a, b])
    policy = merged.terms["policy"]
    assert (merged.losses, merged.grad_norms, merged.entropies) == ([0.75], [0.5], [1.0, 3.0])
    assert (policy.ratio_min, policy.ratio_max, policy.sequences, merged.tokens) == (0.9, 1.2, 5, 50)
    assert (merged.applied, merged.lr, merged.weight_max) == (1, 1e-4, 2.0)
    assert policy.seq_sums == {"clip_fraction": 3.0}
    assert merged.mismatch["lag0"] == [3.0, 6.0]


def test_a_process_not_started_by_torchrun_refuses_a_multi_rank_config(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    assert join(1, "cpu") is None
    with pytest.raises(RuntimeError, match="torchrun did not start this process"):
        join(2, "cpu")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(RuntimeError, match=r"torchrun started 4 ranks, the config's .* is 2"):
        join(2, "cpu")


def test_the_supervisor_starts_several_ranks_through_torchrun(tmp_path: Path) -> None:
    run = RunDir.at(tmp_path)
    one = learner_child_spec(run, load_config(None, []).learner)
    assert one.argv[:3] == [sys.executable, "-m", "learner.process"]
    local = learner_child_spec(run, load_config(None, ["learner.distributed.nproc=2"]).learner).argv
    assert local[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert local[local.index("--nproc-per-node") + 1] == "2" and "--standalone" in local
    assert local[local.index("--max-restarts") + 1] == "0"  # a dead rank ends it; the supervisor restarts
    assert local[-4:] == ["--config", str(run.config_file), "--run-dir", str(run.root)]
    assert local[local.index("-m", 3) + 1] == "learner.process"
    overrides = [
        "learner.distributed.nproc=4",
        "learner.distributed.nnodes=2",
        "learner.distributed.rdzv_endpoint='node-b:29400'",
        "learner.distributed.launcher=['srun', '--nodes=2', '--ntasks-per-node=1']",
    ]
    multi = learner_child_spec(run, load_config(None, overrides).learner).argv
    assert multi[:4] == ["srun", "--nodes=2", "--ntasks-per-node=1", sys.executable]
    assert multi[multi.index("--nnodes") + 1] == "2" and "--standalone" not in multi
    assert multi[multi.index("--rdzv-backend") + 1] == "c10d"
    assert multi[multi.index("--rdzv-endpoint") + 1] == "node-b:29400"
    rdzv_id = multi[multi.index("--rdzv-id") + 1]
    assert rdzv_id.startswith("rollwise-")
    other = learner_child_spec(RunDir.at(tmp_path / "other"), load_config(None, overrides).learner).argv
    assert other[other.index("--rdzv-id") + 1] != rdzv_id  # one rendezvous per run directory


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["learner.distributed.nnodes=2"],
            "learner.distributed.rdzv_endpoint .* is needed when learner.distributed.nnodes > 1",
        ),
        (["learner.distributed.rdzv_endpoint='node-b'"], "must be host:port, got 'node-b'"),
        (["learner.distributed.rdzv_endpoint='node-b:99999'"], "must be host:port"),
        (["learner.distributed.nproc=0"], "learner.distributed.nproc"),
    ],
)
def test_bad_distributed_settings_name_the_key(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_fsdp_mixed_precision_follows_the_learner_precision() -> None:
    from learner.model.precision import resolve_precision
    from learner.sharding import mixed_precision

    cpu = torch.device("cpu")
    mixed = mixed_precision(resolve_precision("bf16-mixed", cpu))
    assert (mixed.param_dtype, mixed.reduce_dtype) == (torch.bfloat16, torch.float32)
    for name in ("fp32", "bf16"):  # the weights' own dtype throughout
        plain = mixed_precision(resolve_precision(name, cpu))
        assert (plain.param_dtype, plain.reduce_dtype) == (None, None)


# ------------------------------------------------------------------------------------ two ranks (gloo)
@pytest.fixture(scope="module")
def two_ranks(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One launch of tests.helpers.distributed_step on 2 ranks; the one-process checkpoint it resumes from
    (after the first batch's step) is written here first. Returns its results and where it wrote them."""
    out = tmp_path_factory.mktemp("two-ranks")
    torch.set_num_threads(1)
    single = make_trainer(tiny_model_dir, "fp32", None)
    single.step(batches()[0])
    save_checkpoint(out / "single-checkpoints", single, consumed=ConsumedState(last_seq=2))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += ["-m", "tests.helpers.distributed_step", "--model", str(tiny_model_dir), "--out", str(out)]
    command += ["--resume", str(out / "single-checkpoints")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        command, cwd=REPO, env=env, capture_output=True, text=True, timeout=240, check=False
    )
    assert done.returncode == 0, done.stderr[-4000:]
    results: dict[str, Any] = torch.load(out / "results.pt", weights_only=False)
    return {"out": out, **results}


def _one_process(model_dir: Path, case: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], Any]:
    """(parameters after, gradients of the first update, metrics) of the first batch's step here."""
    single = make_trainer(model_dir, case, None)
    grads = record_first_gradients(single)
    metrics = single.step(batches()[0])
    return full_parameters(single), grads, metrics


@pytest.mark.integration
@pytest.mark.parametrize("case", [case for case in CASES if case != "bf16_mixed"])
def test_two_ranks_take_the_same_step_as_one_process(
    two_ranks: dict[str, Any], tiny_model_dir: Path, case: str
) -> None:
    start = full_parameters(make_trainer(tiny_model_dir, case, None))
    params, grads, metrics = _one_process(tiny_model_dir, case)
    sharded = two_ranks[case]
    param_diff = _max_diff(params, sharded["params"])
    grad_diff = _max_diff(grads, sharded["grads"])
    print(f"\n{case}: max |param difference| {param_diff:.3g}, max |gradient difference| {grad_diff:.3g}")
    assert param_diff <= PARAM_BOUND
    assert grad_diff <= GRAD_BOUND
    assert _max_diff(start, sharded["params"]) > 50 * PARAM_BOUND  # the step did move the weights
    for key in ("num_sequences", "tokens", "loss_tokens", "optimizer_updates", "num_groups"):
        assert sharded["metrics"][key] == metrics[key], key
    for key in ("loss", "grad_norm", "mismatch_abs_mean", "kl_reference"):
        assert sharded["metrics"][key] == pytest.approx(metrics[key], rel=1e-5, abs=1e-7), key


@pytest.mark.integration
def test_only_rank_0_loads_the_weights_before_sharding(two_ranks: dict[str, Any]) -> None:
    assert two_ranks["loaded_on"] == [["cpu"], ["meta"]]


@pytest.mark.integration
def test_bf16_mixed_computes_in_bf16_on_fp32_shards(two_ranks: dict[str, Any], tiny_model_dir: Path) -> None:
    _, grads, metrics = _one_process(tiny_model_dir, "bf16_mixed")
    sharded = two_ranks["bf16_mixed"]
    assert {p.dtype for p in sharded["params"].values()} == {torch.float32}  # the master copy
    scale = max(float(g.abs().max()) for g in grads.values())
    grad_diff = _max_diff(grads, sharded["grads"])
    print(f"\nbf16_mixed: max |gradient difference| {grad_diff:.3g} of max |gradient| {scale:.3g}")
    assert 0.0 < grad_diff <= 0.05 * scale  # bf16 rounding (8-bit mantissa), not fp32's
    assert sharded["metrics"]["loss"] == pytest.approx(metrics["loss"], rel=0.05, abs=1e-3)


@pytest.mark.integration
def test_a_two_rank_checkpoint_resumes_in_one_process(
    two_ranks: dict[str, Any], tiny_model_dir: Path
) -> None:
    ckpt = load_latest_checkpoint(two_ranks["out"] / "checkpoints")
    assert ckpt is not None and ckpt.sharded and ckpt.consumed.last_seq == 2
    assert sorted(p.name for p in (ckpt.path / "dcp").iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    resumed = make_trainer(tiny_model_dir, "fp32", None)
    restore(resumed, ckpt)
    assert full_parameters(resumed).keys() == two_ranks["fp32"]["params"].keys()
    for name, value in full_parameters(resumed).items():
        assert torch.equal(value, two_ranks["fp32"]["params"][name]), name
    assert resumed.counters() == {"steps": 1, "optimizer_updates": 1, "policy_version": 1}
    assert all(len(s) == 3 for s in resumed.optimizer.state.values())  # step, exp_avg, exp_avg_sq restored

    straight = make_trainer(tiny_model_dir, "fp32", None)
    for batch in batches():
        straight.step(batch)
    resumed.step(batches()[1])
    assert _max_diff(full_parameters(resumed), full_parameters(straight)) <= PARAM_BOUND
    assert resumed.counters() == straight.counters()


@pytest.mark.integration
def test_a_one_process_checkpoint_resumes_on_two_ranks(
    two_ranks: dict[str, Any], tiny_model_dir: Path
) -> None:
    straight = make_trainer(tiny_model_dir, "fp32", None)
    for batch in batches():
        straight.step(batch)
    assert _max_diff(two_ranks["resumed"]["params"], full_parameters(straight)) <= PARAM_BOUND
    assert two_ranks["resumed"]["metrics"]["optimizer_updates"] == 1.0


# --------------------------------------------------------------------------------------------- daemon
def _children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found.extend(int(p) for p in (task / "children").read_text().split())
    return found


def _rank_pids(supervisor_pid: int) -> dict[int, int]:
    """{rank: pid} of the learner's ranks: supervisor -> torchrun agent -> learner.process processes."""
    ranks: dict[int, int] = {}
    for agent in _children(supervisor_pid):
        if b"torch.distributed.run" not in Path(f"/proc/{agent}/cmdline").read_bytes():
            continue
        for worker in _children(agent):
            environ = Path(f"/proc/{worker}/environ").read_bytes().split(b"\0")
            rank = next(int(v[5:]) for v in environ if v.startswith(b"RANK="))
            ranks[rank] = worker
    return ranks


@pytest.mark.integration
@pytest.mark.slow
def test_a_killed_rank_takes_the_learner_down_and_it_resumes_from_its_checkpoint(
    tmp_path: Path, tiny_model: Path, daemons: list[DaemonRun]
) -> None:
    run_dir = tmp_path / "run"
    overrides = [*TINY, f"model.path={json.dumps(str(tiny_model))}", "learner.distributed.nproc=2"]
    overrides.append(
        "learner.keep_checkpoints=100"
    )  # keep the whole lineage (and its spool) to account for it
    run = DaemonRun(run_dir, overrides, max_steps=3)
    daemons.append(run)
    run.wait_steps(1, timeout_s=240)
    ranks = _rank_pids(run.proc.pid)
    assert sorted(ranks) == [0, 1], ranks
    os.kill(ranks[1], signal.SIGKILL)
    steps_before = run.steps()
    run.wait_for(
        lambda r: r.metric("rollwise_process_restarts_total", {"component": "learner"}) >= 1, 120, "restart"
    )
    assert run.wait(timeout_s=240) == 0, run.tail()

    log = (run_dir / "logs" / "learner.log").read_text()
    assert log.count(" start: ") == 2 and "exit code 0" in log.splitlines()[-1]
    assert "exit code 1" in log or "exit code -" in log  # torchrun reported the dead rank and exited
    restored = re.findall(r"learner\[0\] INFO restored \S+: step (\d+),", log)
    assert len(restored) == 1, restored  # only the restarted learner had a checkpoint to restore
    resumed_from = int(restored[0])
    assert 1 <= resumed_from <= steps_before[-1]  # the kill came after step 1's checkpoint
    # The restarted learner redid nothing its checkpoint held and went on from the step after it.
    assert run.steps()[-(3 - resumed_from) :] == list(range(resumed_from + 1, 4))

    state = checkpoint_state(run_dir)
    assert (state["format"], state["ranks"], state["step"]) == (2, 2, 3)
    trained: list[str] = []
    for step_dir in sorted((run_dir / "checkpoints").glob("step*"), key=lambda p: int(p.name[4:])):
        trained.extend(json.loads((step_dir / "state.json").read_text())["consumed"]["group_ids"])
    assert len(trained) == len(set(trained)), "a consumed group was trained twice"
    consumed, after = int(state["consumed"]["last_seq"]), set(state["consumed"]["after"])
    written = {int(p.name[1:13]): read_group_file(p)[0] for p in (run_dir / "spool").glob("g*.arrow")}
    assert {gid for seq, gid in written.items() if seq <= consumed or seq in after} == set(trained)
    # The engines' weights of version 3, gathered and written by rank 0, are the checkpoint's weights.
    from learner.model.model_io import load_policy
    from learner.trainer import Trainer

    ckpt = load_latest_checkpoint(run_dir / "checkpoints")
    assert ckpt is not None and ckpt.counters["policy_version"] == 3
    model, _ = load_policy(tiny_model)
    trainer = Trainer(model, load_config(run_dir / "config.toml").learner, temperature=1.0)
    restore(trainer, ckpt)
    published, _ = load_policy(run_dir / "weights" / "v3")
    for (name, value), other in zip(trainer.model.named_parameters(), published.parameters(), strict=True):
        assert torch.equal(value, other), name


# ---------------------------------------------------------------------------------------------- bench
@pytest.mark.integration
@pytest.mark.slow
def test_learner_bench_compares_one_rank_with_two() -> None:
    from pipeline.tools.bench.learner_step import format_report, run

    argv = ["--nproc", "2", "--preset", "tiny", "--repeats", "1", "--groups", "1", "--prompt", "64"]
    report = run([*argv, "--generated", "64"])
    one, two = report["results"].values()
    assert [len(one["ranks"]), len(two["ranks"])] == [1, 2]
    assert one["state_ratio"] == 1.0 and two["state_ratio"] <= 0.55  # each rank holds half (plus padding)
    assert all(r["seconds"] > 0 and r["peak_extra_bytes"] > 0 for r in (one, two))
    assert "held x" in format_report(report)
