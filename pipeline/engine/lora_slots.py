"""LoRA adapters in the embedded engine, served as SGLang 0.5.x serves them.

Flags: `--enable-lora`, `--max-lora-rank R`, `--lora-target-modules M ...`, `--lora-paths NAME=PATH ...`
(loaded before ready). `/load_lora_adapter {lora_name, lora_path, pinned}` and `/unload_lora_adapter
{lora_name}` answer `{success, error_message, loaded_adapters: {name: path}}` with 200 or 400 (an internal
`lora_id` is ignored). `/generate` names an adapter in `lora_path`; a name not loaded is a 400.

Loop side, `EngineAdapters`: the registry (name -> path, requests holding it), SGLang's checks on a new
adapter (rank, target modules), and unloading: the name is refused at once, the adapter leaves the model
after the last request naming it (SGLang's `wait_for_unload`).

Worker side: the batcher runs peft's PeftModel over the base once an adapter was loaded. Adapters live
in slots (`slot<i>`): a load copies the tensors into a free slot of the same shape (`refill_adapter`) and
injects a new one only otherwise (`attach_adapter`); at most `MAX_FREE_SLOTS` unloaded slots are kept.
A batch whose rows all name one adapter runs it as the active adapter; mixed rows run as ONE forward with
peft's `adapter_names` ("__base__" for none).

Fault injection (`--fault-stale-weights`, tests only): loads are acknowledged and named, but their
requests run on the base model, like an engine the adapter never reached.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

BASE = "__base__"  # peft's name for "no adapter" in a mixed batch
MAX_FREE_SLOTS = 2  # slots of unloaded adapters kept for reuse (a sync needs one: the retiring version's)


def lora_reply(success: bool, error: str, loaded: dict[str, str]) -> dict[str, Any]:
    """SGLang's LoRAUpdateOutput as JSON."""
    return {"success": success, "error_message": error, "loaded_adapters": dict(loaded)}


@dataclass
class _Adapter:
    path: str
    peft_name: str | None  # the adapter's slot inside the model; None = requests run on the base
    shape: tuple[Any, ...] = ()  # slot_shape of its config
    holders: int = 0
    unloading: bool = False
    idle: asyncio.Event = field(default_factory=asyncio.Event)


ADAPTER_SAFETENSORS = "adapter_model.safetensors"  # peft's SAFETENSORS_WEIGHTS_NAME


def read_adapter(path: str, device: str) -> tuple[Any, dict[str, Any]]:
    """peft's config and tensors of a PEFT adapter directory (runs in the loader thread). Its safetensors
    file is read from bytes, not memory-mapped as peft's `load_peft_weights` does: mapped reads keep two
    Python ints per tensor (pipeline/engine/model_loading.py), and an engine reads an adapter per version."""
    from peft import PeftConfig

    config = PeftConfig.from_pretrained(path)
    weights_file = Path(path) / ADAPTER_SAFETENSORS
    if weights_file.is_file():
        from safetensors.torch import load

        return config, {key: t.to(device) for key, t in load(weights_file.read_bytes()).items()}
    from peft.utils import load_peft_weights

    return config, load_peft_weights(path, device=device)


def attach_adapter(model: Any, name: str, config: Any, weights: dict[str, Any]) -> Any:
    """Inject adapter `name` into `model` (worker thread); returns the model to run from now on."""
    from peft import PeftModel
    from peft.utils import set_peft_model_state_dict

    wrapped = isinstance(model, PeftModel)
    if wrapped:
        model.add_adapter(name, config)
    else:
        model = PeftModel(model, config, adapter_name=name)
    result: Any = set_peft_model_state_dict(model, weights, adapter_name=name)
    missing = [k for k in result.missing_keys if ".lora_" in k and f".{name}." in k]
    if result.unexpected_keys or missing:
        model = detach_adapter(model, name)
        raise ValueError(
            f"adapter {name} does not fit the model: unexpected keys {result.unexpected_keys[:3]}, "
            f"missing {missing[:3]}"
        )
    model.eval()
    return model


def slot_shape(config: Any) -> tuple[Any, ...]:
    """What must match for an adapter to reuse another's slot (its tensors' shapes and its scaling)."""
    return (
        int(config.r),
        float(config.lora_alpha),
        tuple(sorted(config.target_modules)),
        bool(getattr(config, "use_rslora", False)),
        bool(getattr(config, "use_dora", False)),
        str(getattr(config, "bias", "none")),
    )


def refill_adapter(model: Any, slot: str, weights: dict[str, Any]) -> None:
    """Copy PEFT-format `weights` into the tensors of the existing adapter `slot` (worker thread).
    ValueError, changing nothing, unless the keys and shapes match the slot's exactly."""
    import torch

    params = {name: p for name, p in model.named_parameters() if f".{slot}." in name}
    targets: dict[str, Any] = {}
    for key, tensor in weights.items():
        for part in (".lora_A.", ".lora_B."):
            if key.endswith(f"{part}weight"):
                targets[key[: -len("weight")] + f"{slot}.weight"] = tensor
    unknown = sorted(k for k, t in targets.items() if k not in params or params[k].shape != t.shape)
    missing = sorted(set(params) - set(targets))
    if unknown or missing or len(targets) != len(weights):
        raise ValueError(f"adapter does not fit slot {slot}: unexpected {unknown[:3]}, missing {missing[:3]}")
    with torch.no_grad():
        for key, tensor in targets.items():
            params[key].copy_(tensor)


def detach_adapter(model: Any, name: str) -> Any:
    """Remove adapter `name` (worker thread); the last one out gives back the plain base model."""
    if len(model.peft_config) <= 1:
        return model.unload()
    if name in model.active_adapters:  # requests name their adapters; peft's "active" one is moot
        model.set_adapter(next(n for n in model.peft_config if n != name))
    model.delete_adapter(name)
    model.eval()
    return model


def adapter_names(rows: Sequence[str | None]) -> list[str]:
    return [BASE if name is None else name for name in rows]


class EngineAdapters:
    """The registry of loaded adapters (event-loop side). `enabled` = --enable-lora."""

    def __init__(
        self,
        *,
        enabled: bool,
        max_rank: int | None,
        target_modules: Sequence[str] | None,
        stale: bool = False,
    ) -> None:
        self.enabled = enabled
        self.max_rank = max_rank
        # SGLang's `--lora-target-modules all` allows every module.
        self.target_modules = set(target_modules) if target_modules and "all" not in target_modules else None
        self.stale = stale
        self.loaded: dict[str, _Adapter] = {}
        self.free: list[tuple[str, tuple[Any, ...]]] = []  # (slot, shape) of unloaded adapters
        self._slots = 0
        self.lock = asyncio.Lock()  # one load or unload at a time

    @property
    def paths(self) -> dict[str, str]:
        return {name: a.path for name, a in self.loaded.items() if not a.unloading}

    # ---- requests ---------------------------------------------------------------------------------
    def resolve(self, lora_path: object, count: int) -> list[str | None]:
        """The adapter each of `count` batch items names (validated, not yet held). ValueError -> 400."""
        if lora_path is None:
            return [None] * count
        raw: list[object] = lora_path if isinstance(lora_path, list) else [lora_path] * count
        if len(raw) != count:
            raise ValueError(f"lora_path has {len(raw)} entries for a batch of {count}")
        names = [name for name in raw if name is None or isinstance(name, str)]
        if len(names) != count:
            raise ValueError("lora_path must be a string, null, or a list of them (one per batch item)")
        wanted = {name for name in names if name is not None}
        if wanted and not self.enabled:
            raise ValueError("LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
        missing = sorted(name for name in wanted if name not in self.paths)
        if missing:
            raise ValueError(
                f"The following requested LoRA adapters are not loaded: {', '.join(missing)}\n"
                f"Loaded adapters: {', '.join(sorted(self.paths)) or '(none)'}"
            )
        return list(names)

    def acquire(self, name: str | None) -> str | None:
        """Hold adapter `name` for one request; returns the name to run it with inside the model."""
        if name is None:
            return None
        adapter = self.loaded[name]
        adapter.holders += 1
        adapter.idle.clear()
        return adapter.peft_name

    def release(self, name: str | None) -> None:
        if name is None or name not in self.loaded:
            return
        adapter = self.loaded[name]
        adapter.holders -= 1
        if adapter.holders <= 0:
            adapter.holders = 0
            adapter.idle.set()

    # ---- control ----------------------------------------------------------------------------------
    def check_new(self, name: object, path: object) -> str | None:
        """Why a load of (`name`, `path`) is refused before reading anything, or None."""
        if not self.enabled:
            return "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            return "lora_name and lora_path must be non-empty strings"
        if name in self.loaded:
            return f"The LoRA adapter {name!r} is already loaded (unload it first)."
        return None

    def check_config(self, name: str, config: Any) -> str | None:
        """SGLang's compatibility checks of an adapter with the server's LoRA flags, or None."""
        if getattr(config, "peft_type", None) is None or str(config.peft_type).rsplit(".", 1)[-1] != "LORA":
            return f"adapter {name} is not a LoRA adapter (peft_type {getattr(config, 'peft_type', None)})"
        rank = int(config.r)
        if self.max_rank is not None and rank > self.max_rank:
            return f"LoRA adapter {name} has rank {rank} > --max-lora-rank {self.max_rank}"
        targets = config.target_modules
        if not isinstance(targets, (list, set, tuple)):
            return f"LoRA adapter {name} names its target modules as a pattern ({targets!r}); list them"
        if self.target_modules is not None and not set(targets) <= self.target_modules:
            extra = sorted(set(targets) - self.target_modules)
            return f"LoRA adapter {name} targets {extra}, outside --lora-target-modules"
        return None

    async def load(
        self, name: object, path: object, batcher: Any, loader: concurrent.futures.Executor, device: str
    ) -> tuple[int, dict[str, Any]]:
        """(HTTP status, reply) of /load_lora_adapter."""
        async with self.lock:
            problem = self.check_new(name, path)
            if problem is not None:
                return 400, lora_reply(False, problem, self.paths)
            assert isinstance(name, str) and isinstance(path, str)
            loop = asyncio.get_running_loop()
            try:
                config, weights = await loop.run_in_executor(loader, read_adapter, path, device)
            except Exception as exc:
                message = f"Failed to load LoRA adapter {name} from {path}: {type(exc).__name__}: {exc}"
                return 400, lora_reply(False, message, self.paths)
            problem = self.check_config(name, config)
            if problem is not None:
                return 400, lora_reply(False, problem, self.paths)
            shape = slot_shape(config)
            if self.stale:
                log.warning("fault injection: adapter %s acknowledged but not applied", name)
                slot = None
            else:
                try:
                    slot = await self._fill_slot(shape, config, weights, batcher)
                except ValueError as exc:
                    return 400, lora_reply(False, str(exc), self.paths)
            self.loaded[name] = _Adapter(path=path, peft_name=slot, shape=shape)
            self.loaded[name].idle.set()
            log.info("LoRA adapter %s loaded from %s", name, path)
            return 200, lora_reply(True, "", self.paths)

    async def _fill_slot(
        self, shape: tuple[Any, ...], config: Any, weights: dict[str, Any], batcher: Any
    ) -> str:
        """A slot holding `weights`: a free one of the same shape refilled, else a new one injected."""
        for i, (slot, free_shape) in enumerate(self.free):
            if free_shape == shape:
                await asyncio.wrap_future(batcher.refill_adapter(slot, weights))
                del self.free[i]
                return slot
        slot = f"slot{self._slots}"
        await asyncio.wrap_future(batcher.attach_adapter(slot, config, weights))
        self._slots += 1
        return slot

    async def unload(self, name: object, batcher: Any) -> tuple[int, dict[str, Any]]:
        """(HTTP status, reply) of /unload_lora_adapter; waits for the requests holding the adapter."""
        if not isinstance(name, str) or name not in self.loaded or self.loaded[name].unloading:
            return 400, lora_reply(False, f"LoRA adapter {name!r} is not loaded.", self.paths)
        adapter = self.loaded[name]
        adapter.unloading = True  # no new request may name it from now on
        await adapter.idle.wait()
        async with self.lock:
            if adapter.peft_name is not None:
                if len(self.free) < MAX_FREE_SLOTS:
                    self.free.append((adapter.peft_name, adapter.shape))
                else:
                    await asyncio.wrap_future(batcher.detach_adapter(adapter.peft_name))
            del self.loaded[name]
        log.info("LoRA adapter %s unloaded", name)
        return 200, lora_reply(True, "", self.paths)
