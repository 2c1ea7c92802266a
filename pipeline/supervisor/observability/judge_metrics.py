"""Judge attempts and failures (envs/judge.py reports them to listeners) -> Prometheus."""

from __future__ import annotations

from envs import judge
from pipeline.supervisor.observability import metrics


def record(event: judge.JudgeEvent) -> None:
    """One judge event: an attempt (status, latency) or a verdict that could not be given (reason)."""
    if event.is_attempt:
        metrics.JUDGE_REQUESTS.labels(judge=event.judge, status=event.status).inc()
        metrics.JUDGE_REQUEST_LATENCY.labels(judge=event.judge).observe(event.seconds)
    else:
        metrics.JUDGE_FAILURES.labels(judge=event.judge, reason=event.failure).inc()


def install() -> None:
    """Export every judge's events from now on (idempotent)."""
    judge.add_listener(record)
