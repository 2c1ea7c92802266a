"""The model as the batcher runs it: one forward over some rows, with their adapters and their routing.

LoRA (pipeline.engine.lora_slots): while adapters are loaded the model is peft's PeftModel over the base
and every forward names each row's adapter ("__base__" for none), so one batch mixes adapters. Rows that
all name one adapter (the usual batch: every request names the served version) run with it as peft's
active adapter, a plain forward. Adapters and weights change only between two forwards.

Routed experts (MoE, `--enable-return-routed-experts`): a request with `return_routed_experts` records
the top-k experts of every position the engine forwards for it: its prefill's positions (all of them
again after a retraction) and, per decode step, the token fed. So a finished request holds prompt +
completion - 1 positions, the last sampled token never forwarded, as SGLang's capturer does.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch
from transformers import DynamicCache

from pipeline.engine import lora_slots, routed_experts
from pipeline.engine.engine_request import EngineRequest
from pipeline.engine.routed_experts import Captured

# Shape-defining config fields: weights whose config differs here cannot reuse the running KV cache.
_ARCH_FIELDS = (
    "num_hidden_layers", "num_key_value_heads", "head_dim", "hidden_size", "vocab_size", "num_experts",
    "num_experts_per_tok",
)  # fmt: skip


def cache_kwarg(model: Any) -> str:
    """The name under which ``model.forward`` takes its KV cache: transformers 5.24 renamed
    ``past_key_values`` to ``cache`` and warns on the old name (an error under the test suite's filters),
    while the releases the package still supports (>= 4.51) only know the old one."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def architecture_mismatch(old: Any, new: Any) -> str | None:
    """Name the first shape-defining config field that differs between two model configs."""
    for name in _ARCH_FIELDS:
        before, after = getattr(old, name, None), getattr(new, name, None)
        if before != after:
            return f"config.{name} differs: loaded model has {before!r}, new weights have {after!r}"
    return None


class ModelForward:
    """Owns the model, its loaded adapters and whether routing is captured. Worker thread only."""

    def __init__(self, model: Any, *, capture_routing: bool) -> None:
        self.model = model
        self.capture_routing = capture_routing  # --enable-return-routed-experts (MoE only)
        self.device = next(model.parameters()).device
        self._cache_kwarg = cache_kwarg(model)
        self._lora_active = False  # the model is a PeftModel (adapters loaded): forwards name them
        self._active_adapter: str | None = None  # peft's active adapter, as last set here

    def __call__(
        self,
        rows: list[EngineRequest],
        *,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache: DynamicCache | None,
        logits_to_keep: int | None = None,
    ) -> tuple[torch.Tensor, Captured | None]:
        """The logits of one forward over `rows` (None cache: no KV kept) and the routing captured."""
        kwargs: dict[str, Any] = {}
        if logits_to_keep is not None:
            kwargs["logits_to_keep"] = logits_to_keep
        if cache is not None:
            kwargs[self._cache_kwarg] = cache
        with self._routing(rows) as captured:
            out = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=cache is not None,
                **kwargs,
                **self._adapter_kwargs(rows),
            )
        return out.logits, captured

    def _adapter_kwargs(self, rows: list[EngineRequest]) -> dict[str, Any]:
        """What a forward over `rows` needs to name their adapters (`rollwise bench lora` measured the
        active-adapter and the mixed-batch paths)."""
        if not self._lora_active:
            if any(r.adapter is not None for r in rows):
                raise ValueError("a request names a LoRA adapter but none is loaded")
            return {}
        names = {r.adapter for r in rows}
        if len(names) == 1 and None not in names:
            (name,) = names
            if name != self._active_adapter:
                self.model.set_adapter(name)
                self._active_adapter = name
            return {}
        return {"adapter_names": lora_slots.adapter_names([r.adapter for r in rows])}

    @contextlib.contextmanager
    def _routing(self, rows: list[EngineRequest]) -> Iterator[Captured | None]:
        """Capture the forward's routed experts when a row asked for them (and the engine records)."""
        if not self.capture_routing or not any(r.return_routed_experts for r in rows):
            yield None
            return
        with routed_experts.capture(self.model, len(rows)) as captured:
            yield captured

    def swap(self, model: Any) -> None:
        """Serve `model` from the next forward on; ValueError (nothing changed) if its shape differs."""
        mismatch = architecture_mismatch(self.model.config, model.config)
        if mismatch:
            raise ValueError(f"cannot swap weights: {mismatch}")
        self.model = model  # same architecture, same loader: the cache keyword stays

    def attach_adapter(self, name: str, config: Any, weights: dict[str, Any]) -> None:
        self.model = lora_slots.attach_adapter(self.model, name, config, weights)
        self._lora_active = True
        self._active_adapter = None

    def refill_adapter(self, slot: str, weights: dict[str, Any]) -> None:
        lora_slots.refill_adapter(self.model, slot, weights)

    def detach_adapter(self, name: str) -> None:
        self.model = lora_slots.detach_adapter(self.model, name)
        self._lora_active = hasattr(self.model, "peft_config")
        self._active_adapter = None


def record_routing(
    rows: list[EngineRequest],
    sequences: list[list[int]],
    captured: Captured | None,
    *,
    replace: bool,
    reused: list[int] | None = None,
) -> None:
    """Each asking row's positions of the captured forward (its last len(seq) - reused, rows being left
    padded): its record's start (`replace`, a prefill) or one more decoded position. The `reused` leading
    positions a prefill took from the prefix cache were not forwarded: their rows are filler (-1), never
    sent (a prefill takes no cached position at or past `routed_experts_start`)."""
    if captured is None or captured.ids is None:
        return
    for row, (request, seq) in enumerate(zip(rows, sequences, strict=True)):
        if not request.return_routed_experts:
            continue
        skipped = reused[row] if reused is not None else 0
        positions = captured.ids[row, captured.ids.shape[1] - (len(seq) - skipped) :]
        if skipped:
            filler = positions.new_full((skipped, *positions.shape[1:]), -1)
            positions = torch.cat([filler, positions])
        if replace:
            request.routed = [positions]
        else:
            request.routed.append(positions)
