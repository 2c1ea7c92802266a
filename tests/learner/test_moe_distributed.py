"""An MoE policy on two ranks (torchrun, gloo on the CPU, FSDP2) with routing replay: the same step as one
process, its sharded checkpoint resumed by one process, its gathered export loadable as a Qwen3-MoE
checkpoint, and the load-balancing loss applied on every rank (tests/helpers/distributed_moe_step.py runs
the two-rank side once)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from learner.process.checkpoint import restore
from learner.process.checkpoint_state import load_latest_checkpoint
from tests.e2e.test_run_e2e import REPO
from tests.helpers.distributed_moe_step import make_moe_trainer, moe_batch
from tests.helpers.distributed_step import full_parameters, record_first_gradients

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_torch_thread")]

PARAM_BOUND = 1e-6  # fp32, summed in another order (tests/learner/process/test_distributed_learner.py)
GRAD_BOUND = 1e-7


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[name] - b[name]).abs().max()) for name in a)


@pytest.fixture(scope="module")
def two_ranks(moe_tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("moe-two-ranks")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += [
        "-m",
        "tests.helpers.distributed_moe_step",
        "--model",
        str(moe_tiny_model_dir),
        "--out",
        str(out),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-4000:]
    results: dict[str, Any] = torch.load(out / "results.pt", weights_only=False)
    return {"out": out, **results}


def test_two_ranks_take_the_same_replayed_moe_step_as_one_process(
    two_ranks: dict[str, Any], moe_tiny_model_dir: Path
) -> None:
    single = make_moe_trainer(moe_tiny_model_dir, None)
    grads = record_first_gradients(single)
    metrics = single.step(moe_batch())
    assert _max_diff(full_parameters(single), two_ranks["params"]) <= PARAM_BOUND
    assert _max_diff(grads, two_ranks["grads"]) <= GRAD_BOUND
    sharded = two_ranks["metrics"]
    assert sharded["routing_replayed_fraction"] == metrics["routing_replayed_fraction"] == 1.0
    for key in (
        "moe_routing_change",
        "moe_load_imbalance",
        "router_mismatch_own",
        "router_mismatch_replayed",
    ):
        assert sharded[key] == pytest.approx(metrics[key], rel=1e-5, abs=1e-7), key
    assert metrics["optimizer_updates"] == sharded["optimizer_updates"] == 3.0


def test_a_two_rank_moe_checkpoint_resumes_in_one_process(
    two_ranks: dict[str, Any], moe_tiny_model_dir: Path
) -> None:
    ckpt = load_latest_checkpoint(two_ranks["out"] / "checkpoints")
    assert ckpt is not None and ckpt.sharded
    resumed = make_moe_trainer(moe_tiny_model_dir, None)
    restore(resumed, ckpt)
    for name, value in full_parameters(resumed).items():
        assert torch.equal(value, two_ranks["params"][name]), name


def test_the_gathered_moe_export_loads_as_the_trained_weights(two_ranks: dict[str, Any]) -> None:
    published = AutoModelForCausalLM.from_pretrained(two_ranks["out"] / "published")
    assert type(published).__name__ == "Qwen3MoeForCausalLM"
    loaded = dict(published.named_parameters())
    for name, value in two_ranks["params"].items():
        assert torch.equal(loaded[name].detach(), value), name


def test_the_load_balancing_loss_trains_on_two_ranks(two_ranks: dict[str, Any]) -> None:
    metrics = two_ranks["balance_metrics"]
    assert metrics["optimizer_updates"] == 3.0
    assert 1.0 <= metrics["moe_load_balance_loss"] <= 8.0
