"""FSDP2 on the policy: every decoder layer its own unit, then the root (token embeddings, final norm and the
output layer, tied or not, in one unit). Parameters, gradients and AdamW's state are sharded over the ranks.

Mixed precision follows learner.precision: bf16-mixed gathers the weights in bf16 for compute and reduces
gradients in fp32 onto fp32 shards (the master copy the optimizer updates); fp32 and pure bf16 keep the
weights' own dtype throughout.

Gradients are summed over the ranks, not averaged: each rank's loss is already its share of the global
mean (the trainer divides by the step's global sequence or token counts), so their sum is exactly the
gradient one process would compute.

The fused log-prob path (learner.policy_forward) runs the base model and then reads the output layer's
weight itself, outside the root's forward. It goes through a method registered with FSDP, so the root's
parameters are gathered for it and, as the root does not reshard after forward, stay gathered until its
backward.
"""

from __future__ import annotations

import types
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor

from learner.distributed import Ranks
from learner.policy_forward import HIDDEN_STATES_METHOD
from learner.precision import Precision


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of an HF model: the classes it names in `_no_split_modules`."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [module for module in model.modules() if type(module).__name__ in names]
    if not layers:
        raise ValueError(
            f"{type(model).__name__} names no decoder layer class in _no_split_modules ({sorted(names)}); "
            "FSDP needs one unit per layer"
        )
    return layers


def mixed_precision(precision: Precision) -> MixedPrecisionPolicy:
    """FSDP's mixed-precision policy for a learner.precision mode."""
    if precision.autocast_dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=precision.autocast_dtype, reduce_dtype=torch.float32)


def _hidden_states(self: Any, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    return self.base_model(
        input_ids=input_ids, attention_mask=attention_mask, use_cache=False
    ).last_hidden_state


def shard_policies(models: Sequence[nn.Module], ranks: Ranks, precision: Precision) -> None:
    """Apply FSDP2 in place to each model (the policy and, with a KL term, its frozen reference), on one
    mesh over every rank. The models must already be on `ranks.device`."""
    mesh = init_device_mesh(ranks.device.type, (ranks.world,))
    policy = mixed_precision(precision)
    for model in models:
        units = [*decoder_layers(model), model]
        for unit in units:
            fully_shard(unit, mesh=mesh, mp_policy=policy)
        for unit in units:
            assert isinstance(unit, FSDPModule)
            unit.set_gradient_divide_factor(1.0)
            # A plain sum: gloo has no pre-multiplied reduction, and NCCL copies less with it.
            unit.set_force_sum_reduction_for_comms(True)
        setattr(model, HIDDEN_STATES_METHOD, types.MethodType(_hidden_states, model))
        register_fsdp_forward_method(model, HIDDEN_STATES_METHOD)


def is_sharded(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def clip_grad_norm(parameters: Iterable[Tensor], max_norm: float) -> float:
    """Clip the gradients of sharded parameters to a global norm of `max_norm`; returns the norm before
    clipping (the same on every rank: each shard's part is reduced over all of them)."""
    params = list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return float(total)
