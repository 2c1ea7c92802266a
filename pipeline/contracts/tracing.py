"""Optional OpenTelemetry tracing (`[tracing]`; docs/monitoring.md, "Traces"), shared by the supervisor and
the learner.

Off by default, and then free: nothing here imports opentelemetry, `span()` hands back one shared no-op
object, and `enabled()` is a module-global read. `configure(cfg, process=...)` (once per process) imports
the SDK, samples root spans at `sample_ratio` (children follow their parent's decision) and exports in
batches over OTLP from a background thread, so a slow or unreachable collector never holds up a turn or a
step: the batch queue drops spans when full, and a failed export is logged once and reported to
`on_error` (the supervisor counts it in rollwise_tracker_errors_total{tracker="otlp"}).

What becomes a span (attribute names `rollwise.*`, token counts as `gen_ai.usage.*`):
- supervisor: `episode` (one trace per native episode; its id is stored with the episode's rows), `turn`
  (reward, done), `engine.generate` (rid, policy version, tokens, finish reason, latency); `publish` of a
  version, with `weight_sync` and `served_check` inside it. An episode whose trace is not sampled opens
  no child spans at all;
- learner: `learner.step` and `learner.publish`. The `Published` event carries the publish span's W3C
  `traceparent`, so the supervisor's `publish` span continues the learner's trace across the process
  boundary, and each episode span links to the trace of the policy version it sampled from.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipeline.contracts.config import TracingConfig

log = logging.getLogger("rollwise.tracing")

Attributes = Mapping[str, str | int | float | bool]
VERSIONS_KEPT = 64  # policy versions whose publish span an episode can still link to


class NoSpan:
    """The span of a process without tracing: every method does nothing."""

    __slots__ = ()

    def __enter__(self) -> NoSpan:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def set_attribute(self, key: str, value: Any) -> None:
        pass

    def set_attributes(self, attributes: Attributes) -> None:
        pass

    def is_recording(self) -> bool:
        return False


NO_SPAN = NoSpan()


class _State:
    def __init__(self, tracer: Any, provider: Any, propagator: Any, api: Any) -> None:
        self.tracer = tracer
        self.provider = provider
        self.propagator = propagator
        self.api = api  # the opentelemetry.trace module
        self.empty = api.set_span_in_context(api.INVALID_SPAN)  # a parent context that starts a new trace
        self.versions: OrderedDict[int, Any] = OrderedDict()  # version -> SpanContext of its publish
        self.lock = threading.Lock()


_state: _State | None = None


def enabled() -> bool:
    return _state is not None


def configure(
    cfg: TracingConfig,
    *,
    process: str,
    exporter: Any = None,
    on_error: Callable[[], None] | None = None,
) -> None:
    """Set up tracing for this process when `cfg.enabled` (else nothing). `process` names the process in
    the resource (`rollwise.process`) and in the service name (`<service_name>-<process>` for any process
    but the supervisor). `exporter`: a span exporter to use instead of OTLP, exported synchronously (tests
    pass the SDK's InMemorySpanExporter)."""
    global _state
    if not cfg.enabled:
        return
    shutdown()  # a second configure replaces the first
    try:
        from opentelemetry import trace as api
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        otlp = None if exporter is not None else _CountingExporter(_otlp_exporter(cfg), on_error)
    except ImportError as exc:
        # `rollwise run` refuses this config before starting; a learner on another machine may still
        # lack the package: it trains untraced rather than not at all.
        log.warning(
            "tracing is on but cannot start in the %s (%s): pip install 'rollwise[tracing]'", process, exc
        )
        if on_error is not None:
            on_error()
        return

    service = cfg.service_name if process == "supervisor" else f"{cfg.service_name}-{process}"
    provider = TracerProvider(
        resource=Resource.create({"service.name": service, "rollwise.process": process}),
        sampler=ParentBased(TraceIdRatioBased(cfg.sample_ratio)),
    )
    if otlp is None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        provider.add_span_processor(BatchSpanProcessor(otlp, max_queue_size=8192))
        # The SDK logs every failed export (and each retry): ours is logged once, then counted.
        for name in ("opentelemetry.exporter", "opentelemetry.sdk.trace.export"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    _state = _State(provider.get_tracer("rollwise"), provider, TraceContextTextMapPropagator(), api)
    log.info(
        "tracing on: %s to %s (%s), sampling %.3g", service, cfg.endpoint, cfg.protocol, cfg.sample_ratio
    )


def _otlp_exporter(cfg: TracingConfig) -> Any:
    if cfg.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc

        return Grpc(endpoint=cfg.endpoint, timeout=cfg.export_timeout_s)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http

    return Http(endpoint=cfg.endpoint, timeout=cfg.export_timeout_s)


class _CountingExporter:
    """An exporter whose failures are logged once and then only counted (`on_error`)."""

    def __init__(self, inner: Any, on_error: Callable[[], None] | None) -> None:
        self.inner = inner
        self.on_error = on_error
        self.failed_before = False

    def export(self, spans: Any) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        try:
            result = self.inner.export(spans)
        except Exception as exc:  # an exporter bug must not end the export thread
            result, why = SpanExportResult.FAILURE, repr(exc)
        else:
            why = f"{len(spans)} spans not accepted"
        if result is not SpanExportResult.SUCCESS:
            if not self.failed_before:
                self.failed_before = True
                log.warning("trace export failed (%s); further failures are only counted", why)
            if self.on_error is not None:
                self.on_error()
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return bool(self.inner.force_flush(timeout_millis))


def flush(timeout_s: float = 5.0) -> bool:
    """Export what is queued now (blocks up to `timeout_s`; False when it did not finish)."""
    state = _state
    return True if state is None else bool(state.provider.force_flush(int(timeout_s * 1000)))


def shutdown(timeout_s: float = 5.0) -> None:
    """Flush and stop the exporter within `timeout_s` (an unreachable collector cannot hold up the exit);
    tracing is off afterwards."""
    global _state
    state, _state = _state, None
    if state is None:
        return
    done = threading.Thread(target=state.provider.shutdown, name="tracing-shutdown", daemon=True)
    done.start()
    done.join(timeout_s)
    if done.is_alive():
        log.warning("trace export did not finish within %.0f s; the rest is dropped", timeout_s)


def span(
    name: str, attributes: Attributes | None = None, *, traceparent: str | None = None
) -> AbstractContextManager[Any]:
    """A span around a block, current inside it (spans opened there are its children); `traceparent`
    (W3C) makes it a child of a span in another process. Without tracing: the shared no-op span."""
    state = _state
    if state is None:
        return NO_SPAN
    context = state.propagator.extract({"traceparent": traceparent}) if traceparent else None
    return state.tracer.start_as_current_span(name, context=context, attributes=attributes)


def root_span(name: str, attributes: Attributes | None = None) -> AbstractContextManager[Any]:
    """A span that starts a trace of its own, whatever is current (an episode)."""
    state = _state
    if state is None:
        return NO_SPAN
    return state.tracer.start_as_current_span(name, context=state.empty, attributes=attributes)


def trace_id(current: Any) -> str | None:
    """The 32-hex-digit trace id of a recorded span; None for a no-op or unsampled one."""
    if not current.is_recording():
        return None
    return f"{current.get_span_context().trace_id:032x}"


def traceparent() -> str | None:
    """The W3C traceparent of the current span (None when tracing is off or nothing is current)."""
    state = _state
    if state is None:
        return None
    carrier: dict[str, str] = {}
    state.propagator.inject(carrier)
    return carrier.get("traceparent")


def remember_version(version: int) -> None:
    """The current span (a version's publish) is the one episodes sampling from `version` link to."""
    state = _state
    if state is None:
        return
    context = state.api.get_current_span().get_span_context()
    if not context.is_valid:
        return
    with state.lock:
        state.versions[version] = context
        while len(state.versions) > VERSIONS_KEPT:
            state.versions.popitem(last=False)


def link_version(current: Any, version: int) -> None:
    """Link `current` (an episode span) to the publish span of `version`, when one is known."""
    state = _state
    if state is None or not current.is_recording():
        return
    with state.lock:
        context = state.versions.get(version)
    if context is not None:
        current.add_link(context, {"rollwise.policy_version": version})


@contextmanager
def configured(cfg: TracingConfig, *, process: str, exporter: Any = None) -> Iterator[None]:
    """`configure` for the length of a block, then `shutdown` (tests, tools)."""
    configure(cfg, process=process, exporter=exporter)
    try:
        yield
    finally:
        shutdown()
