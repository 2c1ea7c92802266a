"""EnginePool: several SGLang servers behind one `generate`, with session affinity and ejection.

Affinity: every request with the same `affinity_key` (an episode) goes to the same member, chosen by
rendezvous hashing over the healthy members, so its growing prompt stays in that server's prefix cache;
ejecting a member moves only the keys it owned.

Health: a member that fails `eject_after_failures` times in a row (EngineUnavailable or HTTP 5xx, on
requests or on `watch_health`'s /health checks) is ejected and probed every `probe_interval_s`; once it
answers, `on_rejoin` loads the fleet's served version into it before it is readmitted. `serving` counts
the members that take work; listeners hear every change. A request that certainly never reached its
member (connection refused, circuit open) goes to the key's next member; one that may have reached a
server is never resent.

With a `router` (sglang-router), `generate` goes through it with the affinity key as
`X-SMG-Routing-Key`; control calls still fan out to each member directly.

Membership changes while the pool runs (`add_member`, `remove_member`). A member being drained gets no
new requests (`set_draining`); `hand_back(url)` aborts its running requests and `generate` sends each
again, from its prompt, to another member.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from pipeline.supervisor.engines.client import EngineClient, PauseMode
from pipeline.supervisor.engines.protocol import (
    EngineError,
    EngineHTTPError,
    EngineUnavailable,
    GenerateResult,
    RoutedExpertsRequest,
    SamplingParams,
)
from pipeline.supervisor.observability import metrics

T = TypeVar("T")
log = logging.getLogger("rollwise.pool")


@dataclass(frozen=True)
class MemberOutcome(Generic[T]):
    """Result of one member's part in a fan-out call; exactly one of `value` and `error` is meaningful."""

    url: str
    seconds: float
    value: T | None
    error: EngineError | None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class _Member:
    client: EngineClient
    consecutive_failures: int = 0
    ejected: bool = False
    draining: bool = False
    probe: asyncio.Task[None] | None = None


def rendezvous_score(key: str, member_url: str) -> int:
    """Stable 64-bit weight of (key, member); the key goes to the healthy member with the highest."""
    digest = hashlib.blake2b(f"{key}\x00{member_url}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def _counts_as_failure(exc: EngineError) -> bool:
    return isinstance(exc, EngineUnavailable) or (isinstance(exc, EngineHTTPError) and exc.status >= 500)


class EnginePool:
    """A set of EngineClients (and optionally a router). The pool owns them: `close()` closes each."""

    def __init__(
        self,
        clients: list[EngineClient],
        *,
        eject_after_failures: int = 3,
        probe_interval_s: float = 2.0,
        router: EngineClient | None = None,
    ) -> None:
        if not clients:
            raise ValueError("EnginePool needs at least one EngineClient")
        if eject_after_failures < 1 or probe_interval_s <= 0:
            raise ValueError(
                f"EnginePool needs eject_after_failures >= 1 and probe_interval_s > 0; got "
                f"{eject_after_failures}, {probe_interval_s}"
            )
        urls = [c.base_url for c in clients]
        if len(set(urls)) != len(urls):
            raise ValueError(f"EnginePool members must have distinct URLs, got {urls}")
        self._members = [_Member(c) for c in clients]
        for client in clients:
            _zero_liveness_series(client.base_url)
        self.eject_after_failures = eject_after_failures
        self.probe_interval_s = probe_interval_s
        self.router = router
        if router is not None:
            # The router does not forward /abort_request; a worker ignores a rid it does not hold.
            router.abort_targets = lambda: self.members
        self._closed = False
        self._in_flight: dict[str, str] = {}  # rid -> member URL (the router's URL when routed)
        self._handed_back: set[str] = set()  # rids aborted by hand_back: generate sends them again
        self.handed_back_total = 0
        # Loads the served version into a member that answers again, before it is readmitted (the
        # fleet's catch_up); an EngineError keeps it ejected and probed.
        self.on_rejoin: Callable[[EngineClient], Awaitable[None]] | None = None
        self._listeners: list[Callable[[], None]] = []  # told whenever `serving` may have changed
        # What the members serve (the last weight version update_all loaded, or the launch version set by
        # the fleet), and how many weight syncs started so far: a reply that spans a sync without
        # per-token versions is labelled with the version its request started on.
        self.weight_version: str | None = None
        self._syncs = 0

    @property
    def members(self) -> list[EngineClient]:
        return [m.client for m in self._members]

    @property
    def healthy_members(self) -> list[EngineClient]:
        return [m.client for m in self._members if not m.ejected]

    @property
    def serving(self) -> int:
        """Members that take new work: neither ejected nor draining."""
        return sum(1 for m in self._members if not m.ejected and not m.draining)

    def add_listener(self, listener: Callable[[], None]) -> None:
        """`listener()` is called whenever a member is ejected, readmitted, added, drained or removed."""
        self._listeners.append(listener)

    def _changed(self) -> None:
        metrics.ENGINES_SERVING.set(self.serving)
        for listener in self._listeners:
            listener()

    def member_for(self, affinity_key: str) -> EngineClient:
        """The healthy member that owns `affinity_key`; EngineUnavailable when every member is ejected."""
        ranked = self._ranked(affinity_key)
        if not ranked:
            raise EngineUnavailable(self._describe(), f"all {len(self._members)} pool members are ejected")
        return ranked[0].client

    def _ranked(self, affinity_key: str) -> list[_Member]:
        healthy = [m for m in self._members if not m.ejected and not m.draining]
        if len(healthy) < 2:  # nothing to rank: skip hashing the key
            return healthy
        return sorted(healthy, key=lambda m: rendezvous_score(affinity_key, m.client.base_url), reverse=True)

    def _describe(self) -> str:
        return "pool[" + ",".join(m.client.base_url for m in self._members) + "]"

    async def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        rid: str,
        *,
        affinity_key: str,
        priority: int | None = None,
        lora_path: str | None = None,
        routed_experts: RoutedExpertsRequest | None = None,
    ) -> GenerateResult:
        """Generate on the member owning `affinity_key` (or through the router, keyed by it). A request
        handed back by a drained member is sent again. Errors as EngineClient.generate."""
        while True:
            if self.router is not None:
                result = await self._tracked(
                    self.router,
                    input_ids,
                    sampling,
                    rid,
                    affinity_key,
                    priority=priority,
                    lora_path=lora_path,
                    routed_experts=routed_experts,
                )
            else:
                result = await self._generate_direct(
                    input_ids,
                    sampling,
                    rid,
                    affinity_key,
                    priority=priority,
                    lora_path=lora_path,
                    routed_experts=routed_experts,
                )
            if result.finish_reason == "abort" and rid in self._handed_back:
                self._handed_back.discard(rid)
                self.handed_back_total += 1
                continue
            self._handed_back.discard(rid)
            return result

    async def _tracked(
        self,
        client: EngineClient,
        input_ids: list[int],
        sampling: SamplingParams,
        rid: str,
        affinity_key: str,
        *,
        priority: int | None,
        lora_path: str | None,
        routed_experts: RoutedExpertsRequest | None = None,
    ) -> GenerateResult:
        self._in_flight[rid] = client.base_url
        routing_key = affinity_key if client is self.router else None
        syncs, version = self._syncs, self.weight_version
        try:
            result = await client.generate(
                input_ids,
                sampling,
                rid,
                routing_key=routing_key,
                priority=priority,
                lora_path=lora_path,
                routed_experts=routed_experts,
            )
        finally:
            self._in_flight.pop(rid, None)
        if syncs != self._syncs and not result.versions_exact and version is not None:
            # It ran across a weight update and the engine says only the version it finished on: some
            # tokens may be older. The version it started on is the one no token can predate.
            if version != result.weight_version:
                metrics.ENGINE_VERSION_AMBIGUOUS_TOKENS.inc(len(result.output_ids))
            result.token_versions = [version] * len(result.output_ids)
        return result

    async def _generate_direct(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        rid: str,
        affinity_key: str,
        *,
        priority: int | None,
        lora_path: str | None,
        routed_experts: RoutedExpertsRequest | None = None,
    ) -> GenerateResult:
        tried: list[str] = []
        last_failure: EngineUnavailable | None = None
        while True:
            candidates = [m for m in self._ranked(affinity_key) if m.client.base_url not in tried]
            if not candidates:
                last = f"; last: {last_failure}" if last_failure is not None else ""
                raise EngineUnavailable(
                    self._describe(), f"no healthy pool member left for rid={rid!r} (tried {tried}){last}"
                ) from last_failure
            member = candidates[0]
            tried.append(member.client.base_url)
            try:
                result = await self._tracked(
                    member.client,
                    input_ids,
                    sampling,
                    rid,
                    affinity_key,
                    priority=priority,
                    lora_path=lora_path,
                    routed_experts=routed_experts,
                )
            except EngineError as exc:
                if _counts_as_failure(exc):
                    self._record_failure(member)
                if isinstance(exc, EngineUnavailable) and not exc.maybe_sent:
                    last_failure = exc
                    continue
                raise
            member.consecutive_failures = 0
            return result

    # --- membership ------------------------------------------------------------------------------------
    def _member(self, url: str) -> _Member:
        for m in self._members:
            if m.client.base_url == url.rstrip("/"):
                return m
        raise KeyError(f"{url} is not a member of {self._describe()}")

    def add_member(self, client: EngineClient) -> None:
        """A new member; it receives requests (and control calls) from now on."""
        if any(m.client.base_url == client.base_url for m in self._members):
            raise ValueError(f"{client.base_url} is already a member of {self._describe()}")
        self._members.append(_Member(client))
        _zero_liveness_series(client.base_url)
        self._changed()

    def set_draining(self, url: str, draining: bool = True) -> None:
        """A draining member gets no new requests (its episodes' next turns go to another member)."""
        self._member(url).draining = draining
        self._changed()

    def in_flight(self, url: str | None = None) -> list[str]:
        """rids running now: all of them, or those sent to member `url` (through the router: all)."""
        if url is None:
            return list(self._in_flight)
        url = url.rstrip("/")
        return [rid for rid, where in self._in_flight.items() if where in (url, self._router_url)]

    @property
    def _router_url(self) -> str | None:
        return self.router.base_url if self.router is not None else None

    async def hand_back(self, url: str) -> list[str]:
        """Abort the requests still running on member `url`; `generate` sends each again to another
        member. Through a router the pool cannot tell which worker runs a request, so it asks `url` to
        abort every rid in flight: SGLang ignores an abort for a rid it does not hold."""
        member = self._member(url)
        rids = self.in_flight(url)
        self._handed_back.update(rids)
        await asyncio.gather(*(member.client.abort_request(rid=rid) for rid in rids), return_exceptions=True)
        return rids

    async def remove_member(self, url: str) -> EngineClient:
        """Take member `url` out (no more requests or control calls) and close its client."""
        member = self._member(url)
        self._members.remove(member)
        if member.probe is not None:
            member.probe.cancel()
            await asyncio.gather(member.probe, return_exceptions=True)
        await member.client.close()
        self._changed()
        return member.client

    def _record_failure(self, member: _Member) -> None:
        member.consecutive_failures += 1
        if not member.ejected and member.consecutive_failures >= self.eject_after_failures:
            member.ejected = True
            url = member.client.base_url
            metrics.ENGINE_EJECTIONS.labels(engine=url).inc()
            log.warning(
                "engine %s stopped answering (%d failures in a row): no work goes to it; probing /health "
                "every %.1f s (%d engine(s) left)",
                url,
                member.consecutive_failures,
                self.probe_interval_s,
                self.serving,
            )
            self._changed()
            if not self._closed:
                member.probe = asyncio.create_task(self._probe_until_healthy(member))

    async def _probe_until_healthy(self, member: _Member) -> None:
        url = member.client.base_url
        while True:
            await asyncio.sleep(self.probe_interval_s)
            try:
                healthy = await member.client.health(timeout_s=max(self.probe_interval_s, 1.0))
            except EngineError:
                healthy = False
            if not healthy:
                continue
            if self.on_rejoin is not None:
                try:
                    await self.on_rejoin(member.client)
                except EngineError as exc:
                    log.warning("engine %s answers again but could not load the served version: %s", url, exc)
                    continue
            member.consecutive_failures = 0
            member.ejected = False
            member.probe = None
            metrics.ENGINE_REJOINS.labels(engine=url).inc()
            log.warning("engine %s answers again on the served version: it gets work again", url)
            self._changed()
            return

    async def watch_health(self, interval_s: float, stopping: asyncio.Event) -> None:
        """Every `interval_s`, /health of each member in service: a server that died while nothing was
        sent to it (admission waiting, an idle fleet) is ejected like one that fails requests."""
        while not stopping.is_set():
            try:
                await asyncio.wait_for(stopping.wait(), interval_s)
            except TimeoutError:
                pass
            else:
                return
            watched = [m for m in self._members if not m.ejected]
            answers = await asyncio.gather(
                *(m.client.health(timeout_s=interval_s) for m in watched), return_exceptions=True
            )
            for member, healthy in zip(watched, answers, strict=True):
                if healthy is True:
                    continue
                if member.ejected or member not in self._members:  # changed while we waited
                    continue
                self._record_failure(member)

    async def _fan_out(self, call: Callable[[EngineClient], Awaitable[T]]) -> list[MemberOutcome[T]]:
        """Run `call` on every member (ejected ones too: they must not miss a weight update)."""

        async def timed(client: EngineClient) -> MemberOutcome[T]:
            started = time.perf_counter()
            try:
                value = await call(client)
            except EngineError as exc:
                return MemberOutcome(client.base_url, time.perf_counter() - started, None, exc)
            return MemberOutcome(client.base_url, time.perf_counter() - started, value, None)

        return list(await asyncio.gather(*(timed(m.client) for m in self._members)))

    async def pause_all(self, mode: PauseMode = "in_place") -> list[MemberOutcome[dict[str, Any]]]:
        self._syncs += 1
        return await self._fan_out(lambda c: c.pause_generation(mode))

    async def update_all(
        self,
        model_path: str,
        weight_version: str,
        *,
        abort_all_requests: bool = False,
        flush_cache: bool = True,
        model_paths: Mapping[str, str | None] | None = None,
    ) -> list[MemberOutcome[dict[str, Any]]]:
        """`model_paths` overrides `model_path` per member URL (engines with their own copy); None: that
        engine has no copy (its fetcher failed), its outcome is that error and it is not asked."""
        paths = model_paths or {}

        async def update(c: EngineClient) -> dict[str, Any]:
            path = paths.get(c.base_url, model_path)
            if path is None:
                raise EngineError(f"{c.base_url} has no copy of version {weight_version}: its fetcher failed")
            return await c.update_weights_from_disk(
                path,
                weight_version=weight_version,
                abort_all_requests=abort_all_requests,
                flush_cache=flush_cache,
            )

        outcomes = await self._fan_out(update)
        if any(o.ok for o in outcomes):
            self.weight_version = weight_version
        return outcomes

    async def continue_all(self) -> list[MemberOutcome[dict[str, Any]]]:
        return await self._fan_out(lambda c: c.continue_generation())

    async def load_lora_all(self, name: str, path: str) -> list[MemberOutcome[dict[str, Any]]]:
        return await self._fan_out(lambda c: c.load_lora_adapter(name, path))

    async def unload_lora_all(self, name: str) -> list[MemberOutcome[dict[str, Any]]]:
        return await self._fan_out(lambda c: c.unload_lora_adapter(name))

    async def prompt_logprobs_all(
        self, input_ids: list[int], *, rid: str, lora_path: str | None = None
    ) -> list[MemberOutcome[list[float]]]:
        """Every member's prompt log-probs of `input_ids` (EngineClient.prompt_logprobs), rid suffixed
        with the member's index so that the requests stay distinct."""
        index = {m.client.base_url: i for i, m in enumerate(self._members)}
        return await self._fan_out(
            lambda c: c.prompt_logprobs(input_ids, rid=f"{rid}-{index[c.base_url]}", lora_path=lora_path)
        )

    async def abort_all(self) -> list[MemberOutcome[None]]:
        return await self._fan_out(lambda c: c.abort_request(abort_all=True))

    async def close(self) -> None:
        """Stop health probes and close every client. Idempotent."""
        self._closed = True
        probes = [m.probe for m in self._members if m.probe is not None]
        for probe in probes:
            probe.cancel()
        await asyncio.gather(*probes, return_exceptions=True)
        for m in self._members:
            m.probe = None
        await asyncio.gather(*(m.client.close() for m in self._members))
        if self.router is not None:
            await self.router.close()


def _zero_liveness_series(url: str) -> None:
    # A counter exists from the start, so increase() sees its first ejection.
    metrics.ENGINE_EJECTIONS.labels(engine=url).inc(0)
    metrics.ENGINE_REJOINS.labels(engine=url).inc(0)
