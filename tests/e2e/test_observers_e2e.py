"""End to end: a real daemon with [tracing] and [trackers] on. Both processes export spans over OTLP/HTTP to
a collector in this test, the learner's publish trace continues in the supervisor, the spool's rows carry
their episodes' trace ids, and TensorBoard gets the learner's steps."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from pipeline.contracts.schema import batch_to_segments
from pipeline.transport.spool import read_group_file
from tests.e2e.test_run_e2e import TINY, DaemonRun

NEEDS = "the OpenTelemetry SDK and OTLP exporter are not installed (pip install 'rollwise[tracing]')"


class Collector:
    """An OTLP/HTTP trace receiver: every span it is sent, as (service, name, trace, span, parent, links)."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

        self.spans: list[dict[str, Any]] = []
        lock = threading.Lock()
        spans = self.spans

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = trace_service_pb2.ExportTraceServiceRequest()
                request.ParseFromString(body)
                with lock:
                    for resource in request.resource_spans:
                        attributes = {a.key: a.value.string_value for a in resource.resource.attributes}
                        for scope in resource.scope_spans:
                            for span in scope.spans:
                                spans.append(
                                    {
                                        "service": attributes["service.name"],
                                        "name": span.name,
                                        "trace": span.trace_id.hex(),
                                        "span": span.span_id.hex(),
                                        "parent": span.parent_span_id.hex(),
                                        "links": [link.span_id.hex() for link in span.links],
                                    }
                                )
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def named(self, name: str) -> list[dict[str, Any]]:
        return [s for s in self.spans if s["name"] == name]


@pytest.fixture
def collector() -> Iterator[Collector]:
    pytest.importorskip("opentelemetry.sdk", reason=NEEDS)
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http.trace_exporter", reason=NEEDS)
    receiver = Collector()
    yield receiver
    receiver.server.shutdown()
    receiver.server.server_close()


@pytest.mark.integration
@pytest.mark.slow
def test_a_daemon_traces_across_its_processes_and_feeds_tensorboard(
    collector: Collector, tmp_path: Path, tiny_model_dir: Path
) -> None:
    pytest.importorskip(
        "tensorboard", reason="tensorboard is not installed (pip install 'rollwise[trackers]')"
    )
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    overrides = [
        *TINY,
        f"model.path={json.dumps(str(tiny_model_dir))}",
        "learner.checkpoint_every=100",  # keep the spool files
        "tracing.enabled=true",
        f"tracing.endpoint={json.dumps(collector.url)}",
        "trackers.tensorboard=true",
    ]
    daemon = DaemonRun(run_dir, overrides, max_steps=3)
    try:
        assert daemon.wait(timeout_s=240) == 0, daemon.tail()
    finally:
        if daemon.proc.poll() is None:
            daemon.proc.kill()

    services = {(s["service"], s["name"]) for s in collector.spans}
    assert {("rollwise-learner", "learner.step"), ("rollwise-learner", "learner.publish")} <= services
    assert {
        ("rollwise", n) for n in ("episode", "turn", "engine.generate", "publish", "weight_sync")
    } <= services
    # A version's trace: learner.step -> learner.publish -> (supervisor) publish -> weight_sync, served_check.
    learner_publish = {s["span"]: s for s in collector.named("learner.publish")}
    steps = {s["span"] for s in collector.named("learner.step")}
    assert all(s["parent"] in steps for s in learner_publish.values())
    continued = [s for s in collector.named("publish") if s["parent"] in learner_publish]
    assert continued and all(s["trace"] == learner_publish[s["parent"]]["trace"] for s in continued)
    publishes = {s["span"] for s in continued}
    assert {s["parent"] for s in collector.named("weight_sync")} & publishes
    assert {s["parent"] for s in collector.named("served_check")} & publishes
    # Episodes: their own traces, linked to the publish of the version they sampled from; ids in the rows.
    episodes = {s["trace"] for s in collector.named("episode")}
    assert any(set(s["links"]) & publishes for s in collector.named("episode"))
    rows = []
    for path in sorted((run_dir / "spool").glob("g*.arrow")):
        _, batch = read_group_file(path)
        rows += batch_to_segments(batch)[0]
    assert rows and all(r.trace_id is not None for r in rows)
    assert {r.trace_id for r in rows} <= episodes

    reader = EventAccumulator(str(run_dir / "trackers" / "tensorboard" / "run"))
    reader.Reload()
    assert [e.step for e in reader.Scalars("learner/loss")] == [1, 2, 3]
