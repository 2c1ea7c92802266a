"""How a turn loop stops: `EpisodeEnded` carries the finish reason (rollout's module docstring lists
them); the engine and environment failures are counted (ENGINE_ERRORS, ENV_ERRORS) where they are made."""

from __future__ import annotations

from envs.api import EnvError
from pipeline.supervisor.engines.protocol import (
    EngineError,
    EngineHTTPError,
    EngineProtocolError,
    EngineUnavailable,
)
from pipeline.supervisor.observability import metrics

ENGINE_LABEL = "pool"  # the engine label of the runner's metrics: the pool hides which member served


class EpisodeEnded(Exception):
    """Ends the turn loop with a finish reason; `aborted` when the engine aborted the generation and it
    was not resubmitted (its tokens are wasted as `aborted`, pipeline.contracts.waste)."""

    def __init__(self, finish_reason: str, message: str | None = None, *, aborted: bool = False) -> None:
        super().__init__(message or finish_reason)
        self.finish_reason = finish_reason
        self.message = message
        self.aborted = aborted


def engine_error_kind(exc: EngineError) -> str:
    if isinstance(exc, EngineProtocolError):
        return "protocol"
    if isinstance(exc, EngineHTTPError):
        return "http"
    if isinstance(exc, EngineUnavailable):
        return "unavailable"
    return "error"


def error_kind(exc: BaseException) -> str:
    """The ENV_ERRORS kind of an exception an environment raised: an EnvError's own `kind` when it is one
    of the known kinds (a bounded label set), else "error"."""
    kind = getattr(exc, "kind", "error") if isinstance(exc, EnvError) else "error"
    return kind if kind in metrics.ENV_ERROR_KINDS else "error"


def engine_failure(kind: str, message: str) -> EpisodeEnded:
    metrics.ENGINE_ERRORS.labels(engine=ENGINE_LABEL, kind=kind).inc()
    return EpisodeEnded("engine_error", message, aborted=kind == "abort")


def env_failure(env_name: str, kind: str, finish_reason: str, message: str) -> EpisodeEnded:
    metrics.ENV_ERRORS.labels(env=env_name, kind=kind).inc()
    return EpisodeEnded(finish_reason, message)
