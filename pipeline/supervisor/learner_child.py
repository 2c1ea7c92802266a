"""The learner as a child of the daemon: started with the resolved config, restarted with backoff, its
JSON-line events decoded into typed records (pipeline.contracts.events) and handed to one callback.

The daemon learns everything about the learner through `on_event`: `Ready` (also kept here, so the
daemon can wait for the first one), and every other record as it arrives.

With learner.distributed.nproc x learner.distributed.nnodes > 1 the child is torchrun (`python -m
torch.distributed.run`, c10d rendezvous, no restarts of its own): a rank that dies ends it as a whole, and
the backoff here restarts it from the last checkpoint like a one-process learner. Rank 0 is the one that
talks on stdin and stdout. `learner.distributed.launcher` prefixes the command (srun, ssh) to run the learner
on other nodes. With `learner.remote.run_dir` the learner keeps its own run directory there: it is started
with `--config -` and gets the config (and its secrets) as the first line on its stdin.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from pipeline.contracts import events
from pipeline.contracts.config import Config, FlightTransport, config_to_toml, get_secret, reveal
from pipeline.contracts.learner_config import LearnerConfig
from pipeline.contracts.run_dir import RunDir
from pipeline.supervisor.fleet.children import Child, ChildSpec, keep_running

log = logging.getLogger("rollwise.learner_child")

MAX_FAILED_STARTS = 3
TRANSPORT_TOKEN_ENV = "ROLLWISE_TRANSPORT_TOKEN"  # pipeline.contracts.config reads it as transport.token


def torchrun_argv(run: RunDir, learner: LearnerConfig) -> list[str]:
    """torchrun's options for the learner's ranks: one node alone rendezvous on a free local port
    (--standalone); several meet at learner.distributed.rdzv_endpoint under an id derived from the run
    directory."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(learner.distributed.nnodes)]
    argv += ["--nproc-per-node", str(learner.distributed.nproc), "--max-restarts", "0"]
    if learner.distributed.rdzv_endpoint is None:
        return [*argv, "--standalone"]
    run_id = "rollwise-" + hashlib.sha256(str(run.root).encode()).hexdigest()[:12]
    return [
        *argv,
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        learner.distributed.rdzv_endpoint,
        "--rdzv-id",
        run_id,
    ]


def learner_child_spec(
    run: RunDir, learner: LearnerConfig, *, transport_token: str | None = None
) -> ChildSpec:
    """The learner's command line (torchrun's above one rank). `transport_token` (a Flight reader's key)
    travels in the environment: the run directory's config.toml never holds secrets, and argv shows in
    /proc/<pid>/cmdline. A learner with its own run directory (learner.remote.run_dir) gets `--config -`: its
    config and secrets arrive on stdin (`config_message`), which a launcher carries to another machine
    (an environment variable would not cross ssh)."""
    if learner.remote.run_dir is not None:
        argv = ["-m", "learner.process", "--config", "-", "--run-dir", learner.remote.run_dir]
        transport_token = None  # in the config message instead
    else:
        argv = ["-m", "learner.process", "--config", str(run.config_file), "--run-dir", str(run.root)]
    command = [*torchrun_argv(run, learner), *argv] if learner.world_size > 1 else [sys.executable, *argv]
    threads = str(learner.threads)
    env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    if transport_token:
        env[TRANSPORT_TOKEN_ENV] = transport_token
    return ChildSpec(
        name="learner",
        argv=[*learner.distributed.launcher, *command],
        log_path=run.log_file("learner"),
        env=env,
        events=True,
        stdin=True,
    )


def flight_token(cfg: Config) -> str | None:
    """The key a learner reading the spool over Flight needs (transport.token); None without Flight."""
    t = cfg.transport
    return reveal(t.token) if isinstance(t, FlightTransport) else None


# The secrets a learner with its own run directory needs: the Flight reader's and its weight server's.
LEARNER_SECRETS = ("transport.token", "learner.remote.weights_token")


def config_message(cfg: Config) -> dict[str, Any]:
    """The first stdin line of a learner started with `--config -`: the resolved config as the run
    directory's config.toml holds it (no secrets), and the secrets the learner needs beside it."""
    secrets = {key: value for key in LEARNER_SECRETS if (value := get_secret(cfg, key)) is not None}
    return {"cmd": "config", "toml": config_to_toml(cfg), "secrets": secrets}


@dataclass(eq=False)  # identity, not field-wise equality
class LearnerChild:
    """Keeps the learner process running until `stopping` is set. `on_event` receives every decoded event
    in order; `fail(why)` is called when the learner exits `MAX_FAILED_STARTS` times in a row before it
    ever reported ready (a problem restarts cannot fix)."""

    spec: ChildSpec
    stopping: asyncio.Event
    on_event: Callable[[events.LearnerEvent], Awaitable[None]]
    fail: Callable[[str], None]
    config: dict[str, Any] | None = None  # sent first to every start (config_message; --config -)
    child: Child | None = field(default=None, init=False)
    ready: events.Ready | None = field(default=None, init=False)  # the latest Ready event
    failed_starts: int = field(default=0, init=False)
    _ready_event: asyncio.Event = field(default_factory=asyncio.Event, init=False)
    _task: asyncio.Task[None] | None = field(default=None, init=False)

    async def start(self) -> events.Ready:
        """Start the learner (kept running with backoff) and wait for its first Ready event."""

        def started(child: Child) -> None:
            self.child = child

        self._task = asyncio.create_task(
            keep_running(lambda: self.spec, self.follow, self.stopping, component="learner", on_start=started)
        )
        await self._ready_event.wait()
        assert self.ready is not None
        return self.ready

    async def follow(self, child: Child) -> None:
        """Decode the child's events until it closes stdout; a malformed line is logged and skipped."""
        was_ready = False
        if self.config is not None:
            await child.send(self.config)  # a child that died at once shows up as stdout's EOF below
        while (obj := await child.read_event()) is not None:
            try:
                event = events.decode(obj)
            except ValueError as exc:
                log.error("learner sent a malformed event: %s", exc)
                continue
            if isinstance(event, events.Ready):
                was_ready = True
                self.failed_starts = 0
                self.ready = event
                self._ready_event.set()
                log.info("learner ready: %s", event)
            await self.on_event(event)
        if not was_ready and not self.stopping.is_set():
            self.failed_starts += 1
            if self.failed_starts >= MAX_FAILED_STARTS:
                self.fail(
                    f"the learner exited {self.failed_starts} times before reporting ready; "
                    f"see {child.spec.log_path}"
                )

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
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
