"""When evaluations run: the budget rule and the minute trigger as pure decisions, then the Evaluator with
them (a controlled clock, the SGLang fake): deferrals counted, eval seconds exported, versions behind,
pause_training off by default, a dedicated engine's load before each evaluation and its failures."""

from __future__ import annotations

import io
import json
import types
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from pipeline.contracts.config import ConfigError, load_config
from pipeline.supervisor.engines.pool import EnginePool
from pipeline.supervisor.engines.protocol import GenerateResult, SamplingParams
from pipeline.supervisor.eval_cadence import Cadence, EvalClock, decide, describe_cadence, effective_interval
from pipeline.supervisor.eval_schedule import Evaluator, read_eval_log
from pipeline.supervisor.fleet.eval_engine import EvalEngineDown
from pipeline.supervisor.observability.metrics import REGISTRY
from pipeline.supervisor.progress import JsonProgress
from tests.supervisor.actors.test_evaluation import coin_setup, fake, pool, settings  # noqa: F401 - fixtures


# --- the rule, pure ---------------------------------------------------------------------------------------
def simulate(cadence: Cadence, served: list[tuple[int, float]], durations: list[float]) -> list[int]:
    """The versions evaluated when `served` lists (version, time) in order and the n-th evaluation takes
    durations[n] seconds; the first served version is the run's start (at_start)."""
    clock, evaluated, ends = EvalClock(), [], None
    for version, now in served:
        if ends is not None and now >= ends:
            clock, ends = replace(clock, ran_s=durations[len(evaluated) - 1]), None
        if decide(cadence, clock, version, now) == "start":
            clock = EvalClock(version=version, since=now, ran_at=now, ran_s=None)
            evaluated.append(version)
            ends = now + durations[len(evaluated) - 1]
    return evaluated


def every_10s(last: int) -> list[tuple[int, float]]:
    return [(v, 10.0 * v) for v in range(last + 1)]


def test_a_tenth_of_the_time_after_a_5_s_evaluation_is_one_every_50_s() -> None:
    # Each 5 s evaluation at time t lets the next start at t + 5 / 0.1 = t + 50: version v + 5.
    assert simulate(Cadence(1, 0.0, 0.10), every_10s(20), [5.0] * 5) == [0, 5, 10, 15, 20]


def test_no_budget_evaluates_every_version_an_evaluation_leaves_free() -> None:
    assert simulate(Cadence(1, 0.0, 1.0), every_10s(5), [5.0] * 6) == [0, 1, 2, 3, 4, 5]
    # 15 s evaluations: the version served while one runs is skipped, never queued.
    assert simulate(Cadence(1, 0.0, 1.0), every_10s(6), [15.0] * 4) == [0, 2, 4, 6]


def test_the_budget_follows_each_evaluations_own_duration() -> None:
    # share 0.25: after D seconds the next waits 4 D from the start: 0 (5 s) -> 20 = v2 (20 s) -> 100 =
    # v10 (2 s) -> 108, so v11 at 110 (2 s) -> 118, so v12 at 120.
    assert simulate(Cadence(1, 0.0, 0.25), every_10s(12), [5.0, 20.0, 2.0, 2.0, 2.0]) == [0, 2, 10, 11, 12]


def test_the_version_trigger_and_the_budget_must_both_allow() -> None:
    # every 7 versions (70 s) is later than the budget (50 s): the trigger decides.
    assert simulate(Cadence(7, 0.0, 0.10), every_10s(20), [5.0] * 3) == [0, 7, 14]
    # every 3 versions (30 s) is earlier: the budget decides.
    assert simulate(Cadence(3, 0.0, 0.10), every_10s(20), [5.0] * 5) == [0, 5, 10, 15, 20]


def test_the_minute_trigger_evaluates_the_first_new_version_after_the_minutes() -> None:
    served = [(v, 25.0 * v) for v in range(9)]  # a version every 25 s
    assert simulate(Cadence(0, 1.0, 0.10), served, [1.0] * 4) == [0, 3, 6]
    # With both triggers, whichever comes first: 2 versions (50 s) before a minute.
    assert simulate(Cadence(2, 1.0, 0.10), served, [1.0] * 5) == [0, 2, 4, 6, 8]


def test_the_minute_trigger_never_scores_the_same_version_twice() -> None:
    clock = EvalClock(version=5, since=0.0, ran_at=0.0, ran_s=1.0)
    assert decide(Cadence(0, 1.0, 1.0), clock, 5, 1000.0) == "wait"
    assert decide(Cadence(0, 1.0, 1.0), clock, 6, 1000.0) == "start"


def test_decisions_name_why_nothing_starts() -> None:
    running = EvalClock(version=0, since=0.0, ran_at=0.0, ran_s=None)
    done = replace(running, ran_s=10.0)
    cadence = Cadence(1, 0.0, 0.5)
    assert decide(cadence, EvalClock(), 0, 0.0) == "start"  # nothing evaluated yet
    assert decide(cadence, running, 1, 5.0) == "running"
    assert decide(cadence, done, 1, 15.0) == "budget"  # opens at 0 + 10 / 0.5 = 20
    assert decide(cadence, done, 1, 20.0) == "start"
    assert decide(Cadence(3, 0.0, 0.5), done, 1, 100.0) == "wait"


def test_the_effective_interval_is_the_later_of_trigger_and_budget_in_whole_versions() -> None:
    # SmolLM2's recipe as measured: a version every 35 s, 60 s per evaluation, every 2 versions.
    assert effective_interval(Cadence(2, 0.0, 0.10), 60.0, 35.0) == (18, 630.0)
    assert effective_interval(Cadence(2, 0.0, 1.0), 60.0, 35.0) == (2, 70.0)
    assert effective_interval(Cadence(0, 5.0, 0.10), 20.0, 35.0) == (9, 315.0)
    assert "10%" in describe_cadence(Cadence(2, 0.0, 0.10), dedicated=False)
    assert "dedicated" in describe_cadence(Cadence(2, 0.0, 1.0), dedicated=True)


# --- config -----------------------------------------------------------------------------------------------
def test_training_is_never_held_and_a_tenth_is_the_budget_by_default() -> None:
    cfg = load_config(None, ["eval.every_versions=2"]).eval
    assert cfg.pause_training is False and cfg.max_engine_share == 0.10 and cfg.engine == "training"
    assert cfg.enabled and load_config(None, ["eval.every_minutes=0.5"]).eval.enabled
    assert not load_config(None, []).eval.enabled


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("eval.max_engine_share=0", "eval.max_engine_share"),
        ("eval.max_engine_share=1.5", "eval.max_engine_share"),
        ("eval.every_minutes=-1", "eval.every_minutes"),
        ('eval.engine="gpu"', "eval.engine"),
        ("eval.engine_threads=0", "eval.engine_threads"),
    ],
)
def test_bad_eval_values_name_the_key(override: str, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        load_config(None, [override])


def test_pause_training_with_a_dedicated_engine_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"eval\.pause_training"):
        load_config(None, ['eval.engine="dedicated"', "eval.pause_training=true"])


def test_a_dedicated_engine_needs_an_engine_kind_that_starts_processes() -> None:
    from pipeline.supervisor.eval_schedule import resolve_eval

    cfg = load_config(
        None,
        [
            'engine.kind="external"',
            'engine.urls=["http://127.0.0.1:1"]',
            "eval.every_versions=1",
            'eval.engine="dedicated"',
            'env.name="guess_number"',
        ],
    )
    with pytest.raises(ConfigError, match=r"eval\.engine"):
        resolve_eval(cfg)


def test_the_default_config_wires_no_admission_hold(tmp_path: Path) -> None:
    from pipeline.supervisor.wiring import build_evaluator

    out = io.StringIO()
    cfg = load_config(None, ["eval.every_versions=2"])
    setup = types.SimpleNamespace(
        cfg=cfg, evaluation=coin_setup(), run=types.SimpleNamespace(eval_log=tmp_path / "e.jsonl")
    )
    evaluator = build_evaluator(
        setup,  # type: ignore[arg-type]
        engine=None,
        tokenizer=None,
        progress=JsonProgress(out),
        started_at=0.0,
        training=object(),  # type: ignore[arg-type]
    )
    assert evaluator is not None and evaluator.training is None and evaluator.dedicated is None
    assert evaluator.cadence == Cadence(2, 0.0, 0.10)
    assert "within 10% of their time" in json.loads(out.getvalue().splitlines()[0])["text"]


# --- the Evaluator with the rule ------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def evaluator(engine: Any, tok: Any, log_path: Path, clock: Clock, **kw: Any) -> Evaluator:
    options: dict[str, Any] = {"every_versions": 1} | kw
    return Evaluator(
        coin_setup(),
        engine=engine,
        tokenizer=tok,
        settings=settings(),
        log_path=log_path,
        progress=JsonProgress(io.StringIO()),
        started_at=0.0,
        clock=clock,
        **options,
    )


async def test_the_evaluator_defers_for_the_budget_and_counts_its_seconds(
    pool: EnginePool,  # noqa: F811 - fixture
    tok: Any,
    tmp_path: Path,
) -> None:
    clock, log_path = Clock(), tmp_path / "eval.jsonl"
    budget_before = sample("rollwise_eval_deferred_total", env="coin", reason="budget")
    seconds_before = sample("rollwise_eval_engine_seconds_total", env="coin", kind="training")
    ev = evaluator(pool, tok, log_path, clock, max_engine_share=0.1, newest_published=lambda: 9)
    assert REGISTRY.get_sample_value("rollwise_eval_engine_share_budget_ratio", {"env": "coin"}) == 0.1
    ev.on_version(0, step=0)
    clock.t = 5.0  # the evaluation ends 5 s after it started
    assert ev.running is not None
    await ev.running
    for version in (1, 2, 3, 4):  # every 10 s: within 50 s of the start, the budget says no
        clock.t = 10.0 * version
        ev.on_version(version, step=version)
        assert ev.running.done()
    clock.t = 50.0
    ev.on_version(5, step=5)
    clock.t = 52.0
    await ev.running
    rows = read_eval_log(log_path)
    assert [r["version"] for r in rows] == [0, 5]
    assert sample("rollwise_eval_deferred_total", env="coin", reason="budget") == budget_before + 4
    seconds = sample("rollwise_eval_engine_seconds_total", env="coin", kind="training")
    assert seconds == pytest.approx(seconds_before + 5.0 + 2.0)
    # Evaluated 7 s of the 52 s since the first one started; the learner had published 9 meanwhile.
    assert rows[1]["eval_share"] == pytest.approx(7 / 52, abs=1e-3)
    assert [r["versions_behind"] for r in rows] == [9, 4]
    assert REGISTRY.get_sample_value("rollwise_eval_lag_versions", {"env": "coin"}) == 4


async def test_the_minute_trigger_in_the_evaluator(
    pool: EnginePool,  # noqa: F811 - fixture
    tok: Any,
    tmp_path: Path,
) -> None:
    clock, log_path = Clock(), tmp_path / "eval.jsonl"
    ev = evaluator(pool, tok, log_path, clock, every_versions=0, every_minutes=1.0)
    ev.skip_start(0)  # at_start = false: the minute counts from the start
    for version, now in ((1, 30.0), (2, 59.0), (3, 61.0), (4, 90.0), (5, 125.0)):
        clock.t = now
        ev.on_version(version, step=version)
        if ev.running is not None:
            await ev.running
    assert [r["version"] for r in read_eval_log(log_path)] == [3, 5]


class OwnFake:
    """A dedicated engine over the fake: `load` records versions (or fails), generate forwards."""

    def __init__(self, engines: EnginePool, fail_loads: int = 0) -> None:
        self.pool, self.fail_loads = engines, fail_loads
        self.loads: list[int] = []
        self.launched: list[int] = []
        self.priorities: list[int | None] = []
        self.stopped = False

    def launch(self, version: int) -> None:
        self.launched.append(version)

    async def load(self, version: int) -> float:
        self.loads.append(version)
        if self.fail_loads > 0:
            self.fail_loads -= 1
            raise EvalEngineDown("the evaluation engine is not up after 1 s")
        return 0.25

    async def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        rid: str,
        *,
        affinity_key: str,
        priority: Any = None,
    ) -> GenerateResult:
        self.priorities.append(priority)
        return await self.pool.generate(input_ids, sampling, rid, affinity_key=affinity_key)

    async def stop(self) -> None:
        self.stopped = True


async def test_a_dedicated_engine_loads_each_version_has_no_budget_and_a_failed_load_costs_one_evaluation(
    pool: EnginePool,  # noqa: F811 - fixture
    tok: Any,
    tmp_path: Path,
) -> None:
    clock, log_path = Clock(), tmp_path / "eval.jsonl"
    own = OwnFake(pool, fail_loads=1)
    failed = sample("rollwise_eval_runs_total", env="coin", status="failed")
    ev = evaluator(
        None, tok, log_path, clock, max_engine_share=0.1, dedicated=own, newest_published=lambda: 3
    )
    assert ev.cadence.max_engine_share == 1.0  # it takes nothing from the training engines
    for version in (0, 1, 2):
        clock.t = float(version)
        ev.on_version(version, step=version)
        assert ev.running is not None
        clock.t += 0.5
        await ev.running
    await ev.stop()
    # v0's load failed (engine down): no row, counted; v1 and v2 back to back, no budget in the way.
    rows = read_eval_log(log_path)
    assert own.loads == [0, 1, 2] and [r["version"] for r in rows] == [1, 2]
    assert all(r["engine"] == "dedicated" and r["load_s"] == 0.25 for r in rows)
    assert [r["versions_behind"] for r in rows] == [2, 1]
    assert sample("rollwise_eval_runs_total", env="coin", status="failed") == failed + 1
    assert set(own.priorities) == {None} and own.stopped
