"""Learner precision: which dtype holds the weights and AdamW state, and which dtype the forward computes in.

    fp32        weights, optimizer and compute in fp32
    bf16-mixed  fp32 weights and optimizer state (the master copy); forward and backward under bf16
                autocast. The default on CUDA: bf16 speed and memory for activations, no lost updates.
    bf16        weights and optimizer state in bf16. Half the memory of the weights and of AdamW's
                moments, but an update smaller than bf16's spacing (2^-8 relative, ~0.4% of a weight)
                rounds away: with lr 1e-6 most updates of a pretrained model are lost.

    auto        bf16-mixed on CUDA, and on a CPU whose matmuls take bf16 natively (AVX512-BF16 or AMX:
                pipeline.contracts.cpu_features); fp32 on other CPUs, where bf16 is emulated and slower.

Log-probs and the loss are computed in fp32 whatever the mode (learner.logprobs, learner.loss.gspo).

Why bf16-mixed on a CPU with native bf16 (`rollwise bench learner`, docs/benchmarks.md): on the 2-core
AMD EPYC of the measurements (Zen 4: AVX512-BF16, no AMX), a step of SmolLM2-135M on 2k tokens of
arithmetic episodes took 2.6x less time than fp32, and even the tiny toy's step (0.3M parameters) 0.73x.
bf16 autocast's log-probs differ from fp32's by ~1e-2 per token, as a bf16 engine's do.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from pipeline.contracts.cpu_features import native_bf16

PRECISIONS = ("auto", "fp32", "bf16-mixed", "bf16")


@dataclass(frozen=True)
class Precision:
    name: str
    param_dtype: torch.dtype
    autocast_dtype: torch.dtype | None

    @property
    def param_dtype_name(self) -> str:
        """The name learner.model.model_io.load_policy takes."""
        return "bfloat16" if self.param_dtype == torch.bfloat16 else "float32"


def resolve_precision(name: str, device: torch.device) -> Precision:
    """`auto` is bf16-mixed on CUDA and on a CPU with native bf16, fp32 elsewhere; ValueError for an unknown
    name."""
    if name == "auto":
        native = device.type == "cuda" or (device.type == "cpu" and native_bf16()[0])
        name = "bf16-mixed" if native else "fp32"
    if name == "fp32":
        return Precision(name, torch.float32, None)
    if name == "bf16-mixed":
        return Precision(name, torch.float32, torch.bfloat16)
    if name == "bf16":
        return Precision(name, torch.bfloat16, None)
    raise ValueError(f"unknown precision {name!r}; expected one of {PRECISIONS}")


@contextlib.contextmanager
def compute(precision: Precision, device: torch.device) -> Iterator[None]:
    """The forward's precision: bf16 autocast for bf16-mixed, nothing otherwise."""
    if precision.autocast_dtype is None:
        yield
        return
    with torch.autocast(device_type=device.type, dtype=precision.autocast_dtype):
        yield
