"""FSDP2 on the policy: every decoder layer its own unit, then the root (token embeddings, final norm and the
output layer, tied or not, in one unit). Parameters, gradients and AdamW's state are sharded over the ranks.

Mixed precision follows learner.precision: bf16-mixed gathers the weights in bf16 for compute and reduces
gradients in fp32 onto fp32 shards (the master copy the optimizer updates); fp32 and pure bf16 keep the
weights' own dtype throughout.

Gradients are summed over the ranks, not averaged: each rank's loss is already its share of the global
mean (the trainer divides by the step's global sequence or token counts), so their sum is exactly the
gradient one process would compute.

No rank ever holds the whole model on its device: rank 0 loads the weights into host memory, the other
ranks build the model on the meta device (no memory), every rank shards it, allocates only its own
shards on its device and receives their values from rank 0, one tensor at a time.

The fused log-prob path (learner.policy_forward) runs the base model and then reads the output layer's
weight itself, outside the root's forward. It goes through a method registered with FSDP, so the root's
parameters are gathered for it and, as the root does not reshard after forward, stay gathered until its
backward.
"""

from __future__ import annotations

import types
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor

from learner.distributed import Ranks
from learner.model.model_io import DTYPES, load_policy, quiet_transformers
from learner.model.precision import Precision
from learner.policy_forward import HIDDEN_STATES_METHOD

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


def load_policy_for_ranks(
    model_dir: str | Path, ranks: Ranks, *, dtype: str = "float32"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The policy as `shard_policies` takes it: loaded into rank 0's host memory, built on the meta device
    (allocating nothing) everywhere else. Same config, same modules, same dtype on every rank."""
    if ranks.leader:
        return load_policy(model_dir, device="cpu", dtype=dtype)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPES)}")
    quiet_transformers()
    config = AutoConfig.from_pretrained(str(model_dir))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype])
    model.train()
    return model, AutoTokenizer.from_pretrained(str(model_dir))


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
    mesh over every rank, and give every rank its shards on its device. Each model comes from
    `load_policy_for_ranks` (rank 0's holds the weights; the others' may be on the meta device)."""
    mesh = init_device_mesh(ranks.device.type, (ranks.world,))
    policy = mixed_precision(precision)
    for model in models:
        # References only: FSDP copies what it keeps, so these stay intact until they are sent.
        source = _host_tensors(model) if ranks.leader else None
        units = [*decoder_layers(model), model]
        for unit in units:
            fully_shard(unit, mesh=mesh, mp_policy=policy)
        for unit in units:
            assert isinstance(unit, FSDPModule)
            unit.set_gradient_divide_factor(1.0)
            # A plain sum: gloo has no pre-multiplied reduction, and NCCL copies less with it.
            unit.set_force_sum_reduction_for_comms(True)
        _materialize(model, ranks, source)
        setattr(model, HIDDEN_STATES_METHOD, types.MethodType(_hidden_states, model))
        register_fsdp_forward_method(model, HIDDEN_STATES_METHOD)


def _host_tensors(model: nn.Module) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """(state dict, buffers outside it) of rank 0's loaded model."""
    state = model.state_dict()
    return state, {name: b for name, b in model.named_buffers() if name not in state}


def _materialize(
    model: nn.Module, ranks: Ranks, source: tuple[dict[str, Any], dict[str, Tensor]] | None
) -> None:
    """Allocate this rank's shards (and buffers) on its device and fill them from rank 0's tensors."""
    model.to_empty(device=ranks.device)
    state, buffers = source if source is not None else ({}, {})
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, state, options=options)
    # Buffers no state dict holds (rotary inverse frequencies): computed at construction, so rank 0 sends
    # its own.
    persistent = set(model.state_dict())
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name in persistent:
                continue
            if source is not None:
                buffer.copy_(buffers[name])
            dist.broadcast(buffer, src=0)


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
