"""Engines that join and leave a running daemon (`rollwise engines add|drain URL`,
pipeline/supervisor/fleet/admin.py).

Join: the engine must answer /health; under the supervisor's publish lock (so no weight sync runs in
between) it loads the version the fleet serves when it serves another one, and only then becomes a
pool member and a router worker: it never receives work on old weights.

Drain: the engine gets no new turns at once (the pool skips it, the router drops it); its in-flight
turns get `engine.drain_timeout_s` to finish; those still running then are aborted on it and sent
again, from their prompt, to another engine (EnginePool.hand_back), so a drain costs no episode. Then
it leaves the pool (a managed engine's process is stopped and not restarted).

Capacity: each engine counts with the `max_running_requests` it reports; the scheduler's concurrency
is `rollout.max_concurrent_groups` scaled by the fleet's capacity now over its capacity at start
(`scaled_concurrency`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from pipeline.contracts.tls import PlaintextRefused, check_url
from pipeline.supervisor.engines.client import EngineClient
from pipeline.supervisor.engines.protocol import EngineError
from pipeline.supervisor.fleet.engine_fleet import EngineFleet
from pipeline.supervisor.observability import metrics

log = logging.getLogger("rollwise.fleet")

JOIN_HEALTH_TIMEOUT_S = 30.0
DRAIN_POLL_S = 0.1


class MembershipError(Exception):
    """A request the fleet cannot honour; `status` is the HTTP status the admin endpoint answers."""

    def __init__(self, message: str, status: int = 409) -> None:
        super().__init__(message)
        self.status = status


def scaled_concurrency(base: int, initial_capacity: int, capacity: int) -> int:
    """Concurrent groups for a fleet of `capacity` when `base` was configured for `initial_capacity`
    (each a sum of engines' max_running_requests): proportional, at least 1."""
    if initial_capacity <= 0:
        return max(1, base)
    return max(1, round(base * capacity / initial_capacity))


class FleetMembership:
    """`publish_lock` = the supervisor's (no sync runs while an engine joins or leaves);
    `on_capacity(total)` is called with the fleet's capacity after every change."""

    def __init__(
        self,
        fleet: EngineFleet,
        publish_lock: asyncio.Lock,
        served_version: Callable[[], int],
        on_capacity: Callable[[int], None],
    ) -> None:
        self.fleet = fleet
        self.publish_lock = publish_lock
        self.served_version = served_version
        self.on_capacity = on_capacity
        self.draining: set[str] = set()

    @property
    def capacity(self) -> int:
        return sum(
            self.fleet.capacity.get(url, 1) for url in self.fleet.pool_urls() if url not in self.draining
        )

    def _changed(self) -> None:
        metrics.FLEET_ENGINES.set(len(self.fleet.pool_urls()) - len(self.draining))
        self.on_capacity(self.capacity)

    async def describe(self) -> list[dict[str, Any]]:
        """One record per engine: url, managed, draining, capacity, weight_version, in-flight turns."""
        managed = {s.url for s in self.fleet.slots if s.managed}
        clients = self.fleet.pool.members

        async def one(client: EngineClient) -> dict[str, Any]:
            url = client.base_url
            return {
                "url": url,
                "managed": url in managed,
                "draining": url in self.draining,
                "capacity": self.fleet.capacity.get(url),
                "weight_version": await self.fleet.serves_version(client),
                "in_flight": len(self.fleet.pool.in_flight(url)) if self.fleet.router_url is None else None,
                "fetcher": self.fleet.fetchers.get(url),
            }

        return list(await asyncio.gather(*(one(c) for c in clients)))

    async def add(self, url: str, fetch_url: str | None = None) -> dict[str, Any]:
        """Join `url` to the running fleet on the served version (module docstring)."""
        url = url.rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise MembershipError(f"engine URL must start with http:// or https://, got {url!r}", 400)
        allow = self.fleet.cfg.tls.allow_plaintext
        try:
            check_url(url, "the engine's URL", allow)
            if fetch_url is not None:
                check_url(fetch_url, "its fetch_url", allow)
        except PlaintextRefused as exc:
            raise MembershipError(str(exc), 400) from None
        if url in self.fleet.pool_urls():
            raise MembershipError(f"{url} is already in the fleet")
        if self.fleet.cfg.engine.weight_transport == "http":
            # An embedded engine fetches for itself; an SGLang server needs its fetch-agent's URL.
            self.fleet.fetchers[url] = (fetch_url or url).rstrip("/")
        client = self.fleet.make_client(url)
        try:
            await client.wait_ready(JOIN_HEALTH_TIMEOUT_S)
            async with self.publish_lock:
                version = self.served_version()
                await self.fleet.catch_up(client, await self.fleet.serves_version(client), version)
                await self.fleet.read_capacity(client)
                self.fleet.pool.add_member(client)
                await self.fleet.router_join(url)
        except (TimeoutError, EngineError, OSError) as exc:
            await client.close()
            self.fleet.fetchers.pop(url, None)
            raise MembershipError(f"{url} cannot join: {exc}", 502) from exc
        metrics.POLICY_VERSION_SERVED.labels(engine=url).set(version)
        metrics.FLEET_CHANGES.labels(kind="add").inc()
        self._changed()
        log.info("engine %s joined on version %d (capacity %s)", url, version, self.fleet.capacity.get(url))
        return {"url": url, "weight_version": str(version), "capacity": self.fleet.capacity.get(url)}

    async def drain(self, url: str) -> dict[str, Any]:
        """Take `url` out of the running fleet without losing its in-flight turns (module docstring)."""
        url = url.rstrip("/")
        if url not in self.fleet.pool_urls():
            raise MembershipError(f"{url} is not in the fleet", 404)
        if url in self.draining:
            raise MembershipError(f"{url} is already draining")
        if len(self.fleet.pool_urls()) - len(self.draining) <= 1:
            raise MembershipError(f"{url} is the last engine serving; add another one before draining it")
        started = time.monotonic()
        self.draining.add(url)
        self.fleet.pool.set_draining(url)
        await self.fleet.router_leave(url)
        self._changed()
        client = next(c for c in self.fleet.pool.members if c.base_url == url)
        finished = await self._until_idle(client, self.fleet.cfg.engine.drain_timeout_s)
        handed_back: list[str] = []
        if not finished:
            handed_back = await self.fleet.pool.hand_back(url)
            metrics.FLEET_HANDED_BACK.inc(len(handed_back))
            await self._until_idle(client, 10.0)
        async with self.publish_lock:
            await self._retire_process(url)
            await self.fleet.pool.remove_member(url)
        self.draining.discard(url)
        self.fleet.capacity.pop(url, None)
        self.fleet.fetchers.pop(url, None)
        metrics.FLEET_CHANGES.labels(kind="drain").inc()
        self._changed()
        seconds = time.monotonic() - started
        log.info("engine %s drained in %.1f s (%d turns handed back)", url, seconds, len(handed_back))
        return {"url": url, "seconds": round(seconds, 3), "handed_back": len(handed_back)}

    async def _until_idle(self, client: EngineClient, timeout_s: float) -> bool:
        """True once nothing runs on the engine: the pool's own count without a router; with one, the
        engine's own count too (/get_load: requests running and queued)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.fleet.pool.in_flight(client.base_url if self.fleet.router_url is None else None):
                return True
            if self.fleet.router_url is not None and await _engine_idle(client):
                return True
            await asyncio.sleep(DRAIN_POLL_S)
        return False

    async def _retire_process(self, url: str) -> None:
        """A managed engine: stop keeping it alive and stop its process."""
        for slot in self.fleet.slots:
            if slot.url == url and slot.managed:
                await self.fleet.retire(slot)


async def _engine_idle(client: EngineClient) -> bool:
    """SGLang's /get_load of the engine itself (the router does not forward it). Its /server_info
    `internal_states` hold no request counts: reading them there made every engine look idle."""
    try:
        return await client.load() == 0
    except EngineError:
        return False
