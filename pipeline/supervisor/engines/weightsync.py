"""Weight sync across every engine: pause -> update_weights_from_disk -> continue, each phase timed.

With LoRA served as adapters (`adapter` given) the load phase is /load_lora_adapter of the version's PEFT
directory under its versioned name; new requests then name it (pipeline.supervisor.engines.adapters), and
requests in flight keep the adapter they named, unloaded after them.

`mode` is SGLang's pause mode, and it decides whether the update may flush the prefix cache: SGLang
0.5.23 flushes only a fully idle scheduler and dies when a flushing update meets queued or running
requests ("Cache flush failed after updating weights"):

    abort     (default) requests in flight return at once with the tokens they have (the runner
              resubmits prompt + those tokens); the update flushes; every token's version is exact.
    in_place  running requests freeze with their KV and decode on after the update; no flush, and the
              tokens of a request spanning the update are exact only where the engine reports
              per-token versions, else labelled with the version the request started on.
    retract   running requests go back to the queue and are re-prefilled on the new weights; no flush;
              versions as for in_place.

The update never aborts requests itself (`abort_all_requests=False`): the pause mode decides.

Invariant: every engine receives continue_generation, whatever failed before it and even when the caller
is cancelled mid-sync, so no engine is ever left paused.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from pipeline.supervisor.engines.adapters import AdapterRegistry, adapter_name
from pipeline.supervisor.engines.pool import MemberOutcome
from pipeline.supervisor.observability import metrics

log = logging.getLogger(__name__)

SyncMode = Literal["in_place", "retract", "abort"]
# Whether the update may flush the prefix cache after each pause mode (module docstring).
FLUSH_SAFE: dict[str, bool] = {"abort": True, "in_place": False, "retract": False}


class ControlPool(Protocol):
    """The fan-out control calls of pipeline.supervisor.engines.pool.EnginePool."""

    async def pause_all(self, mode: SyncMode = "in_place") -> list[MemberOutcome[dict[str, Any]]]: ...

    async def update_all(
        self,
        model_path: str,
        weight_version: str,
        *,
        abort_all_requests: bool = False,
        flush_cache: bool = True,
        model_paths: Mapping[str, str | None] | None = None,
    ) -> list[MemberOutcome[dict[str, Any]]]: ...

    async def continue_all(self) -> list[MemberOutcome[dict[str, Any]]]: ...

    async def load_lora_all(self, name: str, path: str) -> list[MemberOutcome[dict[str, Any]]]: ...


@dataclass(frozen=True)
class SyncTimings:
    """Seconds per phase (wall clock of the slowest member) and the outcome. `errors` maps a member URL
    to "<phase>: <error>" for every member that failed a phase; `ok` = no errors at all."""

    version: int
    pause_s: float
    load_s: float
    continue_s: float
    total_s: float
    ok: bool
    errors: dict[str, str] = field(default_factory=dict)


def _collect(phase: str, outcomes: list[MemberOutcome[Any]], errors: dict[str, str]) -> None:
    for outcome in outcomes:
        if outcome.error is not None and outcome.url not in errors:
            errors[outcome.url] = f"{phase}: {outcome.error}"


async def sync_weights(
    pool: ControlPool,
    *,
    model_path: str,
    version: int,
    mode: SyncMode,
    model_paths: Mapping[str, str | None] | None = None,
    adapter: AdapterRegistry | None = None,
) -> SyncTimings:
    """Load `model_path` as policy `version` on every engine (see module docstring): an HF directory, or
    with `adapter` the PEFT adapter directory of that version. `model_paths` maps an engine URL to its
    own copy of the weights (fetched over HTTP before the pause)."""
    if mode not in ("in_place", "retract", "abort"):
        raise ValueError(f"weight sync mode must be in_place, retract or abort, got {mode!r}")
    if adapter is not None and version < 1:
        raise ValueError(f"an adapter is published for versions >= 1, got version {version}")
    errors: dict[str, str] = {}
    started = time.perf_counter()
    pause_s = load_s = 0.0
    loaded: set[str] = set()
    try:
        pause_outcomes = await pool.pause_all(mode)
        pause_s = time.perf_counter() - started
        _collect("pause", pause_outcomes, errors)
        load_started = time.perf_counter()
        if adapter is None:
            update_outcomes = await pool.update_all(
                model_path,
                str(version),
                abort_all_requests=False,
                flush_cache=FLUSH_SAFE[mode],
                model_paths=model_paths,
            )
        else:
            update_outcomes = await pool.load_lora_all(adapter_name(version) or "", model_path)
            # Engines that failed the load answer requests naming it with an error (counted per episode);
            # the served-policy check names them.
            adapter.serve(version)
        load_s = time.perf_counter() - load_started
        _collect("update", update_outcomes, errors)
        loaded = {o.url for o in update_outcomes if o.ok}
    finally:
        continue_started = time.perf_counter()
        # Shielded: a cancelled caller must still release every engine.
        continue_outcomes = await asyncio.shield(pool.continue_all())
        continue_s = time.perf_counter() - continue_started
        _collect("continue", continue_outcomes, errors)
        total_s = time.perf_counter() - started
        metrics.WEIGHT_SYNC_PHASE.labels(phase="pause").observe(pause_s)
        metrics.WEIGHT_SYNC_PHASE.labels(phase="load").observe(load_s)
        metrics.WEIGHT_SYNC_PHASE.labels(phase="continue").observe(continue_s)
        metrics.WEIGHT_SYNC_PHASE.labels(phase="total").observe(total_s)
        metrics.WEIGHT_SYNCS.labels(status="ok" if not errors else "error").inc()
        for url in loaded:
            metrics.POLICY_VERSION_SERVED.labels(engine=url).set(version)
    if errors:
        log.error("weight sync to version %d failed on %d engine(s): %s", version, len(errors), errors)
    return SyncTimings(
        version=version,
        pause_s=pause_s,
        load_s=load_s,
        continue_s=continue_s,
        total_s=total_s,
        ok=not errors,
        errors=errors,
    )
