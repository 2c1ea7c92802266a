"""The limit on groups in flight (pipeline.supervisor.actors.concurrency): the AIMD rule by hand, its task
on scripted readings, and the engines' /get_load read through the client from the SGLang fake."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import pytest

from pipeline.contracts.config import ConfigError, load_config
from pipeline.supervisor.actors.concurrency import (
    AdaptiveLimit,
    Aimd,
    ConcurrencyLimit,
    concurrency_limit,
)
from pipeline.supervisor.engines.client import EngineClient
from pipeline.supervisor.engines.engine_load import EngineLoad, parse_load
from pipeline.supervisor.engines.pool import EnginePool
from pipeline.supervisor.engines.protocol import (
    EngineError,
    EngineProtocolError,
    EngineUnavailable,
    SamplingParams,
)
from pipeline.supervisor.observability import metrics
from pipeline.tools.fake_sglang import FakeSGLang, LatencyModel

CALM, QUEUED = EngineLoad(requests=8, waiting=0, tokens=900), EngineLoad(requests=12, waiting=4, tokens=1500)


def test_get_load_is_summed_over_the_ranks_and_a_malformed_one_is_named() -> None:
    ranks = [
        {"dp_rank": 0, "num_reqs": 5, "num_waiting_reqs": 2, "num_tokens": 700},
        {"dp_rank": 1, "num_reqs": 3, "num_waiting_reqs": 0, "num_tokens": 400},
    ]
    assert parse_load(ranks) == EngineLoad(requests=8, waiting=2, tokens=1100)
    assert parse_load({"dp_rank": 0, "num_reqs": 1}) == EngineLoad(requests=1, waiting=0, tokens=0)
    for bad, message in (
        ("busy", "expected a list of objects"),
        ([{"dp_rank": 0}], "without integer request counts"),
        ([{"num_reqs": 2, "num_waiting_reqs": -1}], "without integer request counts"),
        ([{"num_reqs": True}], "without integer request counts"),
    ):
        with pytest.raises(EngineProtocolError, match=message):
            parse_load(bad)


def test_an_engine_is_queued_when_more_wait_than_it_has_free_slots() -> None:
    assert not EngineLoad(requests=5, waiting=2, tokens=0, capacity=8).queued  # 3 run, 5 free: a step away
    assert EngineLoad(requests=12, waiting=4, tokens=0, capacity=8).queued  # 8 run: none free
    assert EngineLoad(requests=10, waiting=6, tokens=0, capacity=8).queued  # 4 run, 4 free, 6 wait
    assert EngineLoad(requests=1, waiting=1, tokens=0).queued  # capacity unknown: any wait counts
    assert not EngineLoad(requests=3, waiting=0, tokens=0).queued


def test_the_limit_rises_by_one_while_no_engine_queues_up_to_the_ceiling() -> None:
    aimd = Aimd(floor=4, ceiling=7, limit=5)
    assert [aimd.update([CALM, CALM]) for _ in range(4)] == [6, 7, 7, 7]


def test_two_queued_readings_in_a_row_halve_it_and_one_does_not() -> None:
    aimd = Aimd(floor=2, ceiling=16, limit=16)
    assert aimd.update([CALM, QUEUED]) == 16  # one engine queued once: could be a burst
    assert aimd.update([CALM, CALM]) == 16  # a calm reading resets the count (and the limit is at the top)
    assert aimd.update([QUEUED]) == 16
    assert aimd.update([QUEUED]) == 8
    assert aimd.update([QUEUED]) == 8  # the count starts again after a decrease
    assert aimd.update([QUEUED]) == 4
    assert [aimd.update([QUEUED]) for _ in range(4)] == [4, 2, 2, 2]  # never below the floor


def test_the_floor_and_the_ceiling_bound_the_start_and_a_new_ceiling_clamps() -> None:
    assert Aimd(floor=4, ceiling=8, limit=20).limit == 8
    assert Aimd(floor=4, ceiling=8, limit=1).limit == 4
    aimd = Aimd(floor=4, ceiling=8, limit=8)
    assert aimd.set_ceiling(6) == 6 and aimd.update([CALM]) == 6
    assert aimd.set_ceiling(2) == 4  # a shrunken fleet never takes the limit below a step's groups
    assert aimd.set_ceiling(12) == 4 and aimd.update([CALM]) == 5
    with pytest.raises(ValueError, match=r"floor 9 must be in \[1, ceiling 8\]"):
        Aimd(floor=9, ceiling=8, limit=8)


async def until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():  # noqa: ASYNC110 - plain attributes, no event to wait on
            await asyncio.sleep(0.005)


def _exported() -> float | None:
    return metrics.REGISTRY.get_sample_value("rollwise_admission_concurrency_limit")


class _Readings:
    """Scripted readings: a load list, or an error, per call; then calm forever."""

    def __init__(self, script: list[list[EngineLoad] | EngineError]) -> None:
        self.script: Iterator[list[EngineLoad] | EngineError] = iter(script)
        self.calls = 0

    async def __call__(self) -> list[EngineLoad]:
        self.calls += 1
        reading = next(self.script, [CALM])
        if isinstance(reading, EngineError):
            raise reading
        return reading


async def test_the_task_applies_each_change_and_exports_it() -> None:
    applied: list[int] = []
    unreadable = EngineUnavailable("http://127.0.0.1:9", "connection refused")
    readings = _Readings([[QUEUED], [QUEUED], unreadable, [QUEUED], [QUEUED], [CALM]])
    limit = AdaptiveLimit(Aimd(floor=2, ceiling=8, limit=8), readings, applied.append, interval_s=0.01)
    stop = asyncio.Event()
    task = asyncio.create_task(limit.run(stop))
    await until(lambda: readings.calls >= 6)
    stop.set()
    await task
    # 8 at start; halved after two queued readings; an unreadable engine changes nothing; halved again;
    # one calm reading adds a group.
    assert applied[:4] == [8, 4, 2, 3]
    assert _exported() == applied[-1]


async def test_a_fixed_limit_is_the_ceiling_and_follows_the_fleet() -> None:
    applied: list[int] = []
    fixed = ConcurrencyLimit(6, applied.append)
    await fixed.run(asyncio.Event())
    fixed.set_ceiling(9)
    assert applied == [6, 9] and _exported() == 9


def test_the_config_chooses_the_kind_once() -> None:
    pool = EnginePool([EngineClient("http://127.0.0.1:9")])
    adaptive = concurrency_limit(load_config(None, []).rollout, 4, pool, {}, lambda n: None)
    assert isinstance(adaptive, AdaptiveLimit) and adaptive.state == Aimd(floor=4, ceiling=16, limit=16)
    fixed_cfg = load_config(None, ["rollout.concurrency='fixed'", "rollout.max_concurrent_groups=3"])
    fixed = concurrency_limit(fixed_cfg.rollout, 4, pool, {}, lambda n: None)
    assert type(fixed) is ConcurrencyLimit and fixed.limit == 3
    with pytest.raises(ConfigError, match=r"rollout\.concurrency"):
        load_config(None, ["rollout.concurrency='elastic'"])


async def test_the_engines_queue_is_read_from_get_load_and_halves_the_limit() -> None:
    """The fake runs at most 2 requests and queues the rest, as SGLang's scheduler does."""
    fake = FakeSGLang(max_running_requests=2, latency=LatencyModel(per_token_s=0.05, prefill_s=0.0))
    url = await fake.start()
    client = EngineClient(url)
    pool = EnginePool([client])
    try:
        cfg = load_config(None, ["rollout.max_concurrent_groups=8", "rollout.concurrency_interval_s=0.02"])
        applied: list[int] = []
        limit = concurrency_limit(cfg.rollout, 2, pool, {client.base_url: 2}, applied.append)
        requests = [
            asyncio.create_task(client.generate([1, 2, 3], SamplingParams(max_new_tokens=40), rid=f"r{i}"))
            for i in range(5)
        ]
        await fake.wait_running(5)
        load = await client.load_detail()
        assert (load.requests, load.waiting) == (5, 3) and load.tokens >= 2 * 3  # two running prompts
        stop = asyncio.Event()
        task = asyncio.create_task(limit.run(stop))
        await until(lambda: len(applied) >= 3)
        stop.set()
        await task
        assert applied[:3] == [8, 4, 2]  # at the floor (B = 2) while requests still wait
        for request in requests:
            request.cancel()
        await asyncio.gather(*requests, return_exceptions=True)
    finally:
        await pool.close()
        await fake.stop()
