"""Weight sync through a real EnginePool against fake SGLang servers."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Mapping
from typing import Any

import pytest

from pipeline.supervisor.engines.client import EngineClient
from pipeline.supervisor.engines.pool import EnginePool, MemberOutcome
from pipeline.supervisor.engines.protocol import SamplingParams
from pipeline.supervisor.engines.weightsync import SyncMode, sync_weights
from tests.fakes.sglang_fake import FakeSGLang


@pytest.fixture
async def fakes() -> AsyncIterator[list[FakeSGLang]]:
    servers = [FakeSGLang(report_token_versions=True, token_delay_s=0.01) for _ in range(2)]
    for s in servers:
        await s.start()
    yield servers
    for s in servers:
        await s.stop()


def _pool(urls: list[str]) -> EnginePool:
    return EnginePool([EngineClient(u, retries=0, request_timeout_s=10.0) for u in urls])


def _control_paths(fake: FakeSGLang) -> list[str]:
    return [r.path for r in fake.requests if r.path != "/generate"]


async def test_sync_pauses_updates_and_continues_every_engine(fakes: list[FakeSGLang]) -> None:
    pool = _pool([f.base_url for f in fakes])
    try:
        timings = await sync_weights(pool, model_path="/weights/v3", version=3, mode="in_place")
    finally:
        await pool.close()
    assert timings.ok and timings.errors == {}
    assert timings.version == 3
    assert 0.0 <= timings.pause_s <= timings.total_s
    assert timings.total_s >= timings.pause_s + timings.load_s + timings.continue_s - 1e-6
    for fake in fakes:
        assert _control_paths(fake) == [
            "/pause_generation",
            "/update_weights_from_disk",
            "/continue_generation",
        ]
        assert fake.requests[0].json() == {"mode": "in_place"}
        [update] = fake.update_calls
        assert update["model_path"] == "/weights/v3"
        assert update["weight_version"] == "3"
        assert update["abort_all_requests"] is False
        assert fake.pause_mode is None
        assert fake.weight_version == "3"


async def test_in_flight_request_spans_the_update_with_per_token_versions(fakes: list[FakeSGLang]) -> None:
    fake = fakes[0]
    pool = _pool([fake.base_url])
    try:
        sampling = SamplingParams(max_new_tokens=30, stop_token_ids=())
        generation = asyncio.create_task(pool.generate([1, 2, 3], sampling, "r1", affinity_key="e"))
        await fake.wait_running(1)
        await asyncio.sleep(0.05)
        timings = await sync_weights(pool, model_path="/weights/v1", version=1, mode="in_place")
        result = await generation
    finally:
        await pool.close()
    assert timings.ok
    assert result.finish_reason == "length"
    assert result.token_versions[0] == "default"
    assert result.token_versions[-1] == "1"
    assert result.token_versions == sorted(result.token_versions, key=lambda v: v != "default")


@pytest.mark.parametrize("mode", ["retract", "abort"])
async def test_mode_is_passed_to_pause(fakes: list[FakeSGLang], mode: SyncMode) -> None:
    pool = _pool([fakes[0].base_url])
    try:
        assert (await sync_weights(pool, model_path="/w", version=2, mode=mode)).ok
    finally:
        await pool.close()
    assert fakes[0].requests[0].json() == {"mode": mode}


async def test_failed_update_is_reported_and_engines_still_continue(fakes: list[FakeSGLang]) -> None:
    pool = _pool([f.base_url for f in fakes])
    try:
        timings = await sync_weights(pool, model_path="/missing/v4", version=4, mode="in_place")
    finally:
        await pool.close()
    assert not timings.ok
    assert set(timings.errors) == {f.base_url for f in fakes}
    assert all(e.startswith("update: ") and "/missing/v4" in e for e in timings.errors.values())
    for fake in fakes:
        assert fake.pause_mode is None
        assert _control_paths(fake)[-1] == "/continue_generation"
        assert fake.weight_version == "default"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_unreachable_member_does_not_block_the_others(fakes: list[FakeSGLang]) -> None:
    dead = f"http://127.0.0.1:{_closed_port()}"
    pool = _pool([fakes[0].base_url, dead])
    try:
        timings = await sync_weights(pool, model_path="/w/v5", version=5, mode="in_place")
    finally:
        await pool.close()
    assert not timings.ok
    assert list(timings.errors) == [dead]
    assert timings.errors[dead].startswith("pause: ")
    assert fakes[0].weight_version == "5"
    assert fakes[0].pause_mode is None


class _HangingPool:
    """Control calls recorded; update never returns (a stuck engine)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def pause_all(self, mode: SyncMode = "in_place") -> list[MemberOutcome[dict[str, Any]]]:
        self.calls.append("pause")
        return [MemberOutcome("http://e", 0.0, {}, None)]

    async def update_all(
        self,
        model_path: str,
        weight_version: str,
        *,
        abort_all_requests: bool = False,
        flush_cache: bool = True,
        model_paths: Mapping[str, str] | None = None,
    ) -> list[MemberOutcome[dict[str, Any]]]:
        self.calls.append("update")
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def continue_all(self) -> list[MemberOutcome[dict[str, Any]]]:
        self.calls.append("continue")
        return [MemberOutcome("http://e", 0.0, {}, None)]


async def test_cancelled_sync_still_sends_continue() -> None:
    pool = _HangingPool()
    sync = asyncio.create_task(sync_weights(pool, model_path="/w", version=1, mode="in_place"))
    while "update" not in pool.calls:  # noqa: ASYNC110
        await asyncio.sleep(0.001)
    sync.cancel()
    with pytest.raises(asyncio.CancelledError):
        await sync
    assert pool.calls == ["pause", "update", "continue"]


async def test_unknown_mode_is_rejected() -> None:
    with pytest.raises(ValueError, match="'flush'"):
        await sync_weights(_HangingPool(), model_path="/w", version=1, mode="flush")  # type: ignore[arg-type]
