"""EnginePool: affinity, ejection and readmission, fan-out control calls (fake SGLang servers, real HTTP)."""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from pipeline.supervisor.engines.client import EngineClient
from pipeline.supervisor.engines.pool import EnginePool, rendezvous_score
from pipeline.supervisor.engines.protocol import EngineHTTPError, EngineUnavailable, SamplingParams
from pipeline.tools.fake_sglang import FakeSGLang, free_port

SAMPLING = SamplingParams(max_new_tokens=2)
FAST_BACKOFF: dict[str, Any] = {"backoff_base_s": 0.001, "backoff_max_s": 0.004}


def fast_client(url: str) -> EngineClient:
    return EngineClient(url, retries=0, circuit_failures=100, **FAST_BACKOFF)


@pytest.fixture
async def fakes() -> AsyncIterator[list[FakeSGLang]]:
    servers = [FakeSGLang() for _ in range(3)]
    for s in servers:
        await s.start()
    yield servers
    for s in servers:
        await s.stop()


def served_by(fakes: list[FakeSGLang], rid: str) -> list[int]:
    return [i for i, f in enumerate(fakes) if any(r.get("rid") == rid for r in f.generate_requests())]


async def wait_until(condition: Any, timeout_s: float = 3.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


def test_rendezvous_spreads_keys_evenly_and_ejection_moves_only_the_ejected_members_keys() -> None:
    urls = [f"http://10.0.0.{i}:30000" for i in range(4)]
    keys = [f"episode-{k}" for k in range(2000)]

    def owner(key: str, members: list[str]) -> str:
        return max(members, key=lambda u: rendezvous_score(key, u))

    before = {k: owner(k, urls) for k in keys}
    counts = collections.Counter(before.values())
    assert set(counts) == set(urls)
    assert all(400 <= c <= 600 for c in counts.values()), counts  # 2000 keys / 4 members, +-4.5 sd
    after = {k: owner(k, urls[:3]) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == urls[3] for k in moved)
    assert len(moved) == counts[urls[3]]


async def test_same_affinity_key_always_hits_the_same_member(fakes: list[FakeSGLang]) -> None:
    pool = EnginePool([fast_client(f.base_url) for f in fakes])
    try:
        for i in range(100):
            await pool.generate([1, i], SAMPLING, f"ep7-t{i}", affinity_key="ep7")
        counts = [f.count("/generate") for f in fakes]
        assert sorted(counts) == [0, 0, 100]
        assert fakes[counts.index(100)].base_url == pool.member_for("ep7").base_url

        for k in range(60):
            await pool.generate([2, k], SAMPLING, f"ep-{k}", affinity_key=f"ep-{k}")
        per_member = [f.count("/generate") - c for f, c in zip(fakes, counts, strict=True)]
        assert sum(per_member) == 60
        assert min(per_member) >= 5  # P(a member gets < 5 of 60 keys) ~ 1e-6
    finally:
        await pool.close()


async def test_dead_member_is_ejected_its_keys_fail_over_and_it_is_readmitted(
    fakes: list[FakeSGLang],
) -> None:
    pool = EnginePool([fast_client(f.base_url) for f in fakes], eject_after_failures=2, probe_interval_s=0.05)
    try:
        keys = [f"ep-{k}" for k in range(90)]
        owners_before = {k: pool.member_for(k).base_url for k in keys}
        dead = fakes[1]
        dead_url, dead_port = dead.base_url, dead.port
        dead_keys = [k for k in keys if owners_before[k] == dead_url]
        assert len(dead_keys) >= 3
        await dead.stop()

        # Connection refused never reached the server, so the pool resends to the key's next member.
        for k in dead_keys:
            result = await pool.generate([1], SAMPLING, f"{k}-t0", affinity_key=k)
            assert len(result.output_ids) == 2
        assert [c.base_url for c in pool.healthy_members] == [fakes[0].base_url, fakes[2].base_url]
        owners_during = {k: pool.member_for(k).base_url for k in keys}
        assert all(owners_during[k] == owners_before[k] for k in keys if k not in dead_keys)
        assert all(owners_during[k] != dead_url for k in dead_keys)

        # The member comes back on the same port, warming up (503) at first; the background /health
        # probe readmits it only once it answers 200.
        revived = FakeSGLang(ready=False)
        await revived.start(port=dead_port)
        try:
            await wait_until(lambda: revived.count("/health") >= 2)
            assert len(pool.healthy_members) == 2
            revived.ready = True
            await wait_until(lambda: len(pool.healthy_members) == 3)
            assert {k: pool.member_for(k).base_url for k in keys} == owners_before
            await pool.generate([1], SAMPLING, "back", affinity_key=dead_keys[0])
            assert revived.count("/generate") == 1
        finally:
            await revived.stop()
    finally:
        await pool.close()


async def test_member_at_a_closed_port_from_the_start_is_ejected() -> None:
    server = FakeSGLang()
    await server.start()
    dead_url = f"http://127.0.0.1:{free_port()}"
    pool = EnginePool([fast_client(server.base_url), fast_client(dead_url)], eject_after_failures=3)
    try:
        for k in range(40):
            await pool.generate([k], SAMPLING, f"r{k}", affinity_key=f"ep-{k}")
        assert server.count("/generate") == 40
        assert [c.base_url for c in pool.healthy_members] == [server.base_url]
        assert [c.base_url for c in pool.members] == [server.base_url, dead_url]
    finally:
        await pool.close()
        await server.stop()


async def test_request_that_may_have_run_is_not_resent_to_another_member(fakes: list[FakeSGLang]) -> None:
    pool = EnginePool([fast_client(f.base_url) for f in fakes[:2]])
    try:
        owner = next(f for f in fakes[:2] if f.base_url == pool.member_for("ep").base_url)
        other = next(f for f in fakes[:2] if f is not owner)
        owner.queue_faults("drop_connection")
        with pytest.raises(EngineUnavailable) as info:
            await pool.generate([1], SAMPLING, "r", affinity_key="ep")
        assert info.value.maybe_sent
        assert other.count("/generate") == 0
    finally:
        await pool.close()


async def test_5xx_failures_eject_but_4xx_do_not(fakes: list[FakeSGLang]) -> None:
    pool = EnginePool(
        [fast_client(f.base_url) for f in fakes[:2]], eject_after_failures=3, probe_interval_s=60
    )
    try:
        owner_url = pool.member_for("ep").base_url
        owner = next(f for f in fakes if f.base_url == owner_url)
        for _ in range(5):
            with pytest.raises(EngineHTTPError) as info:
                await pool.generate([], SAMPLING, "empty", affinity_key="ep")
            assert info.value.status == 400
        assert len(pool.healthy_members) == 2

        owner.queue_faults("http_500", "http_500", "http_500")
        for _ in range(3):
            with pytest.raises(EngineHTTPError, match="HTTP 500"):
                await pool.generate([1], SAMPLING, "boom", affinity_key="ep")
        assert owner_url not in [c.base_url for c in pool.healthy_members]
        assert pool.member_for("ep").base_url != owner_url
    finally:
        await pool.close()


async def test_success_resets_the_failure_count(fakes: list[FakeSGLang]) -> None:
    pool = EnginePool([fast_client(fakes[0].base_url)], eject_after_failures=2, probe_interval_s=60)
    try:
        for _ in range(3):
            fakes[0].queue_faults("http_500")
            with pytest.raises(EngineHTTPError):
                await pool.generate([1], SAMPLING, "a", affinity_key="ep")
            await pool.generate([1], SAMPLING, "b", affinity_key="ep")
        assert len(pool.healthy_members) == 1
    finally:
        await pool.close()


async def test_all_members_ejected_raises_unavailable() -> None:
    urls = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    pool = EnginePool([fast_client(u) for u in urls], eject_after_failures=1, probe_interval_s=60)
    try:
        with pytest.raises(EngineUnavailable, match="no healthy pool member left for rid='r'") as failed:
            await pool.generate([1], SAMPLING, "r", affinity_key="ep")
        assert "; last: engine http://127.0.0.1:" in str(failed.value)
        assert "cannot connect" in str(failed.value)
        assert pool.healthy_members == []
        with pytest.raises(EngineUnavailable, match="all 2 pool members are ejected") as info:
            pool.member_for("ep")
        assert not info.value.maybe_sent
    finally:
        await pool.close()


async def test_fan_out_control_calls_reach_every_member_and_report_each(
    fakes: list[FakeSGLang], tmp_path: Path
) -> None:
    dead_url = f"http://127.0.0.1:{free_port()}"
    pool = EnginePool([fast_client(f.base_url) for f in fakes] + [fast_client(dead_url)])
    try:
        paused = await pool.pause_all("in_place")
        assert [o.url for o in paused] == [f.base_url for f in fakes] + [dead_url]
        assert [o.ok for o in paused] == [True, True, True, False]
        assert all(f.pause_mode == "in_place" for f in fakes)
        assert isinstance(paused[3].error, EngineUnavailable)
        assert all(0.0 < o.seconds < 5.0 for o in paused)  # each member's own duration, not a timestamp

        updated = await pool.update_all(str(tmp_path), "1", flush_cache=False)  # paused in place: no flush
        assert [o.ok for o in updated] == [True, True, True, False]
        assert all(o.value is not None and o.value["success"] for o in updated[:3])
        assert [f.weight_version for f in fakes] == ["1", "1", "1"]
        assert all(f.update_calls[-1]["model_path"] == str(tmp_path) for f in fakes)

        continued = await pool.continue_all()
        assert [o.ok for o in continued] == [True, True, True, False]
        assert all(f.pause_mode is None for f in fakes)

        aborted = await pool.abort_all()
        assert [o.ok for o in aborted] == [True, True, True, False]
        assert all(f.requests[-1].json() == {"abort_all": True} for f in fakes)
    finally:
        await pool.close()


async def test_fan_out_runs_members_concurrently(fakes: list[FakeSGLang], tmp_path: Path) -> None:
    pool = EnginePool([fast_client(f.base_url) for f in fakes])
    try:
        for f in fakes:
            f.update_delay_s = 0.5  # one member after the other would take 1.5 s
        started = time.perf_counter()
        outcomes = await pool.update_all(str(tmp_path), "2")
        elapsed = time.perf_counter() - started
        assert all(o.ok for o in outcomes)
        assert all(0.5 <= o.seconds < elapsed + 1e-6 for o in outcomes)
        assert elapsed < 1.2  # concurrent: 0.5 s plus scheduling, far from the serial 1.5 s
    finally:
        await pool.close()


async def test_pool_of_one_router_url_generates(fakes: list[FakeSGLang]) -> None:
    pool = EnginePool([fast_client(fakes[0].base_url)])
    try:
        result = await pool.generate([1, 2, 3], SAMPLING, "via-router", affinity_key="ep")
        assert result.rid == "via-router" and len(result.output_ids) == 2
    finally:
        await pool.close()


def test_pool_rejects_empty_and_duplicate_members() -> None:
    with pytest.raises(ValueError, match="at least one"):
        EnginePool([])
    with pytest.raises(ValueError, match="distinct URLs"):
        EnginePool([EngineClient("http://a:1"), EngineClient("http://a:1/")])
    with pytest.raises(ValueError, match="eject_after_failures >= 1"):
        EnginePool([EngineClient("http://a:1")], eject_after_failures=0)


async def test_once_one_member_is_ejected_every_key_goes_to_the_other(fakes: list[FakeSGLang]) -> None:
    dead = fast_client(f"http://127.0.0.1:{free_port()}")
    live = fast_client(fakes[0].base_url)
    pool = EnginePool([dead, live], eject_after_failures=1, probe_interval_s=60)
    try:
        keys = [f"episode-{k}" for k in range(40)]
        owned_by_dead = [k for k in keys if pool.member_for(k) is dead]
        assert 0 < len(owned_by_dead) < len(keys)  # both members own keys (chance of not: 2 x 2^-40)
        result = await pool.generate([1], SAMPLING, "r", affinity_key=owned_by_dead[0])
        assert result.rid == "r" and served_by(fakes, "r") == [0]  # failed over to the live member
        assert pool.healthy_members == [live]
        assert [pool.member_for(k) for k in keys] == [live] * len(keys)
    finally:
        await pool.close()


async def test_a_cancelled_generate_through_a_router_is_aborted_at_every_worker(
    fakes: list[FakeSGLang],
) -> None:
    # sglang-router answers /abort_request with 404 (0.3.2), so the pool aborts at the workers instead;
    # fakes[2] stands in for the router and decodes slowly, fakes[0] and [1] are the workers.
    router, workers = fakes[2], fakes[:2]
    router.token_delay_s = 0.01
    pool = EnginePool([fast_client(w.base_url) for w in workers], router=fast_client(router.base_url))
    try:
        task = asyncio.create_task(
            pool.generate([1, 2], SamplingParams(max_new_tokens=1000), "ep-0-t0", affinity_key="ep-0")
        )
        await wait_until(lambda: router.running_rids == ["ep-0-t0"])
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_until(lambda: all(w.count("/abort_request") == 1 for w in workers))
        assert [r.json() for w in workers for r in w.requests if r.path == "/abort_request"] == [
            {"rid": "ep-0-t0"},
            {"rid": "ep-0-t0"},
        ]
        assert router.count("/abort_request") == 0
    finally:
        await pool.close()
