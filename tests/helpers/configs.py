"""Configs as tests write them: compact keyword arguments."""

from __future__ import annotations

from typing import Any

from pipeline.contracts.learner_config import FLAT_KEYS, LOSS_LEVELS, LearnerConfig


def learner_cfg(**keys: Any) -> LearnerConfig:
    """A LearnerConfig from keyword arguments, each table's keys given by their flat names (lr=,
    warmup_steps=, kl_coef=, loss_level= ...: pipeline.contracts.learner_config.FLAT_KEYS) and put into
    their tables here; other keys (mini_batches=, device=, mismatch={...}) as they are.

    precision is fp32 unless given: `auto` is bf16-mixed on a CPU with native bf16 matmuls, and the tests'
    expected numbers must not depend on the machine's CPU."""
    tree: dict[str, Any] = {"precision": "fp32"}
    kinds = {level: kind for kind, level in LOSS_LEVELS.items()}
    for key, value in keys.items():
        if key in FLAT_KEYS:
            table, name = FLAT_KEYS[key]
            tree.setdefault(table, {})[name] = kinds.get(value, value) if key == "loss_level" else value
        else:
            tree[key] = value
    return LearnerConfig.model_validate(tree)
