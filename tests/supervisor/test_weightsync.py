"""Weight sync through a real EnginePool against fake SGLang servers (pipeline.tools.fake_sglang).

The fake behaves like SGLang 0.5.23 here, its crash included: a weight update that flushes the cache
while requests are queued or running kills the server (rollwise issue 29, problem 1: today's default
in_place + flush did that at the first sync of a real run)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from pipeline.supervisor.engines.client import EngineClient
from pipeline.supervisor.engines.pool import EnginePool, MemberOutcome
from pipeline.supervisor.engines.protocol import EngineUnavailable, SamplingParams
from pipeline.supervisor.engines.weightsync import SyncMode, sync_weights
from pipeline.supervisor.observability import metrics
from pipeline.tools.fake_sglang import FakeSGLang, free_port
from pipeline.tools.fake_sglang.sglang_rules import FLUSH_CRASH


@pytest.fixture
async def fakes() -> AsyncIterator[list[FakeSGLang]]:
    servers = [FakeSGLang(token_delay_s=0.01) for _ in range(2)]
    for s in servers:
        await s.start()
    yield servers
    for s in servers:
        await s.stop()


@pytest.fixture
def weights(tmp_path: Path) -> Path:
    """A published version's directory: the real server reads the disk (a missing one is a 400)."""
    path = tmp_path / "weights" / "v1"
    path.mkdir(parents=True)
    return path


def _pool(urls: list[str]) -> EnginePool:
    return EnginePool([EngineClient(u, retries=0, request_timeout_s=10.0) for u in urls])


def _control_paths(fake: FakeSGLang) -> list[str]:
    return [r.path for r in fake.requests if r.path != "/generate"]


async def test_sync_pauses_updates_and_continues_every_engine(fakes: list[FakeSGLang], weights: Path) -> None:
    pool = _pool([f.base_url for f in fakes])
    try:
        timings = await sync_weights(pool, model_path=str(weights), version=3, mode="abort")
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
        assert fake.requests[0].json() == {"mode": "abort"}
        [update] = fake.update_calls
        assert update == {
            "model_path": str(weights),
            "weight_version": "3",
            "abort_all_requests": False,
            "flush_cache": True,
        }
        assert fake.pause_mode is None and fake.weight_version == "3"


@pytest.mark.parametrize(("mode", "flush"), [("abort", True), ("in_place", False), ("retract", False)])
async def test_a_sync_with_requests_in_flight_never_kills_the_engine(
    fakes: list[FakeSGLang], weights: Path, mode: SyncMode, flush: bool
) -> None:
    """Problem 1: the update flushes the cache only after a pause that leaves nothing in flight (abort)."""
    fake = fakes[0]
    pool = _pool([fake.base_url])
    try:
        sampling = SamplingParams(max_new_tokens=40)
        turns = [
            asyncio.create_task(pool.generate([1, 2, k], sampling, f"r{k}", affinity_key=f"e{k}"))
            for k in range(4)
        ]
        await fake.wait_running(4)
        await asyncio.sleep(0.03)
        timings = await sync_weights(pool, model_path=str(weights), version=1, mode=mode)
        results = await asyncio.gather(*turns)
    finally:
        await pool.close()
    assert timings.ok and fake.crashed is None
    assert [c["flush_cache"] for c in fake.update_calls] == [flush]
    if mode == "abort":  # returned at once with the tokens they had, all of the old version
        assert {r.finish_reason for r in results} == {"abort"}
        assert all(set(r.token_versions) <= {"default"} and r.versions_exact is False for r in results)
    else:  # frozen or requeued, then finished on the new weights
        assert {r.finish_reason for r in results} <= {"length", "stop"}


async def test_the_old_default_in_place_sync_with_a_flush_kills_a_busy_engine(
    fakes: list[FakeSGLang], weights: Path
) -> None:
    """What problem 1 was, held against the fake: SGLang asserts after the update and exits."""
    fake = fakes[0]
    async with EngineClient(fake.base_url, retries=0) as client:
        turn = asyncio.create_task(client.generate([1, 2], SamplingParams(max_new_tokens=200), "busy"))
        await fake.wait_running(1)
        await client.pause_generation("in_place")
        with pytest.raises(EngineUnavailable, match="connection lost"):
            await client.update_weights_from_disk(str(weights), weight_version="1", flush_cache=True)
        with pytest.raises(EngineUnavailable):
            await turn
        assert fake.crashed == FLUSH_CRASH
        with pytest.raises(EngineUnavailable, match="cannot connect"):
            await client.model_info()


async def test_in_flight_tokens_keep_their_true_versions_when_the_engine_reports_them(
    fakes: list[FakeSGLang], weights: Path
) -> None:
    """Problem 6, with an engine that says per token (SGLang's `weight_versions` spans)."""
    fake = fakes[0]
    fake.reports_weight_spans = True
    pool = _pool([fake.base_url])
    try:
        sampling = SamplingParams(max_new_tokens=30)
        generation = asyncio.create_task(pool.generate([1, 2, 3], sampling, "r1", affinity_key="e"))
        await fake.wait_running(1)
        await asyncio.sleep(0.05)
        timings = await sync_weights(pool, model_path=str(weights), version=1, mode="in_place")
        result = await generation
    finally:
        await pool.close()
    assert timings.ok and result.versions_exact
    switch = result.token_versions.index("1")
    assert 0 < switch < 30
    assert result.token_versions == ["default"] * switch + ["1"] * (30 - switch)


async def test_without_per_token_versions_a_reply_that_spans_a_sync_keeps_the_version_it_started_on(
    fakes: list[FakeSGLang], weights: Path
) -> None:
    """Problem 6: SGLang 0.5.23 reports one weight_version per reply (the new one here); labelling every
    token with it invented versions for the tokens decoded before the update."""
    fake = fakes[0]
    pool = _pool([fake.base_url])
    pool.weight_version = "default"  # the fleet sets what the engines were launched with
    before = metrics.ENGINE_VERSION_AMBIGUOUS_TOKENS._value.get()
    try:
        sampling = SamplingParams(max_new_tokens=30)
        generation = asyncio.create_task(pool.generate([1, 2, 3], sampling, "r1", affinity_key="e"))
        await fake.wait_running(1)
        await asyncio.sleep(0.05)
        await sync_weights(pool, model_path=str(weights), version=1, mode="in_place")
        result = await generation
        after = await pool.generate([1, 2, 4], sampling, "r2", affinity_key="e")
    finally:
        await pool.close()
    assert result.weight_version == "1" and not result.versions_exact
    assert result.token_versions == ["default"] * 30
    assert metrics.ENGINE_VERSION_AMBIGUOUS_TOKENS._value.get() - before == 30
    assert after.token_versions == ["1"] * 30  # sent after the sync: nothing to doubt


@pytest.mark.parametrize("mode", ["retract", "in_place", "abort"])
async def test_mode_is_passed_to_pause(fakes: list[FakeSGLang], weights: Path, mode: SyncMode) -> None:
    pool = _pool([fakes[0].base_url])
    try:
        assert (await sync_weights(pool, model_path=str(weights), version=2, mode=mode)).ok
    finally:
        await pool.close()
    assert fakes[0].requests[0].json() == {"mode": mode}


async def test_failed_update_is_reported_and_engines_still_continue(fakes: list[FakeSGLang]) -> None:
    pool = _pool([f.base_url for f in fakes])
    try:
        timings = await sync_weights(pool, model_path="/missing/v4", version=4, mode="abort")
    finally:
        await pool.close()
    assert not timings.ok
    assert set(timings.errors) == {f.base_url for f in fakes}
    assert all(e.startswith("update: ") and "/missing/v4" in e for e in timings.errors.values())
    for fake in fakes:
        assert fake.pause_mode is None and fake.crashed is None
        assert _control_paths(fake)[-1] == "/continue_generation"
        assert fake.weight_version == "default"


async def test_unreachable_member_does_not_block_the_others(fakes: list[FakeSGLang], weights: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    pool = _pool([fakes[0].base_url, dead])
    try:
        timings = await sync_weights(pool, model_path=str(weights), version=5, mode="abort")
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
        model_paths: Mapping[str, str | None] | None = None,
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
