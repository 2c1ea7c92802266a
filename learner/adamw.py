"""The policy's AdamW optimizer and its learning-rate schedule (a pure function of the update count)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from pipeline.contracts.learner_config import ConstantSchedule, DecaySchedule, LearnerConfig


def lr_factor(schedule: ConstantSchedule | DecaySchedule) -> Callable[[int], float]:
    """Learning-rate multiplier of optimizer update u (0-based): a linear warm-up over `warmup_steps`, then
    constant, or a linear or cosine decay over `decay_steps` to `min_ratio`, held there after.
    A pure function of u, so a resumed scheduler (its update count restored) continues exactly."""
    warmup, shape = schedule.warmup_steps, schedule.kind
    decay, floor = (
        (schedule.decay_steps, schedule.min_ratio) if isinstance(schedule, DecaySchedule) else (0, 1.0)
    )

    def factor(update: int) -> float:
        if update < warmup:
            return (update + 1) / warmup
        if shape == "constant" or decay <= 0:
            return 1.0
        progress = min(1.0, (update - warmup) / decay)
        if shape == "linear":
            return floor + (1.0 - floor) * (1.0 - progress)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def param_groups(
    model: Any, weight_decay: float, embedding_weight_decay: float | None
) -> list[dict[str, Any]]:
    """AdamW parameter groups: one, or the token embeddings and output layer (tied or not) apart when
    they decay differently. One group otherwise, so checkpoints of earlier runs keep loading."""
    params = [p for p in model.parameters() if p.requires_grad]
    if embedding_weight_decay is None or embedding_weight_decay == weight_decay:
        return [{"params": params}]
    embedding_ids = {
        id(p)
        for module in (model.get_input_embeddings(), model.get_output_embeddings())
        if module is not None
        for p in module.parameters()
    }
    return [
        {"params": [p for p in params if id(p) in embedding_ids], "weight_decay": embedding_weight_decay},
        {"params": [p for p in params if id(p) not in embedding_ids], "weight_decay": weight_decay},
    ]


def adamw(
    model: Any, cfg: LearnerConfig, *, fused: bool
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over the model's trainable parameters and its schedule. `fused`: one kernel over all
    parameters (one process on CPU or CUDA); otherwise torch's default."""
    optim = cfg.optim
    optimizer = torch.optim.AdamW(
        param_groups(model, optim.weight_decay, optim.embedding_weight_decay),
        lr=optim.lr,
        betas=(float(optim.betas[0]), float(optim.betas[1])),
        weight_decay=optim.weight_decay,
        fused=True if fused else None,
    )
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(cfg.schedule))
