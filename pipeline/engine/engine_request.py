"""One sequence the embedded engine generates, as its batcher and its HTTP handlers share it.

The output lists (`output_ids`, `logprobs`, `versions`) are append-only and written only by the batcher's
worker thread; a reader on another thread takes a prefix of the length `notify` announced. Every
generated token is stamped with the weight version active when it was sampled (`versions`, sent as
`meta_info.output_token_weight_versions`); `finish_version` is the version at finish.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from pipeline.engine.sampling import RequestSampling


def abort_reason(message: str) -> dict[str, Any]:
    """SGLang's FINISH_ABORT json."""
    return {"type": "abort", "message": message, "status_code": None, "err_type": None}


@dataclass(eq=False)
class EngineRequest:
    """One sequence to generate. `notify(request, finished)` is called on the worker thread after each
    new token when `stream` is true, and once when the request finishes (finish_reason set first)."""

    rid: str
    prompt_ids: list[int]
    sampling: RequestSampling
    notify: Callable[[EngineRequest, bool], None]
    stream: bool = False
    priority: int = 0  # SGLang's request priority: higher is admitted first, ties in arrival order
    arrival: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    finish_time: float | None = None
    finish_version: str | None = None  # weight version active when the request finished
    adapter: str | None = None  # LoRA adapter the request runs with (its name inside the model)
    logprob_start_len: int | None = None  # first prompt position of input_logprobs; None = not wanted
    input_logprobs: list[float | None] | None = None  # set by the first prefill
    return_routed_experts: bool = False  # record routed experts (needs a capturing batcher)
    # First position whose routed experts the reply carries: a prefill never takes positions from this one
    # on from the prefix cache (their routing must be computed; the record's earlier rows may be filler).
    routed_experts_start: int = 0
    routed: list[torch.Tensor] = field(default_factory=list)  # (positions, layers, topk) int32 chunks
    cached_tokens: int | None = None  # tokens the first prefill took from the prefix cache
    kv_epoch: int = -1  # the batcher's kv_epoch when this request's KV was last computed from scratch
    generator: torch.Generator = field(init=False)

    def __post_init__(self) -> None:
        seed = self.sampling.sampling_seed
        self.generator = torch.Generator()
        self.generator.manual_seed(seed if seed is not None else random.getrandbits(63))

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def needs_input_logprobs(self) -> bool:
        """Prompt log-probs were asked for and no prefill has computed them yet."""
        return self.logprob_start_len is not None and self.input_logprobs is None
