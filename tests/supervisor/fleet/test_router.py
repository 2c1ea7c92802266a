"""sglang-router (the real 0.3.2 binary) in front of two embedded engines the fleet starts and keeps.

Each engine is labelled with its own weight version, so every reply names the engine that produced
it (`meta_info.weight_version`) without any test hook in the path.
"""

from __future__ import annotations

import asyncio
import collections
import importlib.util
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from pipeline.contracts.config import load_config
from pipeline.contracts.run_dir import RunDir
from pipeline.supervisor.engines.protocol import EngineError, SamplingParams
from pipeline.supervisor.engines.router import router_argv
from pipeline.supervisor.engines.weightsync import sync_weights
from pipeline.supervisor.fleet.engine_fleet import EngineFleet

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        importlib.util.find_spec("sglang_router") is None,
        reason="sglang-router is not installed (make venv installs it from the dev extra)",
    ),
]

SAMPLING = SamplingParams(max_new_tokens=3, temperature=1.0)


def test_router_argv_uses_session_affinity_and_short_health_checks() -> None:
    argv = router_argv(
        host="127.0.0.1",
        port=31000,
        worker_urls=["http://127.0.0.1:30000", "http://127.0.0.1:30001"],
        policy="manual",
        request_timeout_s=120,
        prometheus_port=31001,
    )
    assert argv[1:3] == ["-m", "sglang_router.launch_router"]
    flags = dict(zip(argv[3::2], argv[4::2], strict=False))
    assert flags["--policy"] == "manual" and flags["--assignment-mode"] == "min_load"
    assert flags["--request-timeout-secs"] == "120" and flags["--health-check-interval-secs"] == "5"
    assert argv[argv.index("--worker-urls") + 1 :] == ["http://127.0.0.1:30000", "http://127.0.0.1:30001"]
    assert "--assignment-mode" not in router_argv(
        host="h", port=1, worker_urls=[], policy="cache_aware", request_timeout_s=1, prometheus_port=2
    )


@pytest.fixture
async def fleet(tmp_path: Path, tiny_model_dir: Path) -> AsyncIterator[EngineFleet]:
    cfg = load_config(
        None,
        [
            "engine.port=0",
            "engine.num_engines=2",
            'engine.router.kind="sglang-router"',
            "engine.max_batch=8",
            f'model.path="{tiny_model_dir}"',
        ],
    )
    run = RunDir.at(str(tmp_path / "run"), str(tiny_model_dir))
    failures: list[str] = []
    stopping = asyncio.Event()
    fleet = EngineFleet(cfg, run, stopping, served_version=lambda: 0, fail=failures.append)
    try:
        await asyncio.wait_for(fleet.start(), 180)
        # Label each engine with its own version: a reply then says which engine produced it.
        for i, client in enumerate(fleet.clients):
            await client._call_json(
                "POST", "/update_weight_version", {"new_version": f"e{i}", "abort_all_requests": False}
            )
        yield fleet
    finally:
        stopping.set()
        await fleet.stop(5.0)
    assert failures == []


async def play(fleet: EngineFleet, episode: str, turns: int) -> list[str]:
    """An episode: each turn's prompt extends the last; returns the engine label of every turn."""
    ids = [5, 6, 7, 8]
    served = []
    for t in range(turns):
        result = await fleet.pool.generate(ids, SAMPLING, f"{episode}-t{t}", affinity_key=episode)
        served.append(result.weight_version)
        ids = ids + result.output_ids + [9]
    return served


async def test_router_keeps_each_episode_on_one_engine_and_control_calls_reach_every_engine(
    fleet: EngineFleet,
) -> None:
    assert fleet.router_url is not None
    engines = {c.base_url for c in fleet.clients}
    assert fleet.router_admin is not None and set(await fleet.router_admin.workers()) == engines

    served = await asyncio.gather(*(play(fleet, f"ep{k}", 3) for k in range(8)))
    for labels in served:
        assert len(set(labels)) == 1, served  # every turn of an episode on the same engine
    assert {labels[0] for labels in served} == {"e0", "e1"}  # new episodes go to the less loaded one

    timings = await sync_weights(
        fleet.pool, model_path=str(fleet.run_dir.initial_model), version=7, mode="in_place"
    )
    assert timings.ok, timings.errors
    after = await asyncio.gather(*(play(fleet, f"late{k}", 2) for k in range(4)))
    assert {label for labels in after for label in labels} == {"7"}  # both engines loaded it directly


async def test_killing_one_engine_costs_only_its_in_flight_episodes_and_it_rejoins(
    fleet: EngineFleet,
) -> None:
    outcomes: dict[str, str] = {}
    on_engine: dict[str, str] = {}
    all_placed = asyncio.Event()

    async def episode(name: str) -> None:
        ids = [3, 4, 5]
        try:
            for t in range(30):
                result = await fleet.pool.generate(ids, SAMPLING, f"{name}-t{t}", affinity_key=name)
                on_engine.setdefault(name, result.weight_version)
                if len(on_engine) == 6:
                    all_placed.set()
                ids = ids + result.output_ids
                await asyncio.sleep(0.02)
            outcomes[name] = "ok"
        except EngineError:
            outcomes[name] = "failed"

    running = [asyncio.create_task(episode(f"ep{k}")) for k in range(6)]
    await asyncio.wait_for(all_placed.wait(), 60)
    victim = fleet.children["engine1"]
    victim.kill()
    await asyncio.gather(*running)
    counts = collections.Counter(outcomes.values())
    lost = {n for n, o in outcomes.items() if o == "failed"}
    assert lost <= {n for n, e in on_engine.items() if e == "e1"}, (outcomes, on_engine)
    assert counts["ok"] >= sum(1 for e in on_engine.values() if e == "e0")

    # New episodes while engine1 is down all succeed on engine0 (the router dropped it at once).
    fresh = await asyncio.gather(*(play(fleet, f"fresh{k}", 2) for k in range(3)))
    assert {label for labels in fresh for label in labels} <= {"e0", "0"}

    # The engine restarts on the served version and rejoins the router.
    for _ in range(600):
        if fleet.up.get("engine1") and fleet.children["engine1"] is not victim:
            break
        await asyncio.sleep(0.1)
    assert fleet.up["engine1"]
    assert fleet.router_admin is not None
    await fleet.router_admin.wait_worker(fleet.slots[1].url, 30.0)
