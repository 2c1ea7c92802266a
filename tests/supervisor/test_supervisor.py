"""Unit tests of the daemon's machinery: children, backoff, run-dir lock, config gate, HTTP, progress."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest

from pipeline.contracts import events
from pipeline.contracts.config import ConfigError, load_config
from pipeline.contracts.run_dir import RunDir, RunDirInUse, hold_supervisor_lock
from pipeline.supervisor.daemon import main_run
from pipeline.supervisor.fleet.children import Backoff, Child, ChildSpec, keep_running
from pipeline.supervisor.fleet.engine_launch import engine_argv, plan_engines
from pipeline.supervisor.http_endpoints import HttpEndpoints
from pipeline.supervisor.learner_dispatch import StepBook, step_line
from pipeline.supervisor.observability import metrics
from pipeline.supervisor.observability.learner_metrics import record_step
from pipeline.supervisor.observability.run_health.advisor import doctor_json
from pipeline.supervisor.progress import JsonProgress, Totals, status_between
from pipeline.supervisor.run_logs import JsonLinesLog, write_metrics_snapshot
from pipeline.supervisor.status_report import StatusReport
from pipeline.supervisor.wiring import initial_accepted, resolve_config


def _ns(**kw: object) -> argparse.Namespace:
    base: dict[str, object] = {
        "config": None,
        "set": [],
        "run_dir": None,
        "max_steps": None,
        "log_format": None,
    }
    base.update(kw)
    return argparse.Namespace(**base)


def _restarts(component: str) -> float:
    return (
        metrics.REGISTRY.get_sample_value("rollwise_process_restarts_total", {"component": component}) or 0.0
    )


# --- backoff and children ------------------------------------------------------------------------------
def test_backoff_doubles_caps_and_resets_after_stable_uptime() -> None:
    b = Backoff(base_s=0.5, cap_s=3.0, stable_s=10.0)
    assert [b.next_delay(1.0) for _ in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert b.next_delay(uptime_s=11.0) == 0.5  # it ran long enough: a fresh failure
    assert b.next_delay(1.0) == 1.0


async def test_keep_running_restarts_a_crashing_child_and_counts_restarts(tmp_path: Path) -> None:
    stopping = asyncio.Event()
    starts: list[int] = []
    before = _restarts("test-crasher")

    def spec() -> ChildSpec:
        return ChildSpec("crasher", [sys.executable, "-c", "import sys; sys.exit(3)"], tmp_path / "c.log")

    async def serve(child: Child) -> None:
        starts.append(child.pid or 0)
        if len(starts) == 3:
            stopping.set()

    await asyncio.wait_for(
        keep_running(
            spec, serve, stopping, component="test-crasher", backoff=Backoff(base_s=0.01, cap_s=0.02)
        ),
        20,
    )
    assert len(starts) == 3 and len(set(starts)) == 3
    # The third exit happened while stopping: not a restart.
    assert _restarts("test-crasher") - before == 2
    assert (tmp_path / "c.log").read_text().count("exit code 3") == 3


async def test_child_stop_escalates_to_sigkill_when_sigterm_is_ignored(tmp_path: Path) -> None:
    code = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('up', flush=True); time.sleep(60)"
    )
    child = Child(ChildSpec("stubborn", [sys.executable, "-c", code], tmp_path / "s.log", events=True))
    await child.start()
    assert child.proc is not None and child.proc.stdout is not None
    assert await child.proc.stdout.readline() == b"up\n"  # the handler is installed
    started = time.monotonic()
    rc = await child.stop(grace_s=0.3)
    assert rc == -9
    assert time.monotonic() - started < 5


async def test_child_events_are_json_objects_and_other_stdout_goes_to_the_log(tmp_path: Path) -> None:
    code = "print('hello'); print('{\"event\": \"ready\", \"version\": 2}'); print('[1, 2]')"
    child = Child(ChildSpec("talker", [sys.executable, "-c", code], tmp_path / "t.log", events=True))
    await child.start()
    assert await child.read_event() == {"event": "ready", "version": 2}
    assert await child.read_event() is None
    assert await child.wait() == 0
    text = (tmp_path / "t.log").read_text()
    assert "[stdout] hello" in text and "[stdout] [1, 2]" in text


async def test_child_send_writes_json_lines_to_stdin(tmp_path: Path) -> None:
    code = "import sys, json; print(json.dumps({'echo': json.loads(sys.stdin.readline())}), flush=True)"
    child = Child(
        ChildSpec("echo", [sys.executable, "-c", code], tmp_path / "e.log", events=True, stdin=True)
    )
    await child.start()
    assert await child.send({"cmd": "stop"})
    assert await child.read_event() == {"echo": {"cmd": "stop"}}
    await child.wait()
    assert not await child.send({"cmd": "stop"})


# --- run directory --------------------------------------------------------------------------------------
def test_second_lock_on_the_same_run_dir_is_refused_with_the_holder_pid(tmp_path: Path) -> None:
    holder = r"in use by another rollwise daemon \(pid \d+"
    run = RunDir.at(tmp_path)
    with hold_supervisor_lock(run), pytest.raises(RunDirInUse, match=holder), hold_supervisor_lock(run):
        pass
    with hold_supervisor_lock(run):  # released on exit
        pass


def test_initial_accepted_counts_trained_versions_and_unconsumed_spool() -> None:
    assert initial_accepted(version=0, batch_groups=4, unconsumed_groups=0) == 0
    assert initial_accepted(version=3, batch_groups=4, unconsumed_groups=5) == 17


def test_a_resumed_scheduler_does_not_count_groups_the_learner_consumed_after_its_watermark(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    from pipeline.contracts.schema import segments_to_batch
    from pipeline.supervisor.wiring import build_scheduler, rollout_settings
    from pipeline.transport.spool import SpoolWriter
    from tests.helpers.train_groups import one_turn_row

    ns = argparse.Namespace(
        config=None,
        set=[f"model.path={json.dumps(str(tiny_model_dir))}", "learner.batch_groups=2"],
        run_dir=str(tmp_path / "run"),
        max_steps=None,
        log_format=None,
    )
    setup = resolve_config(ns)
    spool = SpoolWriter(setup.run.spool)
    for k in range(7):
        batch = segments_to_batch([one_turn_row(f"g{k}", i, 0) for i in range(2)])
        spool.write_group(batch, group_id=f"g{k}")
    # version 1: two groups trained (seqs 4 and 5, taken before 1-3), then seqs 1 and 2 consumed too
    ready = events.Ready(version=1, step=1, consumed_seq=2, path="", consumed_after=[4, 5])
    scheduler = build_scheduler(
        setup,
        engine=None,  # type: ignore[arg-type]
        tokenizer=None,  # type: ignore[arg-type]
        agent_endpoint=SimpleNamespace(settings=rollout_settings(setup.cfg)),  # type: ignore[arg-type]
        ready=ready,
        served_version=1,
        dropped_already=0,
    )
    assert scheduler.accepted == 1 * 2 + 3  # seqs 3, 6 and 7 wait in the spool


def test_serving_weights_prefer_the_published_version(tmp_path: Path) -> None:
    run = RunDir.at(tmp_path)
    model = tmp_path.resolve() / "model"
    assert run.serving_weights(0) == model
    assert run.serving_weights(2) == model  # not published (yet): the initial model
    (tmp_path / "weights" / "v2").mkdir(parents=True)
    (tmp_path / "weights" / "v2" / "config.json").write_text("{}")
    assert run.serving_weights(2) == tmp_path.resolve() / "weights" / "v2"


# --- config gate ------------------------------------------------------------------------------------------
def test_run_flags_override_the_config(tmp_path: Path) -> None:
    cfg = resolve_config(_ns(run_dir=str(tmp_path / "r"), max_steps=7, log_format="json")).cfg
    assert (cfg.run.run_dir, cfg.run.max_steps, cfg.run.log_format) == (str(tmp_path / "r"), 7, "json")


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["learner.optim.lr=-1"], "learner.optim.lr"),
        (["learner.no_such_key=1"], "learner.no_such_key"),
        (["env.name=no-such-env"], "env.name"),
        (["env.options={low = 9, high = 3}"], "env.options"),
        (["model.path='/nonexistent/model'"], "model.path"),
        (["learner.regularizers.action_prior_coef=-0.1"], "learner.regularizers.action_prior_coef"),
        (
            ["env.name='word-guess'", "learner.regularizers.action_prior_coef=0.1"],
            "learner.regularizers.action_prior_coef",
        ),
    ],
)
def test_bad_config_names_the_key(overrides: list[str], key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        resolve_config(_ns(set=overrides))


def test_bad_max_steps_flag_names_run_max_steps() -> None:
    with pytest.raises(ConfigError, match=r"run\.max_steps"):
        resolve_config(_ns(max_steps=0))


def test_main_run_with_bad_config_exits_2_before_creating_the_run_dir(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "never"
    assert main_run(_ns(run_dir=str(run_dir), set=["learner.batch_groups=0"])) == 2
    assert "learner.batch_groups" in capsys.readouterr().err
    assert not run_dir.exists()


# --- engines ----------------------------------------------------------------------------------------------
def test_plan_engines_assigns_consecutive_ports_and_external_urls() -> None:
    cfg = load_config(None, ["engine.num_engines=2", "engine.port=31000"])
    slots = plan_engines(cfg)
    assert [s.url for s in slots] == ["http://127.0.0.1:31000", "http://127.0.0.1:31001"]
    assert all(s.managed for s in slots)
    ext = plan_engines(load_config(None, ["engine.kind='external'", "engine.urls=['http://h:1/']"]))
    assert [(s.url, s.managed) for s in ext] == [("http://h:1", False)]


def test_embedded_engine_argv_carries_model_version_and_port(tmp_path: Path) -> None:
    cfg = load_config(None, ["engine.port=0", "engine.threads=2"])
    slot = plan_engines(cfg)[0]
    argv = engine_argv(cfg, slot, model_dir=tmp_path / "w", version=5)
    assert argv[1:3] == ["-m", "pipeline.engine"]
    assert argv[-1] == "--enable-metrics"
    flags = dict(zip(argv[3:-1:2], argv[4:-1:2], strict=True))
    assert flags["--model"] == str(tmp_path / "w")
    assert flags["--weight-version"] == "5"
    assert flags["--port"] == str(slot.port) and slot.port > 0
    assert flags["--threads"] == "2"


# --- metrics, HTTP, progress ----------------------------------------------------------------------------
def _step(step: int, **fields: object) -> events.Step:
    base: dict[str, object] = {
        "step": step,
        "version": step,
        "groups": 4,
        "group_ids": ["a", "b", "c", "d"],
        "consumed_seq": 4 * step,
        "metrics": {
            "loss": 0.25,
            "clip_fraction": 0.5,
            "grad_norm": None,
            "mismatch_abs_mean_lag0": 0.02,
            "mismatch_abs_mean_lag1plus": 0.3,
            "is_weight_max": 1.5,
            "rejected_fraction": 0.125,
        },
        "staleness": {0: 5, 1: 2},
        "idle_s": 0.5,
        "busy_s": 1.5,
        "spool_read_s": 0.125,
        "spool_depth_groups": 3,
        "spool_depth_bytes": 4096,
    }
    return events.Step(**(base | fields))  # type: ignore[arg-type]


def test_step_event_lands_in_learner_metrics() -> None:
    def value(name: str, labels: dict[str, str] | None = None) -> float:
        return metrics.REGISTRY.get_sample_value(name, labels) or 0.0

    accepted = value("rollwise_groups_accepted_total")
    count = value("rollwise_trained_token_staleness_versions_count")
    total = value("rollwise_trained_token_staleness_versions_sum")
    le_0, le_1 = (
        value("rollwise_trained_token_staleness_versions_bucket", {"le": le}) for le in ("0.0", "1.0")
    )
    read_count = value("rollwise_spool_read_duration_seconds_count")
    record_step(_step(12, groups=3))
    assert value("rollwise_learner_step") == 12
    assert value("rollwise_learner_loss") == 0.25
    assert value("rollwise_learner_clip_fraction_ratio") == 0.5
    assert value("rollwise_learner_logprob_mismatch_abs_by_lag", {"lag": "0"}) == 0.02
    assert value("rollwise_learner_logprob_mismatch_abs_by_lag", {"lag": "1+"}) == 0.3
    assert value("rollwise_learner_is_weight", {"stat": "max"}) == 1.5
    assert value("rollwise_learner_rejected_tokens_ratio") == 0.125
    assert value("rollwise_groups_accepted_total") == accepted + 3
    assert value("rollwise_spool_depth_groups") == 3 and value("rollwise_spool_depth_bytes") == 4096
    # 5 tokens 0 versions behind and 2 tokens 1 behind: 7 observations summing to 2, bucketed as such.
    assert value("rollwise_trained_token_staleness_versions_count") == count + 7
    assert value("rollwise_trained_token_staleness_versions_sum") == total + 2
    assert value("rollwise_trained_token_staleness_versions_bucket", {"le": "0.0"}) == le_0 + 5
    assert value("rollwise_trained_token_staleness_versions_bucket", {"le": "1.0"}) == le_1 + 7
    assert value("rollwise_spool_read_duration_seconds_count") == read_count + 1


def test_observe_many_equals_repeated_observe() -> None:
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    many = metrics.CountedHistogram("many", "m", buckets=(0, 1, 2), registry=registry)
    one = metrics.CountedHistogram("one", "o", buckets=(0, 1, 2), registry=registry)
    for amount, count in ((0.0, 3), (1.0, 2), (5.0, 4), (2.0, 0)):
        many.observe_many(amount, count)
        for _ in range(count):
            one.observe(amount)

    def samples(histogram: metrics.CountedHistogram, prefix: str) -> dict[tuple[str, str], float]:
        family = next(iter(histogram.collect()))
        return {
            (s.name.removeprefix(prefix), s.labels.get("le", "")): s.value
            for s in family.samples
            if not s.name.endswith("_created")
        }

    got, expected = samples(many, "many"), samples(one, "one")
    assert got == expected
    assert got[("_count", "")] == 9 and got[("_sum", "")] == 22.0 and got[("_bucket", "1.0")] == 5


def test_step_line_puts_the_metrics_beside_the_counts_once() -> None:
    line = step_line(_step(2))
    assert line["loss"] == 0.25 and line["grad_norm"] is None and line["step"] == 2
    assert "metrics" not in line and line["staleness"] == {"0": 5, "1": 2}


async def test_http_endpoints_serve_metrics_health_and_readiness() -> None:
    waiting = ["learner", "engine0"]
    endpoints = HttpEndpoints("127.0.0.1", 0, lambda: list(waiting))
    await endpoints.start()
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(endpoints.url + "/healthz") as r:
                assert r.status == 200
            async with session.get(endpoints.url + "/readyz") as r:
                assert r.status == 503
                assert json.loads(await r.text())["waiting_for"] == ["learner", "engine0"]
            waiting.clear()
            async with session.get(endpoints.url + "/readyz") as r:
                assert r.status == 200
            async with session.get(endpoints.url + "/metrics") as r:
                assert r.status == 200
                text = await r.text()
                assert "# TYPE rollwise_learner_step gauge" in text
                assert "# TYPE rollwise_process_restarts_total counter" in text
    finally:
        await endpoints.stop()


async def test_the_doctor_route_serves_the_advisors_findings_of_the_run(tmp_path: Path) -> None:
    run = RunDir.at(tmp_path / "run")
    run.logs.mkdir(parents=True)
    step = {"event": "step", "step": 1, "version": 1, "idle_s": 0.0, "busy_s": 1.0, "metrics": {}}
    run.step_log.write_text("".join(json.dumps({**step, "step": k}) + "\n" for k in range(1, 30)))
    endpoints = HttpEndpoints("127.0.0.1", 0, list, doctor=lambda: doctor_json(run.root))
    await endpoints.start()
    try:
        async with aiohttp.ClientSession() as session, session.get(endpoints.url + "/doctor") as r:
            assert r.status == 200 and r.content_type == "application/json"
            report = json.loads(await r.text())
    finally:
        await endpoints.stop()
    assert report["source"] == str(run.root) and isinstance(report["findings"], list)
    plain = HttpEndpoints("127.0.0.1", 0, list)  # without an advisor the route is not there
    await plain.start()
    try:
        async with aiohttp.ClientSession() as session, session.get(plain.url + "/doctor") as r:
            assert r.status == 404
    finally:
        await plain.stop()


def test_status_reports_interval_rates_from_counter_deltas() -> None:
    before = Totals(at=10.0, episodes=100, successes=20, staleness_sum=0.0, staleness_count=0)
    after = Totals(
        at=20.0, episodes=150, successes=60, staleness_sum=30.0, staleness_count=60, spool_depth_groups=7
    )
    status = status_between(
        before, after, elapsed_s=20.0, version=3, step=4, step_time_s=0.5, step_rewards=[0.5, 1.1]
    )
    assert status.episodes_per_s == 5.0
    assert status.success_rate == 0.8  # 40 of the last 50 episodes
    assert status.reward_mean == 0.8
    assert status.staleness_mean == 0.5
    assert (status.policy_version, status.learner_step, status.episodes) == (3, 4, 150)
    assert status.spool_depth_groups == 7


def test_status_without_new_episodes_or_steps_has_no_rates() -> None:
    t = Totals(1.0, episodes=5, successes=1, staleness_sum=0, staleness_count=0)
    status = status_between(t, t, elapsed_s=1.0, version=0, step=0, step_time_s=None, step_rewards=[])
    assert status.success_rate is None and status.reward_mean is None and status.episodes_per_s == 0.0


def test_status_report_reads_the_book_and_the_scheduler_once_it_exists() -> None:
    out = io.StringIO()
    book = StepBook(
        step=4, last_step_time_s=0.5, staleness_sum=30.0, staleness_tokens=60, spool_depth_groups=2
    )
    book.rewards = [0.25, 0.75]
    scheduler: Any = None
    report = StatusReport(
        JsonProgress(out), book, version=lambda: 3, scheduler=lambda: scheduler, started_at=0.0
    )
    start = report.totals()
    after_first = report.report(since=start)  # before the children are ready: no scheduler yet
    scheduler = SimpleNamespace(
        episodes_finished=10, episodes_succeeded=4, running=2, accepted=7, dropped_in_flight=1
    )
    book.staleness_sum, book.staleness_tokens = 36.0, 63  # 3 more tokens, 2 versions behind each
    report.report(since=after_first)
    first, second = (json.loads(line) for line in out.getvalue().splitlines())
    assert (first["episodes"], first["groups_running"], first["reward_mean"]) == (0, None, 0.5)
    assert (first["policy_version"], first["learner_step"], first["staleness_mean"]) == (3, 4, None)
    assert (second["episodes"], second["success_rate"], second["reward_mean"]) == (10, 0.4, None)
    assert second["staleness_mean"] == 2.0
    assert (second["groups_running"], second["groups_accepted"], second["spool_depth_groups"]) == (2, 7, 2)
    assert (first["groups_dropped_in_flight"], second["groups_dropped_in_flight"]) == (None, 1)


def test_the_final_status_reports_once_more_after_run_and_never_before() -> None:
    out = io.StringIO()
    book = StepBook(step=1, last_step_time_s=0.5, staleness_sum=0.0, staleness_tokens=0, spool_depth_groups=0)
    report = StatusReport(JsonProgress(out), book, version=lambda: 1, scheduler=lambda: None, started_at=0.0)
    report.final()  # the daemon stopped before its status loop started: nothing to report from
    assert out.getvalue() == ""

    async def one_interval() -> None:
        report.interval_s = 0.01
        loop = asyncio.create_task(report.run())
        await asyncio.sleep(0.05)
        loop.cancel()

    asyncio.run(one_interval())
    lines = len(out.getvalue().splitlines())
    report.final()
    assert len(out.getvalue().splitlines()) == lines + 1
    last = json.loads(out.getvalue().splitlines()[-1])
    assert last["event"] == "status" and last["no_signal_tokens"] is not None


def test_with_a_run_directory_each_status_is_logged_and_the_metrics_kept(tmp_path: Path) -> None:
    run = RunDir.at(tmp_path / "run")
    run.logs.mkdir(parents=True)
    book = StepBook(step=2, last_step_time_s=0.5, staleness_sum=0.0, staleness_tokens=0, spool_depth_groups=0)
    report = StatusReport(
        JsonProgress(io.StringIO()),
        book,
        version=lambda: 2,
        scheduler=lambda: None,
        started_at=0.0,
        run_dir=run,
    )

    status_log = run.logs / "status.jsonl"

    async def two_intervals() -> None:
        report.interval_s = 0.01
        loop = asyncio.create_task(report.run())
        async with asyncio.timeout(10):
            while not status_log.exists() or len(status_log.read_text().splitlines()) < 2:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        loop.cancel()

    asyncio.run(two_intervals())
    written = len(status_log.read_text().splitlines())
    report.final()
    lines = [json.loads(line) for line in status_log.read_text().splitlines()]
    assert len(lines) == written + 1 and {line["event"] for line in lines} == {"status"}
    assert lines[-1]["policy_version"] == 2
    snapshot = (run.logs / "metrics.prom").read_text()
    assert "rollwise_generated_tokens_no_signal_total" in snapshot
    assert not (run.logs / "metrics.prom.partial").exists()


def test_a_metrics_snapshot_the_storage_refuses_is_counted_and_leaves_no_partial_file(tmp_path: Path) -> None:
    labels = {"component": "metrics_snapshot", "kind": "other"}
    before = metrics.REGISTRY.get_sample_value("rollwise_storage_errors_total", labels) or 0.0
    assert not write_metrics_snapshot(tmp_path / "gone" / "metrics.prom")  # its directory is missing
    assert metrics.REGISTRY.get_sample_value("rollwise_storage_errors_total", labels) == before + 1
    assert write_metrics_snapshot(tmp_path / "metrics.prom")
    assert "# TYPE rollwise_storage_errors_total counter" in (tmp_path / "metrics.prom").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.prom"]


def test_a_log_the_storage_refuses_to_open_costs_its_lines_and_is_retried(tmp_path: Path) -> None:
    log = JsonLinesLog(tmp_path / "logs" / "status.jsonl", "status_log")  # logs/ missing: open fails
    labels = {"component": "status_log", "kind": "other"}
    before = metrics.REGISTRY.get_sample_value("rollwise_storage_errors_total", labels) or 0.0
    assert not log.open()
    log.append("lost")  # tries to open again, is refused again: counted, no exception
    assert metrics.REGISTRY.get_sample_value("rollwise_storage_errors_total", labels) == before + 2
    (tmp_path / "logs").mkdir()
    log.append("kept")
    log.close()
    assert (tmp_path / "logs" / "status.jsonl").read_text() == "kept\n"
    with pytest.raises(RuntimeError, match="is not open"):
        log.append("after close")


def test_json_progress_writes_one_object_per_line() -> None:
    out = io.StringIO()
    progress = JsonProgress(out)
    progress.on_step({"event": "step", "step": 1, "loss": 0.5})
    progress.message("hello")
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [line["event"] for line in lines] == ["step", "message"]
    assert lines[0]["step"] == 1 and lines[0]["loss"] == 0.5 and lines[1]["text"] == "hello"


def test_prints_while_json_owns_stdout_become_log_lines(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Three of TextArena's single-player games print (LogicPuzzle, RushHour), from environment threads;
    under `--log-format json` such prints would break the one-object-per-line stream."""
    import logging
    import threading

    from pipeline.supervisor.progress import RichProgress, stray_stdout_to_log

    real = io.StringIO()
    monkeypatch.setattr(sys, "stdout", real)
    progress = JsonProgress(sys.stdout)
    log = logging.getLogger("rollwise.test-stdout")
    with caplog.at_level(logging.INFO, logger=log.name), stray_stdout_to_log(progress, log):
        print("Correct: 0, Total: 18")

        def game() -> None:
            print("Attempt 1:", end="", flush=True)
            print(" Generated invalid", "puzzle", end="")

        worker = threading.Thread(target=game)
        worker.start()
        worker.join()
        progress.message("still JSON")
    assert sys.stdout is real  # restored
    assert [json.loads(line)["text"] for line in real.getvalue().splitlines()] == ["still JSON"]
    # The unterminated line is logged once, whole, when the run ends; not at each flush, not lost.
    assert [r.getMessage() for r in caplog.records if r.name == log.name] == [
        "stdout: Correct: 0, Total: 18",
        "stdout: Attempt 1: Generated invalid puzzle",
    ]
    # A progress stream that is not the process's stdout, or a rich view, leaves sys.stdout alone.
    with stray_stdout_to_log(JsonProgress(io.StringIO()), log), stray_stdout_to_log(RichProgress(), log):
        assert sys.stdout is real


async def test_a_background_task_that_dies_stops_the_daemon_with_its_error(tmp_path: Path) -> None:
    from pipeline.supervisor.daemon import Supervisor

    sup = Supervisor(resolve_config(_ns(run_dir=str(tmp_path), log_format="json")))

    async def broken() -> None:
        raise RuntimeError("boom")

    task = sup.watch(broken(), "scheduler")
    await asyncio.wait_for(sup.stopping.wait(), 5)
    assert task.done()
    assert sup.fatal is not None and "scheduler" in sup.fatal and "boom" in sup.fatal
    await sup.engines.pool.close()


async def test_versions_and_drops_announced_while_the_scheduler_starts_reach_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tok: object
) -> None:
    """A resumed learner trains its unconsumed groups and publishes while the tokenizer loads; the
    scheduler must start from what happened by then, or admission waits forever for a version the
    engines already serve (seen as a stalled daemon after a kill -9). The tokenizer's loader is the seam
    that makes the start slow."""
    import pipeline.supervisor.daemon as daemon
    from pipeline.supervisor.daemon import Supervisor
    from pipeline.tools.fake_sglang import FakeSGLang

    fake = FakeSGLang()
    await fake.start()
    overrides = ['engine.kind="external"', f'engine.urls=["{fake.base_url}"]', "learner.batch_groups=2"]
    setup = resolve_config(_ns(run_dir=str(tmp_path), log_format="json", set=overrides))
    sup = Supervisor(setup, progress_out=io.StringIO())
    setup.run.spool.mkdir(parents=True)
    loading = asyncio.Event()

    def slow_tokenizer(model_dir: Path) -> object:
        loop.call_soon_threadsafe(loading.set)
        time.sleep(0.3)
        return tok

    async def learner_events_meanwhile() -> None:
        await loading.wait()
        for v in (23, 24):
            await sup.learner_events.handle(events.Published(version=v, path=f"/run/weights/v{v}"))
        await sup.learner_events.handle(events.Dropped(seq=45, group_id="g45", reason="stale"))

    loop = asyncio.get_running_loop()
    monkeypatch.setattr(daemon, "load_tokenizer", slow_tokenizer)
    ready = events.Ready(version=22, step=22, consumed_seq=44, path=str(tmp_path))
    await sup.learner_events.handle(ready)
    await sup.lineage.publish(22, str(tmp_path), received_at=time.monotonic())
    try:
        scheduler, _ = await asyncio.gather(sup.start_scheduler(ready), learner_events_meanwhile())
        assert scheduler is sup.scheduler
        assert scheduler.version == 24
        assert scheduler.accepted == 22 * 2 - 1  # v·B, nothing unconsumed in the spool, one drop
        await sup.learner_events.handle(events.Dropped(seq=46, group_id="g46", reason="stale"))
        assert scheduler.accepted == 22 * 2 - 2  # later drops reach the scheduler directly
    finally:
        await scheduler.drain(1.0)
        await sup.engines.pool.close()
        await fake.stop()


# --- Mixture-of-Experts -----------------------------------------------------------------------------------
@pytest.mark.parametrize("setting", ["routing_replay=true", "record_routing=true", "load_balance_coef=0.01"])
def test_moe_options_with_a_dense_preset_are_refused_before_start(setting: str, tmp_path: Path) -> None:
    key = setting.split("=")[0]
    overrides = [f"learner.moe.{setting}", f"run.run_dir='{tmp_path / 'r'}'"]
    with pytest.raises(ConfigError, match=rf"learner\.moe\.{key} needs a Mixture-of-Experts model.*'tiny'"):
        resolve_config(_ns(set=overrides))
    resolve_config(_ns(set=[*overrides, "model.preset='moe-tiny'"]))


def test_routing_options_read_a_model_paths_config(tiny_model_dir: Path, moe_tiny_model_dir: Path) -> None:
    from pipeline.supervisor.wiring import moe_routing_shape

    assert moe_routing_shape(moe_tiny_model_dir) == (2, 2, 8)
    assert moe_routing_shape(tiny_model_dir) is None
    with pytest.raises(ConfigError, match=rf"learner\.moe\.routing_replay .* {tiny_model_dir} is dense"):
        resolve_config(_ns(set=[f"model.path='{tiny_model_dir}'", "learner.moe.routing_replay=true"]))
    resolve_config(_ns(set=[f"model.path='{moe_tiny_model_dir}'", "learner.moe.routing_replay=true"]))


def test_lora_on_expert_weights_of_an_moe_model_is_refused_before_start() -> None:
    moe_lora = ["model.preset='moe-tiny'", "learner.lora.enabled=true"]
    with pytest.raises(ConfigError, match=r"learner\.lora\.target_modules: \['down_proj', 'gate_proj'"):
        resolve_config(_ns(set=moe_lora))
    resolve_config(_ns(set=[*moe_lora, "learner.lora.target_modules=['q_proj', 'v_proj']"]))


def test_the_moe_table_refuses_bad_values_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"learner\.moe\.routing_replay: Input should be a valid boolean"):
        load_config(None, ["learner.moe.routing_replay='sometimes'"])
    with pytest.raises(ConfigError, match=r"learner\.moe\.replay: Extra inputs are not permitted"):
        load_config(None, ["learner.moe.replay=true"])
    assert not load_config(None, []).learner.moe.records_routing  # off by default


def test_engines_record_routing_only_when_the_learner_asks(tmp_path: Path, moe_tiny_model_dir: Path) -> None:
    from pipeline.supervisor.wiring import rollout_settings

    for kind in ("embedded", "sglang"):
        plain = load_config(None, ["engine.port=0", f"engine.kind='{kind}'"])
        replay = load_config(
            None, ["engine.port=0", f"engine.kind='{kind}'", "learner.moe.routing_replay=true"]
        )
        assert "--enable-return-routed-experts" not in engine_argv(
            plain, plan_engines(plain)[0], model_dir=tmp_path, version=0
        )
        assert "--enable-return-routed-experts" in engine_argv(
            replay, plan_engines(replay)[0], model_dir=tmp_path, version=0
        )
    assert rollout_settings(replay, moe_tiny_model_dir).routed_experts == (2, 2, 8)
    assert rollout_settings(plain, moe_tiny_model_dir).routed_experts is None
    assert rollout_settings(replay).routed_experts is None  # no model: the daemon passes its initial model


def test_an_moe_step_creates_the_moe_series_and_a_dense_step_leaves_them_alone() -> None:
    def value(name: str, labels: dict[str, str]) -> float | None:
        return metrics.REGISTRY.get_sample_value(name, labels)

    moe = {
        "moe_routing_change": 0.1,
        "moe_routing_change_max_layer": 0.25,
        "moe_load_imbalance": 1.5,
        "moe_load_imbalance_max_layer": 2.0,
        "router_mismatch_own": 0.04,
        "router_mismatch_replayed": 0.01,
        "ratio_spread_token": 0.3,
        "ratio_spread_sequence": 0.1,
    }
    record_step(_step(40, metrics=moe))
    assert value("rollwise_learner_moe_routing_change_ratio", {"stat": "mean"}) == 0.1
    assert value("rollwise_learner_moe_routing_change_ratio", {"stat": "max"}) == 0.25
    assert value("rollwise_learner_moe_load_imbalance", {"stat": "mean"}) == 1.5
    assert value("rollwise_learner_moe_load_imbalance", {"stat": "max"}) == 2.0
    assert value("rollwise_learner_router_mismatch_abs", {"routing": "own"}) == 0.04
    assert value("rollwise_learner_router_mismatch_abs", {"routing": "replayed"}) == 0.01
    assert value("rollwise_learner_log_ratio_spread", {"level": "token"}) == 0.3
    assert value("rollwise_learner_log_ratio_spread", {"level": "sequence"}) == 0.1
    record_step(_step(41, metrics={"loss": 0.5, "ratio_spread_token": 0.2}))  # a dense model's step
    assert value("rollwise_learner_moe_routing_change_ratio", {"stat": "mean"}) == 0.1
    assert value("rollwise_learner_log_ratio_spread", {"level": "token"}) == 0.2
