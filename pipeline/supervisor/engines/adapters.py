"""LoRA served as adapters (`learner.lora.serving = "adapter"`): names, launch flags, and which adapter
each request names.

SGLang's dynamic LoRA (0.5.x, `docs/advanced_features/lora.md`, `io_struct.py`): a server launched with
`--enable-lora --max-lora-rank R --lora-target-modules M ...` (and `--lora-paths NAME=PATH` to load at
start) loads adapters with `/load_lora_adapter {lora_name, lora_path, pinned}`, drops them with
`/unload_lora_adapter {lora_name}`, and a `/generate` request names its adapter in `lora_path`.

Policy version v > 0 is served as the adapter `rollwise-v<v>`; version 0 is the base model, whose
requests name no adapter. `AdapterRouting` stands in front of the EnginePool: every request names the
newest served adapter, holds it until its reply, and reports the adapter's version as the version of its
tokens (the engine's own `weight_version` is the base's and never moves). An adapter replaced by a newer
one is unloaded on every engine once no request names it any more.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import Counter
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from pipeline.contracts.learner_config import LoraConfig
from pipeline.supervisor.engines.pool import EnginePool
from pipeline.supervisor.engines.protocol import GenerateResult, RoutedExpertsRequest, SamplingParams

log = logging.getLogger(__name__)

ADAPTER_PREFIX = "rollwise-v"


def adapter_name(version: int) -> str | None:
    """The adapter name of policy `version` (None for version 0: the base model)."""
    if version < 0:
        raise ValueError(f"policy version must be >= 0, got {version}")
    return f"{ADAPTER_PREFIX}{version}" if version > 0 else None


def lora_launch_flags(lora: LoraConfig, *, version: int, adapter: Path | None) -> list[str]:
    """SGLang's LoRA server flags for `[learner.lora]` served as adapters ([] otherwise); with the adapter
    directory of `version` > 0, also `--lora-paths` so the engine starts serving it. The embedded engine
    takes the same flags."""
    if not lora.enabled or lora.serving != "adapter":
        return []
    flags = [
        "--enable-lora",
        "--max-lora-rank",
        str(lora.rank),
        "--lora-target-modules",
        *lora.target_modules,
    ]
    name = adapter_name(version)
    if name is not None and adapter is not None:
        flags += ["--lora-paths", f"{name}={adapter}"]
    return flags


class AdapterRegistry:
    """Which adapter new requests name (the served version's) and how many requests hold each adapter.

    `serve(v)` makes version v the one new requests name and retires the previous adapter; a retired
    adapter is handed to `unload(name)` once its last request released it (at once if none holds it).
    """

    def __init__(self, version: int, unload: Callable[[str], Coroutine[Any, Any, None]]) -> None:
        self.version = version
        self._unload = unload
        self._holders: Counter[str] = Counter()
        self._retired: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def current(self) -> str | None:
        return adapter_name(self.version)

    def held(self, name: str) -> int:
        return self._holders[name]

    def acquire(self) -> tuple[str | None, int]:
        """(adapter name, version) for a new request; pair it with `release(name)`."""
        name = self.current
        if name is not None:
            self._holders[name] += 1
        return name, self.version

    def release(self, name: str | None) -> None:
        if name is None:
            return
        self._holders[name] -= 1
        if self._holders[name] <= 0:
            del self._holders[name]
            if name in self._retired:
                self._start_unload(name)

    def serve(self, version: int) -> None:
        """New requests name `version`'s adapter from now on; the previous one is retired."""
        previous = self.current
        self.version = version
        if previous is None or previous == self.current:
            return
        self._retired.add(previous)
        if self._holders[previous] == 0:
            self._start_unload(previous)

    def _start_unload(self, name: str) -> None:
        self._retired.discard(name)
        task = asyncio.get_running_loop().create_task(self._unload(name), name=f"unload-{name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self) -> None:
        """Wait for the unloads already started (tests; shutdown does not need them)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)


class AdapterRouting:
    """The EnginePool's `generate` with every request naming the served adapter (see module docstring)."""

    def __init__(self, pool: EnginePool, registry: AdapterRegistry) -> None:
        self.pool = pool
        self.registry = registry

    async def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        rid: str,
        *,
        affinity_key: str,
        priority: int | None = None,
        routed_experts: RoutedExpertsRequest | None = None,
    ) -> GenerateResult:
        name, version = self.registry.acquire()
        try:
            result = await self.pool.generate(
                input_ids,
                sampling,
                rid,
                affinity_key=affinity_key,
                priority=priority,
                lora_path=name,
                routed_experts=routed_experts,
            )
        finally:
            self.registry.release(name)
        # A request decodes every token with the adapter it named, whatever was loaded meanwhile.
        label = str(version)
        return dataclasses.replace(
            result, weight_version=label, token_versions=[label] * len(result.output_ids)
        )


def unloader(pool: EnginePool) -> Callable[[str], Coroutine[Any, Any, None]]:
    """`unload(name)` for the registry: /unload_lora_adapter on every engine; failures are logged (an
    engine restarted since never loaded it, and SGLang waits for its own in-flight requests)."""

    async def unload(name: str) -> None:
        for outcome in await pool.unload_lora_all(name):
            if outcome.error is not None:
                log.warning("unloading adapter %s on %s failed: %s", name, outcome.url, outcome.error)

    return unload
