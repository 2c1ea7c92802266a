"""An engine that stops answering, and one that comes back (rollwise issue 29, problems 2 and 3): against
the SGLang fake as an external engine, which dies like the real server and restarts on its launch
weights. Before: every episode ended engine_error (2,812 within 60 s), /readyz stayed ready, and the
returning server got work on its initial weights while the policy was version 1."""

from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from pipeline.contracts.config import load_config
from pipeline.contracts.run_dir import RunDir
from pipeline.supervisor.engines.protocol import SamplingParams
from pipeline.supervisor.fleet.engine_fleet import EngineFleet
from pipeline.supervisor.observability import metrics
from pipeline.tools.fake_sglang import FakeSGLang
from pipeline.transport.weights_http import FetchError


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def publish(run: RunDir, version: int) -> Path:
    path = run.weights_of(version)
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}\n")
    return path


@pytest.fixture
async def fake() -> AsyncIterator[FakeSGLang]:
    server = FakeSGLang(token_delay_s=0.002)
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
async def fleet(fake: FakeSGLang, tmp_path: Path) -> AsyncIterator[tuple[EngineFleet, list[str]]]:
    """An external engine (the fake) serving version 3, watched every 50 ms."""
    cfg = load_config(None, ['engine.kind="external"', f'engine.urls=["{fake.base_url}"]'])
    run = RunDir.at(str(tmp_path / "run"), None)
    publish(run, 3)
    failures: list[str] = []
    fleet = EngineFleet(cfg, run, asyncio.Event(), served_version=lambda: 3, fail=failures.append)
    fleet.health_watch_s = 0.05
    fleet.pool.probe_interval_s = 0.05
    await fleet.start()
    yield fleet, failures
    fleet.stopping.set()
    await fleet.stop(1.0)


def ejections(url: str) -> float:
    return metrics.REGISTRY.get_sample_value("rollwise_engine_ejections_total", {"engine": url}) or 0.0


async def test_a_dead_engine_is_ejected_counted_and_the_daemon_stops_after_the_timeout(
    fleet: tuple[EngineFleet, list[str]], fake: FakeSGLang
) -> None:
    engines, failures = fleet
    before = ejections(fake.base_url)
    assert engines.pool.serving == 1
    fake.crash("killed by the test")
    await until(lambda: engines.pool.serving == 0)  # /health checks, nothing sent to it
    assert ejections(fake.base_url) == before + 1
    assert metrics.REGISTRY.get_sample_value("rollwise_engines_serving") == 0.0
    messages: list[str] = []
    engines.progress_message = messages.append
    await asyncio.wait_for(engines.guard_availability(0.3), 5.0)
    assert len(failures) == 1 and failures[0].startswith("no engine has answered for 0 s")
    assert fake.base_url in failures[0] and "engine.unavailable_timeout_s" in failures[0]
    assert "no engine answers" in messages[0] and "the daemon stops in 0 s" in messages[0]


async def test_an_engine_that_comes_back_is_loaded_with_the_served_version_before_it_gets_work(
    fleet: tuple[EngineFleet, list[str]], fake: FakeSGLang
) -> None:
    engines, failures = fleet
    assert fake.weight_version == "3"  # caught up at start
    fake.crash("killed by the test")
    await until(lambda: engines.pool.serving == 0)
    fake.requests.clear()
    await fake.restart()  # the same URL, the weights it was launched with
    assert fake.weight_version == "default"
    await until(lambda: engines.pool.serving == 1)
    result = await engines.pool.generate([1, 2], SamplingParams(max_new_tokens=3), "after", affinity_key="e")
    paths = [r.path for r in fake.requests if r.path not in ("/health", "/model_info")]
    assert paths[0] == "/update_weights_from_disk" and paths.index("/generate") > 0
    assert fake.update_calls[-1]["model_path"] == str(engines.run_dir.weights_of(3))
    assert result.weight_version == "3" and result.token_versions == ["3"] * 3
    assert failures == []


async def test_while_no_engine_answers_the_daemon_is_not_ready(fake: FakeSGLang, tmp_path: Path) -> None:
    from pipeline.supervisor.daemon import Supervisor
    from pipeline.supervisor.wiring import resolve_config
    from tests.supervisor.test_supervisor import _ns

    overrides = ['engine.kind="external"', f'engine.urls=["{fake.base_url}"]', "metrics.port=0"]
    sup = Supervisor(
        resolve_config(_ns(run_dir=str(tmp_path / "run"), set=overrides)), progress_out=io.StringIO()
    )
    sup.engines.health_watch_s = 0.05
    try:
        await sup.engines.start()
        assert "engines (none answers)" not in sup.not_ready()
        fake.crash("killed by the test")
        await until(lambda: sup.engines.pool.serving == 0)
        assert "engines (none answers)" in sup.not_ready()
    finally:
        sup.stopping.set()
        await sup.engines.stop(1.0)


async def test_an_engine_whose_weights_cannot_be_fetched_yet_stays_ejected_and_is_tried_again(
    fleet: tuple[EngineFleet, list[str]], fake: FakeSGLang
) -> None:
    # A fetch failure while an engine rejoins (the network to its fetcher) once ended the pool's probing
    # of it for good: the engine never got work again (bench hosts' `drops`).
    engines, failures = fleet
    loads = engines.weights_for
    tries: list[int] = []

    async def flaky(url: str, version: int, published_path: str | None = None) -> str:
        tries.append(version)
        if len(tries) <= 2:
            raise FetchError(f"{url} could not fetch version {version}: connection reset")
        return await loads(url, version, published_path)

    engines.weights_for = flaky  # type: ignore[method-assign]
    fake.crash("killed by the test")
    await until(lambda: engines.pool.serving == 0)
    await fake.restart()
    await until(lambda: engines.pool.serving == 1)
    assert tries == [3, 3, 3] and fake.weight_version == "3" and failures == []


async def test_an_engine_a_sync_left_paused_is_released_before_it_gets_work(
    fleet: tuple[EngineFleet, list[str]], fake: FakeSGLang
) -> None:
    # bench hosts' engine partition: a sync paused the engine, then could not reach it to continue it;
    # back, it answered /health but queued every request until it timed out, ejected again and again.
    engines, failures = fleet
    [client] = engines.clients
    await client.pause_generation("in_place")
    stuck = asyncio.create_task(client.generate([1, 2], SamplingParams(max_new_tokens=3), "stuck"))
    await asyncio.sleep(0.2)
    assert not stuck.done()  # paused: it waits (SGLang holds new requests at the tokenizer while paused)
    await engines.rejoin(client)
    result = await asyncio.wait_for(stuck, 5.0)
    assert len(result.output_ids) == 3 and failures == []
