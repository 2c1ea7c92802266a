"""`rollwise run`: the daemon. `Supervisor.run` is the whole schedule, top to bottom:

    start the learner and the engines -> run the scheduler -> on each published version sync the
    engines' weights -> on a stop: drain, checkpoint, stop the children.

The machinery is one call away: the learner child (learner_child.py), the engine fleet
(engine_fleet.py), config -> components (wiring.py), the run directory's layout (pipeline.contracts.run_dir),
learner events -> Prometheus (observability.learner_metrics).

Resume: `rollwise run --run-dir DIR` on an existing run continues it; the learner restores its latest
checkpoint and reports its policy version v, the engines start on the version that checkpoint
published, and the scheduler's staleness accounting starts at `v·B + unconsumed groups`
(wiring.initial_accepted).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import aiohttp

from envs.api import Environment
from pipeline.contracts import events
from pipeline.contracts.config import ConfigError, reveal, write_resolved
from pipeline.contracts.durable import storage_fault_kind
from pipeline.contracts.run_dir import (
    RunDir,
    RunDirInUse,
    checkpointed_version,
    hold_supervisor_lock,
    model_digest,
)
from pipeline.supervisor.actors.rollout import ENGINE_LABEL
from pipeline.supervisor.actors.scheduler import GroupScheduler
from pipeline.supervisor.admin import AdminEndpoint, make_admin_app
from pipeline.supervisor.engine_fleet import EngineFleet
from pipeline.supervisor.engines.adapters import adapter_name
from pipeline.supervisor.engines.served_check import Probe, ServedPolicyCheck, Verdict, tolerance_for
from pipeline.supervisor.eval_schedule import Evaluator
from pipeline.supervisor.fleet_membership import FleetMembership, scaled_concurrency
from pipeline.supervisor.http_endpoints import HttpEndpoints
from pipeline.supervisor.learner_child import LearnerChild, config_message, learner_child_spec
from pipeline.supervisor.observability import learner_metrics, metrics
from pipeline.supervisor.progress import (
    Progress,
    RichProgress,
    Totals,
    make_progress,
    status_between,
    stray_stdout_to_log,
)
from pipeline.supervisor.wiring import (
    RunSetup,
    build_evaluator,
    build_scheduler,
    ensure_initial_model,
    load_tokenizer,
    resolve_config,
    start_openai_endpoint,
)
from pipeline.transport.flight import SpoolFlightService
from pipeline.transport.weights_http import FetchError, WeightServer, fetch_version

log = logging.getLogger("rollwise.supervisor")
T = TypeVar("T")

STATUS_INTERVAL_S = 5.0
LOOP_LAG_PERIOD_S = 0.1
MIRROR_RETRY_FIRST_S = 0.5  # copying a version from a learner with its own run directory: retry delays
MIRROR_RETRY_MAX_S = 10.0


class Supervisor:
    def __init__(self, setup: RunSetup, *, progress_out: Any = None) -> None:
        cfg = setup.cfg
        self.cfg = cfg
        self.setup = setup
        self.run_dir: RunDir = setup.run
        self.progress: Progress = make_progress(cfg.run.log_format, progress_out)
        self.stopping = asyncio.Event()  # set once: stop admitting, drain, stop children, exit
        self.fatal: str | None = None  # why the run cannot go on (then exit code 1)
        self.learner = LearnerChild(
            learner_child_spec(self.run_dir, cfg.learner, transport_token=reveal(cfg.transport.token)),
            stopping=self.stopping,
            on_event=self.on_learner_event,
            fail=self.fail,
            config=config_message(cfg) if cfg.learner.run_dir is not None else None,
        )
        # A learner with its own run directory (learner.run_dir): each version it announces is copied from
        # its weight server into this run directory (mirror) before the engines load it.
        self.announced_version = 0  # the newest version the learner announced (its current lineage)
        self.learner_starts = 0  # ready events so far: a new one ends the lineage a mirror was fetching
        self.mirror_tasks: set[asyncio.Task[None]] = set()  # publishes that copy from the learner first
        self.initial_model_digest: str | None = None  # this run directory's, once computed
        self.publish_lock = asyncio.Lock()  # one weight sync at a time, in version order
        self.engines = EngineFleet(
            cfg, self.run_dir, self.stopping, served_version=lambda: self.version, fail=self.fail
        )
        check = cfg.async_.served_check
        self.served_check = (
            ServedPolicyCheck(
                self.engines.pool,
                tolerance=tolerance_for(cfg),
                max_failures=check.max_failures,
                fail=self.fail,
                names={slot.url: slot.name for slot in self.engines.slots},
            )
            if check.enabled
            else None
        )
        self.endpoints = HttpEndpoints(
            cfg.metrics.host, cfg.metrics.port, self.not_ready, api_key=reveal(cfg.metrics.api_key)
        )
        # Elastic fleet, weights over HTTP and Arrow Flight (docs/operations.md, "A fleet across machines").
        self.membership = FleetMembership(
            self.engines, self.publish_lock, lambda: self.version, self.on_fleet_capacity
        )
        self.admin = AdminEndpoint(
            cfg.admin.host,
            cfg.admin.port,
            make_admin_app(self.membership, WeightServer(self.run_dir.weights_of), reveal(cfg.admin.token)),
        )
        self.initial_capacity = 0
        self.flight: SpoolFlightService | None = None
        self.scheduler: GroupScheduler | None = None
        self.evaluator: Evaluator | None = None  # held-out evaluation ([eval]); None when off
        self.version = 0  # the policy version the engines serve
        self.step = 0
        self.last_step_time_s: float | None = None
        self.dropped_seqs: set[int] = set()
        self.drops_before_scheduler = 0  # dropped groups announced before the scheduler existed
        self.step_rewards: list[float] = []  # reward_mean of the steps since the last status
        self.staleness_sum = 0.0  # over trained tokens, for the status line
        self.staleness_tokens = 0
        self.spool_depth_groups = 0
        self.started_at = time.monotonic()
        self.step_log_failing = False
        self.storage_blocked: set[str] = set()  # learner components waiting for the run directory

    async def run(self) -> int:
        """The schedule. Returns the process exit code (0 after a requested stop, 1 after a fatal error)."""
        cfg, grace = self.cfg, self.cfg.run.shutdown_grace_s
        with hold_supervisor_lock(self.run_dir), stray_stdout_to_log(self.progress, log):
            log_to_run_dir(self.run_dir, quiet_stderr=isinstance(self.progress, RichProgress))
            write_resolved(cfg, self.run_dir.root)
            await asyncio.to_thread(ensure_initial_model, self.setup)
            self.install_signal_handlers()
            metrics.SUPERVISOR_UP.set(time.time())
            metrics.init_label_values(envs=[cfg.env.name], engines=[ENGINE_LABEL])
            metrics.init_long_run_label_values()
            self.step_log = self.run_dir.step_log.open("a", encoding="utf-8")
            await self.endpoints.start()
            await self.start_fleet_services()
            self.progress.start()
            self.progress.message(f"run dir {self.run_dir.root}; metrics on {self.endpoints.url}/metrics")
            background: list[asyncio.Task[None]] = []
            try:
                # 1. The learner resumes its checkpoint; the engines serve the version it published.
                ready = await self.until_stopping(self.start_children())
                if ready is not None and not self.stopping.is_set():
                    # 2. Actors fill the spool; learner events drive weight syncs (on_learner_event).
                    scheduler = await self.start_scheduler(ready)
                    self.start_evaluator()
                    background = [
                        self.watch(scheduler.run(self.stopping), "scheduler"),
                        self.watch(self.report_status(), "status"),
                        self.watch(measure_loop_lag(self.stopping), "loop-lag"),
                    ]
                    await self.stopping.wait()
                # 3. Stop: the learner finishes its step and checkpoints while in-flight episodes finish
                # (or are aborted after the grace period); then the engines go.
                self.progress.message(f"stopping ({self.fatal or 'requested'}): draining, checkpointing")
                drain = [self.scheduler.drain(grace)] if self.scheduler is not None else []
                # A running evaluation may end meanwhile (the engines stay up until the learner is done).
                scoring = [self.evaluator.finish(grace)] if self.evaluator is not None else []
                await asyncio.gather(self.learner.stop(grace), *drain, *scoring)
            finally:
                if self.evaluator is not None:
                    await self.evaluator.stop()
                await cancel_all([*background, *self.mirror_tasks])
                await self.learner.stop(grace)
                await self.engines.stop(grace)
                await close_env(self.setup.env)
                self.progress.stop()
                with contextlib.suppress(OSError):  # its last lines may not fit on a full disk
                    self.step_log.close()
                await self.admin.stop()
                if self.flight is not None:
                    await asyncio.to_thread(self.flight.stop)
                await self.endpoints.stop()
        if self.fatal is not None:
            print(f"rollwise: {self.fatal}", file=sys.stderr)
            return 1
        return 0

    async def start_fleet_services(self) -> None:
        """The admin endpoint (engines add/drain, published weights for fetchers) and, with
        transport.kind = flight, the spool's Flight service, which a learner may read at once."""
        cfg = self.cfg
        await self.admin.start()
        self.engines.weight_source = cfg.admin.advertise_url or self.admin.url
        self.engines.weight_token = reveal(cfg.admin.token)
        if cfg.transport.kind == "flight":
            t = cfg.transport
            self.flight = SpoolFlightService(
                self.run_dir.spool, host=t.flight_host, port=t.flight_port, token=reveal(t.token)
            )
            self.flight.start()
            self.progress.message(f"spool served over Arrow Flight at {self.flight.url}")

    def on_fleet_capacity(self, capacity: int) -> None:
        """Engines joined or left: the scheduler's concurrency follows the fleet's capacity."""
        if self.scheduler is None or self.initial_capacity <= 0:
            return
        groups = scaled_concurrency(self.cfg.rollout.max_concurrent_groups, self.initial_capacity, capacity)
        self.scheduler.set_max_concurrent(groups)
        log.info("fleet capacity %d: up to %d groups at once", capacity, groups)

    async def start_children(self) -> events.Ready:
        """Start the learner and the engines together: the learner restores its latest checkpoint and
        reports the policy version v it holds, while the engines load the version that checkpoint
        published (the initial model without one). If the two differ, the engines load the learner's v
        before any work is admitted."""
        # A learner with its own run directory keeps its checkpoints on its disk: its ready event is the
        # only word on the version, so the engines start on the initial model and then load that one.
        own_run_dir = self.cfg.learner.run_dir is not None
        self.version = 0 if own_run_dir else checkpointed_version(self.run_dir)
        ready, _ = await asyncio.gather(self.learner.start(), self.engines.start())
        if not await self.accept_learner_model(ready):
            return ready
        # The learner may already have trained and published a newer version while the engines started;
        # publish() ignores anything not newer than what the engines serve.
        if ready.version > self.version:
            await self.publish(
                ready.version, ready.path, received_at=time.monotonic(), source=ready.weights_url
            )
        metrics.POLICY_VERSION.set(ready.version)
        return ready

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
            f"({self.cfg.learner.run_dir}) and {ours} in {self.run_dir.initial_model}. Both machines build "
            "it from the same preset and seed, so their torch, transformers or tokenizers versions or their "
            "environment plugins (the tokenizer's vocabulary) differ, or the learner's directory holds an "
            "older model: align them, or set model.path to a model directory present on both machines"
        )
        return False

    async def start_scheduler(self, ready: events.Ready) -> GroupScheduler:
        tokenizer = await asyncio.to_thread(load_tokenizer, self.run_dir.initial_model)
        endpoint = await start_openai_endpoint(self.engines.generator, tokenizer, self.cfg)
        # No await from here to the assignment: versions published and groups dropped until now are in
        # self.version and drops_before_scheduler; later ones reach the scheduler via on_learner_event.
        self.scheduler = build_scheduler(
            self.setup,
            engine=self.engines.generator,
            tokenizer=tokenizer,
            agent_endpoint=endpoint,
            ready=ready,
            served_version=self.version,
            dropped_already=self.drops_before_scheduler,
            notify=self.progress.message,
        )
        self.initial_capacity = self.membership.capacity
        return self.scheduler

    def start_evaluator(self) -> None:
        """Held-out evaluation on the training engines (pipeline.supervisor.eval_schedule); the version the
        run
        starts from is the first one evaluated unless `eval.at_start` is off."""
        assert self.scheduler is not None
        self.evaluator = build_evaluator(
            self.setup,
            engine=self.engines.generator,
            tokenizer=self.scheduler.tokenizer,
            progress=self.progress,
            started_at=self.started_at,
        )
        if self.evaluator is None:
            return
        if self.cfg.eval.at_start:
            self.evaluator.on_version(self.version, self.step)
        else:
            self.evaluator.skip_start(self.version)

    # --- learner events -----------------------------------------------------------------------------
    async def on_learner_event(self, event: events.LearnerEvent) -> None:
        if isinstance(event, events.Step):
            self.on_step(event)
        elif isinstance(event, events.Published):
            metrics.PUBLISHED_BYTES.set(event.bytes)
            self.announced_version = max(self.announced_version, event.version)
            if event.weights_url is None:
                probe = Probe(event.probe_ids, event.probe_logprobs) if event.probe_logprobs else None
                await self.publish(event.version, event.path, received_at=time.monotonic(), probe=probe)
            else:
                self.publish_in_background(event)
        elif isinstance(event, events.Dropped):
            self.on_dropped(event.seq, event.reason)
        elif isinstance(event, events.Ready):
            self.step = event.step
            self.learner_starts += 1
            self.announced_version = event.version  # a restarted learner's lineage starts here
            metrics.LEARNER_STEP.set(event.step)
            # The first ready event is start_children's; later ones are a learner restarted alone.
            restarted = self.scheduler is not None
            if restarted and await self.accept_learner_model(event) and event.version != self.version:
                await self.follow_restarted_learner(event)
        elif isinstance(event, events.Finished):
            self.request_stop(f"the learner finished: {event.reason}")
        elif isinstance(event, events.CheckpointSaved):
            learner_metrics.record_checkpoint(event)
        elif isinstance(event, events.StorageFault):
            self.on_storage_fault(event)
        elif isinstance(event, events.Quarantined):
            learner_metrics.record_quarantined(event)
            self.progress.message(f"spool file quarantined: {event.file}: {event.reason}")
        elif isinstance(event, events.Error):
            self.progress.message(f"learner error: {event.message}")

    def on_step(self, event: events.Step) -> None:
        learner_metrics.record_step(event)
        self.append_step_log(event)
        self.step = event.step
        self.last_step_time_s = event.metric("step_time_s")
        if (reward := event.metric("reward_mean")) is not None:
            self.step_rewards.append(reward)
        self.staleness_sum += sum(lag * tokens for lag, tokens in event.staleness.items())
        self.staleness_tokens += sum(event.staleness.values())
        self.spool_depth_groups = event.spool_depth_groups
        self.progress.on_step(step_line(event))

    def on_storage_fault(self, event: events.StorageFault) -> None:
        """The learner's checkpoint or weight export was refused by the storage (it holds its work and
        retries), or goes through again."""
        component = event.component
        if event.blocked:
            metrics.STORAGE_ERRORS.labels(component=component, kind=event.kind).inc()
            if component not in self.storage_blocked:
                self.storage_blocked.add(component)
                metrics.STORAGE_BLOCKED.labels(component=component).set(1)
                self.progress.message(f"learner {component} write refused ({event.kind}): {event.message}")
        elif component in self.storage_blocked:
            self.storage_blocked.discard(component)
            metrics.STORAGE_BLOCKED.labels(component=component).set(0)
            self.progress.message(f"learner {component} writable again: {event.message}")

    def append_step_log(self, event: events.Step) -> None:
        """The run's own learning curve: `rollwise report --run-dir` reads it without Prometheus. A full or
        read-only run directory costs lines of it (counted), never the learner's events."""
        try:
            self.step_log.write(events.encode(event) + "\n")
            self.step_log.flush()
        except OSError as exc:
            kind = storage_fault_kind(exc, self.run_dir.logs) or "other"
            metrics.STORAGE_ERRORS.labels(component="step_log", kind=kind).inc()
            if not self.step_log_failing:
                log.error(
                    "cannot append to %s (%s: %s); step lines are lost meanwhile",
                    self.run_dir.step_log,
                    kind,
                    exc,
                )
            self.step_log_failing = True
        else:
            if self.step_log_failing:
                log.warning("%s takes writes again", self.run_dir.step_log)
            self.step_log_failing = False

    def on_dropped(self, seq: int, reason: str) -> None:
        """A written group the learner will never train: admission gets its slot back. Deduplicated by
        spool sequence number, because a restarted learner re-reads the groups after its checkpoint."""
        if seq in self.dropped_seqs:
            return
        self.dropped_seqs.add(seq)
        learner_metrics.record_dropped(reason)
        if self.scheduler is not None:
            self.scheduler.on_dropped(1)
        else:
            self.drops_before_scheduler += 1

    async def follow_restarted_learner(self, ready: events.Ready) -> None:
        """A learner that restarted alone resumed its last checkpoint, at version `ready.version`. The
        learner is the authority on the policy: every version the engines received after that checkpoint
        belongs to a lineage no checkpoint holds (its optimizer state is gone, and the learner trains the
        groups after the checkpoint again, re-publishing the same version numbers with new weights). So
        the engines go back to the learner's version and sync each re-published version again; otherwise
        they would keep sampling for the lost lineage and stamp its version numbers, ahead of the
        learner's step, on every new group until the learner passed them."""
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

    def publish_in_background(self, event: events.Published) -> None:
        """A version to copy from a learner with its own run directory first: a copy may take minutes
        (a large model over the network) or be retried, and meanwhile the learner's other events (steps,
        dropped groups, newer versions) must still be heard. The publishes still run one at a time in
        the order the events came (publish_lock is first come, first served); one that finds a newer
        version announced, or a learner restarted since, is skipped."""
        starts = self.learner_starts
        task = asyncio.create_task(
            self.publish(
                event.version,
                event.path,
                received_at=time.monotonic(),
                probe=Probe(event.probe_ids, event.probe_logprobs) if event.probe_logprobs else None,
                source=event.weights_url,
                learner_starts=starts,
            ),
            name=f"publish-v{event.version}",
        )
        self.mirror_tasks.add(task)

        def done(t: asyncio.Task[None]) -> None:
            self.mirror_tasks.discard(t)
            if not t.cancelled() and (exc := t.exception()) is not None:
                log.error("publishing version %d failed", event.version, exc_info=exc)
                self.fail(f"publishing version {event.version} failed: {exc!r}")

        task.add_done_callback(done)

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
        check, with the learner's `probe`), then let the scheduler admit against it. `rollback` = the
        learner restarted at an older version (follow_restarted_learner): load it even though the
        engines serve a higher number. `source` = the weight server of a learner with its own run
        directory: the version is first copied into this run directory (`mirror`), and from there
        everything goes on as with a shared one.

        sync_weights sets POLICY_VERSION_SERVED{engine=url} for each engine that loaded it; an engine
        that failed (down, restarting) catches up when it is ready again (EngineFleet.keep)."""
        verdicts: list[Verdict] = []
        async with self.publish_lock:
            if version == self.version or (version < self.version and not rollback):
                # Never move the engines backwards otherwise (a late event after a newer publish).
                log.info("version %d not newer than served version %d: not synced", version, self.version)
                return
            if learner_starts is not None and (
                learner_starts != self.learner_starts or version < self.announced_version
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
            timings = await self.engines.sync(path, version, self.cfg.async_.weight_sync_mode)
            self.version = version
            if self.served_check is not None and probe is not None:
                lora_path = adapter_name(version) if self.engines.adapters is not None else None
                verdicts = await self.served_check.run(version, probe, lora_path=lora_path)
        metrics.POLICY_VERSION.set(version)
        if self.scheduler is not None:
            self.scheduler.on_version(version)
        if self.evaluator is not None:
            self.evaluator.on_version(version, self.step)
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
        model, which is here already (its digest was compared). A failed fetch is retried with a
        doubling delay until it succeeds, or the learner announces a newer version or restarts (that
        version is then never needed), or the daemon stops: None."""
        if version == 0:
            return self.run_dir.initial_model
        token = reveal(self.cfg.learner.weights_token)
        starts = self.learner_starts
        delay = MIRROR_RETRY_FIRST_S
        while True:
            started = time.monotonic()
            try:
                path = await fetch_version(source, version, self.run_dir.weights, token=token)
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
                superseded = self.announced_version > version or self.learner_starts != starts
                if superseded or self.stopping.is_set():
                    self.progress.message(f"version {version} not copied from the learner ({why}); skipped")
                    return None
                self.progress.message(
                    f"copying version {version} from the learner failed ({why}); retrying in {delay:.1f} s"
                )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stopping.wait(), delay)
                delay = min(MIRROR_RETRY_MAX_S, delay * 2)
                continue
            metrics.WEIGHT_MIRROR_DURATION.observe(time.monotonic() - started)
            return path

    # --- stopping, signals, status, readiness -----------------------------------------------------------
    def request_stop(self, why: str) -> None:
        if not self.stopping.is_set():
            log.info("stop requested: %s", why)
            self.stopping.set()

    def fail(self, why: str) -> None:
        """A problem restarts cannot fix (e.g. a child that dies before it is ever ready)."""
        log.error("%s", why)
        self.fatal = self.fatal or why
        self.request_stop(why)

    async def until_stopping(self, work: Awaitable[T]) -> T | None:
        """`await work`, unless a stop is requested first (then cancel it and return None)."""
        task = asyncio.ensure_future(work)
        stop_wait = asyncio.ensure_future(self.stopping.wait())
        await asyncio.wait({task, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
        stop_wait.cancel()
        if task.done():
            return task.result()
        await cancel_all([task])
        return None

    def watch(self, work: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        """Run `work` as a task whose unexpected end (an exception, or returning before a stop was
        requested) stops the daemon instead of leaving it running with a dead part."""
        task = asyncio.create_task(work, name=name)

        def ended(t: asyncio.Task[None]) -> None:
            if t.cancelled() or self.stopping.is_set():
                return
            exc = t.exception()
            if exc is not None:
                log.error("%s failed", name, exc_info=exc)
            self.fail(f"the {name} task ended unexpectedly: {exc!r}")

        task.add_done_callback(ended)
        return task

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.on_signal, sig)

    def on_signal(self, sig: signal.Signals) -> None:
        if self.stopping.is_set():
            # Second signal: leave at once. Children die by PID; the run directory stays consistent
            # because everything it keeps is written to a temporary name and renamed.
            for child in (self.learner.child, *self.engines.children.values()):
                if child is not None:
                    child.kill()
            os._exit(128 + int(sig))
        self.request_stop(f"received {signal.Signals(sig).name}")

    def not_ready(self) -> list[str]:
        reasons = [] if self.learner.ready is not None else ["learner"]
        reasons += self.engines.not_up()
        if self.scheduler is None:
            reasons.append("scheduler")
        return reasons

    def totals(self) -> Totals:
        sched = self.scheduler
        return Totals(
            at=time.monotonic(),
            episodes=sched.episodes_finished if sched is not None else 0,
            successes=sched.episodes_succeeded if sched is not None else 0,
            staleness_sum=self.staleness_sum,
            staleness_count=self.staleness_tokens,
            spool_depth_groups=self.spool_depth_groups,
        )

    async def report_status(self) -> None:
        before = self.totals()
        while True:
            await asyncio.sleep(STATUS_INTERVAL_S)
            after = self.totals()
            status = status_between(
                before,
                after,
                elapsed_s=time.monotonic() - self.started_at,
                version=self.version,
                step=self.step,
                step_time_s=self.last_step_time_s,
                step_rewards=self.step_rewards,
            )
            if self.scheduler is not None:
                status = dataclasses.replace(
                    status, groups_running=self.scheduler.running, groups_accepted=self.scheduler.accepted
                )
            self.progress.on_status(status)
            before, self.step_rewards = after, []


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


def step_line(event: events.Step) -> dict[str, Any]:
    """A step as the progress view shows it: the step's metrics beside its counts, one level deep."""
    fields = {k: v for k, v in dataclasses.asdict(event).items() if k != "metrics"}
    fields["staleness"] = {str(k): v for k, v in event.staleness.items()}
    return {**event.metrics, **fields}


# --- machinery --------------------------------------------------------------------------------------------
def log_to_run_dir(run: RunDir, *, quiet_stderr: bool) -> None:
    """Supervisor log lines go to logs/supervisor.log; stderr keeps only warnings under a live view."""
    run.logs.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(run.log_file("supervisor"))
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    if quiet_stderr:
        for h in root.handlers:
            if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
                h.setLevel(logging.WARNING)


async def close_env(env: Environment) -> None:
    try:
        await asyncio.wait_for(env.close(), 10.0)
    except Exception as exc:  # a plugin's close must not hide the daemon's exit code
        log.warning("closing the task environment failed: %r", exc)


async def measure_loop_lag(stopping: asyncio.Event) -> None:
    """How late a 100 ms timer fires: a blocked event loop shows up here first. Once a second it also
    counts the loop's tasks (a leak of tasks is a leak of memory a soak would find hours later)."""
    loop = asyncio.get_running_loop()
    ticks = 0
    while not stopping.is_set():
        started = loop.time()
        await asyncio.sleep(LOOP_LAG_PERIOD_S)
        metrics.EVENT_LOOP_LAG.observe(max(0.0, loop.time() - started - LOOP_LAG_PERIOD_S))
        ticks += 1
        if ticks % 10 == 0:
            metrics.SUPERVISOR_TASKS.set(len(asyncio.all_tasks(loop)))


async def cancel_all(tasks: list[asyncio.Task[None]] | list[asyncio.Task[Any]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


# --- entry point ------------------------------------------------------------------------------------------
def main_run(ns: argparse.Namespace) -> int:
    """`rollwise run`: validate everything, then run the daemon until stopped. Exit 2 = bad config."""
    try:
        setup = resolve_config(ns)
    except ConfigError as exc:
        print(f"rollwise: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    try:
        return asyncio.run(Supervisor(setup).run())
    except RunDirInUse as exc:
        print(f"rollwise: {exc}", file=sys.stderr)
        return 1
