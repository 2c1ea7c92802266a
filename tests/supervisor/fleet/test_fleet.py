"""Engines that join and leave, weights over HTTP, the admin endpoint, and SGLang's NCCL request shapes
(fake SGLang servers on 127.0.0.1, real HTTP; the fleet code under test is the daemon's own)."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from pipeline.contracts.config import load_config
from pipeline.contracts.run_dir import RunDir
from pipeline.supervisor.engines.client import EngineClient
from pipeline.supervisor.engines.pool import EnginePool
from pipeline.supervisor.engines.protocol import EngineHTTPError, SamplingParams
from pipeline.supervisor.fleet.admin import AdminEndpoint, make_admin_app
from pipeline.supervisor.fleet.admin import main as engines_main
from pipeline.supervisor.fleet.engine_fleet import EngineFleet
from pipeline.supervisor.fleet.fleet_membership import FleetMembership, MembershipError, scaled_concurrency
from pipeline.tools.fake_sglang import FakeSGLang, free_port
from pipeline.transport.weights_http import (
    FetchError,
    WeightServer,
    add_fetch_route,
    fetch_version,
    request_fetch,
)

SAMPLING = SamplingParams(max_new_tokens=40)


@pytest.fixture
async def fakes() -> AsyncIterator[list[FakeSGLang]]:
    servers = [FakeSGLang(token_delay_s=0.005), FakeSGLang(token_delay_s=0.005)]
    for s in servers:
        await s.start()
    yield servers
    for s in servers:
        await s.stop()


def publish(run: RunDir, version: int) -> Path:
    path = run.weights_of(version)
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"model_type": "qwen3"}\n')
    (path / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    return path


async def serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


def test_concurrency_follows_the_fleets_capacity_proportionally() -> None:
    assert scaled_concurrency(16, 64, 128) == 32
    assert scaled_concurrency(16, 128, 64) == 8
    assert scaled_concurrency(3, 100, 1) == 1  # never below one group
    assert scaled_concurrency(5, 0, 10) == 5


async def test_a_drained_member_hands_its_in_flight_turns_to_another_member(fakes: list[FakeSGLang]) -> None:
    pool = EnginePool([EngineClient(f.base_url) for f in fakes])
    try:
        key = "episode-9"
        owner = pool.member_for(key).base_url
        slow = next(f for f in fakes if f.base_url == owner)
        other = next(f for f in fakes if f.base_url != owner)
        turn = asyncio.create_task(pool.generate([1, 2, 3], SAMPLING, "episode-9-t0", affinity_key=key))
        await slow.wait_running(1)
        pool.set_draining(owner)
        assert await pool.hand_back(owner) == ["episode-9-t0"]
        result = await turn
        assert result.finish_reason != "abort" and len(result.output_ids) > 0
        assert [r["rid"] for r in other.generate_requests()] == ["episode-9-t0"]  # sent again, whole
        assert pool.handed_back_total == 1
        assert pool.member_for(key).base_url == other.base_url  # the next turn goes there too
    finally:
        await pool.close()


@pytest.fixture
async def membership(tmp_path: Path, fakes: list[FakeSGLang]) -> AsyncIterator[FleetMembership]:
    cfg = load_config(
        None, ['engine.kind="external"', f'engine.urls=["{fakes[0].base_url}"]', "engine.drain_timeout_s=0.3"]
    )
    run = RunDir.at(str(tmp_path / "run"), None)
    publish(run, 3)
    stopping = asyncio.Event()
    fleet = EngineFleet(cfg, run, stopping, served_version=lambda: 3, fail=lambda why: None)
    await fleet.start()
    capacities: list[int] = []
    member = FleetMembership(fleet, asyncio.Lock(), lambda: 3, capacities.append)
    member.capacities = capacities  # type: ignore[attr-defined]
    yield member
    stopping.set()
    await fleet.stop(1.0)


async def test_a_version_published_while_the_engines_start_is_synced_once_they_answer(
    tmp_path: Path, fakes: list[FakeSGLang]
) -> None:
    """Seen in CI: a resumed learner published a version while its restarted engine was warming up; the
    sync paused that engine and asked it to load, its warm-up waited behind the pause, and both timed out.
    """
    cfg = load_config(None, ['engine.kind="external"', f'engine.urls=["{fakes[0].base_url}"]'])
    run = RunDir.at(str(tmp_path / "run"), None)
    publish(run, 4)
    fleet = EngineFleet(cfg, run, asyncio.Event(), served_version=lambda: 0, fail=lambda why: None)
    warm = asyncio.Event()
    answer = fleet.clients[0].wait_ready

    async def warming_up(timeout_s: float) -> None:
        await warm.wait()
        await answer(timeout_s)

    fleet.clients[0].wait_ready = warming_up  # type: ignore[method-assign]
    starting = asyncio.create_task(fleet.start())
    syncing = asyncio.create_task(fleet.sync(str(run.weights_of(4)), 4, "in_place"))
    await asyncio.sleep(0.3)
    try:
        assert not syncing.done() and fakes[0].update_calls == []  # nothing sent to a warming engine
        warm.set()
        await asyncio.wait_for(starting, 10)
        timings = await asyncio.wait_for(syncing, 10)
        assert timings.ok and fakes[0].update_calls[-1]["weight_version"] == "4"
    finally:
        await fleet.stop(1.0)


async def test_a_joining_engine_loads_the_served_version_before_it_gets_work(
    membership: FleetMembership, fakes: list[FakeSGLang]
) -> None:
    assert fakes[0].update_calls[0]["weight_version"] == "3"  # the external engine caught up at start
    joined = await membership.add(fakes[1].base_url)
    assert joined["weight_version"] == "3"
    paths = [r.path for r in fakes[1].requests]
    assert "/update_weights_from_disk" in paths and "/generate" not in paths
    assert fakes[1].update_calls[-1]["model_path"] == str(membership.fleet.run_dir.weights_of(3))
    assert membership.fleet.pool_urls() == [fakes[0].base_url, fakes[1].base_url]
    assert membership.capacities == [2 * 256]  # type: ignore[attr-defined]  # each reports 256 running
    with pytest.raises(MembershipError, match="already in the fleet"):
        await membership.add(fakes[1].base_url)


async def test_draining_an_engine_finishes_or_hands_back_its_turns_and_refuses_the_last_one(
    membership: FleetMembership, fakes: list[FakeSGLang]
) -> None:
    await membership.add(fakes[1].base_url)
    pool = membership.fleet.pool
    keys = [f"ep{k}" for k in range(40)]
    on_first = next(k for k in keys if pool.member_for(k).base_url == fakes[0].base_url)
    long_turn = SamplingParams(max_new_tokens=200)  # 200 tokens x 5 ms > the 0.3 s drain timeout
    turn = asyncio.create_task(pool.generate([4, 5], long_turn, f"{on_first}-t0", affinity_key=on_first))
    await fakes[0].wait_running(1)
    report = await membership.drain(fakes[0].base_url)
    assert report["handed_back"] == 1
    assert (await turn).finish_reason != "abort"
    assert membership.fleet.pool_urls() == [fakes[1].base_url]
    assert membership.capacities[-1] == 256  # type: ignore[attr-defined]
    with pytest.raises(MembershipError, match="last engine"):
        await membership.drain(fakes[1].base_url)


async def test_admin_endpoint_requires_its_token_and_the_cli_drives_it(
    membership: FleetMembership, fakes: list[FakeSGLang], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    app = make_admin_app(membership, WeightServer(membership.fleet.run_dir.weights_of), "t0k3n")
    admin = AdminEndpoint("127.0.0.1", 0, app)
    await admin.start()
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(admin.url + "/engines") as resp:
                assert resp.status == 401
            auth = {"Authorization": "Bearer t0k3n"}
            async with http.post(admin.url + "/engines", json={"url": "ftp://x"}, headers=auth) as resp:
                assert resp.status == 400 and "http://" in (await resp.json())["error"]
            async with http.post(
                admin.url + "/engines/drain", json={"url": "http://nowhere:1"}, headers=auth
            ) as r:
                assert r.status == 404
        base = ["--admin", admin.url, "--token", "t0k3n"]
        assert await asyncio.to_thread(engines_main, [*base, "add", fakes[1].base_url]) == 0
        assert await asyncio.to_thread(engines_main, [*base, "list"]) == 0
        assert fakes[1].base_url in capsys.readouterr().out
        assert await asyncio.to_thread(engines_main, ["--admin", admin.url, "list"]) == 1
        assert "HTTP 401" in capsys.readouterr().err
    finally:
        await admin.stop()


async def _weight_server_and_fetcher(
    run: RunDir, dest: Path, *middlewares: Any
) -> tuple[web.AppRunner, str, web.AppRunner, str]:
    """A weight server of `run`'s versions (behind `middlewares`) and a fetcher storing into `dest`:
    (server runner, its URL, fetcher runner, its URL)."""
    server_app = web.Application(middlewares=list(middlewares))
    WeightServer(run.weights_of).add_routes(server_app)
    fetcher_app = web.Application()
    add_fetch_route(fetcher_app, dest)
    server, source = await serve(server_app)
    fetcher, fetcher_url = await serve(fetcher_app)
    return server, source, fetcher, fetcher_url


async def test_weights_travel_over_http_checked_against_the_manifest(tmp_path: Path) -> None:
    run = RunDir.at(str(tmp_path / "run"), None)
    published = publish(run, 5)
    server, source, fetcher, fetcher_url = await _weight_server_and_fetcher(run, tmp_path / "engine-disk")
    try:
        local = await request_fetch(fetcher_url, source=source, version=5, token=None)
        assert Path(local) == tmp_path / "engine-disk" / "v5"
        for name in ("config.json", "model.safetensors"):
            assert (Path(local) / name).read_bytes() == (published / name).read_bytes()
        with pytest.raises(FetchError, match="404"):
            await request_fetch(fetcher_url, source=source, version=6, token=None)
        async with aiohttp.ClientSession() as http, http.get(f"{source}/weights/v5/files/../../x") as resp:
            assert resp.status == 404
        # A file that changed after the manifest was made is refused, not installed.
        publish(run, 7)
        async with aiohttp.ClientSession() as http, http.get(f"{source}/weights/v7/manifest") as resp:
            manifest: dict[str, Any] = await resp.json()
        (run.weights_of(7) / "model.safetensors").write_bytes(b"tampered")
        with pytest.raises(FetchError, match="sha256"):
            await fetch_version(source, 7, tmp_path / "other-disk")
        assert not (tmp_path / "other-disk" / "v7").exists()
        digest = hashlib.sha256((published / "config.json").read_bytes()).hexdigest()
        assert manifest["files"][0] == {
            "path": "config.json",
            "size": 24,
            "sha256": manifest["files"][0]["sha256"],
        }
        assert digest == hashlib.sha256(b'{"model_type": "qwen3"}\n').hexdigest()
    finally:
        await server.cleanup()
        await fetcher.cleanup()


async def test_a_copy_broken_mid_file_resumes_where_it_stopped(tmp_path: Path) -> None:
    """A link that resets connections (bench hosts' `drops`) must not restart a weight copy from zero:
    the next attempt asks for the rest of the file with a range request."""
    run = RunDir.at(str(tmp_path / "run"), None)
    published = publish(run, 5)
    whole = (published / "model.safetensors").read_bytes()  # 16,384 bytes
    ranges: list[str | None] = []

    @web.middleware
    async def break_the_first_copy(request: web.Request, handler: Any) -> web.StreamResponse:
        if not request.path.endswith("/model.safetensors"):
            return await handler(request)
        ranges.append(request.headers.get("Range"))
        if len(ranges) > 1:
            return await handler(request)
        response = web.StreamResponse(headers={"Content-Length": str(len(whole))})
        await response.prepare(request)
        await response.write(whole[:6000])
        assert request.transport is not None
        request.transport.close()  # reset mid-file
        return response

    server_app = web.Application(middlewares=[break_the_first_copy])
    WeightServer(run.weights_of).add_routes(server_app)
    server, source = await serve(server_app)
    try:
        with pytest.raises((aiohttp.ClientError, FetchError)):
            await fetch_version(source, 5, tmp_path / "disk")
        assert (tmp_path / "disk" / "v5.tmp" / "model.safetensors").stat().st_size == 6000
        local = await fetch_version(source, 5, tmp_path / "disk")
        assert (local / "model.safetensors").read_bytes() == whole
        assert ranges == [None, "bytes=6000-"]
        assert sorted(p.name for p in local.iterdir()) == ["config.json", "model.safetensors"]
    finally:
        await server.cleanup()


async def test_a_fetcher_resumes_a_download_the_network_keeps_breaking_within_one_request(
    tmp_path: Path,
) -> None:
    """An engine's fetcher behind a link that resets connections (bench hosts' `drops`, where the
    supervisor's own request crosses the network too) resumes the copy itself until it is whole, instead
    of answering the first reset; a version that is not published is still answered at once."""
    run = RunDir.at(str(tmp_path / "run"), None)
    published = publish(run, 5)
    whole = (published / "model.safetensors").read_bytes()  # 16,384 bytes
    seen: list[str] = []

    @web.middleware
    async def hostile(request: web.Request, handler: Any) -> web.StreamResponse:
        seen.append(f"{request.path.rsplit('/', 1)[-1]} {request.headers.get('Range')}")
        if request.path.endswith("/manifest") and seen.count("manifest None") == 1:
            return web.Response(status=503, text="overloaded")
        if not request.path.endswith("/model.safetensors") or len(seen) > 6:
            return await handler(request)
        asked = request.headers.get("Range")  # cut the answer 4,000 bytes after where it starts
        start = int(asked[6:-1]) if asked else 0
        cut = web.StreamResponse(
            status=206 if asked else 200, headers={"Content-Length": str(len(whole) - start)}
        )
        await cut.prepare(request)
        await cut.write(whole[start : start + 4000])
        assert request.transport is not None
        request.transport.close()
        return cut

    server, source, fetcher, fetcher_url = await _weight_server_and_fetcher(
        run, tmp_path / "engine-disk", hostile
    )
    try:
        local = await request_fetch(fetcher_url, source=source, version=5, token=None)
        assert (Path(local) / "model.safetensors").read_bytes() == whole
        assert seen == [
            "manifest None",  # 503: tried again
            "manifest None",
            "config.json None",
            "model.safetensors None",  # cut at 4,000
            "manifest None",
            "model.safetensors bytes=4000-",  # cut at 8,000
            "manifest None",
            "model.safetensors bytes=8000-",
        ]
        began = asyncio.get_running_loop().time()
        with pytest.raises(FetchError, match="404"):
            await request_fetch(fetcher_url, source=source, version=6, token=None)
        assert asyncio.get_running_loop().time() - began < 5.0
    finally:
        await server.cleanup()
        await fetcher.cleanup()


async def test_nccl_weight_update_requests_have_sglangs_exact_fields(fakes: list[FakeSGLang]) -> None:
    fake = fakes[0]
    async with EngineClient(fake.base_url, retries=0) as client:
        with pytest.raises(EngineHTTPError, match="not in the process groups"):
            await client.update_weights_from_distributed(
                names=["w"], dtypes=["bfloat16"], shapes=[[2]], weight_version="1"
            )
        await client.init_weights_update_group(
            master_address="10.0.0.1", master_port=29600, rank_offset=1, world_size=3
        )
        await client.update_weights_from_distributed(
            names=["model.embed_tokens.weight", "lm_head.weight"],
            dtypes=["bfloat16", "bfloat16"],
            shapes=[[151936, 2048], [151936, 2048]],
            weight_version="4",
        )
        assert fake.weight_version == "4"
        await client.destroy_weights_update_group()
        with pytest.raises(ValueError, match="parallel"):
            await client.update_weights_from_distributed(
                names=["a"], dtypes=[], shapes=[], weight_version="5"
            )
        # The fake refuses what SGLang's structs do not define or require.
        with pytest.raises(EngineHTTPError, match="field required: world_size"):
            await client._control(
                "/init_weights_update_group", {"master_address": "a", "master_port": 1, "rank_offset": 0}
            )
        with pytest.raises(EngineHTTPError, match="unknown field"):
            await client._control("/destroy_weights_update_group", {"group": "x"})
    _, init, update, *_ = fake.update_calls  # the first is the update refused before the group existed
    assert init == {
        "master_address": "10.0.0.1",
        "master_port": 29600,
        "rank_offset": 1,
        "world_size": 3,
        "group_name": "weight_update_group",
        "backend": "nccl",
    }
    assert set(update) == {
        "names",
        "dtypes",
        "shapes",
        "group_name",
        "flush_cache",
        "abort_all_requests",
        "weight_version",
    }


async def test_an_engine_counts_as_idle_by_its_own_get_load(fakes: list[FakeSGLang]) -> None:
    """Issue 29, problem 7: `internal_states` of /server_info hold no request counts, so a drained
    engine looked idle at once; /get_load counts running and queued requests (the router 404s it: each
    engine is asked directly)."""
    from pipeline.supervisor.fleet.fleet_membership import _engine_idle

    async with EngineClient(fakes[0].base_url) as client:
        assert await _engine_idle(client)
        turn = asyncio.create_task(client.generate([1, 2], SamplingParams(max_new_tokens=100), "busy"))
        await fakes[0].wait_running(1)
        assert not await _engine_idle(client) and await client.load() == 1
        await client.abort_request("busy")
        await turn
        assert await _engine_idle(client)


async def test_an_engine_whose_fetcher_cannot_be_reached_sits_the_sync_out_and_the_run_goes_on(
    tmp_path: Path, fakes: list[FakeSGLang], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 33: a connection to a fetcher that breaks (reset, partition) failed the whole publish, and
    the daemon stopped. Now it is asked again, then its engine keeps its version until the next sync."""
    monkeypatch.setattr("pipeline.supervisor.fleet.engine_fleet.FETCH_RETRY_S", (0.01,))
    run = RunDir.at(str(tmp_path / "run"), None)
    publish(run, 5)
    server_app, fetcher_app = web.Application(), web.Application()
    WeightServer(run.weights_of).add_routes(server_app)
    add_fetch_route(fetcher_app, tmp_path / "engine-disk")
    server, source = await serve(server_app)
    fetcher, fetcher_url = await serve(fetcher_app)
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    urls = [f.base_url for f in fakes]
    cfg = load_config(
        None,
        [
            'engine.kind="external"',
            f"engine.urls={json.dumps(urls)}",
            'engine.weight_transport="http"',
            f"engine.fetch_urls={json.dumps([fetcher_url, dead])}",
        ],
    )
    said: list[str] = []
    fleet = EngineFleet(cfg, run, asyncio.Event(), served_version=lambda: 0, fail=lambda why: None)
    fleet.weight_source, fleet.progress_message = source, said.append
    await fleet.start()
    try:
        timings = await fleet.sync(str(run.weights_of(5)), 5, "in_place")
        assert fakes[0].update_calls[-1] == {**fakes[0].update_calls[-1], "weight_version": "5"}
        assert fakes[0].update_calls[-1]["model_path"] == str(tmp_path / "engine-disk" / "v5")
        assert all(call["weight_version"] != "5" for call in fakes[1].update_calls)  # not asked
        assert list(timings.errors) == [urls[1]] and "its fetcher failed" in timings.errors[urls[1]]
        assert len(said) == 1 and said[0].startswith(f"engine {urls[1]} could not fetch version 5 (")
    finally:
        await fleet.stop(1.0)
        await server.cleanup()
        await fetcher.cleanup()
