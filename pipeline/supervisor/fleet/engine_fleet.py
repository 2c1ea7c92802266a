"""The engines of a run: managed children (none for `engine.kind = "external"`), one EngineClient per
engine, the EnginePool over them and, with `[engine.router] kind = "sglang-router"`, the router in front.

- A managed engine is kept running with backoff; each (re)start loads the served version, and it is
  marked up only once it serves the newest published one. `MAX_FAILED_STARTS` failed starts in a row
  call `fail(why)`.
- The router is a child too, restarted with the engines up at that moment; an engine joins its worker
  list only while up on the served version. Engines added or drained at run time go through `admit`
  and `retire` (fleet_membership.py).
- One weight operation at a time (`sync_lock`). With `engine.weight_transport = "http"` an engine's
  fetcher copies each version to its own disk first (`weights_for`).
- An engine that stops answering is ejected and readmitted only after `rejoin` loaded the served
  version. With none able to serve, admission waits; after `engine.unavailable_timeout_s` the daemon
  stops, naming them (`guard_availability`).
- LoRA served as adapters: every engine runs the initial model with the LoRA flags, a version is its
  adapter, and `generator` makes each request name the served adapter.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

from pipeline.contracts.config import Config, ExternalEngine, reveal
from pipeline.contracts.run_dir import RunDir
from pipeline.contracts.tls import client_context, scheme_of
from pipeline.supervisor.actors.rollout import GenerateEngine
from pipeline.supervisor.engines.adapters import AdapterRegistry, AdapterRouting, adapter_name, unloader
from pipeline.supervisor.engines.client import EngineClient
from pipeline.supervisor.engines.pool import EnginePool
from pipeline.supervisor.engines.protocol import EngineError
from pipeline.supervisor.engines.router import RouterAdmin, RouterError, router_argv
from pipeline.supervisor.engines.weightsync import SyncMode, SyncTimings, sync_weights
from pipeline.supervisor.fleet.children import Child, ChildSpec, keep_running
from pipeline.supervisor.fleet.engine_launch import EngineSlot, engine_child_spec, plan_engines
from pipeline.supervisor.fleet.port_reservations import PortReservations
from pipeline.supervisor.observability import metrics
from pipeline.transport.weights_http import FetchError, request_fetch

log = logging.getLogger("rollwise.engine_fleet")

MAX_FAILED_STARTS = 3
ROUTER_READY_TIMEOUT_S = 60.0
# A fetcher that cannot be reached, or whose connection breaks, is asked again after these delays; then
# its engine sits this sync out (it keeps its version until the next one) rather than fail the run.
FETCH_RETRY_S = (0.5, 2.0)
_FETCH_FAILURES = (FetchError, aiohttp.ClientError, TimeoutError, OSError)


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
        # What this machine's clients trust (engines, fetchers and the router over https).
        self.client_tls = client_context(self.cfg.tls.files())
        self.ports = PortReservations()  # the ports picked for its children, held until `stop`
        self.slots: list[EngineSlot] = plan_engines(self.cfg, self.ports.take)
        self.up: dict[str, bool] = {s.name: False for s in self.slots}
        self._up_events = {s.name: asyncio.Event() for s in self.slots}
        e = self.cfg.engine
        self.clients = [self.make_client(s.url) for s in self.slots]
        # engine URL -> its fetcher (weights over HTTP): an embedded engine serves the route itself.
        self.fetchers: dict[str, str] = {}
        if e.weight_transport == "http":
            listed = e.fetch_urls if isinstance(e, ExternalEngine) else []
            fetch_urls = listed or [s.url for s in self.slots]
            self.fetchers = {s.url: f.rstrip("/") for s, f in zip(self.slots, fetch_urls, strict=True)}
        self.capacity: dict[str, int] = {}  # engine URL -> max_running_requests it reported
        self.engine_tasks: dict[str, asyncio.Task[None]] = {}  # managed slot name -> its keep() task
        self.router_url: str | None = None
        self.router_metrics_url: str | None = None
        self.router_admin: RouterAdmin | None = None
        self.router_child: Child | None = None
        self._router_up = False
        self._router_ready = asyncio.Event()
        router_client = None
        router = e.router
        if router.kind == "sglang-router":
            port = router.port or self.ports.take(router.host)
            self._router_prometheus_port = self.ports.take(router.host)
            self.router_url = f"{scheme_of(router.host, self.cfg.tls.files())}://{router.host}:{port}"
            self.router_metrics_url = f"http://{router.host}:{self._router_prometheus_port}/metrics"
            self._router_port = port
            router_client = self.make_client(self.router_url)
            self.router_admin = RouterAdmin(self.router_url, ssl_context=self.client_tls)
        self.pool = EnginePool(self.clients, router=router_client)
        lora = self.cfg.learner.lora
        self.adapters: AdapterRegistry | None = None
        self.generator: GenerateEngine = self.pool
        if lora.enabled and lora.serving == "adapter":
            self.adapters = AdapterRegistry(0, unloader(self.pool))
            self.generator = AdapterRouting(self.pool, self.adapters)
        self.weight_source: str | None = None  # the admin endpoint's URL, set by the supervisor
        self.weight_token: str | None = None
        self.on_capacity: Callable[[], None] = lambda: None
        self.sync_lock = asyncio.Lock()  # one weight operation at a time, first come first served
        # A version published while `start` waits for the engines (a learner that resumes and trains its
        # pending groups at once) is synced once they answer: before that, an engine still warming up
        # was paused and asked to load, and its warm-up waited behind the pause until both timed out.
        self._starting = False
        self._started = asyncio.Event()
        self.health_watch_s = e.health_check_interval_s
        self.pool.on_rejoin = self.rejoin
        self.progress_message: Callable[[str], None] = lambda text: None

    def make_client(self, url: str) -> EngineClient:
        e = self.cfg.engine
        return EngineClient(
            url, api_key=reveal(e.api_key), request_timeout_s=e.request_timeout_s, ssl_context=self.client_tls
        )

    async def sync(self, path: str, version: int, mode: SyncMode) -> SyncTimings:
        """Load published `version` (at `path`) on every engine: its weights (each engine's own copy when
        they travel over HTTP, fetched before the pause), or the version's adapter."""
        if self._starting and not self._started.is_set():
            await self._started.wait()
        local = await self.stage(version, path) if self.fetchers and self.adapters is None else None
        return await sync_weights(
            self.pool, model_path=path, version=version, mode=mode, model_paths=local, adapter=self.adapters
        )

    async def start(self) -> None:
        """Start the managed engines and wait until every engine, external ones included, answers
        /health; then the router, until it lists every engine as a healthy worker."""
        self._starting = True
        try:
            await self._start()
        finally:
            self._started.set()  # also when starting failed: a waiting sync then meets the failure itself

    async def _start(self) -> None:
        if self.adapters is not None:
            self.adapters.version = self.served_version()
        self.pool.weight_version = str(self.served_version())
        for slot, client in zip(self.slots, self.clients, strict=True):
            if slot.managed:
                task = asyncio.create_task(self.keep(slot, client), name=slot.name)
                self.engine_tasks[slot.name] = task
                self._tasks.append(task)
            else:
                await client.wait_ready(self.cfg.engine.startup_timeout_s)
                version = self.served_version()
                await self.catch_up(client, await self.serves_version(client), version)
                self._mark_up(slot, version)
        await asyncio.gather(*(e.wait() for e in self._up_events.values()))
        await asyncio.gather(*(self.read_capacity(c) for c in self.clients))
        if self.router_admin is not None:
            self._tasks.append(asyncio.create_task(self.keep_router(), name="router"))
            await self._router_ready.wait()
        self._tasks.append(
            asyncio.create_task(
                self.pool.watch_health(self.health_watch_s, self.stopping), name="engine health"
            )
        )

    async def rejoin(self, client: EngineClient) -> None:
        """An ejected engine answers /health again: load the served version into it and release it before
        the pool gives it work (EngineError: not now; the pool keeps probing). Released: a weight sync
        that paused it and then lost it (a partition between pause and continue) left it paused, and a
        paused engine queues every request until each times out, over and over."""
        async with self.sync_lock:
            version = self.served_version()
            serving = await self.serves_version(client)
            if serving != str(version):
                log.warning(
                    "engine %s is back serving version %s; loading the served version %d before it gets work",
                    client.base_url,
                    serving,
                    version,
                )
            try:
                await self.catch_up(client, serving, version)
            except _FETCH_FAILURES as exc:
                # The pool keeps an engine it cannot load ejected and probes it again; any other error
                # would end its probing for good.
                raise EngineError(f"its fetcher could not fetch version {version}: {exc}") from exc
            await client.continue_generation()
            metrics.POLICY_VERSION_SERVED.labels(engine=client.base_url).set(version)

    async def guard_availability(self, timeout_s: float) -> None:
        """Stop the daemon when no engine has been able to serve for `timeout_s` (module docstring)."""
        changed = asyncio.Event()
        self.pool.add_listener(changed.set)
        while not self.stopping.is_set():
            if self.pool.serving > 0:
                changed.clear()
                await changed.wait()
                continue
            down = ", ".join(s.url for s in self.slots)
            self.progress_message(
                f"no engine answers ({down}): admission waits; the daemon stops in {timeout_s:.0f} s "
                "(engine.unavailable_timeout_s) unless one comes back"
            )
            changed.clear()
            try:
                await asyncio.wait_for(self._until_serving(changed), timeout_s)
            except TimeoutError:
                self.fail(
                    f"no engine has answered for {timeout_s:.0f} s (engine.unavailable_timeout_s): {down}; "
                    "see each engine's log, and docs/troubleshoot.md, 'When things break'"
                )
                return
            self.progress_message(f"engines serve again ({self.pool.serving} of {len(self.pool.members)})")

    async def _until_serving(self, changed: asyncio.Event) -> None:
        while self.pool.serving == 0:
            await changed.wait()
            changed.clear()

    def not_up(self) -> list[str]:
        down = [name for name, up in self.up.items() if not up]
        if self.router_admin is not None and not self._router_up:
            down.append("router")
        return down

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
        fetched = self.run_dir.root / "fetched" / slot.name if slot.url in self.fetchers else None
        return engine_child_spec(
            self.cfg, slot, model_dir=weights, version=version, log_dir=self.run_dir.logs, weights_dir=fetched
        )

    async def weights_for(self, url: str, version: int, published_path: str | None = None) -> str:
        """The path engine `url` loads `version` from: the run directory's copy, or (weights over HTTP)
        the copy its fetcher downloads now from the admin endpoint."""
        fetcher = self.fetchers.get(url)
        if fetcher is None or version == 0:
            return published_path or str(self.run_dir.serving_weights(version))
        if self.weight_source is None:
            raise RuntimeError("weights over HTTP need the admin endpoint, which is not started")
        source, token = self.weight_source, self.weight_token
        return await request_fetch(
            fetcher,
            source=source,
            version=version,
            token=token,
            ssl_context=self.client_tls,
            api_key=reveal(self.cfg.engine.api_key),
        )

    async def stage(self, version: int, published_path: str) -> dict[str, str | None]:
        """Each engine's path for `version`, fetched in parallel where needed (before any pause); None for
        an engine whose fetcher answered that it failed (it resumes a broken download itself for
        weights_http.FETCHER_RETRY_S first) or could not be reached FETCH_RETRY_S tries over: that engine
        sits this sync out, counted as its error, and loads the next version."""

        async def fetched(url: str) -> str | None:
            for delay in (*FETCH_RETRY_S, None):
                try:
                    return await self.weights_for(url, version, published_path)
                except _FETCH_FAILURES as exc:
                    why = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
                    if delay is None or isinstance(exc, FetchError):
                        log.error("engine %s: its fetcher could not fetch version %d: %s", url, version, why)
                        self.progress_message(
                            f"engine {url} could not fetch version {version} ({why}); it serves its current "
                            "version until the next sync"
                        )
                        return None
                    log.warning(
                        "engine %s: fetching version %d failed (%s); again in %.1f s",
                        url,
                        version,
                        why,
                        delay,
                    )
                    await asyncio.sleep(delay)
            return None

        urls = [c.base_url for c in self.pool.members]
        paths = await asyncio.gather(*(fetched(u) for u in urls))
        return dict(zip(urls, paths, strict=True))

    @staticmethod
    async def serves_version(client: EngineClient) -> str | None:
        try:
            info = await client.model_info()
        except EngineError:
            return None
        version = info.get("weight_version")
        return str(version) if version is not None else None

    async def catch_up(self, client: EngineClient, serving: str | None, version: int) -> None:
        """Load `version` into an engine that serves another one (a late start, a joining engine)."""
        if serving == str(version) or (serving == "default" and version == 0):
            return
        if self.adapters is not None:
            name = adapter_name(version)
            if name is None:
                return
            try:
                await client.load_lora_adapter(name, str(self.run_dir.weights_of(version)))
            except EngineError as exc:
                # An external server that kept running since the last daemon may hold it already (the load
                # is refused then); the served-policy check verifies what it serves either way.
                log.warning("loading adapter of version %d on %s: %s", version, client.base_url, exc)
            return
        path = await self.weights_for(client.base_url, version)
        await client.update_weights_from_disk(path, weight_version=str(version))

    async def read_capacity(self, client: EngineClient) -> None:
        """max_running_requests the engine reports (its share of the fleet's concurrency); 1 if none."""
        try:
            info = await client.server_info()
            self.capacity[client.base_url] = max(1, int(info.get("max_running_requests") or 1))
        except (EngineError, TypeError, ValueError) as exc:
            log.warning("%s reported no max_running_requests (%r); counting it as 1", client.base_url, exc)
            self.capacity[client.base_url] = 1

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
            await self.catch_up(client, str(launched), version)  # published while this engine started
            self._mark_up(slot, version)
            await self.router_join(slot.url)
            await child.wait()
            self.up[slot.name] = False
            await self.router_leave(slot.url)

        def started(child: Child) -> None:
            self.children[slot.name] = child

        await keep_running(
            lambda: self._spec(slot), serve, self.stopping, component="engine", on_start=started
        )

    # --- the router ---------------------------------------------------------------------------------------
    def _router_spec(self) -> ChildSpec:
        e = self.cfg.engine
        up = [u for u in self.pool_urls() if self._is_up(u)]
        return ChildSpec(
            name="router",
            argv=router_argv(
                host=e.router.host,
                port=self._router_port,
                worker_urls=up,
                policy=e.router.policy,
                request_timeout_s=e.request_timeout_s,
                prometheus_port=self._router_prometheus_port,
                api_key=reveal(e.api_key),
                extra_args=e.router.args,
                tls=self.cfg.tls.files(),
            ),
            log_path=self.run_dir.log_file("router"),
        )

    def _is_up(self, url: str) -> bool:
        for slot in self.slots:
            if slot.url == url:
                return self.up.get(slot.name, False)
        return True  # engines added at run time are members only while up

    async def keep_router(self) -> None:
        """Keep the router running; it is up once it lists every engine it was started with."""
        admin = self.router_admin
        assert admin is not None
        failed_starts = 0

        async def serve(child: Child) -> None:
            nonlocal failed_starts
            workers = {u for u in self.pool_urls() if self._is_up(u)}
            waiting = asyncio.ensure_future(admin.wait_workers(workers, ROUTER_READY_TIMEOUT_S))
            exited = asyncio.ensure_future(child.wait())
            await asyncio.wait({waiting, exited}, return_when=asyncio.FIRST_COMPLETED)
            if not (waiting.done() and waiting.exception() is None):
                waiting.cancel()
                await asyncio.gather(waiting, return_exceptions=True)
                failed_starts += 1
                if failed_starts >= MAX_FAILED_STARTS:
                    self.fail(f"the router failed to start {failed_starts} times; see {child.spec.log_path}")
                child.kill()
                await exited
                return
            failed_starts = 0
            self._router_up = True
            self._router_ready.set()
            await exited
            self._router_up = False

        def started(child: Child) -> None:
            self.router_child = child

        await keep_running(self._router_spec, serve, self.stopping, component="router", on_start=started)

    def pool_urls(self) -> list[str]:
        return [c.base_url for c in self.pool.members]

    async def router_join(self, url: str) -> None:
        """Put `url` in the router's worker list and wait until the router routes to it."""
        if self.router_admin is None or not self._router_up:
            return
        try:
            await self.router_admin.add_worker(url)
            await self.router_admin.wait_worker(url, ROUTER_READY_TIMEOUT_S)
        except (RouterError, OSError) as exc:
            log.error("router did not take worker %s: %s", url, exc)

    async def router_leave(self, url: str) -> None:
        if self.router_admin is None or not self._router_up:
            return
        try:
            await self.router_admin.remove_worker(url)
        except (RouterError, OSError) as exc:
            log.error("router did not drop worker %s: %s", url, exc)

    async def retire(self, slot: EngineSlot) -> None:
        """Stop keeping a managed engine alive (a drain): its process is killed, not restarted."""
        task = self.engine_tasks.pop(slot.name, None)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        self.children.pop(slot.name, None)
        self.up.pop(slot.name, None)
        self._up_events.pop(slot.name, None)

    # --- stop ---------------------------------------------------------------------------------------------
    async def stop(self, grace_s: float) -> None:
        """SIGTERM every engine (and the router), SIGKILL after `grace_s`. Idempotent."""
        children = [*self.children.values(), *([self.router_child] if self.router_child else [])]
        await asyncio.gather(*(c.stop(grace_s) for c in children), return_exceptions=True)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.pool.close()
        if self.router_admin is not None:
            await self.router_admin.close()
        self.ports.close()


async def ready_or_exited(client: EngineClient, child: Child, timeout_s: float) -> bool:
    """True once the engine answers /health; False if its process exits or `timeout_s` passes first."""
    ready = asyncio.ensure_future(client.wait_ready(timeout_s))
    exited = asyncio.ensure_future(child.wait())
    await asyncio.wait({ready, exited}, return_when=asyncio.FIRST_COMPLETED)
    exited.cancel()
    if ready.done() and ready.exception() is None:
        return True
    if ready.done():  # a 4xx: a wrong api key, or another program answering on the engine's port
        log.warning("%s (pid %s) is not ready: %s", child.spec.name, child.pid, ready.exception())
    ready.cancel()
    await asyncio.gather(ready, return_exceptions=True)
    if child.returncode is None:
        child.kill()
    return False
