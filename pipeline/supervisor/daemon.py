"""`rollwise run`: the daemon. `Supervisor.run` is the whole schedule, top to bottom:

    start the learner and the engines -> run the scheduler -> on each published version sync the
    engines' weights -> on a stop: drain, checkpoint, stop the children.

The machinery is one call away: config -> components (wiring.py), the learner child (learner_child.py)
and what each of its events does (learner_dispatch.py), the version the engines serve and how a
published one reaches them (lineage.py), the engine fleet (engine_fleet.py, fleet_membership.py), the
doors other hosts use (fleet_services.py), the status line (status_report.py) and the observers
(observability/observers.py).

Resume: `rollwise run --run-dir DIR` on an existing run continues it; the learner restores its latest
checkpoint and reports its policy version v, the engines start on the version that checkpoint
published, and the scheduler's staleness accounting starts at `v·B + unconsumed groups`
(wiring.initial_accepted).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Coroutine
from typing import Any, TypeVar

from pipeline.contracts import events, memory_trace
from pipeline.contracts.config import ConfigError, reveal, write_resolved
from pipeline.contracts.http_guard import CannotListen
from pipeline.contracts.run_dir import RunDir, RunDirInUse, checkpointed_version, hold_supervisor_lock
from pipeline.contracts.run_endpoints import remove_endpoints, write_endpoints
from pipeline.contracts.tls import context_for
from pipeline.supervisor.actors.concurrency import ConcurrencyLimit
from pipeline.supervisor.actors.episode_end import ENGINE_LABEL
from pipeline.supervisor.actors.scheduler import GroupScheduler
from pipeline.supervisor.eval_schedule import Evaluator
from pipeline.supervisor.fleet.engine_fleet import EngineFleet
from pipeline.supervisor.fleet.fleet_membership import FleetMembership, scaled_concurrency
from pipeline.supervisor.fleet.fleet_services import FleetServices
from pipeline.supervisor.heap import freeze_startup_heap
from pipeline.supervisor.http_endpoints import HttpEndpoints
from pipeline.supervisor.learner_child import LearnerChild, config_message, flight_token, learner_child_spec
from pipeline.supervisor.learner_dispatch import LearnerEvents, StepLog
from pipeline.supervisor.lineage import Lineage
from pipeline.supervisor.log_rotation import keep_logs_small
from pipeline.supervisor.observability import metrics
from pipeline.supervisor.observability.loop_lag import measure_loop_lag
from pipeline.supervisor.observability.observers import start_observers, stop_observers
from pipeline.supervisor.observability.run_health.advisor import doctor_json
from pipeline.supervisor.observability.service_health import watch_run_dir
from pipeline.supervisor.observability.trackers import build_trackers
from pipeline.supervisor.progress import (
    Progress,
    RichProgress,
    log_to_run_dir,
    make_progress,
    stray_stdout_to_log,
)
from pipeline.supervisor.status_report import StatusReport
from pipeline.supervisor.wiring import (
    RunSetup,
    bare_run_config,
    build_concurrency,
    build_evaluator,
    build_scheduler,
    build_served_check,
    close_env,
    ensure_initial_model,
    load_tokenizer,
    resolve_config,
    start_openai_endpoint,
)

log = logging.getLogger("rollwise.supervisor")
T = TypeVar("T")


class Supervisor:
    def __init__(self, setup: RunSetup, *, progress_out: Any = None) -> None:
        cfg = setup.cfg
        self.cfg = cfg
        self.setup = setup
        self.run_dir: RunDir = setup.run
        self.progress: Progress = make_progress(cfg.run.log_format, progress_out)
        self.stopping = asyncio.Event()  # set once: stop admitting, drain, stop children, exit
        self.fatal: str | None = None  # why the run cannot go on (then exit code 1)
        self.scheduler: GroupScheduler | None = None
        self.concurrency: ConcurrencyLimit | None = None  # set with the scheduler
        self.evaluator: Evaluator | None = None  # held-out evaluation ([eval]); None when off
        self.engines = EngineFleet(
            cfg, self.run_dir, self.stopping, served_version=lambda: self.lineage.version, fail=self.fail
        )
        self.lineage = Lineage(
            cfg,
            self.run_dir,
            self.engines,
            build_served_check(cfg, self.engines, self.fail),
            self.progress,
            stopping=self.stopping,
            fail=self.fail,
            on_served=self.on_served,
        )
        self.trackers = build_trackers(cfg, self.run_dir.root)  # None when [trackers] turns none on
        self.learner_events = LearnerEvents(
            self.lineage,
            self.progress,
            StepLog(self.run_dir),
            request_stop=self.request_stop,
            trackers=self.trackers,
        )
        self.learner = LearnerChild(
            learner_child_spec(self.run_dir, cfg.learner, transport_token=flight_token(cfg)),
            stopping=self.stopping,
            on_event=self.learner_events.handle,
            fail=self.fail,
            config=config_message(cfg) if cfg.learner.remote.run_dir is not None else None,
        )
        self.endpoints = HttpEndpoints(
            cfg.metrics.host,
            cfg.metrics.port,
            self.not_ready,
            api_key=reveal(cfg.metrics.api_key),
            ssl_context=context_for(cfg.metrics.host, cfg.tls.files()),
            doctor=lambda: doctor_json(self.run_dir.root),
        )
        # Elastic fleet, weights over HTTP and Arrow Flight (docs/scale_out.md, "A fleet across machines").
        self.membership = FleetMembership(
            self.engines, self.engines.sync_lock, lambda: self.lineage.version, self.on_fleet_capacity
        )
        self.engines.progress_message = self.progress.message
        self.fleet_services = FleetServices(cfg, self.run_dir, self.membership)
        self.initial_capacity = 0
        self.started_at = time.monotonic()
        self.status = StatusReport(
            self.progress,
            self.learner_events.book,
            version=lambda: self.lineage.version,
            scheduler=lambda: self.scheduler,
            started_at=self.started_at,
            run_dir=self.run_dir,
        )

    async def run(self) -> int:
        """The schedule. Returns the process exit code (0 after a requested stop, 1 after a fatal error)."""
        cfg, grace = self.cfg, self.cfg.run.shutdown_grace_s
        with hold_supervisor_lock(self.run_dir), stray_stdout_to_log(self.progress, log):
            log_to_run_dir(self.run_dir, quiet_stderr=isinstance(self.progress, RichProgress))
            write_resolved(cfg, self.run_dir.root)
            # The ports first: a taken one (another daemon on this host) is one line before any work.
            await self.endpoints.start()
            await self.fleet_services.start(self.engines, self.progress.message)
            write_endpoints(self.run_dir.root, metrics=self.endpoints.url, **self.fleet_services.urls())
            await ensure_initial_model(self.setup)
            self.install_signal_handlers()
            metrics.SUPERVISOR_UP.set(time.time())
            metrics.init_label_values(envs=[cfg.env.name], engines=[ENGINE_LABEL])
            metrics.init_long_run_label_values()
            metrics.init_service_label_values()
            start_observers(cfg, self.trackers, self.engines)
            self.learner_events.step_log.open()
            self.progress.start()
            self.progress.message(f"run dir {self.run_dir.root}; metrics on {self.endpoints.url}/metrics")
            if self.setup.cores is not None:
                self.progress.message(self.setup.cores.describe())
                self.setup.cores.prepare(self.run_dir.root)
            logs = cfg.logs
            background: list[asyncio.Task[None]] = [
                asyncio.create_task(
                    keep_logs_small(
                        self.run_dir.logs, logs.max_bytes, logs.keep, self.stopping, logs.check_every_s
                    ),
                    name="log rotation",
                )
            ]
            try:
                # 1. The learner resumes its checkpoint; the engines serve the version it published.
                ready = await self.until_stopping(self.start_children())
                if ready is not None and not self.stopping.is_set():
                    # 2. Actors fill the spool; learner events drive weight syncs (learner_dispatch).
                    scheduler = await self.start_scheduler(ready)
                    self.start_evaluator()
                    log.info("start-up heap frozen: %d objects", freeze_startup_heap())
                    unavailable_s = cfg.engine.unavailable_timeout_s
                    background += [
                        self.watch(scheduler.run(self.stopping), "scheduler"),
                        self.watch(self.concurrency_limit().run(self.stopping), "concurrency"),
                        self.watch(self.engines.guard_availability(unavailable_s), "engine guard"),
                        self.watch(self.status.run(), "status"),
                        self.watch(measure_loop_lag(self.stopping), "loop-lag"),
                        self.watch(watch_run_dir(self.run_dir.root, self.stopping), "disk-space"),
                    ]
                    await self.stopping.wait()
                # 3. Stop: the learner finishes its step and checkpoints while in-flight episodes finish
                # (or are aborted after the grace period); then the engines go.
                self.progress.message(f"stopping ({self.fatal or 'requested'}): draining, checkpointing")
                drain = [self.scheduler.drain(grace)] if self.scheduler is not None else []
                # A running evaluation may end meanwhile (the engines stay up until the learner is done).
                scoring = [self.evaluator.finish(grace)] if self.evaluator is not None else []
                await asyncio.gather(self.learner.stop(grace), *drain, *scoring)
                self.status.final()
            finally:
                if self.evaluator is not None:
                    await self.evaluator.stop()
                await cancel_all(background)
                await self.lineage.stop()
                await self.learner.stop(grace)
                await self.engines.stop(grace)
                await close_env(self.setup.env)
                self.progress.stop()
                self.learner_events.step_log.close()
                await self.fleet_services.stop()
                await stop_observers(self.trackers)
                await self.endpoints.stop()
                remove_endpoints(self.run_dir.root)
        if self.fatal is not None:
            print(f"rollwise: {self.fatal}", file=sys.stderr)
            return 1
        return 0

    def on_fleet_capacity(self, capacity: int) -> None:
        """Engines joined or left: the scheduler's concurrency follows the fleet's capacity."""
        if self.scheduler is None or self.initial_capacity <= 0:
            return
        groups = scaled_concurrency(self.cfg.rollout.max_concurrent_groups, self.initial_capacity, capacity)
        self.concurrency_limit().set_ceiling(groups)
        log.info("fleet capacity %d: up to %d groups at once", capacity, groups)

    async def start_children(self) -> events.Ready:
        """Start the learner and the engines together: the learner restores its latest checkpoint and
        reports the policy version v it holds, while the engines load the version that checkpoint
        published (the initial model without one). If the two differ, the engines load the learner's v
        before any work is admitted."""
        # A learner with its own run directory keeps its checkpoints on its disk: its ready event is the
        # only word on the version, so the engines start on the initial model and then load that one.
        own_run_dir = self.cfg.learner.remote.run_dir is not None
        self.lineage.version = 0 if own_run_dir else checkpointed_version(self.run_dir)
        ready, _ = await asyncio.gather(self.learner.start(), self.engines.start())
        if await self.lineage.start(ready):
            metrics.POLICY_VERSION.set(ready.version)
        return ready

    async def start_scheduler(self, ready: events.Ready) -> GroupScheduler:
        tokenizer = await asyncio.to_thread(load_tokenizer, self.run_dir.initial_model)
        endpoint = await start_openai_endpoint(
            self.engines.generator, tokenizer, self.cfg, self.run_dir.initial_model
        )
        # No await from here to `attach`: versions published and groups dropped until now are in the
        # lineage and the unclaimed drops; later ones reach the scheduler through on_served and attach.
        self.scheduler = build_scheduler(
            self.setup,
            engine=self.engines.generator,
            tokenizer=tokenizer,
            agent_endpoint=endpoint,
            ready=ready,
            served_version=self.lineage.version,
            dropped_already=self.learner_events.drops_unclaimed,
            notify=self.progress.message,
            engines_up=lambda: self.engines.pool.serving > 0,
        )
        self.engines.pool.add_listener(self.scheduler.on_engines_changed)
        self.concurrency = build_concurrency(self.cfg, self.engines, self.scheduler)
        self.learner_events.attach(self.scheduler)
        self.initial_capacity = self.membership.capacity
        return self.scheduler

    def concurrency_limit(self) -> ConcurrencyLimit:
        """The limit on groups in flight (pipeline.supervisor.actors.concurrency), built with the
        scheduler."""
        assert self.concurrency is not None
        return self.concurrency

    def start_evaluator(self) -> None:
        """Held-out evaluation on the training engines or a dedicated one (pipeline.supervisor.eval_schedule,
        which also stops that one); the version the run starts from is evaluated first unless
        `eval.at_start` is off."""
        assert self.scheduler is not None
        self.evaluator = build_evaluator(
            self.setup,
            engine=self.engines.generator,
            tokenizer=self.scheduler.recipe.tokenizer,
            progress=self.progress,
            started_at=self.started_at,
            on_result=self.trackers.log_eval if self.trackers is not None else None,
            training=self.scheduler,
            newest_published=lambda: max(self.lineage.announced, self.lineage.version),
        )
        if self.evaluator is None:
            return
        if self.cfg.eval.at_start:
            self.evaluator.on_version(self.lineage.version, self.learner_events.book.step)
        else:
            self.evaluator.skip_start(self.lineage.version)

    def on_served(self, version: int) -> None:
        """The engines serve `version` now: admission's staleness budget and held-out evaluation follow."""
        if self.scheduler is not None:
            self.scheduler.on_version(version)
        if self.evaluator is not None:
            self.evaluator.on_version(version, self.learner_events.book.step)

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
        if self.engines.pool.serving == 0:
            reasons.append("engines (none answers)")
        if self.scheduler is None:
            reasons.append("scheduler")
        return reasons


# --- machinery --------------------------------------------------------------------------------------------
async def cancel_all(tasks: list[asyncio.Task[None]] | list[asyncio.Task[Any]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


# --- entry point ------------------------------------------------------------------------------------------
def main_run(ns: argparse.Namespace) -> int:
    """`rollwise run`: validate everything, then run the daemon until stopped. Exit 2 = bad config."""
    try:
        if (notice := bare_run_config(ns)) is not None:
            print(f"rollwise: {notice}", file=sys.stderr)
        setup = resolve_config(ns)
    except ConfigError as exc:
        print(f"rollwise: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    memory_trace.start_from_env("supervisor")
    try:
        return asyncio.run(Supervisor(setup).run())
    except (RunDirInUse, CannotListen) as exc:
        print(f"rollwise: {exc}", file=sys.stderr)
        return 1
