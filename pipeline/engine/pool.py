"""EnginePool: several SGLang servers behind one `generate`, with session affinity and ejection.

Affinity: every request of one episode (same `affinity_key`) goes to the same member, so the episode's
growing prompt stays in that server's prefix cache. The member is chosen by rendezvous (highest random
weight) hashing over the healthy members: ejecting a member moves only the keys it owned, and
readmitting it moves them back.

Health: a member that fails `eject_after_failures` times in a row (EngineUnavailable, or HTTP 5xx) is
ejected; a background task probes its /health every `probe_interval_s` and readmits it on 200.
When a member fails a request that certainly never reached it (connection refused, circuit open), the
pool sends it to the key's next member instead; a request that may have reached a server is never
resent (it is not idempotent).

A single sglang-router URL works as a pool of one: the router balances across its workers itself (it
can route by an `X-SMG-Routing-Key` header for affinity; rollwise does not depend on that). Weight
updates and pauses must then be sent to each worker directly, i.e. a pool of the worker URLs.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from pipeline.engine.client import EngineClient, PauseMode
from pipeline.engine.protocol import (
    EngineError,
    EngineHTTPError,
    EngineUnavailable,
    GenerateResult,
    SamplingParams,
)

T = TypeVar("T")


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
    probe: asyncio.Task[None] | None = None


def rendezvous_score(key: str, member_url: str) -> int:
    """Stable 64-bit weight of (key, member); the key goes to the healthy member with the highest."""
    digest = hashlib.blake2b(f"{key}\x00{member_url}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def _counts_as_failure(exc: EngineError) -> bool:
    return isinstance(exc, EngineUnavailable) or (isinstance(exc, EngineHTTPError) and exc.status >= 500)


class EnginePool:
    """A fixed set of EngineClients. The pool owns them: `close()` closes every client."""

    def __init__(
        self, clients: list[EngineClient], *, eject_after_failures: int = 3, probe_interval_s: float = 2.0
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
        self.eject_after_failures = eject_after_failures
        self.probe_interval_s = probe_interval_s
        self._closed = False

    @property
    def members(self) -> list[EngineClient]:
        return [m.client for m in self._members]

    @property
    def healthy_members(self) -> list[EngineClient]:
        return [m.client for m in self._members if not m.ejected]

    def member_for(self, affinity_key: str) -> EngineClient:
        """The healthy member that owns `affinity_key`; EngineUnavailable when every member is ejected."""
        ranked = self._ranked(affinity_key)
        if not ranked:
            raise EngineUnavailable(self._describe(), f"all {len(self._members)} pool members are ejected")
        return ranked[0].client

    def _ranked(self, affinity_key: str) -> list[_Member]:
        healthy = [m for m in self._members if not m.ejected]
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
        lora_path: str | None = None,
    ) -> GenerateResult:
        """Generate on the member owning `affinity_key`. Errors as EngineClient.generate."""
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
                result = await member.client.generate(input_ids, sampling, rid, lora_path=lora_path)
            except EngineError as exc:
                if _counts_as_failure(exc):
                    self._record_failure(member)
                if isinstance(exc, EngineUnavailable) and not exc.maybe_sent:
                    last_failure = exc
                    continue
                raise
            member.consecutive_failures = 0
            return result

    def _record_failure(self, member: _Member) -> None:
        member.consecutive_failures += 1
        if not member.ejected and member.consecutive_failures >= self.eject_after_failures:
            member.ejected = True
            if not self._closed:
                member.probe = asyncio.create_task(self._probe_until_healthy(member))

    async def _probe_until_healthy(self, member: _Member) -> None:
        while True:
            await asyncio.sleep(self.probe_interval_s)
            try:
                healthy = await member.client.health(timeout_s=max(self.probe_interval_s, 1.0))
            except EngineError:
                healthy = False
            if healthy:
                member.consecutive_failures = 0
                member.ejected = False
                member.probe = None
                return

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
        return await self._fan_out(lambda c: c.pause_generation(mode))

    async def update_all(
        self,
        model_path: str,
        weight_version: str,
        *,
        abort_all_requests: bool = False,
        flush_cache: bool = True,
    ) -> list[MemberOutcome[dict[str, Any]]]:
        return await self._fan_out(
            lambda c: c.update_weights_from_disk(
                model_path,
                weight_version=weight_version,
                abort_all_requests=abort_all_requests,
                flush_cache=flush_cache,
            )
        )

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
