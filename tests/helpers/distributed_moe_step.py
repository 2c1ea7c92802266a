"""An MoE learner step under torchrun, for tests/learner/test_moe_distributed.py.

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m tests.helpers.distributed_moe_step \
        --model MOE_TINY_DIR --out OUT_DIR

Rank 0 writes OUT_DIR/results.pt (the gathered parameters, the first update's gradients and the step
metrics of a routing-replay step), OUT_DIR/checkpoints (a sharded checkpoint) and OUT_DIR/published (the
gathered HF export an engine loads).
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path
from typing import Any

import torch

from learner.distributed import Ranks, join, leave
from learner.groups import TrainGroup
from learner.model.model_io import load_policy
from learner.model.moe_routing import MoeShape
from learner.process.checkpoint_state import ConsumedState
from learner.process.sharded_checkpoint import export_gathered, save_sharded_checkpoint
from learner.sharding import load_policy_for_ranks
from learner.trainer import Trainer
from pipeline.contracts.learner_config import LearnerConfig
from pipeline.contracts.schema import RoutedExperts
from tests.helpers.distributed_step import full_parameters, record_first_gradients
from tests.helpers.train_groups import groups_of, one_turn_segment

SHAPE = MoeShape(layers=2, topk=2, num_experts=8)


def moe_batch() -> list[TrainGroup]:
    """5 one-turn episodes in groups of 3 and 2, each with an engine routing record (mini_batches 3 gives
    one rank an empty share of the last mini-batch)."""
    rows = []
    for group, size in ((0, 3), (1, 2)):
        for member in range(size):
            row = one_turn_segment(
                f"g{group}e{member}",
                f"g{group}",
                [5, 6, 7, 9 + group],
                [20 + 3 * group + member, 60 + member, 2],
                logprob=-4.0 - 0.3 * member,
                outcome=float(member == 0),
            )
            positions = len(row.token_ids) - 1
            ids = [
                (3 * p + 5 * layer + k + member) % 8
                for p in range(positions)
                for layer in range(2)
                for k in (0, 1)
            ]
            row.routed_experts = RoutedExperts(2, 2, 1, RoutedExperts.encode(ids, layers=2, topk=2, width=1))
            rows.append(row)
    return groups_of(rows)


def moe_config(balance: float = 0.0) -> LearnerConfig:
    """Routing replay; `balance` > 0 adds the load-balancing loss (a mean over each rank's micro-batch,
    like transformers' and Megatron's, so it is not split-invariant and is not compared exactly)."""
    return LearnerConfig.model_validate(
        {
            "optim": {"lr": 1e-4},
            "schedule": {"warmup_steps": 0},
            "loss": {"kind": "grpo", "clip_low": 0.2, "clip_high": 0.27},
            "mini_batches": 3,
            "device": "cpu",
            "precision": "fp32",  # the bounds are fp32's (auto is bf16-mixed on a CPU with native bf16)
            "moe": {"routing_replay": True, "load_balance_coef": balance},
        }
    )


def make_moe_trainer(model_dir: Path, ranks: Ranks | None, balance: float = 0.0) -> Trainer:
    load = load_policy if ranks is None else functools.partial(load_policy_for_ranks, ranks=ranks)
    model, _ = load(model_dir)
    return Trainer(model, moe_config(balance), temperature=1.0, seed=3, ranks=ranks)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    ranks = join(2, "cpu")
    assert ranks is not None
    trainer = make_moe_trainer(args.model, ranks)
    grads = record_first_gradients(trainer)
    metrics = trainer.step(moe_batch())
    results: dict[str, Any] = {"params": full_parameters(trainer), "grads": grads, "metrics": metrics}
    save_sharded_checkpoint(
        args.out / "checkpoints", trainer, consumed=ConsumedState(last_seq=1), ranks=ranks
    )
    export_gathered(trainer, None, args.out / "published", 1, ranks)
    results["balance_metrics"] = make_moe_trainer(args.model, ranks, balance=0.05).step(moe_batch())
    if ranks.leader:
        torch.save(results, args.out / "results.pt")
    leave(ranks)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
