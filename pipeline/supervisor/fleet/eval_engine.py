"""The dedicated evaluation engine (`eval.engine = "dedicated"`): one more engine process of the fleet's
kind that serves only held-out evaluation.

It is launched the way the training engines are (engine_launch.engine_child_spec: the embedded engine
with `eval.engine_threads` torch threads, or SGLang, plus `eval.engine_args`) on a free port of
127.0.0.1, logs to `logs/eval-engine.log`, and is never a member of the training pool: training requests,
weight syncs, the served-policy check and the fleet's metrics never see it. Before each evaluation
`load(version)` puts the served version into it through the calls the fleet uses for an engine that
comes up late (EngineFleet.catch_up): /update_weights_from_disk of the published directory, or with LoRA
served as adapters /load_lora_adapter of the version's adapter (the previous one is unloaded; nothing is
in flight between evaluations).

It is a child of the daemon (its own session, SIGKILLed with the daemon, stopped with it) and is kept
running with the children's backoff: a crash costs the evaluation in flight (its episodes end
engine_error, which fails that evaluation, pipeline.supervisor.eval_schedule), counts in
`rollwise_process_restarts_total{component="eval_engine"}`, and the next evaluation waits for the
restarted process. It never stops the daemon: an engine that cannot start fails evaluations, not
training.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from pathlib import Path

from pipeline.contracts.config import Config, EmbeddedEngine, ManagedEngine, reveal
from pipeline.contracts.run_dir import RunDir, is_published_dir
from pipeline.contracts.tls import client_context
from pipeline.supervisor.engines.adapters import adapter_name
from pipeline.supervisor.engines.client import EngineClient
from pipeline.supervisor.engines.protocol import (
    EngineError,
    EngineUnavailable,
    GenerateResult,
    SamplingParams,
)
from pipeline.supervisor.fleet.children import Child, ChildSpec, keep_running
from pipeline.supervisor.fleet.engine_fleet import ready_or_exited
from pipeline.supervisor.fleet.engine_launch import EngineSlot, engine_child_spec
from pipeline.supervisor.fleet.port_reservations import PortReservations

log = logging.getLogger("rollwise.evaluation")

EVAL_ENGINE = "eval-engine"  # its slot name, log file (logs/eval-engine.log) and restart component
HOST = "127.0.0.1"  # it serves this daemon only


class EvalEngineDown(EngineError):
    """The evaluation engine is not up (starting, restarting, or failing to start)."""


def eval_engine_config(cfg: Config) -> Config:
    """`cfg` as the evaluation engine is launched with: eval.engine_args appended, and an embedded
    engine's own thread count (external engines have no evaluation engine: eval_schedule refuses it)."""
    e = cfg.engine
    assert isinstance(e, ManagedEngine), "resolve_eval refuses a dedicated engine beside external ones"
    update: dict[str, object] = {"extra_args": [*e.extra_args, *cfg.eval.engine_args]}
    if isinstance(e, EmbeddedEngine):
        update["threads"] = cfg.eval.engine_threads
    return cfg.model_copy(update={"engine": e.model_copy(update=update)})


class DedicatedEvalEngine:
    """One evaluation engine process and its client. `launch(v)` starts keeping it running (a (re)start
    is launched on the newest version asked for), `load(v)` makes it serve v, `generate` is what the
    evaluation runner calls, `stop` ends it (SIGTERM, SIGKILL after `grace_s`)."""

    def __init__(self, cfg: Config, run_dir: RunDir, *, grace_s: float) -> None:
        self.cfg = eval_engine_config(cfg)
        self.run_dir = run_dir
        self.grace_s = grace_s
        self.wanted = 0  # the latest version asked for: a (re)started process is launched on it
        self.adapters = cfg.learner.lora.enabled and cfg.learner.lora.serving == "adapter"
        self.ports = PortReservations()
        self.slot = EngineSlot(name=EVAL_ENGINE, host=HOST, port=self.ports.take(HOST), managed=True)
        self.client = EngineClient(
            self.slot.url,
            api_key=reveal(cfg.engine.api_key),
            request_timeout_s=cfg.engine.request_timeout_s,
            ssl_context=client_context(cfg.tls.files()),
        )
        self.stopping = asyncio.Event()
        self.up = asyncio.Event()
        self.child: Child | None = None
        self.task: asyncio.Task[None] | None = None
        self.serving: int | None = None  # the version it serves, once up (None: not up)
        self.launched = 0  # the version its current process was launched on
        self.starts = 0

    @property
    def log_path(self) -> Path:
        return self.run_dir.log_file(EVAL_ENGINE)

    def launch(self, version: int) -> None:
        """Start keeping the process running, on `version` (idempotent; needs a running event loop)."""
        self.wanted = version
        if self.task is None:
            self.task = asyncio.create_task(
                keep_running(
                    self._spec, self._serve, self.stopping, component="eval_engine", on_start=self._started
                ),
                name=EVAL_ENGINE,
            )

    def _spec(self) -> ChildSpec:
        version = self.wanted
        if version > 0 and not is_published_dir(self.run_dir.weights_of(version)):
            version = 0  # pruned since it was asked for: start on the initial model, load() brings the rest
        self.launched = version
        if self.adapters:
            adapter = self.run_dir.weights_of(version) if version > 0 else None
            model = self.run_dir.initial_model
        else:
            adapter, model = None, self.run_dir.serving_weights(version)
        return engine_child_spec(
            self.cfg, self.slot, model_dir=model, version=version, log_dir=self.run_dir.logs, adapter=adapter
        )

    def _started(self, child: Child) -> None:
        self.child = child
        self.starts += 1

    async def _serve(self, child: Child) -> None:
        if not await ready_or_exited(self.client, child, self.cfg.engine.startup_timeout_s):
            if not self.stopping.is_set():
                log.error("the evaluation engine did not start; see %s", child.spec.log_path)
            return
        self.serving = self.launched
        self.up.set()
        log.info("evaluation engine up on %s (pid %s, version %d)", self.slot.url, child.pid, self.serving)
        code = await child.wait()
        self.up.clear()
        self.serving = None
        if not self.stopping.is_set():
            log.error("the evaluation engine exited with code %s; see %s", code, child.spec.log_path)

    async def load(self, version: int) -> float:
        """Make the engine serve `version` (waiting up to engine.startup_timeout_s for it to be up);
        returns the seconds it took. Raises EngineError (EvalEngineDown when it is not up) or OSError."""
        started = time.monotonic()
        self.launch(version)
        timeout = self.cfg.engine.startup_timeout_s
        try:
            await asyncio.wait_for(self.up.wait(), timeout)
        except TimeoutError:
            raise EvalEngineDown(
                f"the evaluation engine ({self.slot.url}) is not up after {timeout:.0f} s "
                f"(engine.startup_timeout_s); see {self.log_path}"
            ) from None
        if self.serving != version:
            path = self.run_dir.weights_of(version)
            if version > 0 and not is_published_dir(path):
                raise EngineError(f"version {version} is not published at {path} (pruned meanwhile?)")
            if self.adapters:
                await self._load_adapter(version, path)
            else:
                await self.client.update_weights_from_disk(str(path), weight_version=str(version))
            self.serving = version
        return time.monotonic() - started

    async def _load_adapter(self, version: int, path: Path) -> None:
        previous, name = adapter_name(self.serving or 0), adapter_name(version)
        if name is not None:
            await self.client.load_lora_adapter(name, str(path))
        self.serving = version
        if previous is not None and previous != name:
            try:
                await self.client.unload_lora_adapter(previous)
            except EngineError as exc:
                log.warning("unloading adapter %s from the evaluation engine: %s", previous, exc)

    async def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        rid: str,
        *,
        affinity_key: str,
        priority: int | None = None,
    ) -> GenerateResult:
        """The evaluation runner's generate: the loaded version, no priority (nothing else runs here)."""
        version = self.serving
        if version is None:
            raise EngineUnavailable(self.slot.url, "the evaluation engine is not up", maybe_sent=False)
        name = adapter_name(version) if self.adapters else None
        result = await self.client.generate(input_ids, sampling, rid, lora_path=name)
        if name is None:
            return result
        # The base's weight_version never moves with adapters: the adapter's version is the tokens' version.
        label = str(version)
        return dataclasses.replace(
            result, weight_version=label, token_versions=[label] * len(result.output_ids)
        )

    async def stop(self) -> None:
        """SIGTERM the process (SIGKILL after the grace), stop restarting it, close the client. Idempotent."""
        if self.stopping.is_set():
            return
        self.stopping.set()
        if self.child is not None:
            await self.child.stop(self.grace_s)
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        await self.client.close()
        self.ports.close()
