"""Bounded oneDNN kernel caches for the processes that run torch on a CPU: the embedded engine and the
learner.

torch's bf16 matmuls on a CPU (AMX, AVX512-BF16) go through oneDNN, and two caches keep a compiled
kernel for every operand shape seen: ideep's primitive LRU (`LRU_CACHE_CAPACITY`) and oneDNN's own
(`ONEDNN_PRIMITIVE_CACHE_CAPACITY`), 1,024 entries each by default. An engine's prefills and a learner's
micro-batches come in ever new token counts, and every new count adds an entry per weight shape, held
in malloc'd memory and JIT code pages. Measured here (torch 2.13, bf16, one thread):
- SmolLM2-135M prefill forwards at 100 new widths: +286 MiB of malloc'd memory (2.9 MiB per width);
  the same widths again: +0, and no faster than with the caches at 64 entries (compiling a kernel is
  negligible beside the forward);
- one 256 x 512 linear at 1,000 new row counts: +553 MiB with the defaults, +36 MiB at 64 entries.

So the caches are bounded to `DEFAULT_CAPACITY` entries each, enough for every weight shape of a
forward (a handful per token count; more with LoRA adapters or MoE experts) with room to spare. A value
the user exported wins. Both libraries read the variable when they first build a kernel, so
`bound_kernel_caches` must run before the process's first matmul. fp32 matmuls do not use these caches.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

DEFAULT_CAPACITY = 256
CACHE_VARIABLES = ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")


def bound_kernel_caches(
    capacity: int = DEFAULT_CAPACITY, environ: MutableMapping[str, str] | None = None
) -> dict[str, str]:
    """Set each cache variable the environment does not set yet to `capacity`; returns the values now in
    force (the user's where given)."""
    if capacity < 1:
        raise ValueError(f"kernel cache capacity must be >= 1, got {capacity}")
    env = os.environ if environ is None else environ
    for name in CACHE_VARIABLES:
        env.setdefault(name, str(capacity))
    return {name: env[name] for name in CACHE_VARIABLES}
