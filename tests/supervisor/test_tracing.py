"""[tracing]: spans of episodes, turns, engine requests, env steps and of a version's way from the learner to
the engines, recorded with the OpenTelemetry SDK's in-memory exporter; off, it costs nothing and imports
nothing; an unreachable collector never holds up the run."""

from __future__ import annotations

import io
import json
import logging
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pipeline.contracts import events, tracing
from pipeline.contracts.config import TracingConfig, load_config
from pipeline.supervisor.actors.rollout import RolloutSettings, run_episode
from pipeline.supervisor.engines.protocol import SamplingParams
from pipeline.supervisor.learner_dispatch import LearnerEvents, StepLog
from pipeline.supervisor.progress import JsonProgress
from pipeline.tools.fake_sglang import FakeSGLang
from tests.helpers.lineage import lineage_for
from tests.supervisor.actors.test_silent_failures import GOOD_CALL, TASK, TextEngine, TurnsEnv

ROOT = Path(__file__).resolve().parents[2]
ON = TracingConfig(enabled=True)
NO_SDK = "the OpenTelemetry SDK is not installed (pip install 'rollwise[tracing]'; in the dev extras)"


def test_off_by_default_it_hands_back_one_no_op_span_and_imports_no_opentelemetry() -> None:
    assert load_config(None, []).tracing.enabled is False
    assert not tracing.enabled()
    with tracing.span("x", {"a": 1}) as span:
        span.set_attribute("b", 2)
        assert span is tracing.NO_SPAN and tracing.trace_id(span) is None
    assert tracing.traceparent() is None
    code = (
        "import sys; import pipeline.supervisor.daemon, pipeline.supervisor.actors.rollout; "
        "import learner.process.shell; "
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('opentelemetry', 'wandb', 'mlflow', 'tensorboard'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", "import json; " + code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert json.loads(out.stdout) == []


@pytest.fixture
def spans() -> Iterator[Any]:
    memory = pytest.importorskip("opentelemetry.sdk.trace.export.in_memory_span_exporter", reason=NO_SDK)
    exporter = memory.InMemorySpanExporter()
    with tracing.configured(ON, process="supervisor", exporter=exporter):
        yield exporter


def by_name(finished: Any) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for span in finished:
        out.setdefault(span.name, []).append(span)
    return out


async def play(tok: Any, texts: list[str], **kwargs: Any) -> Any:
    settings = RolloutSettings(sampling=SamplingParams(max_new_tokens=64), max_context_tokens=1024)
    env = TurnsEnv(len(texts), tools=True)
    return await run_episode(
        TextEngine(tok, texts), tok, env, TASK, settings, episode_id="e-7", group_id="g", env_name="traced"
    )


async def test_an_episode_is_a_trace_of_turns_engine_requests_and_env_steps(spans: Any, tok: Any) -> None:
    outcome = await play(tok, [GOOD_CALL, "done"])
    found = by_name(spans.get_finished_spans())
    [episode] = found["episode"]
    turns, requests = found["turn"], found["engine.generate"]
    assert (len(turns), len(requests), set(found)) == (2, 2, {"episode", "turn", "engine.generate"})
    assert episode.parent is None
    trace = episode.context.trace_id
    assert {s.context.trace_id for s in turns + requests} == {trace}
    assert all(t.parent.span_id == episode.context.span_id for t in turns)
    assert [r.parent.span_id for r in requests] == [t.context.span_id for t in turns]
    assert [(t.attributes["rollwise.turn"], t.attributes["rollwise.done"]) for t in turns] == [
        (0, False),
        (1, True),
    ]
    first = requests[0].attributes
    assert first["rollwise.rid"] == "e-7-t0" and first["rollwise.policy_version"] == 1
    assert first["rollwise.finish_reason"] == "stop" and first["gen_ai.usage.output_tokens"] > 1
    assert first["gen_ai.usage.input_tokens"] > 0 and first["rollwise.latency_s"] >= 0
    attributes = episode.attributes
    assert attributes["rollwise.episode_id"] == "e-7" and attributes["rollwise.finish_reason"] == "stop"
    assert (attributes["rollwise.turns"], attributes["rollwise.tool_calls"]) == (2, 1)
    # the trace id travels with the episode's rows (Contract 1's optional column)
    assert [row.trace_id for row in outcome.rows] == [f"{trace:032x}"]


async def test_an_unsampled_episode_has_no_trace_id(tok: Any) -> None:
    memory = pytest.importorskip("opentelemetry.sdk.trace.export.in_memory_span_exporter", reason=NO_SDK)
    exporter = memory.InMemorySpanExporter()
    with tracing.configured(
        TracingConfig(enabled=True, sample_ratio=0.0), process="supervisor", exporter=exporter
    ):
        outcome = await play(tok, ["done"])
    assert exporter.get_finished_spans() == () and outcome.rows[0].trace_id is None


async def test_a_version_goes_from_the_learners_trace_through_publish_to_the_sync_and_episodes_link_to_it(
    spans: Any, tok: Any, fake: FakeSGLang, tmp_path: Path
) -> None:
    # The learner's side (another process): its publish span's traceparent rides on the Published event.
    with tracing.span("learner.publish") as learner_span:
        published = events.Published(version=1, path="/run/weights/v1", traceparent=tracing.traceparent())
    received = events.decode(json.loads(events.encode(published)))
    assert received.traceparent == published.traceparent is not None
    under = lineage_for([fake.base_url], tmp_path / "run")
    under.run_dir.logs.mkdir(parents=True)
    step_log = StepLog(under.run_dir)
    step_log.open()
    handler = LearnerEvents(under.lineage, JsonProgress(io.StringIO()), step_log, request_stop=print)
    try:
        await handler.handle(received)
    finally:
        step_log.close()
        await under.close()
    assert under.served == [1]
    await play(tok, ["done"])  # its tokens are version 1 (TextEngine)
    found = by_name(spans.get_finished_spans())
    [publish], [sync], [episode] = found["publish"], found["weight_sync"], found["episode"]
    learner_context = learner_span.get_span_context()
    assert publish.context.trace_id == learner_context.trace_id
    assert publish.parent.span_id == learner_context.span_id
    assert sync.parent.span_id == publish.context.span_id and sync.attributes["rollwise.policy_version"] == 1
    [link] = episode.links
    assert link.context.span_id == publish.context.span_id and link.attributes == {
        "rollwise.policy_version": 1
    }


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_an_unreachable_collector_costs_no_time_and_is_logged_once_then_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http.trace_exporter", reason=NO_SDK)
    failures: list[int] = []
    endpoint = f"http://127.0.0.1:{closed_port()}/v1/traces"
    cfg = TracingConfig(enabled=True, endpoint=endpoint, export_timeout_s=0.5)
    with caplog.at_level(logging.WARNING, logger="rollwise.tracing"):
        tracing.configure(cfg, process="supervisor", on_error=lambda: failures.append(1))
        try:
            started = time.perf_counter()
            for i in range(200):
                with tracing.root_span("episode", {"i": i}):
                    pass
            spent = time.perf_counter() - started
            for _ in range(3):
                tracing.flush(2.0)
                with tracing.root_span("episode"):
                    pass
        finally:
            started = time.perf_counter()
            tracing.shutdown(timeout_s=3.0)
            assert time.perf_counter() - started < 3.5
    assert spent < 0.5  # spans are queued; the export (and its failure) happens on the exporter's thread
    assert len(failures) >= 2
    warned = [r for r in caplog.records if "trace export failed" in r.message]
    assert len(warned) == 1


def test_an_exporter_that_raises_is_counted_not_propagated() -> None:
    export = pytest.importorskip("opentelemetry.sdk.trace.export", reason=NO_SDK)

    class Broken:
        def export(self, spans: Any) -> Any:
            raise RuntimeError("collector library bug")

    failures: list[int] = []
    counting = tracing._CountingExporter(Broken(), lambda: failures.append(1))
    assert counting.export([object()]) is export.SpanExportResult.FAILURE
    assert counting.export([object()]) is export.SpanExportResult.FAILURE
    assert failures == [1, 1]


def test_a_process_without_the_sdk_runs_untraced_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """`rollwise run` refuses [tracing] without the SDK; a learner on a machine without it trains anyway."""
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.resources", None)  # its import now fails
    failures: list[int] = []
    with caplog.at_level(logging.WARNING, logger="rollwise.tracing"):
        tracing.configure(ON, process="learner", on_error=lambda: failures.append(1))
    assert not tracing.enabled() and failures == [1]
    assert "tracing is on but cannot start in the learner" in caplog.text
    assert tracing.span("learner.step") is tracing.NO_SPAN
