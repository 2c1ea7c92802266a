"""The code sandbox (envs.sandbox.runner), recorded through its observer hook."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from envs.sandbox import (
    runner as sandbox,  # import-light (standard library only): its observer hook feeds the metrics below
)
from pipeline.supervisor.observability.metrics.registry import LATENCY_BUCKETS, REGISTRY

SANDBOX_EXECUTIONS = Counter(
    "rollwise_sandbox_executions",
    "Sandboxed code executions by isolation (kind) and the limit that stopped them (reason, or none).",
    ["kind", "reason"],
    registry=REGISTRY,
)
SANDBOX_FAILURES = Counter(
    "rollwise_sandbox_failures",
    "Executions in which the sandbox itself failed (SandboxError: the episode is excluded, not scored).",
    ["kind"],
    registry=REGISTRY,
)
SANDBOX_QUEUE_WAIT = Histogram(
    "rollwise_sandbox_queue_wait_seconds",
    "Time a call waited for one of the sandbox's max_concurrency slots.",
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)
SANDBOX_EXECUTION_SECONDS = Histogram(
    "rollwise_sandbox_execution_seconds",
    "Wall time of one sandboxed execution, from start to reaped.",
    ["kind"],
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)
SANDBOX_RUNNING = Gauge("rollwise_sandbox_running", "Sandboxed interpreters running now.", registry=REGISTRY)
SANDBOX_WAITING = Gauge(
    "rollwise_sandbox_waiting", "Calls waiting for a free sandbox slot now.", registry=REGISTRY
)
SANDBOX_KINDS = ("bwrap", "rlimits")
SANDBOX_STOP_REASONS = ("none", "wall_time", "cpu_time", "output")


def record_sandbox_execution(execution: sandbox.Execution) -> None:
    if execution.failed:
        SANDBOX_FAILURES.labels(kind=execution.isolation).inc()
        return
    SANDBOX_EXECUTIONS.labels(kind=execution.isolation, reason=execution.stopped_by or "none").inc()
    SANDBOX_QUEUE_WAIT.observe(execution.queued_s)
    SANDBOX_EXECUTION_SECONDS.labels(kind=execution.isolation).observe(execution.wall_s)


SANDBOX_RUNNING.set_function(sandbox.running_total)
SANDBOX_WAITING.set_function(sandbox.waiting_total)
sandbox.add_observer(record_sandbox_execution)
for _kind in SANDBOX_KINDS:
    SANDBOX_FAILURES.labels(kind=_kind)
    SANDBOX_EXECUTION_SECONDS.labels(kind=_kind)
    for _reason in SANDBOX_STOP_REASONS:
        SANDBOX_EXECUTIONS.labels(kind=_kind, reason=_reason)
