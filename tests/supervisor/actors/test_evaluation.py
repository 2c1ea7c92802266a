"""Held-out evaluation: the runner against the SGLang fake over real HTTP, its numbers, the daemon's
Evaluator (schedule, eval.jsonl, metrics), the embedded engine's priority queue, `rollwise eval`."""

from __future__ import annotations

import asyncio
import collections
import io
import json
import types
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from envs.api import Action, Environment, EnvSpec, Message, StepResult, Task
from pipeline.contracts.config import ConfigError, load_config, write_resolved
from pipeline.supervisor.actors.heldout import EvalPlan, ModeResult, run_evaluation, summarise
from pipeline.supervisor.actors.rollout import EpisodeOutcome, RolloutSettings
from pipeline.supervisor.engines.client import EngineClient
from pipeline.supervisor.engines.pool import EnginePool
from pipeline.supervisor.engines.protocol import EngineError, SamplingParams
from pipeline.supervisor.eval_schedule import (
    EvalSetup,
    Evaluator,
    read_eval_log,
    resolve_eval,
    training_holdout,
)
from pipeline.supervisor.observability import metrics
from pipeline.supervisor.observability.metrics import REGISTRY
from pipeline.supervisor.progress import JsonProgress
from pipeline.tools.fake_sglang import FakeSGLang, GenerateCall, Plan

WIN, LOSE = "7", "3"


class CoinEnv(Environment):
    """One turn: outcome 1.0 when the answer is "7", turn reward 0.5 either way."""

    spec = EnvSpec(name="coin", version="1", max_turns=1)

    def tasks(self, seed: int) -> Iterator[Task]:
        index = 0
        while True:
            yield Task(id=f"coin-{seed}-{index}", seed=index, data={"i": index})
            index += 1

    async def reset(self, task: Task) -> list[Message]:
        return [{"role": "user", "content": "Say a number."}]

    async def step(self, action: Action) -> StepResult:
        solved = action.text.strip() == WIN
        return StepResult([], reward=0.5, done=True, outcome=1.0 if solved else 0.0)


def winner(rid: str) -> bool:
    """Greedy solves even tasks; sampled solves only sample 0 of tasks 0 and 1 (ids: ...-MODE-tI-S-tTURN)."""
    mode, task, sample, _ = rid.split("-")[-4:]
    index, s = int(task[1:]), int(sample)
    return index % 2 == 0 if mode == "greedy" else index < 2 and s == 0


@pytest.fixture
async def fake(tok: Any) -> AsyncIterator[FakeSGLang]:
    def script(call: GenerateCall) -> Plan:
        answer = WIN if winner(call.rid) else LOSE
        ids = [*tok.encode(answer, add_special_tokens=False), tok.eos_token_id]
        return Plan(ids, [-0.5] * len(ids), "stop")

    server = FakeSGLang(script=script, token_delay_s=0.01)
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
async def pool(fake: FakeSGLang) -> AsyncIterator[EnginePool]:
    engines = EnginePool([EngineClient(fake.base_url, retries=0)])
    yield engines
    await engines.close()


def settings() -> RolloutSettings:
    return RolloutSettings(sampling=SamplingParams(temperature=0.7, max_new_tokens=4), max_context_tokens=256)


def plan(tasks: int, *, greedy: bool = True, samples: int = 0) -> EvalPlan:
    env = CoinEnv()
    stream = env.tasks(5)
    return EvalPlan(tuple(next(stream) for _ in range(tasks)), greedy=greedy, samples=samples)


def training_episodes(env: str) -> float:
    return sum(
        REGISTRY.get_sample_value("rollwise_episodes_total", {"env": env, "reason": r}) or 0.0
        for r in ("stop", "length", "truncated", "env_error", "engine_error", "timeout")
    )


async def test_eval_scores_greedy_and_pass_at_k_and_sends_low_priority_greedy_requests(
    fake: FakeSGLang, pool: EnginePool, tok: Any
) -> None:
    results = await run_evaluation(
        pool, tok, CoinEnv, plan(4, samples=3), settings(), env_name="coin", max_concurrent=3, priority=-100
    )
    greedy, sampled = results["greedy"], results["sampled"]
    # Greedy: tasks 0 and 2 solved. Sampled: one of 3 samples of tasks 0 and 1.
    assert (greedy.tasks, greedy.episodes, greedy.successes, greedy.success, greedy.pass_at_k) == (
        4,
        4,
        2,
        0.5,
        0.5,
    )
    assert (sampled.k, sampled.episodes, sampled.successes) == (3, 12, 2)
    assert sampled.success == pytest.approx(2 / 12) and sampled.pass_at_k == 0.5
    assert greedy.reward_mean == pytest.approx(0.5 + 0.5) and sampled.reward_mean == pytest.approx(
        0.5 + 2 / 12
    )
    assert greedy.turns_mean == 1.0 and greedy.finish_reasons == {"stop": 4}
    assert greedy.versions == (0, 0)  # the fake's "default" weight version
    bodies = fake.generate_requests()
    assert len(bodies) == 16 and all(b["priority"] == -100 for b in bodies)
    temperatures = collections.Counter(
        (b["rid"].split("-")[1], b["sampling_params"]["temperature"]) for b in bodies
    )
    assert temperatures == {("greedy", 0.0): 4, ("sampled", 0.7): 12}
    assert fake.peak_running == 3  # max_concurrent bounds eval's share of the engine


async def test_eval_episodes_stay_out_of_the_training_metrics(pool: EnginePool, tok: Any) -> None:
    before = training_episodes("coin")
    await run_evaluation(pool, tok, CoinEnv, plan(2), settings(), env_name="coin")
    assert training_episodes("coin") == before == 0.0


async def test_without_a_priority_the_request_carries_no_priority_field(
    fake: FakeSGLang, pool: EnginePool, tok: Any
) -> None:
    await run_evaluation(pool, tok, CoinEnv, plan(1), settings(), env_name="coin", priority=None)
    assert all("priority" not in b for b in fake.generate_requests())


def test_summarise_counts_a_task_for_pass_at_k_once_and_reports_versions() -> None:
    def ep(outcome: float | None, reason: str = "stop", turns: int = 2) -> EpisodeOutcome:
        return EpisodeOutcome("e", "g", "t", "coin", reason, [], [0.25] * turns, outcome, 1, 0.1)

    result = summarise("sampled", [[ep(1.0), ep(1.0)], [ep(0.0), ep(None, "env_error", 0)]])
    assert (result.success, result.pass_at_k, result.successes, result.k) == (0.5, 0.5, 2, 2)
    assert result.reward_mean == pytest.approx((1.5 + 1.5 + 0.5 + 0.0) / 4)
    assert result.turns_mean == 1.5 and result.finish_reasons == {"env_error": 1, "stop": 3}
    assert result.versions is None  # no rows: no token was generated


def test_eval_plan_needs_a_mode_and_a_task() -> None:
    with pytest.raises(ValueError, match="greedy or samples"):
        plan(1, greedy=False, samples=0)
    with pytest.raises(ValueError, match="at least one task"):
        EvalPlan(())


# --- the daemon's Evaluator ----------------------------------------------------------------------------
def coin_setup(tasks: int = 2) -> EvalSetup:
    return EvalSetup("coin", CoinEnv, {}, plan(tasks), 5, 0.0, max_concurrent=4, priority=-100)


async def test_evaluator_runs_on_schedule_and_logs_a_row_metrics_and_a_status_line(
    pool: EnginePool, tok: Any, tmp_path: Path
) -> None:
    out = io.StringIO()
    log_path = tmp_path / "logs" / "eval.jsonl"
    evaluator = Evaluator(
        coin_setup(),
        engine=pool,
        tokenizer=tok,
        settings=settings(),
        every_versions=3,
        log_path=log_path,
        progress=JsonProgress(out),
        started_at=0.0,
    )
    evaluator.on_version(0, step=0)  # the start
    evaluator.on_version(1, step=1)  # one is running: not due
    assert evaluator.running is not None
    await evaluator.running
    for version in (1, 2):
        evaluator.on_version(version, step=version)
        assert evaluator.running.done()  # 1 and 2 are fewer than 3 versions past 0
    evaluator.on_version(3, step=4)
    await evaluator.running
    rows = read_eval_log(log_path)
    assert [(r["version"], r["step"]) for r in rows] == [(0, 0), (3, 4)]
    assert rows[1]["greedy"]["success"] == 0.5 and rows[1]["tasks"] == 2 and "sampled" not in rows[1]
    assert REGISTRY.get_sample_value("rollwise_eval_success_ratio", {"env": "coin", "mode": "greedy"}) == 0.5
    assert REGISTRY.get_sample_value("rollwise_eval_policy_version", {"env": "coin"}) == 3
    status = [json.loads(line) for line in out.getvalue().splitlines()]
    evals = [s for s in status if s["event"] == "eval"]
    assert [s["version"] for s in evals] == [0, 3] and evals[1]["engine"] == "training"
    # Once an evaluation's cost and the versions' pace (over 5 versions) are known, the effective interval
    # is printed, once.
    assert not [s for s in status if s["event"] == "message"]
    for version in (4, 5):
        evaluator.on_version(version, step=version)
    told = [json.loads(line)["text"] for line in out.getvalue().splitlines() if '"message"' in line]
    assert len(told) == 1 and told[0].startswith("evaluation every ~")


async def test_a_failing_evaluation_is_counted_and_reported_not_raised(
    pool: EnginePool, tmp_path: Path
) -> None:
    out = io.StringIO()
    before = REGISTRY.get_sample_value("rollwise_eval_runs_total", {"env": "coin", "status": "failed"}) or 0.0
    evaluator = Evaluator(
        coin_setup(),
        engine=pool,
        tokenizer=None,  # a bug, not an episode failure: the runner cannot render a prompt
        settings=settings(),
        every_versions=1,
        log_path=tmp_path / "eval.jsonl",
        progress=JsonProgress(out),
        started_at=0.0,
    )
    evaluator.on_version(0, step=0)
    assert evaluator.running is not None
    await evaluator.running
    after = REGISTRY.get_sample_value("rollwise_eval_runs_total", {"env": "coin", "status": "failed"})
    assert after == before + 1
    assert "evaluation of version 0 failed" in out.getvalue() and not (tmp_path / "eval.jsonl").exists()


class DyingEngine:
    """Answers the first `good` requests through `engine`, then fails as a killed engine does."""

    def __init__(self, engine: EnginePool, good: int) -> None:
        self.engine, self.good = engine, good

    async def generate(self, input_ids: list[int], sampling: SamplingParams, rid: str, **kw: Any) -> Any:
        if self.good <= 0:
            raise EngineError("engine http://127.0.0.1:1 stopped answering")
        self.good -= 1
        return await self.engine.generate(input_ids, sampling, rid, **kw)


async def test_an_evaluation_with_engine_errors_scores_nothing_and_the_next_version_is_evaluated(
    pool: EnginePool, tok: Any, tmp_path: Path
) -> None:
    """Seen with SmolLM2: an engine killed for memory mid-evaluation turned 64 episodes into
    engine_error and the curve read 0.0 between 0.56 and 0.67. Such an evaluation is no score."""
    out = io.StringIO()
    log_path = tmp_path / "eval.jsonl"
    failed = REGISTRY.get_sample_value("rollwise_eval_runs_total", {"env": "coin", "status": "failed"}) or 0.0
    engine = DyingEngine(pool, good=3)
    evaluator = Evaluator(
        coin_setup(tasks=4),
        engine=engine,
        tokenizer=tok,
        settings=settings(),
        every_versions=5,
        log_path=log_path,
        progress=JsonProgress(out),
        started_at=0.0,
    )
    evaluator.on_version(0, step=0)
    assert evaluator.running is not None
    await evaluator.running
    assert not log_path.exists()
    assert (
        REGISTRY.get_sample_value("rollwise_eval_runs_total", {"env": "coin", "status": "failed"})
        == failed + 1
    )
    assert "evaluation of version 0 failed: 1 of 4 episodes ended engine_error" in out.getvalue()
    engine.good = 100  # the engine is back: the very next version is due, not 5 versions later
    evaluator.on_version(1, step=1)
    await evaluator.running
    assert [r["version"] for r in read_eval_log(log_path)] == [1]


async def test_stop_cancels_a_running_evaluation(
    fake: FakeSGLang, pool: EnginePool, tok: Any, tmp_path: Path
) -> None:
    fake.token_delay_s = 5.0
    evaluator = Evaluator(
        coin_setup(),
        engine=pool,
        tokenizer=tok,
        settings=settings(),
        every_versions=1,
        log_path=tmp_path / "eval.jsonl",
        progress=JsonProgress(io.StringIO()),
        started_at=0.0,
    )
    evaluator.on_version(0, step=0)
    await fake.wait_running(1)
    await asyncio.wait_for(evaluator.stop(), 10)
    assert evaluator.running is not None and evaluator.running.cancelled()


async def test_finish_lets_a_running_evaluation_end_within_the_grace(
    fake: FakeSGLang, pool: EnginePool, tok: Any, tmp_path: Path
) -> None:
    evaluator = Evaluator(
        coin_setup(),
        engine=pool,
        tokenizer=tok,
        settings=settings(),
        every_versions=1,
        log_path=tmp_path / "eval.jsonl",
        progress=JsonProgress(io.StringIO()),
        started_at=0.0,
    )
    evaluator.on_version(7, step=7)
    await asyncio.wait_for(evaluator.finish(grace_s=60), 60)
    assert [r["version"] for r in read_eval_log(tmp_path / "eval.jsonl")] == [7]


class RecordingHold:
    """The scheduler's pause/resume, recorded with whether the evaluation's requests had started."""

    def __init__(self, fake: FakeSGLang) -> None:
        self.fake = fake
        self.calls: list[tuple[str, str, int]] = []

    def pause(self, by: str) -> None:
        self.calls.append(("pause", by, len(self.fake.generate_requests())))

    def resume(self, by: str) -> None:
        self.calls.append(("resume", by, len(self.fake.generate_requests())))


def paused_seconds() -> float:
    return REGISTRY.get_sample_value("rollwise_eval_training_paused_seconds_total", {"env": "coin"}) or 0.0


async def test_pause_training_holds_admission_for_exactly_the_evaluation_even_when_it_fails(
    fake: FakeSGLang, pool: EnginePool, tok: Any, tmp_path: Path
) -> None:
    """eval.pause_training: held before the first eval request, released after the last one (and after
    a failed evaluation too, or training would stay paused for good); the seconds are exported."""
    hold = RecordingHold(fake)
    before = paused_seconds()
    for tokenizer, version in ((tok, 0), (None, 1)):  # None: the evaluation fails (a bug, not an episode)
        evaluator = Evaluator(
            coin_setup(tasks=3),
            engine=pool,
            tokenizer=tokenizer,
            settings=settings(),
            every_versions=1,
            log_path=tmp_path / "eval.jsonl",
            progress=JsonProgress(io.StringIO()),
            started_at=0.0,
            training=hold,
        )
        evaluator.on_version(version, step=version)
        assert evaluator.running is not None
        await evaluator.running
    assert hold.calls == [
        ("pause", "eval v0", 0),
        ("resume", "eval v0", 3),
        ("pause", "eval v1", 3),
        ("resume", "eval v1", 3),
    ]
    assert paused_seconds() > before


def test_pause_training_is_wired_only_when_configured(tmp_path: Path) -> None:
    from pipeline.supervisor.wiring import build_evaluator

    hold = object()
    for flag, expected in (("false", None), ("true", hold)):
        cfg = load_config(None, ["eval.every_versions=2", f"eval.pause_training={flag}"])
        setup = types.SimpleNamespace(
            cfg=cfg, evaluation=coin_setup(), run=types.SimpleNamespace(eval_log=tmp_path / "e.jsonl")
        )
        evaluator = build_evaluator(
            setup,  # type: ignore[arg-type]
            engine=None,
            tokenizer=None,
            progress=JsonProgress(io.StringIO()),
            started_at=0.0,
            training=hold,  # type: ignore[arg-type]
        )
        assert evaluator is not None and evaluator.training is expected


# --- config -----------------------------------------------------------------------------------------------
def test_eval_priority_off_sends_none() -> None:
    assert resolve_eval(load_config(None, ["eval.priority=off"])).priority is None
    assert resolve_eval(load_config(None, [])).priority == -100
    with pytest.raises(ConfigError, match=r"eval\.priority"):
        load_config(None, ["eval.priority=low"])


def test_eval_seed_equal_to_the_training_seed_is_refused_unless_content_is_held_out() -> None:
    with pytest.raises(ConfigError, match=r"eval.seed must differ from run.seed"):
        load_config(None, ["eval.seed=0"])
    assert load_config(None, ["eval.seed=0", "eval.holdout_fraction=0.5"]).eval.seed == 0
    assert load_config(None, ["eval.seed=0", "eval.env=calculator"]).eval.env == "calculator"
    with pytest.raises(ConfigError, match="eval needs greedy = true or samples >= 1"):
        load_config(None, ["eval.greedy=false"])


def test_resolve_eval_fixes_the_tasks_and_names_bad_keys() -> None:
    cfg = load_config(None, ["eval.tasks=5", "eval.samples=2"])
    setup = resolve_eval(cfg)
    assert [t.id for t in setup.plan.tasks] == [f"guess-number-1000003-{i}" for i in range(5)]
    assert setup.plan.modes == ("greedy", "sampled") and setup.options == {}
    with pytest.raises(ConfigError, match=r"eval.env: .*nope"):
        resolve_eval(load_config(None, ["eval.env=nope"]))
    with pytest.raises(ConfigError, match=r"eval.options: guess-number rejects"):
        resolve_eval(load_config(None, ["eval.options={low=9,high=2}"]))
    with pytest.raises(ConfigError, match=r"eval.holdout_fraction: only 0 of the first"):
        resolve_eval(load_config(None, ["eval.holdout_fraction=0.01"]))


def test_a_holdout_binds_training_only_when_eval_plays_the_training_env() -> None:
    assert training_holdout(load_config(None, ["eval.holdout_fraction=0.5"])) == 0.5
    assert training_holdout(load_config(None, ["eval.holdout_fraction=0.5", "eval.env=calculator"])) == 0.0
    other_options = ["eval.holdout_fraction=0.5", "eval.options={low=1,high=8}"]
    assert training_holdout(load_config(None, other_options)) == 0.0


# --- embedded engine: priority queue ------------------------------------------------------------------------
def test_embedded_engine_queues_by_priority_then_arrival() -> None:
    from pipeline.engine.batcher import ContinuousBatcher
    from pipeline.engine.engine_request import EngineRequest
    from pipeline.engine.sampling import RequestSampling

    def req(rid: str, priority: int) -> EngineRequest:
        return EngineRequest(rid, [1], RequestSampling(), lambda r, f: None, priority=priority)

    queue = types.SimpleNamespace(_waiting=collections.deque())
    ContinuousBatcher._enqueue(queue, [req("t1", 0), req("e1", -100), req("t2", 0)])  # type: ignore[arg-type]
    ContinuousBatcher._enqueue(queue, [req("e2", -100), req("t3", 0), req("hi", 5)])  # type: ignore[arg-type]
    assert [r.rid for r in queue._waiting] == ["hi", "t1", "t2", "t3", "e1", "e2"]


# --- rollwise eval ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """A run directory as the daemon leaves it: resolved config and an initial model (version 0)."""
    import shutil

    root = tmp_path_factory.mktemp("eval-run")
    cfg = load_config(
        Path(__file__).resolve().parents[3] / "examples" / "guess_number.toml",
        [f"run.run_dir={json.dumps(str(root))}", "eval.tasks=4", "eval.samples=2"],
    )
    write_resolved(cfg, root)
    shutil.copytree(tiny_model_dir, root / "model")
    return root


def test_rollwise_eval_prints_json_for_version_zero_on_its_own_engine(
    run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from pipeline.tools.offline_eval import main

    assert main(["--run-dir", str(run_dir), "--samples", "2", "--tasks", "3", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert (row["version"], row["env"], row["tasks"], row["seed"]) == (0, "guess-number", 3, 1000003)
    assert "greedy" not in row and row["sampled"]["episodes"] == 6 and row["sampled"]["k"] == 2
    assert row["sampled"]["versions"] == [0, 0]
    assert sum(row["sampled"]["finish_reasons"].values()) == 6


def test_rollwise_eval_table_and_argument_errors(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from pipeline.tools.offline_eval import main

    assert main(["--run-dir", str(run_dir), "--greedy", "--tasks", "2"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("guess-number v0: 2 held-out tasks (seed 1000003, holdout 0.0)")
    assert table[1].split() == ["mode", "k", "episodes", "success", "pass@k", "reward", "turns"]
    assert table[2].split()[:3] == ["greedy", "1", "2"] and len(table) == 4
    assert main(["--run-dir", str(run_dir), "--version", "7"]) == 2
    assert "--version 7: no weights for it" in capsys.readouterr().err
    assert main(["--run-dir", str(run_dir.parent / "missing")]) == 2
    assert "config.toml does not exist" in capsys.readouterr().err


async def test_rollwise_eval_against_an_engine_url_checks_the_served_version(
    run_dir: Path, fake: FakeSGLang
) -> None:
    from pipeline.contracts.config import load_config as load
    from pipeline.contracts.run_dir import RunDir
    from pipeline.tools.offline_eval import EvalCommandError, evaluate_version

    cfg = load(run_dir / "config.toml")
    setup = resolve_eval(cfg, tasks=1, greedy=True, samples=0)
    with pytest.raises(EvalCommandError, match="serves weight_version 'default', not 0"):
        await evaluate_version(cfg, RunDir.at(run_dir), setup, 0, fake.base_url)
    fake.weight_version = "0"
    results, _ = await evaluate_version(cfg, RunDir.at(run_dir), setup, 0, fake.base_url)
    assert results["greedy"].episodes == 1 and fake.generate_requests()[0]["priority"] == -100


def test_report_plots_the_eval_log_against_the_learner_step(tmp_path: Path) -> None:
    from pipeline.tools import report

    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "steps.jsonl").write_text('{"event": "step", "step": 1, "metrics": {"loss": 1.0}}\n')
    rows = [
        {"event": "eval", "step": 0, "greedy": {"success": 0.1}},
        {
            "event": "eval",
            "step": 50,
            "greedy": {"success": 0.4},
            "sampled": {"success": 0.3, "pass_at_k": 0.6},
        },
        {"event": "eval", "step": None, "greedy": {"success": 0.9}},  # an offline row: no step, not plotted
    ]
    (tmp_path / "logs" / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"eve')
    panel = report.from_step_log(tmp_path)[-1]
    assert panel.title == "Held-out eval success" and panel.unit == "percentunit"
    assert [(s.label, s.x, s.y) for s in panel.series] == [
        ("greedy success", [0.0, 50.0], [0.1, 0.4]),
        ("sampled success", [50.0], [0.3]),
        ("sampled pass@k", [50.0], [0.6]),
    ]


def test_sglang_is_launched_with_priority_scheduling_only_when_eval_sends_a_priority(tmp_path: Path) -> None:
    from pipeline.supervisor.fleet.engine_launch import engine_argv, plan_engines

    def argv(*overrides: str) -> list[str]:
        cfg = load_config(None, ["engine.kind=sglang", *overrides])
        return engine_argv(cfg, plan_engines(cfg)[0], model_dir=tmp_path, version=0)

    on = argv("eval.every_versions=10")
    assert on[on.index("--enable-priority-scheduling") + 1 : on.index("--default-priority-value") + 2] == [
        "--default-priority-value",
        "0",
    ]
    assert "--enable-priority-scheduling" not in argv()  # eval off
    assert "--enable-priority-scheduling" not in argv("eval.every_versions=10", "eval.priority=off")
    own = argv("eval.every_versions=10", 'engine.extra_args=["--enable-priority-scheduling"]')
    assert own.count("--enable-priority-scheduling") == 1 and "--default-priority-value" not in own


def test_the_live_view_line_names_each_mode_of_an_evaluation() -> None:
    from pipeline.supervisor.progress import eval_summary

    row = {
        "env": "guess-number",
        "tasks": 64,
        "greedy": {"success": 0.8125},
        "sampled": {"success": 0.5, "k": 4, "pass_at_k": 0.9375},
    }
    assert eval_summary(row) == "guess-number: greedy 81.2%; sampled 50.0%, pass@4 93.8% (64 tasks)"


async def test_the_daemons_training_stream_skips_the_held_out_tasks(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    import argparse
    import itertools
    import types

    from envs.task_split import is_held_out
    from pipeline.contracts import events
    from pipeline.supervisor.wiring import build_scheduler, resolve_config, rollout_settings

    ns = argparse.Namespace(
        config=None,
        set=[
            f"model.path={json.dumps(str(tiny_model_dir))}",
            "eval.every_versions=5",
            "eval.holdout_fraction=0.5",
        ],
        run_dir=str(tmp_path / "run"),
        max_steps=None,
        log_format=None,
    )
    setup = resolve_config(ns)
    assert setup.evaluation is not None
    held_out = {t.data["secret"] for t in setup.evaluation.plan.tasks}
    assert held_out == {4, 6, 10, 11}
    scheduler = build_scheduler(
        setup,
        engine=None,  # type: ignore[arg-type]
        tokenizer=None,  # type: ignore[arg-type]
        agent_endpoint=types.SimpleNamespace(settings=rollout_settings(setup.cfg)),  # type: ignore[arg-type]
        ready=events.Ready(0, 0, 0, ""),
        served_version=0,
        dropped_already=0,
    )
    trained = list(itertools.islice(scheduler._tasks, 300))
    assert not [t for t in trained if is_held_out(t, 0.5)]
    assert {t.data["secret"] for t in trained} == set(range(1, 17)) - held_out


# --- training vs held-out success ----------------------------------------------------------------------
def mode_result(success: float) -> ModeResult:
    return ModeResult("greedy", 1, 10, 10, int(success * 10), success, success, 0.0, 1.0, {"stop": 10}, None)


def test_the_gap_is_training_success_since_the_last_evaluation_minus_held_out_success(tmp_path: Path) -> None:
    env = "coin-gap"
    setup = EvalSetup(env, CoinEnv, {}, plan(2), 5, 0.0, max_concurrent=4, priority=-100)
    evaluator = Evaluator(
        setup,
        engine=None,
        tokenizer=None,
        settings=settings(),
        every_versions=7,
        log_path=tmp_path / "eval.jsonl",
        progress=JsonProgress(io.StringIO()),
        started_at=0.0,
        training_env=env,
    )

    def gap() -> float | None:
        return REGISTRY.get_sample_value("rollwise_eval_success_gap_ratio", {"env": env, "mode": "greedy"})

    assert gap() == 0.0  # a series from the start, like every eval gauge
    assert REGISTRY.get_sample_value("rollwise_eval_interval_versions", {"env": env}) == 7
    metrics.EPISODES.labels(env=env, reason="stop").inc(8)
    metrics.EPISODES.labels(env=env, reason="timeout").inc(2)
    metrics.EPISODE_SUCCESSES.labels(env=env).inc(8)
    evaluator.record_gap({"greedy": mode_result(0.5)})
    assert gap() == pytest.approx(0.8 - 0.5)
    evaluator.record_gap({"greedy": mode_result(0.1)})  # no training episode since: the last gap stands
    assert gap() == pytest.approx(0.3)
    metrics.EPISODES.labels(env=env, reason="stop").inc(10)
    metrics.EPISODE_SUCCESSES.labels(env=env).inc(2)
    evaluator.record_gap({"greedy": mode_result(0.5)})  # only the 10 episodes since the last evaluation
    assert gap() == pytest.approx(0.2 - 0.5)


def test_no_gap_when_eval_plays_another_env(tmp_path: Path) -> None:
    setup = EvalSetup("coin-other", CoinEnv, {}, plan(2), 5, 0.0, max_concurrent=4, priority=-100)
    evaluator = Evaluator(
        setup,
        engine=None,
        tokenizer=None,
        settings=settings(),
        every_versions=1,
        log_path=tmp_path / "eval.jsonl",
        progress=JsonProgress(io.StringIO()),
        started_at=0.0,
    )
    evaluator.record_gap({"greedy": mode_result(0.5)})
    labels = {"env": "coin-other", "mode": "greedy"}
    assert REGISTRY.get_sample_value("rollwise_eval_success_gap_ratio", labels) is None


async def test_each_evaluation_row_reaches_on_result(pool: EnginePool, tok: Any, tmp_path: Path) -> None:
    rows: list[dict[str, Any]] = []
    evaluator = Evaluator(
        coin_setup(),
        engine=pool,
        tokenizer=tok,
        settings=settings(),
        every_versions=1,
        log_path=tmp_path / "eval.jsonl",
        progress=JsonProgress(io.StringIO()),
        started_at=0.0,
        on_result=rows.append,
    )
    evaluator.on_version(0, step=0)
    assert evaluator.running is not None
    await evaluator.running
    assert [(r["version"], r["greedy"]["success"]) for r in rows] == [(0, 0.5)]
