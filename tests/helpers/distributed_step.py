"""Learner steps under torchrun, for tests/learner/process/test_distributed_learner.py (and importable
there: the batches and configs below are what the one-process side trains too).

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m tests.helpers.distributed_step \
        --model TINY_DIR --out OUT_DIR [--resume CHECKPOINTS_DIR]

Every case builds a fresh sharded trainer (learner.distributed.join, Trainer(ranks=...)), takes its steps
and has rank 0 write the gathered parameters and the step metrics to OUT_DIR/<case>.pt. The `fp32` case
also writes a sharded checkpoint after its first step (OUT_DIR/checkpoints). With --resume, the `resumed`
case restores a one-process checkpoint from CHECKPOINTS_DIR and takes the second batch's step.
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from learner.distributed import Ranks, join, leave
from learner.groups import TrainGroup
from learner.model.model_io import load_policy
from learner.process.checkpoint import restore
from learner.process.checkpoint_state import ConsumedState, load_latest_checkpoint
from learner.process.sharded_checkpoint import save_sharded_checkpoint
from learner.sharding import load_policy_for_ranks
from learner.trainer import Trainer
from pipeline.contracts.learner_config import LearnerConfig
from tests.helpers.configs import learner_cfg
from tests.helpers.train_groups import groups_of, one_turn_segment

SEED = 7


def batches() -> list[list[TrainGroup]]:
    """Two steps' groups: 5 one-turn episodes in groups of 3 and 2 with distinct answers and outcomes, so
    mini_batches = 3 splits them 2 + 2 + 1 and one rank's share of the last mini-batch is empty."""
    steps = []
    for step in range(2):
        rows = []
        for group, size in ((0, 3), (1, 2)):
            for member in range(size):
                prompt = [5, 6, 7, 8 + step, 9 + group]
                action = [20 + (7 * step + 3 * group + member) % 40, 60 + member, 2]
                rows.append(
                    one_turn_segment(
                        f"s{step}g{group}e{member}",
                        f"s{step}g{group}",
                        prompt,
                        action,
                        logprob=-4.0 - 0.3 * member,
                        outcome=float(member == 0),
                    )
                )
        steps.append(groups_of(rows))
    return steps


# fp32: one AdamW update over three micro-batches (entropy bonus on, so the fused path's output-layer
# rows are made after the root's forward). logits_kl: the logits path, token-mean loss, a KL term (a
# sharded frozen reference) and three updates. recompute: activation checkpointing inside the FSDP units.
# bf16_mixed: bf16 compute on fp32 shards (compared within bf16's precision).
CASES: dict[str, dict[str, Any]] = {
    "fp32": {"mini_batches": 3, "grad_accum": 3, "entropy_coef": 0.01},
    "logits_kl": {
        "mini_batches": 3,
        "fused_logprobs": False,
        "loss_agg": "token_mean",
        "kl_coef": 0.05,
        "mismatch": {"proximal": "engine", "is_weights": "none"},
    },
    "recompute": {"mini_batches": 2, "gradient_checkpointing": True},
    "bf16_mixed": {"mini_batches": 1, "precision": "bf16-mixed"},
}


def learner_config(case: str) -> LearnerConfig:
    return learner_cfg(lr=1e-4, warmup_steps=0, device="cpu", **CASES[case])


def make_trainer(model_dir: Path, case: str, ranks: Ranks | None) -> Trainer:
    cfg = learner_config(case)
    load = load_policy if ranks is None else functools.partial(load_policy_for_ranks, ranks=ranks)
    model, _ = load(model_dir)
    reference = load(model_dir)[0] if cfg.regularizers.kl_coef > 0 else None
    return Trainer(model, cfg, temperature=1.0, seed=SEED, reference=reference, ranks=ranks)


def record_first_gradients(trainer: Trainer) -> dict[str, torch.Tensor]:
    """The whole gradients the trainer's first optimizer update applies (filled in when it runs; rank 0's
    copy when sharded, where gathering them is collective inside the update)."""
    grads: dict[str, torch.Tensor] = {}

    def record(optimizer: Any, args: Any, kwargs: Any) -> None:
        if not grads:
            for name, p in trainer.model.named_parameters():
                grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                grads[name] = grad.detach().clone()

    trainer.optimizer.register_step_pre_hook(record)
    return grads


def full_parameters(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Every parameter, whole, by name (on rank 0; collective when sharded)."""
    if trainer.ranks is None:
        return {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    gathered = get_model_state_dict(trainer.model, options=options)
    names = [name for name, _ in trainer.model.named_parameters()]
    return {name: gathered[name] for name in names} if trainer.ranks.leader else {}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--resume", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    ranks = join(2, "cpu")
    assert ranks is not None
    steps = batches()
    # What each rank holds before sharding: the weights on rank 0, nothing (the meta device) elsewhere.
    model, _ = load_policy_for_ranks(args.model, ranks)
    results: dict[str, Any] = {"loaded_on": ranks.gather(sorted({p.device.type for p in model.parameters()}))}
    del model
    for case in CASES:
        trainer = make_trainer(args.model, case, ranks)
        grads = record_first_gradients(trainer)
        metrics = trainer.step(steps[0])
        results[case] = {"params": full_parameters(trainer), "grads": grads, "metrics": metrics}
        if case == "fp32":
            save_sharded_checkpoint(
                args.out / "checkpoints", trainer, consumed=ConsumedState(last_seq=2), ranks=ranks
            )
    if args.resume is not None:
        trainer = make_trainer(args.model, "fp32", ranks)
        ckpt = load_latest_checkpoint(args.resume)
        assert ckpt is not None and not ckpt.sharded
        restore(trainer, ckpt)
        metrics = trainer.step(steps[1])
        results["resumed"] = {"params": full_parameters(trainer), "metrics": metrics}
    if ranks.leader:
        torch.save(results, args.out / "results.pt")
    leave(ranks)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
