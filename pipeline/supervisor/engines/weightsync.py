"""Weight sync across every engine: pause -> update_weights_from_disk -> continue, each phase timed.

With LoRA served as adapters (`adapter` given) the load phase is /load_lora_adapter of the version's
PEFT directory under its versioned name instead, and once it is loaded new requests name it
(pipeline.supervisor.engines.adapters); requests in flight keep the adapter they named, which is unloaded
after them.

`mode` is SGLang's pause mode (the `mode` field of /pause_generation), and it decides whether the update
may flush the prefix cache, because SGLang 0.5.23 flushes only a fully idle scheduler and *dies* when a
flushing update meets queued or running requests (weight_updater.flush_cache_after_weight_update:
"AssertionError: Cache flush failed after updating weights", which takes the whole server down):

    abort     (default) every request in flight returns at once, aborted with the tokens it has (the
              runner resubmits the turn as prompt + those tokens: a partial rollout); the pause returns
              only when none is left, so the update flushes the cache (KV of the old weights is never
              reused) and every token's version is exact. Costs one re-prefill per request in flight.
    in_place  running requests freeze with their KV and decode on after the update: no re-prefill, but the
              update must not flush (flush_cache = false), so cached prefixes keep the old weights' KV
              until evicted, and the tokens of a request that spans the update are of two versions:
              exact only where the engine reports per-token versions (SGLang's `weight_versions` spans,
              the embedded engine's extension); otherwise the pool labels them with the version the
              request started on (EnginePool, `rollwise_engine_version_ambiguous_tokens_total`).
    retract   running requests go back to the queue with their tokens and are re-prefilled on the new
              weights after continue; no flush either (retracted requests wait in the queue), versions as
              for in_place.

The update never aborts requests itself (`abort_all_requests=False`): the pause mode decides.

Invariant: every engine receives continue_generation, whatever failed before it and even when the
caller is cancelled mid-sync, so no engine is ever left paused.
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
