"""The learner's policy as a config builds it: model, tokenizer, LoRA adapter, KL reference and Trainer.

One function, used by the learner process (learner.process) and by `rollwise bench learner --replay`, so a
replayed step runs on exactly the model, options and threads the daemon's learner ran.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.contracts.config import Config

if TYPE_CHECKING:
    from learner.distributed import Ranks
    from learner.model.lora import LoraPolicy
    from learner.trainer import Trainer


@dataclass
class Policy:
    """What `build_policy` made: the Trainer (which owns the model), the tokenizer, and the LoRA policy
    when `[learner.lora]` is on."""

    trainer: Trainer
    tokenizer: Any
    lora: LoraPolicy | None


def env_action_token_ids(cfg: Config, tokenizer: Any) -> list[int]:
    """The env's answer tokens for the action prior (learner.action_prior); [] when the prior is off.

    `rollwise run` already refused a prior for an env without action_hints; an env that lost them since
    (a changed plugin on resume) raises ValueError naming the key rather than training without the prior.
    """
    if cfg.learner.regularizers.action_prior_coef <= 0.0:
        return []
    from envs.discovery import resolve_env
    from learner.loss.action_prior import action_token_ids

    hints = resolve_env(cfg.env.name)(**cfg.env.options).spec.action_hints
    if not hints:
        raise ValueError(
            f"learner.regularizers.action_prior_coef > 0 but env {cfg.env.name!r} declares no action_hints"
        )
    return action_token_ids(tokenizer, hints)


def build_policy(cfg: Config, initial_model: Path, ranks: Ranks | None = None) -> Policy:
    """Load `initial_model` and build the Trainer `cfg.learner` asks for, with `cfg.learner.threads` torch
    threads. Under several ranks only rank 0 reads the weights; the model reaches the devices as shards
    (learner.sharding)."""
    import torch

    from learner.model.cpu_attention import attention_implementation
    from learner.model.model_io import load_policy, resolve_device
    from learner.model.precision import resolve_precision
    from learner.trace import StepTracer
    from learner.trainer import Trainer

    torch.set_num_threads(cfg.learner.threads)
    device = ranks.device if ranks is not None else resolve_device(cfg.learner.device)
    precision = resolve_precision(cfg.learner.precision, device)
    if ranks is None:
        load = functools.partial(load_policy, device=device)
    else:
        from learner.sharding import load_policy_for_ranks

        load = functools.partial(load_policy_for_ranks, ranks=ranks)
    model, tokenizer = load(initial_model, dtype=precision.param_dtype_name)
    if model.config._attn_implementation == "sdpa":
        # The attention kernels of the device that trains (rank 0 of a GPU run loads on the CPU first).
        model.set_attn_implementation(attention_implementation(device))
    lora: LoraPolicy | None = None
    if cfg.learner.lora.enabled:
        from learner.model.lora import apply_lora

        # The base stays the initial model; only the adapter trains, is checkpointed and published.
        lora = apply_lora(model, cfg.learner.lora, seed=cfg.run.seed)
        model = lora.model
    reference: Any = None
    if cfg.learner.regularizers.kl_coef > 0.0 and lora is not None:
        reference = lora.adapter_off()  # the initial policy is the base: no second copy
    elif cfg.learner.regularizers.kl_coef > 0.0:
        # The initial weights, frozen; in bf16 when the compute is (it runs under the same autocast).
        dtype = "bfloat16" if precision.autocast_dtype is not None else precision.param_dtype_name
        reference, _ = load(initial_model, dtype=dtype)
    trainer = Trainer(
        model,
        cfg.learner,
        temperature=cfg.sampling.temperature,
        seed=cfg.run.seed,
        device=device,
        action_token_ids=env_action_token_ids(cfg, tokenizer),
        reference=reference,
        ranks=ranks,
        tracer=StepTracer(cfg.trace.groups_per_step, cfg.trace.every_steps),
    )
    return Policy(trainer, tokenizer, lora)
