"""The engines of a run: the managed children (none for `engine.kind = "external"`), one EngineClient
per engine and the EnginePool over them.

A managed engine is kept running with backoff; each (re)start loads the version the daemon serves at
that moment (`served_version()`), and an engine that comes up after a newer version was published
loads it before it is marked up. An engine that fails its start `MAX_FAILED_STARTS` times in a row
calls `fail(why)`.

With LoRA served as adapters (`learner.lora.serving = "adapter"`) every engine runs the initial model
with SGLang's LoRA flags and a version is its adapter (pipeline.engine.adapters): a (re)started engine
loads the served version's adapter at launch (`--lora-paths`), `sync` loads new ones, and `generator`
(what the actors call) makes each request name the served adapter.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from pipeline.actors.rollout import GenerateEngine
from pipeline.config import Config
from pipeline.daemon.children import Child, ChildSpec, keep_running
from pipeline.daemon.weightsync import SyncMode, SyncTimings, sync_weights
from pipeline.engine.adapters import AdapterRegistry, AdapterRouting, adapter_name, unloader
from pipeline.engine.client import EngineClient
from pipeline.engine.launch import EngineSlot, engine_child_spec, plan_engines
from pipeline.engine.pool import EnginePool
from pipeline.engine.protocol import EngineError
from pipeline.observability import metrics
from pipeline.run_dir import RunDir

log = logging.getLogger("rollwise.engine_fleet")

MAX_FAILED_STARTS = 3


@dataclass(eq=False)  # identity, not field-wise equality
class EngineFleet:
    """`served_version()` is the version the daemon serves now; `fail(why)` stops the daemon."""

    cfg: Config
    run_dir: RunDir
    stopping: asyncio.Event
    served_version: Callable[[], int]
    fail: Callable[[str], None]
    children: dict[str, Child] = field(default_factory=dict, init=False)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        self.slots: list[EngineSlot] = plan_engines(self.cfg)
        self.up: dict[str, bool] = {s.name: False for s in self.slots}
        self._up_events = {s.name: asyncio.Event() for s in self.slots}
        e = self.cfg.engine
        self.clients = [
            EngineClient(s.url, api_key=e.api_key, request_timeout_s=e.request_timeout_s) for s in self.slots
        ]
        self.pool = EnginePool(self.clients)
        lora = self.cfg.learner.lora
        self.adapters: AdapterRegistry | None = None
        self.generator: GenerateEngine = self.pool
        if lora.enabled and lora.serving == "adapter":
            self.adapters = AdapterRegistry(0, unloader(self.pool))
            self.generator = AdapterRouting(self.pool, self.adapters)

    async def sync(self, path: str, version: int, mode: SyncMode) -> SyncTimings:
        """Load published `version` (at `path`) on every engine: weights, or the version's adapter."""
        return await sync_weights(
            self.pool, model_path=path, version=version, mode=mode, adapter=self.adapters
        )

    async def start(self) -> None:
        """Start the managed engines and wait until every engine, external ones included, answers
        /health."""
        if self.adapters is not None:
            self.adapters.version = self.served_version()
        for slot, client in zip(self.slots, self.clients, strict=True):
            if slot.managed:
                self._tasks.append(asyncio.create_task(self.keep(slot, client), name=slot.name))
            else:
                await client.wait_ready(self.cfg.engine.startup_timeout_s)
                version = self.served_version()
                if self.adapters is not None and version > 0:
                    # An external server does not start on our adapter; one that kept running since the
                    # last daemon already has it (then the load is refused, and the check still verifies).
                    try:
                        await self._catch_up(client, version)
                    except EngineError as exc:
                        log.warning("loading adapter of version %d on %s: %s", version, slot.url, exc)
                self._mark_up(slot, version)
        await asyncio.gather(*(e.wait() for e in self._up_events.values()))

    def not_up(self) -> list[str]:
        return [name for name, up in self.up.items() if not up]

    def _mark_up(self, slot: EngineSlot, version: int) -> None:
        self.up[slot.name] = True
        self._up_events[slot.name].set()
        metrics.POLICY_VERSION_SERVED.labels(engine=slot.url).set(version)

    def _spec(self, slot: EngineSlot) -> ChildSpec:
        version = self.served_version()
        if self.adapters is not None:
            adapter = self.run_dir.weights_of(version) if version > 0 else None
            return engine_child_spec(
                self.cfg,
                slot,
                model_dir=self.run_dir.initial_model,
                version=version,
                log_dir=self.run_dir.logs,
                adapter=adapter,
            )
        weights = self.run_dir.serving_weights(version)
        return engine_child_spec(
            self.cfg, slot, model_dir=weights, version=version, log_dir=self.run_dir.logs
        )

    async def _catch_up(self, client: EngineClient, version: int) -> None:
        """Load `version` on an engine that started on an older one."""
        if self.adapters is not None:
            name = adapter_name(version)
            if name is not None:
                await client.load_lora_adapter(name, str(self.run_dir.weights_of(version)))
            return
        weights = self.run_dir.serving_weights(version)
        await client.update_weights_from_disk(str(weights), weight_version=str(version))

    async def keep(self, slot: EngineSlot, client: EngineClient) -> None:
        """Keep one engine running; a restarted engine loads the version served at its start."""
        failed_starts = 0

        async def serve(child: Child) -> None:
            nonlocal failed_starts
            launched = self.served_version()
            if not await ready_or_exited(client, child, self.cfg.engine.startup_timeout_s):
                failed_starts += 1
                if failed_starts >= MAX_FAILED_STARTS:
                    self.fail(f"{slot.name} failed to start {failed_starts} times; see {child.spec.log_path}")
                return
            failed_starts = 0
            version = self.served_version()
            if version != launched:  # a version was published while this engine was starting
                await self._catch_up(client, version)
            self._mark_up(slot, version)
            await child.wait()
            self.up[slot.name] = False

        def started(child: Child) -> None:
            self.children[slot.name] = child

        await keep_running(
            lambda: self._spec(slot), serve, self.stopping, component="engine", on_start=started
        )

    async def stop(self, grace_s: float) -> None:
        """SIGTERM every engine, SIGKILL after `grace_s`. Idempotent."""
        await asyncio.gather(*(c.stop(grace_s) for c in self.children.values()), return_exceptions=True)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.pool.close()


async def ready_or_exited(client: EngineClient, child: Child, timeout_s: float) -> bool:
    """True once the engine answers /health; False if its process exits or `timeout_s` passes first."""
    ready = asyncio.ensure_future(client.wait_ready(timeout_s))
    exited = asyncio.ensure_future(child.wait())
    await asyncio.wait({ready, exited}, return_when=asyncio.FIRST_COMPLETED)
    exited.cancel()
    if ready.done() and ready.exception() is None:
        return True
    ready.cancel()
    await asyncio.gather(ready, return_exceptions=True)
    if child.returncode is None:
        child.kill()
    return False
