"""Which policy version the engines serve, and how a published one gets there.

The learner is the authority on the policy; `Lineage` follows it:
- `start(ready)`: the learner's first ready event. A learner with its own run directory built the preset
  itself: its digest must be this run directory's (`accept_learner_model`). A version newer than the
  engines' (trained while they started) is loaded before any work is admitted.
- `on_published(event)`: sync the engines to the new version (`publish`); with a learner that keeps its
  own run directory (`weights_url`), copy the version here first (`mirror`) in the background, so the
  learner's other events are still heard while a large model crosses the network.
- `on_ready(event)` after the first: the learner restarted alone from its checkpoint, so every version the
  engines received after it belongs to a lineage no checkpoint holds: the engines go back to the
  learner's version (`follow_restarted_learner`) and each re-published version is synced again.

`publish` runs one sync at a time, in event order (the fleet's `sync_lock`, shared with engines joining,
leaving and answering again),
never moves the engines backwards except to follow a restarted learner, skips versions overtaken while
they waited, and proves with the served-policy check that each engine serves the version it loaded.
Nothing is synced once the daemon is stopping.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

from pipeline.contracts import events, tracing
from pipeline.contracts.config import Config, reveal
from pipeline.contracts.durable import retry_delays
from pipeline.contracts.run_dir import RunDir, model_digest
from pipeline.supervisor.engines.adapters import adapter_name
from pipeline.supervisor.engines.served_check import Probe, ServedPolicyCheck, Verdict
from pipeline.supervisor.fleet.engine_fleet import EngineFleet
from pipeline.supervisor.observability import metrics
from pipeline.supervisor.progress import Progress
from pipeline.transport.weights_http import FetchError, fetch_version, staged_bytes

log = logging.getLogger("rollwise.supervisor")

# Copying a version from a learner with its own run directory: retry delays, doubling while attempts
# deliver nothing. Capped at 2 s: an attempt costs the learner one small request, while under bench
# hosts' `drops` (30 % of connections closed at once) chains of empty attempts are common and every
# second waited keeps the engines, and so the training (max_staleness), a version behind.
MIRROR_RETRY_S = (0.5, 2.0)


class Lineage:
    """`on_served(version)` is called after each version the engines were synced to (the scheduler's
    staleness budget and held-out evaluation follow it); `fail(why)` stops the daemon."""

    def __init__(
        self,
        cfg: Config,
        run_dir: RunDir,
        engines: EngineFleet,
        served_check: ServedPolicyCheck | None,
        progress: Progress,
        *,
        stopping: asyncio.Event,
        fail: Callable[[str], None],
        on_served: Callable[[int], None],
        mirror_retry_s: tuple[float, float] = MIRROR_RETRY_S,
    ) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.engines = engines
        self.served_check = served_check
        self.progress = progress
        self.stopping = stopping
        self.fail = fail
        self.on_served = on_served
        self.mirror_retry_s = mirror_retry_s  # first and longest wait between tries of a failed copy
        self.lock = engines.sync_lock  # one weight operation at a time, in the order they came
        self.version = 0  # the policy version the engines serve
        self.announced = 0  # the newest version the learner announced (its current lineage)
        self.learner_starts = 0  # ready events so far: a new one ends the lineage a mirror was fetching
        self.background: set[asyncio.Task[None]] = set()  # publishes that copy from the learner first
        self.initial_model_digest: str | None = None  # this run directory's, once computed

    # --- learner events ---------------------------------------------------------------------------------
    async def start(self, ready: events.Ready) -> bool:
        """After the learner's first ready event, with the engines up on `self.version`: False when its
        model is not this run's (the daemon stops). A newer version is loaded before any work is
        admitted."""
        if not await self.accept_learner_model(ready):
            return False
        # The learner may already have trained and published a newer version while the engines started;
        # publish() ignores anything not newer than what the engines serve.
        if ready.version > self.version:
            await self.publish(
                ready.version, ready.path, received_at=time.monotonic(), source=ready.weights_url
            )
        return True

    async def on_ready(self, ready: events.Ready, *, restarted: bool) -> None:
        """Every ready event starts a lineage; `restarted`: the learner restarted alone after the run
        began (the first one is handled by `start`)."""
        self.learner_starts += 1
        self.announced = ready.version  # a restarted learner's lineage starts here
        if restarted and await self.accept_learner_model(ready) and ready.version != self.version:
            await self.follow_restarted_learner(ready)

    async def on_published(self, event: events.Published) -> None:
        metrics.PUBLISHED_BYTES.set(event.bytes)
        self.announced = max(self.announced, event.version)
        probe = None
        if event.probe_logprobs:
            previous = event.probe_logprobs_prev or None
            probe = Probe(event.probe_ids, event.probe_logprobs, previous)
        if event.weights_url is None:
            await self.publish(event.version, event.path, received_at=time.monotonic(), probe=probe)
        else:
            self.publish_in_background(event, probe)

    async def accept_learner_model(self, ready: events.Ready) -> bool:
        """A learner with its own run directory built the preset itself, from the same model.preset and
        run.seed: its weights must be this run directory's, or the engines would sample from another
        policy than the one trained. A mismatch stops the daemon naming both digests."""
        theirs = ready.initial_model_digest
        if theirs is None:
            return True
        if self.initial_model_digest is None:
            self.initial_model_digest = await asyncio.to_thread(model_digest, self.run_dir.initial_model)
        ours = self.initial_model_digest
        if theirs == ours:
            log.info("the learner's initial model matches %s (digest %s)", self.run_dir.initial_model, ours)
            return True
        m = self.cfg.model
        self.fail(
            f"the learner's initial model differs from the supervisor's: preset {m.preset!r} with seed "
            f"{self.cfg.run.seed} has digest {theirs} in the learner's run directory "
            f"({self.cfg.learner.remote.run_dir}) and {ours} in {self.run_dir.initial_model}. Both machines "
            "build it from the same preset and seed, so their torch, transformers or tokenizers versions or "
            "their environment plugins (the tokenizer's vocabulary) differ, or the learner's directory holds "
            "an older model: align them, or set model.path to a model directory present on both machines"
        )
        return False

    async def follow_restarted_learner(self, ready: events.Ready) -> None:
        """Take the engines back to the version of a learner that restarted from its checkpoint (module
        docstring); otherwise they would keep sampling for the lost lineage and stamp its version
        numbers, ahead of the learner's step, on every new group until the learner passed them."""
        log.warning(
            "learner restarted at step %d, version %d; engines serve %d: moving them back to %d",
            ready.step,
            ready.version,
            self.version,
            ready.version,
        )
        self.progress.message(
            f"learner restarted from its checkpoint at step {ready.step} (version {ready.version}); "
            f"the engines served version {self.version}, which no checkpoint holds: they go back to "
            f"{ready.version}"
        )
        await self.publish(
            ready.version, ready.path, received_at=time.monotonic(), rollback=True, source=ready.weights_url
        )

    def publish_in_background(self, event: events.Published, probe: Probe | None) -> None:
        """A version to copy from a learner with its own run directory first: a copy may take minutes
        (a large model over the network) or be retried, and meanwhile the learner's other events (steps,
        dropped groups, newer versions) must still be heard. The publishes still run one at a time in
        the order the events came (`lock` is first come, first served); one that finds a newer version
        announced, or a learner restarted since, is skipped."""
        task = asyncio.create_task(
            self.publish(
                event.version,
                event.path,
                received_at=time.monotonic(),
                probe=probe,
                source=event.weights_url,
                learner_starts=self.learner_starts,
            ),
            name=f"publish-v{event.version}",
        )
        self.background.add(task)

        def done(t: asyncio.Task[None]) -> None:
            self.background.discard(t)
            if not t.cancelled() and (exc := t.exception()) is not None:
                log.error("publishing version %d failed", event.version, exc_info=exc)
                self.fail(f"publishing version {event.version} failed: {exc!r}")

        task.add_done_callback(done)

    async def stop(self) -> None:
        """Cancel the publishes still copying from the learner."""
        tasks = list(self.background)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # --- one sync ----------------------------------------------------------------------------------------
    async def publish(
        self,
        version: int,
        path: str,
        *,
        received_at: float,
        probe: Probe | None = None,
        rollback: bool = False,
        source: str | None = None,
        learner_starts: int | None = None,
    ) -> None:
        """Load a newly published version into every engine, prove they serve it (the served-policy
        check, with the learner's `probe`), then tell `on_served`. `rollback` = the learner restarted at
        an older version: load it even though the engines serve a higher number. `source` = the weight
        server of a learner with its own run directory: the version is first copied into this run
        directory (`mirror`), and from there everything goes on as with a shared one.

        sync_weights sets POLICY_VERSION_SERVED{engine=url} for each engine that loaded it; an engine
        that failed (down, restarting) catches up when it is ready again (EngineFleet.keep)."""
        verdicts: list[Verdict] = []
        async with self.lock:
            if self.stopping.is_set():
                log.info("version %d not synced: the daemon is stopping", version)
                return
            if version == self.version or (version < self.version and not rollback):
                # Never move the engines backwards otherwise (a late event after a newer publish).
                log.info("version %d not newer than served version %d: not synced", version, self.version)
                return
            if learner_starts is not None and (
                learner_starts != self.learner_starts or version < self.announced
            ):
                # Waited behind a copy: a newer version follows in the queue, or this one belongs to a
                # learner that has restarted since (its lineage is gone).
                log.info("version %d superseded before it was copied: not synced", version)
                return
            mirror_s = None
            if source is not None:
                started = time.monotonic()
                mirrored = await self.mirror(version, source)
                if mirrored is None:
                    return
                path, mirror_s = str(mirrored), time.monotonic() - started
            adapters = self.engines.adapters is not None
            if self.served_check is not None and probe is not None:
                served = adapter_name(self.version) if adapters else None
                with tracing.span("served_check.calibrate", {"rollwise.policy_version": self.version}):
                    await self.served_check.calibrate(self.version, probe, lora_path=served)
            with tracing.span("weight_sync", {"rollwise.policy_version": version}):
                timings = await self.engines.sync(path, version, self.cfg.async_.weight_sync_mode)
            self.version = version
            if self.served_check is not None and probe is not None:
                lora_path = adapter_name(version) if adapters else None
                with tracing.span("served_check", {"rollwise.policy_version": version}):
                    verdicts = await self.served_check.run(version, probe, lora_path=lora_path)
        metrics.POLICY_VERSION.set(version)
        self.on_served(version)
        log.info("version %d served: %s", version, timings)
        self.progress.on_sync(
            {
                "version": version,
                "publish_to_served_s": round(time.monotonic() - received_at, 4),
                "pause_s": round(timings.pause_s, 4),
                "load_s": round(timings.load_s, 4),
                "continue_s": round(timings.continue_s, 4),
                **({"mirror_s": round(mirror_s, 4)} if mirror_s is not None else {}),
                "ok": timings.ok,
                **({"errors": timings.errors} if timings.errors else {}),
                **({"served_check": served_summary(verdicts)} if verdicts else {}),
            }
        )
        for verdict in verdicts:
            if verdict.status == "mismatch":
                self.progress.error(
                    "served_policy_mismatch",
                    f"engine {verdict.engine} does not serve policy version {version}: {verdict.detail}",
                    {"engine": verdict.engine, "version": version, "diff": verdict.diff},
                )

    async def mirror(self, version: int, source: str) -> Path | None:
        """Copy `version` from the learner's weight server into this run directory's weights/v<n>
        (pipeline.transport.weights_http.fetch_version: every file checked against the manifest's size
        and sha256, staged, renamed; the 3 most recently installed kept). Version 0 is the initial
        model, which is here already (its digest was compared). A failed fetch is retried, resuming what
        it staged, until it succeeds, or the learner announces a newer version or restarts (that
        version is then never needed), or the daemon stops: None. The delay doubles while attempts
        deliver nothing (a learner that is down) and starts over after one that staged bytes (a link
        that resets connections): under bench hosts' `drops` the doubling alone had reached 10 s
        (then its cap) between attempts that each made progress, and the engines' version, and so the
        training (max_staleness), waited on it."""
        if version == 0:
            return self.run_dir.initial_model
        token = reveal(self.cfg.learner.remote.weights_token)
        starts = self.learner_starts
        delays = retry_delays(*self.mirror_retry_s)
        staged = await asyncio.to_thread(staged_bytes, self.run_dir.weights, version)
        while True:
            started = time.monotonic()
            try:
                path = await fetch_version(
                    source, version, self.run_dir.weights, token=token, ssl_context=self.engines.client_tls
                )
            except (
                FetchError,
                aiohttp.ClientError,
                TimeoutError,
                OSError,
                KeyError,
                TypeError,
                ValueError,
            ) as exc:
                metrics.WEIGHT_MIRROR_FAILURES.inc()
                why = f"{type(exc).__name__}: {exc}"
                log.error("copying version %d from the learner (%s) failed: %s", version, source, why)
                superseded = self.announced > version or self.learner_starts != starts
                if superseded or self.stopping.is_set():
                    self.progress.message(f"version {version} not copied from the learner ({why}); skipped")
                    return None
                staged, before = await asyncio.to_thread(staged_bytes, self.run_dir.weights, version), staged
                if staged > before:
                    delays = retry_delays(*self.mirror_retry_s)
                delay = next(delays)
                self.progress.message(
                    f"copying version {version} from the learner failed ({why}); retrying in {delay:.1f} s"
                )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stopping.wait(), delay)
                continue
            metrics.WEIGHT_MIRROR_DURATION.observe(time.monotonic() - started)
            return path


def served_summary(verdicts: list[Verdict]) -> dict[str, dict[str, Any]]:
    """Per engine URL: the check's status, mean |engine - learner| log-prob and (adapters) base gap."""
    return {
        v.engine: {
            "status": v.status,
            "diff": None if v.diff is None else round(v.diff, 6),
            **({"base_diff": round(v.base_diff, 6)} if v.base_diff is not None else {}),
        }
        for v in verdicts
    }
