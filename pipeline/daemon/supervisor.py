"""`rollwise run`: the daemon. `Supervisor.run` is the whole schedule, top to bottom; the machinery
(run directory, children, learner events, signals) sits below it, one call away.

Processes: this process runs the scheduler and its actors, the spool writer and the HTTP endpoints;
the engines and the learner are child processes it starts, watches and restarts with backoff.
Resume: `rollwise run --run-dir DIR` on an existing run continues it; the learner restores its latest
checkpoint and reports its policy version v, the engines start on `weights/v<v>`, and the scheduler's
staleness accounting starts at `v·B + unconsumed groups` (see `initial_accepted`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import fcntl
import itertools
import json
import logging
import os
import shutil
import signal
import sys
import time
from collections.abc import Awaitable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO, TypeVar

from pipeline.actors.rollout import ENGINE_LABEL
from pipeline.actors.scheduler import Scheduler
from pipeline.config import Config, ConfigError, load_config, write_resolved
from pipeline.daemon.children import Child, ChildSpec, keep_running
from pipeline.daemon.http_endpoints import HttpEndpoints
from pipeline.daemon.progress import Progress, RichProgress, Totals, make_progress, status_between
from pipeline.daemon.weightsync import sync_weights
from pipeline.engine.client import EngineClient
from pipeline.engine.launch import EngineSlot, engine_child_spec, plan_engines
from pipeline.engine.pool import EnginePool
from pipeline.observability import metrics

log = logging.getLogger("rollwise.supervisor")
T = TypeVar("T")

STATUS_INTERVAL_S = 5.0
LOOP_LAG_PERIOD_S = 0.1


class RunDirInUse(RuntimeError):
    """Another daemon holds the run directory's lock."""


class Supervisor:
    def __init__(self, cfg: Config, *, progress_out: TextIO | None = None) -> None:
        self.cfg = cfg
        self.run_dir = Path(cfg.run.run_dir).resolve()
        self.progress: Progress = make_progress(cfg.run.log_format, progress_out)
        self.stopping = asyncio.Event()  # set once: stop admitting, drain, stop children, exit
        self.fatal: str | None = None  # why the run cannot go on (then exit code 1)
        self.learner = LearnerProcess(self)
        self.engines = EngineFleet(self)
        self.endpoints = HttpEndpoints(cfg.metrics.host, cfg.metrics.port, self.not_ready)
        self.scheduler: Scheduler | None = None
        self.version = 0  # the policy version the engines serve
        self.publish_lock = asyncio.Lock()  # one weight sync at a time, in version order
        self.step = 0
        self.last_step_time_s: float | None = None
        self.dropped_seqs: set[int] = set()
        self.drops_before_scheduler = 0  # dropped groups announced before the scheduler existed
        self.step_rewards: list[float] = []  # reward_mean of the steps since the last status
        self.started_at = time.monotonic()

    async def run(self) -> int:
        """The schedule. Returns the process exit code (0 after a requested stop, 1 after a fatal error)."""
        cfg, grace = self.cfg, self.cfg.run.shutdown_grace_s
        with hold_run_dir_lock(self.run_dir):
            log_to_run_dir(self.run_dir, quiet_stderr=isinstance(self.progress, RichProgress))
            write_resolved(cfg, self.run_dir)
            await asyncio.to_thread(ensure_initial_model, cfg, self.run_dir)
            self.install_signal_handlers()
            metrics.SUPERVISOR_UP.set(time.time())
            metrics.init_label_values(envs=[cfg.env.name], engines=[ENGINE_LABEL])
            self.step_log = (self.run_dir / "logs" / "steps.jsonl").open("a", encoding="utf-8")
            await self.endpoints.start()
            self.progress.start()
            self.progress.message(f"run dir {self.run_dir}; metrics on {self.endpoints.url}/metrics")
            background: list[asyncio.Task[None]] = []
            try:
                # 1. The learner resumes its checkpoint; the engines serve the version it holds.
                ready = await self.until_stopping(self.start_children())
                if ready is not None:
                    # 2. Actors fill the spool; learner events drive weight syncs (on_learner_event).
                    self.scheduler = await make_scheduler(self, ready)
                    background = [
                        self.watch(self.scheduler.run(self.stopping), "scheduler"),
                        self.watch(self.report_status(), "status"),
                        self.watch(measure_loop_lag(self.stopping), "loop-lag"),
                    ]
                    await self.stopping.wait()
                # 3. Stop: the learner finishes its step and checkpoints while in-flight episodes finish
                # (or are aborted after the grace period); then the engines go.
                self.progress.message(f"stopping ({self.fatal or 'requested'}): draining, checkpointing")
                drain = [self.scheduler.drain(grace)] if self.scheduler is not None else []
                await asyncio.gather(self.learner.stop(grace), *drain)
            finally:
                await cancel_all(background)
                await self.learner.stop(grace)
                await self.engines.stop(grace)
                self.progress.stop()
                self.step_log.close()
                await self.endpoints.stop()
        if self.fatal is not None:
            print(f"rollwise: {self.fatal}", file=sys.stderr)
            return 1
        return 0

    async def start_children(self) -> LearnerReady:
        """Start the learner and the engines together: the learner restores its latest checkpoint and
        reports the policy version v it holds, while the engines load the version that checkpoint
        recorded (weights/v<v>, the initial model without one). If the two differ (weights not on disk),
        the engines load the learner's v before any work is admitted."""
        self.version = checkpointed_version(self.run_dir)
        ready, _ = await asyncio.gather(self.learner.start(), self.engines.start(self.version))
        # The learner may already have trained and published a newer version while the engines started;
        # publish() ignores anything not newer than what the engines serve.
        if ready.version > self.version:
            await self.publish(ready.version, ready.path, received_at=time.monotonic())
        metrics.POLICY_VERSION.set(ready.version)
        return ready

    # --- learner events -----------------------------------------------------------------------------
    async def on_learner_event(self, event: dict[str, Any]) -> None:
        kind = event.get("event")
        if kind == "step":
            record_step_metrics(event)
            # The run's own learning curve: `rollwise report --run-dir` reads it without Prometheus.
            self.step_log.write(json.dumps(event, separators=(",", ":")) + "\n")
            self.step_log.flush()
            self.step = int(event.get("step", self.step + 1))
            self.last_step_time_s = _float(event.get("step_time_s"))
            if (reward := _float(event.get("reward_mean"))) is not None:
                self.step_rewards.append(reward)
            self.progress.on_step(event)
            if self.cfg.run.max_steps is not None and self.step >= self.cfg.run.max_steps:
                self.request_stop(f"reached run.max_steps = {self.cfg.run.max_steps}")
        elif kind == "published":
            await self.publish(int(event["version"]), Path(event["path"]), received_at=time.monotonic())
        elif kind == "dropped":
            self.on_dropped(
                int(event["seq"]), str(event.get("reason", "unknown")), int(event.get("groups", 1))
            )
        elif kind == "checkpoint":
            if (seconds := _float(event.get("seconds"))) is not None:
                metrics.CHECKPOINT_DURATION.observe(seconds)
        elif kind == "quarantined":
            metrics.SPOOL_QUARANTINED.labels(reason=str(event.get("kind", "unknown"))).inc()
            self.progress.message(f"spool file quarantined: {event.get('file')}: {event.get('reason')}")
        elif kind == "error":
            self.progress.message(f"learner error: {event.get('message')}")

    def on_dropped(self, seq: int, reason: str, groups: int) -> None:
        """A written group the learner will never train: admission gets its slot back. Deduplicated by
        spool sequence number, because a restarted learner re-reads the groups after its checkpoint."""
        if seq in self.dropped_seqs:
            return
        self.dropped_seqs.add(seq)
        metrics.GROUPS_DROPPED.labels(reason=reason).inc(groups)
        if self.scheduler is not None:
            self.scheduler.on_dropped(groups)
        else:
            self.drops_before_scheduler += groups

    async def publish(self, version: int, path: Path, *, received_at: float) -> None:
        """Load a newly published version into every engine, then let the scheduler admit against it.

        sync_weights sets POLICY_VERSION_SERVED{engine=url} for each engine that loaded it; an engine
        that failed (down, restarting) catches up when it is ready again (EngineFleet.keep)."""
        async with self.publish_lock:
            if version <= self.version:
                # Never move the engines backwards (a late "ready" after a newer publish, a replayed event).
                log.info("version %d not newer than served version %d: not synced", version, self.version)
                return
            timings = await sync_weights(
                self.engines.pool,
                model_path=str(path),
                version=version,
                mode=self.cfg.async_.weight_sync_mode,
            )
            self.version = version
        metrics.POLICY_VERSION.set(version)
        if self.scheduler is not None:
            self.scheduler.on_version(version)
        log.info("version %d served: %s", version, timings)
        self.progress.on_sync(
            {
                "version": version,
                "publish_to_served_s": round(time.monotonic() - received_at, 4),
                "pause_s": round(timings.pause_s, 4),
                "load_s": round(timings.load_s, 4),
                "continue_s": round(timings.continue_s, 4),
                "ok": timings.ok,
                **({"errors": timings.errors} if timings.errors else {}),
            }
        )

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
            for child in self.children():
                child.kill()
            os._exit(128 + int(sig))
        self.request_stop(f"received {signal.Signals(sig).name}")

    def children(self) -> list[Child]:
        return [c for c in (self.learner.child, *self.engines.children.values()) if c is not None]

    def not_ready(self) -> list[str]:
        reasons = [] if self.learner.ready is not None else ["learner"]
        reasons += [name for name, up in self.engines.up.items() if not up]
        if self.scheduler is None:
            reasons.append("scheduler")
        return reasons

    async def report_status(self) -> None:
        before = Totals.read()
        while True:
            await asyncio.sleep(STATUS_INTERVAL_S)
            after = Totals.read()
            elapsed = time.monotonic() - self.started_at
            status = status_between(
                before,
                after,
                elapsed_s=elapsed,
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


# --- the learner child ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class LearnerReady:
    version: int
    consumed_seq: int
    path: Path  # weights of `version`


MAX_FAILED_STARTS = 3


class LearnerProcess:
    """The learner child: started with the resolved config, speaks JSON lines, restarted on crash."""

    def __init__(self, sup: Supervisor) -> None:
        self.sup = sup
        self.child: Child | None = None
        self.ready: LearnerReady | None = None
        self.failed_starts = 0
        self._ready_event = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def spec(self) -> ChildSpec:
        run_dir, threads = self.sup.run_dir, str(self.sup.cfg.learner.threads)
        argv = ["--config", str(run_dir / "config.toml"), "--run-dir", str(run_dir)]
        return ChildSpec(
            name="learner",
            argv=[sys.executable, "-m", "learner.worker", *argv],
            log_path=run_dir / "logs" / "learner.log",
            env={"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads},
            events=True,
            stdin=True,
        )

    async def start(self) -> LearnerReady:
        """Start the learner (kept running with backoff) and wait for its first "ready" event."""

        def started(child: Child) -> None:
            self.child = child

        self._task = asyncio.create_task(
            keep_running(self.spec, self.follow, self.sup.stopping, component="learner", on_start=started)
        )
        await self._ready_event.wait()
        assert self.ready is not None
        return self.ready

    async def follow(self, child: Child) -> None:
        """Handle the child's events until it closes stdout."""
        was_ready = False
        while (event := await child.read_event()) is not None:
            if event.get("event") == "ready":
                was_ready = True
                self.failed_starts = 0
                self.ready = LearnerReady(
                    int(event["version"]), int(event.get("consumed_seq", 0)), Path(str(event["path"]))
                )
                self.sup.step = int(event.get("step", self.sup.step))
                metrics.LEARNER_STEP.set(self.sup.step)
                max_steps = self.sup.cfg.run.max_steps
                if max_steps is not None and self.sup.step >= max_steps:
                    self.sup.request_stop(f"the learner is already at step {self.sup.step} >= run.max_steps")
                self._ready_event.set()
                log.info("learner ready: %s", event)
                if self.ready.version != self.sup.version and self.sup.scheduler is not None:
                    # A restarted learner resumed from an older checkpoint; it re-publishes from there.
                    log.warning("learner restarted at version %d, engines serve %d", *self._versions())
            else:
                await self.sup.on_learner_event(event)
        if not was_ready and not self.sup.stopping.is_set():
            self.failed_starts += 1
            if self.failed_starts >= MAX_FAILED_STARTS:
                self.sup.fail(
                    f"the learner exited {self.failed_starts} times before reporting ready; "
                    f"see {child.spec.log_path}"
                )

    def _versions(self) -> tuple[int, int]:
        return (self.ready.version if self.ready else -1, self.sup.version)

    async def stop(self, grace_s: float) -> None:
        """Ask the learner to finish its step and checkpoint; kill it if it does not exit in time.
        Idempotent."""
        child = self.child
        if child is not None and child.returncode is None:
            await child.send({"cmd": "stop"})
            # A checkpoint of a large model can take a while; the grace covers the step in progress.
            try:
                await asyncio.wait_for(asyncio.shield(child.wait()), grace_s + 30.0)
            except TimeoutError:
                log.warning("learner did not stop within %.0f s; killing pid=%s", grace_s + 30.0, child.pid)
                await child.stop(1.0)
        if self._task is not None:
            await cancel_all([self._task])


# --- the engines ----------------------------------------------------------------------------------------
class EngineFleet:
    """Engine children (none for `external`), one EngineClient per engine, and the pool over them."""

    def __init__(self, sup: Supervisor) -> None:
        self.sup = sup
        self.slots: list[EngineSlot] = plan_engines(sup.cfg)
        self.children: dict[str, Child] = {}
        self.up: dict[str, bool] = {s.name: False for s in self.slots}
        self._up_events = {s.name: asyncio.Event() for s in self.slots}
        self._tasks: list[asyncio.Task[None]] = []
        timeout = sup.cfg.engine.request_timeout_s
        self.clients = [
            EngineClient(s.url, api_key=sup.cfg.engine.api_key, request_timeout_s=timeout) for s in self.slots
        ]
        self.pool = EnginePool(self.clients)

    async def start(self, version: int) -> bool:
        """Start the managed engines on the weights of `version` and wait until every engine, external
        ones included, answers /health. Returns True."""
        for slot, client in zip(self.slots, self.clients, strict=True):
            if slot.managed:
                self._tasks.append(asyncio.create_task(self.keep(slot, client), name=slot.name))
            else:
                await client.wait_ready(self.sup.cfg.engine.startup_timeout_s)
                self._mark_up(slot, version)
        await asyncio.gather(*(e.wait() for e in self._up_events.values()))
        return True

    def _mark_up(self, slot: EngineSlot, version: int) -> None:
        self.up[slot.name] = True
        self._up_events[slot.name].set()
        metrics.POLICY_VERSION_SERVED.labels(engine=slot.url).set(version)

    async def keep(self, slot: EngineSlot, client: EngineClient) -> None:
        """Keep one engine running; a restarted engine loads the latest published version."""
        sup = self.sup
        failed_starts = 0

        def spec() -> ChildSpec:
            weights = latest_weights(sup.run_dir, model_dir_of(sup.cfg, sup.run_dir), sup.version)
            return engine_child_spec(
                sup.cfg, slot, model_dir=weights, version=sup.version, log_dir=sup.run_dir / "logs"
            )

        async def serve(child: Child) -> None:
            nonlocal failed_starts
            launched = sup.version
            if not await ready_or_exited(client, child, sup.cfg.engine.startup_timeout_s):
                failed_starts += 1
                if failed_starts >= MAX_FAILED_STARTS:
                    sup.fail(f"{slot.name} failed to start {failed_starts} times; see {child.spec.log_path}")
                return
            failed_starts = 0
            if sup.version != launched:  # a version was published while this engine was starting
                weights = latest_weights(sup.run_dir, model_dir_of(sup.cfg, sup.run_dir), sup.version)
                await client.update_weights_from_disk(str(weights), weight_version=str(sup.version))
            self._mark_up(slot, sup.version)
            await child.wait()
            self.up[slot.name] = False

        def started(child: Child) -> None:
            self.children[slot.name] = child

        await keep_running(spec, serve, sup.stopping, component="engine", on_start=started)

    async def stop(self, grace_s: float) -> None:
        """SIGTERM every engine, SIGKILL after `grace_s`. Idempotent."""
        await asyncio.gather(*(c.stop(grace_s) for c in self.children.values()), return_exceptions=True)
        await cancel_all(self._tasks)
        await self.pool.close()


async def ready_or_exited(client: EngineClient, child: Child, timeout_s: float) -> bool:
    """True once the engine answers /health; False if its process exits or `timeout_s` passes first."""
    ready = asyncio.ensure_future(client.wait_ready(timeout_s))
    exited = asyncio.ensure_future(child.wait())
    await asyncio.wait({ready, exited}, return_when=asyncio.FIRST_COMPLETED)
    exited.cancel()
    if ready.done() and ready.exception() is None:
        return True
    await cancel_all([ready])
    if child.returncode is None:
        child.kill()
    return False


# --- machinery --------------------------------------------------------------------------------------------
def log_to_run_dir(run_dir: Path, *, quiet_stderr: bool) -> None:
    """Supervisor log lines go to logs/supervisor.log; stderr keeps only warnings under a live view."""
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(run_dir / "logs" / "supervisor.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    if quiet_stderr:
        for h in root.handlers:
            if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
                h.setLevel(logging.WARNING)


@contextlib.contextmanager
def hold_run_dir_lock(run_dir: Path) -> Any:
    """Exclusive flock on `run_dir/supervisor.lock`; RunDirInUse if another daemon holds it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "supervisor.lock"
    handle = open(path, "a+")  # noqa: SIM115 - held for the whole run
    try:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown"
            raise RunDirInUse(
                f"run dir {run_dir} is in use by another rollwise daemon (pid {holder}); "
                "stop it first or choose another --run-dir"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        yield
    finally:
        handle.close()


def model_dir_of(cfg: Config, run_dir: Path) -> Path:
    return Path(cfg.model.path) if cfg.model.path is not None else run_dir / "model"


def ensure_initial_model(cfg: Config, run_dir: Path) -> Path:
    """The initial model directory; creates the preset in run_dir/model (atomically) when needed."""
    target = model_dir_of(cfg, run_dir)
    if cfg.model.path is not None:
        if not (target / "config.json").is_file():
            raise ConfigError(f"model.path: {target} is not an HF model directory (no config.json)")
        return target
    if (target / "config.json").is_file():
        return target
    from learner.model_init import init_model

    staged = run_dir / ".model.tmp"
    shutil.rmtree(staged, ignore_errors=True)
    init_model(staged, preset=cfg.model.preset, seed=cfg.run.seed)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(staged, target)
    return target


def latest_weights(run_dir: Path, model_dir: Path, version: int) -> Path:
    """Weights of `version`: weights/v<version> when published, the initial model for version 0."""
    published = run_dir / "weights" / f"v{version}"
    if (published / "config.json").is_file():
        return published
    if version > 0:
        log.warning("weights for version %d not found at %s; serving the initial model", version, published)
    return model_dir


def checkpointed_version(run_dir: Path) -> int:
    """Policy version of the latest checkpoint whose weights were published (0 without one). The learner
    reports the authoritative version when ready; this only lets the engines start in parallel."""
    try:
        latest = (run_dir / "checkpoints" / "latest").read_text().strip()
        state = json.loads((run_dir / "checkpoints" / latest / "state.json").read_text())
        version = int(state["counters"]["policy_version"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0
    return version if (run_dir / "weights" / f"v{version}" / "config.json").is_file() else 0


def initial_accepted(version: int, batch_groups: int, unconsumed_groups: int) -> int:
    """Groups the staleness control counts as accepted on resume.

    Each learner version consumed exactly B accepted groups, so v·B groups are behind the learner;
    the groups fsync'd to the spool but not yet consumed are accepted too (they will be trained).
    Groups lost with a killed supervisor were never fsync'd, never counted, and are simply redone.
    """
    return version * batch_groups + unconsumed_groups


async def make_scheduler(sup: Supervisor, ready: LearnerReady) -> Any:
    """The actor side: env factory, tokenizer, spool writer and staleness control around the pool."""
    from envs.discovery import resolve_env
    from pipeline.actors.admission import AdmissionController
    from pipeline.actors.rollout import RolloutSettings
    from pipeline.actors.scheduler import Scheduler
    from pipeline.engine.protocol import SamplingParams
    from pipeline.transport.spool import SpoolWriter, spool_depth

    cfg = sup.cfg
    tokenizer = await asyncio.to_thread(load_tokenizer, model_dir_of(cfg, sup.run_dir))
    unconsumed, _ = spool_depth(sup.run_dir / "spool", ready.consumed_seq)
    spool = SpoolWriter(sup.run_dir / "spool")
    factory = resolve_env(cfg.env.name)
    # A resumed run continues the task stream after the groups already produced instead of replaying it.
    tasks = itertools.islice(factory(**cfg.env.options).tasks(cfg.run.seed), spool.next_seq - 1, None)
    return Scheduler(
        engine=sup.engines.pool,
        tokenizer=tokenizer,
        factory=factory,
        env_name=cfg.env.name,
        env_options=cfg.env.options,
        settings=RolloutSettings(
            sampling=SamplingParams(
                temperature=cfg.sampling.temperature,
                top_p=cfg.sampling.top_p,
                top_k=cfg.sampling.top_k,
                min_p=cfg.sampling.min_p,
                max_new_tokens=cfg.sampling.max_new_tokens,
            ),
            max_context_tokens=cfg.env.max_context_tokens,
            tool_parser=cfg.env.tool_parser,
            system_prompt=cfg.env.system_prompt,
            # abort-and-retry: an aborted turn is resubmitted with its partial output (AReaL-style), so the
            # tokens already generated keep their old version and the rest comes from the new weights.
            retry_aborted=cfg.async_.weight_sync_mode == "abort",
        ),
        group_size=cfg.env.group_size,
        admission=AdmissionController(
            cfg.learner.batch_groups, cfg.async_.max_staleness, cfg.rollout.max_concurrent_groups
        ),
        spool=spool,
        tasks=tasks,
        # The learner may already have trained the unconsumed groups, published newer versions and dropped
        # some groups while the engines and this scheduler were starting: start from what the engines serve
        # now, and do not count as accepted what the learner already announced it will never train.
        initial_version=sup.version,
        initial_accepted=initial_accepted(ready.version, cfg.learner.batch_groups, unconsumed)
        - sup.drops_before_scheduler,
    )


def load_tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def record_step_metrics(event: dict[str, Any]) -> None:
    """Learner step event -> Prometheus (the learner has no scrape target of its own)."""
    gauges = {
        "step": metrics.LEARNER_STEP,
        "loss": metrics.LEARNER_LOSS,
        "clip_fraction": metrics.LEARNER_CLIP_FRACTION,
        "mismatch_abs_mean": metrics.LEARNER_MISMATCH_ABS,
        "mismatch_k3": metrics.LEARNER_MISMATCH_K3,
        "entropy": metrics.LEARNER_ENTROPY,
        "grad_norm": metrics.LEARNER_GRAD_NORM,
        "lr": metrics.LEARNER_LR,
    }
    for key, gauge in gauges.items():
        value = _float(event.get(key))
        if value is not None:
            gauge.set(value)
    metrics.LEARNER_STEPS.inc()
    for key in ("ratio_mean", "ratio_min", "ratio_max"):
        value = _float(event.get(key))
        if value is not None:
            metrics.LEARNER_IMPORTANCE_RATIO.observe(value)
    if (value := _float(event.get("step_time_s"))) is not None:
        metrics.LEARNER_STEP_DURATION.observe(value)
    if (value := _float(event.get("busy_s"))) is not None:
        metrics.LEARNER_BUSY.inc(value)
    if (value := _float(event.get("idle_s"))) is not None:
        metrics.LEARNER_IDLE.inc(value)
    if (value := _float(event.get("spool_read_s"))) is not None:
        metrics.SPOOL_READ_LATENCY.observe(value)
    if (value := _float(event.get("tokens"))) is not None:
        metrics.LEARNER_TOKENS.inc(value)
    if (value := _float(event.get("groups"))) is not None:
        # Groups dropped (counted by their own "dropped" events) were not trained on.
        metrics.GROUPS_ACCEPTED.inc(max(0.0, value - _counts(event.get("dropped")).get("no_update", 0.0)))
    for reason, count in _counts(event.get("skipped")).items():
        metrics.LEARNER_SKIPPED.labels(reason=reason).inc(count)
    for staleness, count in _counts(event.get("staleness")).items():
        for _ in range(int(count)):
            metrics.TOKEN_STALENESS.observe(float(staleness))
    if (value := _float(event.get("spool_depth_groups"))) is not None:
        metrics.SPOOL_DEPTH_GROUPS.set(value)
    if (value := _float(event.get("spool_depth_bytes"))) is not None:
        metrics.SPOOL_DEPTH_BYTES.set(value)


def _float(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _counts(value: object) -> dict[str, float]:
    if not isinstance(value, dict):
        return {}
    return {str(k): float(v) for k, v in value.items() if _float(v) is not None and float(v) > 0}


async def measure_loop_lag(stopping: asyncio.Event) -> None:
    """How late a 100 ms timer fires: a blocked event loop shows up here first."""
    loop = asyncio.get_running_loop()
    while not stopping.is_set():
        started = loop.time()
        await asyncio.sleep(LOOP_LAG_PERIOD_S)
        metrics.EVENT_LOOP_LAG.observe(max(0.0, loop.time() - started - LOOP_LAG_PERIOD_S))


async def cancel_all(tasks: list[asyncio.Task[None]] | list[asyncio.Task[Any]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


# --- entry point ------------------------------------------------------------------------------------------
def resolve_config(ns: argparse.Namespace) -> Config:
    """Config file + --set + the run flags (as overrides, so errors name the key); checks the env name
    and options before anything starts. Raises ConfigError."""
    overrides = list(ns.set or [])
    if ns.run_dir is not None:
        overrides.append(f"run.run_dir={json.dumps(ns.run_dir)}")
    if ns.max_steps is not None:
        overrides.append(f"run.max_steps={ns.max_steps}")
    if ns.log_format is not None:
        overrides.append(f"run.log_format={json.dumps(ns.log_format)}")
    cfg = load_config(ns.config, overrides)
    from envs.discovery import EnvDiscoveryError, resolve_env

    try:
        factory = resolve_env(cfg.env.name)
    except EnvDiscoveryError as exc:
        raise ConfigError(f"env.name: {exc}") from None
    try:
        env = factory(**cfg.env.options)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"env.options: {cfg.env.name} rejects {cfg.env.options!r}: {exc}") from None
    if cfg.learner.action_prior_coef > 0.0 and not env.spec.action_hints:
        raise ConfigError(
            f"learner.action_prior_coef: {cfg.learner.action_prior_coef} needs an env that declares "
            f"action_hints, and {cfg.env.name} declares none (set it to 0)"
        )
    if cfg.model.path is not None and not (Path(cfg.model.path) / "config.json").is_file():
        raise ConfigError(f"model.path: {cfg.model.path} is not an HF model directory (no config.json)")
    return cfg


def main_run(ns: argparse.Namespace) -> int:
    """`rollwise run`: validate everything, then run the daemon until stopped. Exit 2 = bad config."""
    try:
        cfg = resolve_config(ns)
    except ConfigError as exc:
        print(f"rollwise: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    try:
        return asyncio.run(Supervisor(cfg).run())
    except RunDirInUse as exc:
        print(f"rollwise: {exc}", file=sys.stderr)
        return 1
