"""Operating the daemon over long runs: aborted requests, storage faults, the supervisor's own
resources, the rollout fleet, the run directory's disk and the trackers."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from pipeline.supervisor.observability.metrics.registry import REGISTRY

# --- long runs: aborted requests, storage faults, the supervisor's own resources -----------------------
ENGINE_ABORTS = Counter(
    "rollwise_engine_aborts",
    "Engine requests aborted by rid because nobody waits for them any more: the episode was cancelled "
    "or timed out (cancelled), or the call outlived engine.request_timeout_s (timeout).",
    ["reason"],
    registry=REGISTRY,
)
STORAGE_ERRORS = Counter(
    "rollwise_storage_errors",
    "Durable writes that failed because the run directory is full or read-only, by component (spool, "
    "checkpoint, weights, step_log, status_log, metrics_snapshot) and kind (ENOSPC, EROFS, EDQUOT, EIO: "
    "also an I/O failure the writing library did not name, other).",
    ["component", "kind"],
    registry=REGISTRY,
)
STORAGE_BLOCKED = Gauge(
    "rollwise_storage_blocked",
    "1 while a component holds its work and retries because the run directory cannot be written.",
    ["component"],
    registry=REGISTRY,
)
SUPERVISOR_TASKS = Gauge(
    "rollwise_supervisor_asyncio_tasks",
    "asyncio tasks alive in the supervisor's event loop.",
    registry=REGISTRY,
)
ABORT_REASONS = ("cancelled", "timeout")
STORAGE_COMPONENTS = ("spool", "checkpoint", "weights", "step_log", "status_log", "metrics_snapshot")
STORAGE_ERROR_KINDS = ("ENOSPC", "EROFS", "EDQUOT", "EIO", "other")


def init_long_run_label_values() -> None:
    """Create the label combinations of the block above at zero (see init_label_values)."""
    for reason in ABORT_REASONS:
        ENGINE_ABORTS.labels(reason=reason)
    for component in STORAGE_COMPONENTS:
        STORAGE_BLOCKED.labels(component=component).set(0)
        for kind in STORAGE_ERROR_KINDS:
            STORAGE_ERRORS.labels(component=component, kind=kind)


# --- rollout fleet (pipeline/supervisor/fleet/fleet_membership.py) ------------------------------------------
FLEET_ENGINES = Gauge(
    "rollwise_fleet_engines",
    "Engines in the pool that take new work (draining ones excluded).",
    registry=REGISTRY,
)
FLEET_CHANGES = Counter(
    "rollwise_fleet_changes",
    "Engines added to or drained from the running fleet (rollwise engines add|drain), by kind.",
    ["kind"],
    registry=REGISTRY,
)
ENGINES_SERVING = Gauge(
    "rollwise_engines_serving",
    "Engines that take work now: pool members neither ejected (they stopped answering) nor draining. 0 "
    "pauses admission; engine.unavailable_timeout_s of 0 stops the daemon.",
    registry=REGISTRY,
)
ENGINE_EJECTIONS = Counter(
    "rollwise_engine_ejections",
    "Times an engine was taken out of the pool because it stopped answering (failed requests or health "
    "checks in a row).",
    ["engine"],
    registry=REGISTRY,
)
ENGINE_REJOINS = Counter(
    "rollwise_engine_rejoins",
    "Times an ejected engine answered again and, loaded with the served version, got work again.",
    ["engine"],
    registry=REGISTRY,
)
ENGINE_VERSION_AMBIGUOUS_TOKENS = Counter(
    "rollwise_engine_version_ambiguous_tokens",
    "Generated tokens of requests that ran across a weight update on an engine that reports one version "
    "per reply (in_place or retract sync): labelled with the version the request started on.",
    registry=REGISTRY,
)
FLEET_HANDED_BACK = Counter(
    "rollwise_fleet_handed_back_turns",
    "In-flight turns a drained engine handed back (aborted there, sent again to another engine).",
    registry=REGISTRY,
)


# --- operating the daemon (pipeline/supervisor/observability/service_health.py) ----------------------------
RUN_DIR_FREE_BYTES = Gauge(
    "rollwise_run_dir_free_bytes",
    "Bytes free (to this user) on the run directory's filesystem, read every 15 s.",
    registry=REGISTRY,
)
RUN_DIR_CAPACITY_BYTES = Gauge(
    "rollwise_run_dir_capacity_bytes",
    "Size of the run directory's filesystem in bytes (free / capacity: how full it is).",
    registry=REGISTRY,
)
ENGINE_POOL_MEMBERS = Gauge(
    "rollwise_engine_pool_members",
    "Engines in the actors' pool (draining ones included).",
    registry=REGISTRY,
)
ENGINE_POOL_EJECTED = Gauge(
    "rollwise_engine_pool_ejected",
    "Pool engines ejected after consecutive failures (their /health is probed until they answer).",
    registry=REGISTRY,
)
ENGINES_NOT_UP = Gauge(
    "rollwise_engines_not_up",
    "Engine processes rollwise started (and its router) that are not up now: starting or restarting.",
    registry=REGISTRY,
)
TRACKER_ERRORS = Counter(
    "rollwise_tracker_errors",
    "Failures of an experiment tracker or trace exporter, by tracker (wandb, mlflow, tensorboard, otlp; "
    "queue = records dropped because the trackers fell behind). Training goes on without them.",
    ["tracker"],
    registry=REGISTRY,
)
TRACKERS = ("wandb", "mlflow", "tensorboard", "otlp", "queue")


def init_service_label_values() -> None:
    for tracker in TRACKERS:
        TRACKER_ERRORS.labels(tracker=tracker)
