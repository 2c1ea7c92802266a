"""Continuous batching of the embedded engine: one worker thread owns the model and the running batch.

Threading: `ContinuousBatcher` runs the model in ONE dedicated thread (torch releases the GIL inside its
kernels, so the aiohttp loop stays responsive). Other threads talk to it only through a thread-safe
command queue (`submit`, `abort`, `pause`, `resume`, `swap_weights`, the adapters, `flush_cache`);
replies come back as `concurrent.futures.Future`s, and per-request progress through the request's
`notify` callback, invoked on the worker thread (the server wraps it in `loop.call_soon_threadsafe`).

One step: run the commands, admit a round of waiting requests (pipeline.engine.waiting_queue), prefill
it into the batch (pipeline.engine.prefill), decode one token for every row (each row feeds its last
sampled token; pipeline.engine.request_outputs records it and finishes the rows that stop), drop the
finished rows. Weight swaps and adapter changes happen between two steps, never inside one. Rows that
keep their KV across a swap (in-place pause, or no pause) continue on the new weights with the old KV;
retracted rows recompute their KV with whatever weights are active when they are admitted again.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Literal

import torch

from pipeline.contracts.core_lease import NO_LEASE, CoreLease
from pipeline.contracts.malloc_trim import Trimmer
from pipeline.engine.engine_metrics import EngineMetrics, version_value
from pipeline.engine.engine_request import EngineRequest, abort_reason
from pipeline.engine.kv_batch import RunningBatch
from pipeline.engine.kv_reuse import KVReuse, PrefixStats
from pipeline.engine.model_forward import ModelForward, record_routing
from pipeline.engine.prefill import Prefiller
from pipeline.engine.prefix_cache import PrefixCache
from pipeline.engine.request_outputs import RequestOutputs
from pipeline.engine.waiting_queue import enqueue_by_priority, take_round

log = logging.getLogger(__name__)
# How often a yielding engine looks at the lease again: a learner step is seconds, its turn-over cheap.
YIELD_POLL_S = 0.002

PauseMode = Literal["abort", "retract", "in_place"]
PAUSE_MODES: tuple[str, ...] = ("abort", "retract", "in_place")


class ContinuousBatcher:
    """Owns the model; batches, decodes and finishes requests on its own worker thread."""

    def __init__(
        self,
        model: Any,
        *,
        weight_version: str,
        eos_token_ids: frozenset[int],
        context_length: int,
        metrics: EngineMetrics,
        max_batch: int = 64,
        batch_wait_s: float = 0.003,
        max_prefill_tokens: int = 16384,
        decode: Callable[[list[int]], str] | None = None,
        capture_routing: bool = False,
        prefix_cache_bytes: int = 0,
        lease: CoreLease = NO_LEASE,
    ) -> None:
        self.vocab_size = int(model.config.vocab_size)
        self.context_length = context_length
        self._metrics = metrics
        self._max_batch = max_batch
        self._batch_wait_s = batch_wait_s
        self._max_prefill_tokens = max_prefill_tokens
        self._forward = ModelForward(model, capture_routing=capture_routing)
        self._reuse = KVReuse(prefix_cache_bytes, metrics)
        self._outputs = RequestOutputs(
            weight_version=weight_version,
            vocab_size=self.vocab_size,
            eos_token_ids=eos_token_ids,
            context_length=context_length,
            decode=decode,
            metrics=metrics,
        )
        self._prefiller = Prefiller(self._forward, self._reuse, self._outputs, metrics, self._join)
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._waiting: deque[EngineRequest] = deque()
        self._batch: RunningBatch | None = None
        self._paused = False
        self._stopping = False
        self._lease = lease  # held by the learner: yield the cores between decode steps (core_lease)
        self.peak_batch = 0  # most rows ever decoded in one step (diagnostics, tests)
        self.trimmer = Trimmer()  # hands the freed KV's pages back (pipeline/contracts/malloc_trim.py)
        self._thread = threading.Thread(target=self._run, name="rollwise-engine-worker", daemon=True)
        metrics.weight_version.set(version_value(weight_version))

    # ---- what other threads read ----------------------------------------------------------------

    @property
    def model(self) -> Any:
        return self._forward.model

    @model.setter
    def model(self, model: Any) -> None:
        """Replace the model as is (no checks; tests wrap it between two requests)."""
        self._forward.model = model

    @property
    def weight_version(self) -> str:
        return self._outputs.weight_version

    @property
    def prefix_cache(self) -> PrefixCache | None:
        return self._reuse.cache

    @property
    def prefix_stats(self) -> PrefixStats:
        return self._reuse.stats

    @property
    def kv_epoch(self) -> int:
        return self._reuse.epoch

    @property
    def running_batch(self) -> RunningBatch | None:
        """The batch being decoded now (None between batches); read-only for other threads."""
        return self._batch

    def num_running(self) -> int:
        batch = self._batch
        return batch.size if batch is not None else 0

    def num_waiting(self) -> int:
        return len(self._waiting)

    def num_requests(self) -> int:
        return self.num_running() + self.num_waiting()

    @property
    def alive(self) -> bool:
        """The worker thread is running (False before start, after stop, or if it died)."""
        return self._thread.is_alive()

    @property
    def paused(self) -> bool:
        return self._paused

    # ---- thread-safe commands -------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort everything in flight and end the worker thread."""

        def command() -> None:
            self._abort_matching(None, "engine shutting down")
            self._stopping = True

        self._commands.put(command)
        self._thread.join(timeout)

    def submit(self, requests: list[EngineRequest]) -> None:
        self._commands.put(lambda: self._enqueue(requests))

    def abort(self, rid: str | None, message: str = "Aborted by /abort_request") -> None:
        """Abort the request `rid` (running or waiting), or every request when rid is None."""
        self._commands.put(lambda: self._abort_matching(rid, message))

    def pause(self, mode: PauseMode) -> concurrent.futures.Future[None]:
        def command() -> None:
            if mode == "abort":
                self._abort_matching(None, "Aborted by /pause_generation")
            elif mode == "retract":
                self._retract_all()
            self._paused = True

        return self._call(command)

    def resume(self) -> concurrent.futures.Future[None]:
        def command() -> None:
            self._paused = False

        return self._call(command)

    def swap_weights(
        self, model: Any, weight_version: str | None, abort_all: bool
    ) -> concurrent.futures.Future[int]:
        """Replace the model between two steps; resolves to the number of requests held by a pause.
        Fails (ValueError) if the new model's architecture differs; then nothing changes."""

        def command() -> int:
            self._forward.swap(model)  # raises before anything changed
            if abort_all:
                self._abort_matching(None, "Aborted by weight update (abort_all_requests)")
            self._invalidate_kv()
            if weight_version is not None:
                self._outputs.weight_version = weight_version
                self._metrics.weight_version.set(version_value(weight_version))
            return self.num_requests() if self._paused else 0

        return self._call(command)

    def attach_adapter(
        self, name: str, config: Any, weights: dict[str, Any]
    ) -> concurrent.futures.Future[None]:
        """Inject LoRA adapter `name` between two steps (pipeline.engine.lora_slots)."""
        return self._call(lambda: self._forward.attach_adapter(name, config, weights))

    def refill_adapter(self, slot: str, weights: dict[str, Any]) -> concurrent.futures.Future[None]:
        """Copy new LoRA weights into the free adapter `slot` between two steps."""

        def command() -> None:
            self._refuse_if_named(slot, f"adapter slot {slot}")
            self._forward.refill_adapter(slot, weights)
            self._reuse.clear_namespace(slot)

        return self._call(command)

    def detach_adapter(self, name: str) -> concurrent.futures.Future[None]:
        """Remove LoRA adapter `name` between two steps; no request may still name it."""

        def command() -> None:
            self._refuse_if_named(name, f"adapter {name}")
            self._forward.detach_adapter(name)
            self._reuse.clear_namespace(name)

        return self._call(command)

    def flush_cache(self) -> concurrent.futures.Future[bool]:
        """Drop the prefix cache if the engine is idle (SGLang flushes only then); True if it was."""

        def command() -> bool:
            if self.num_requests() > 0:
                return False
            self._invalidate_kv()
            return True

        return self._call(command)

    def _call(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def command() -> None:
            try:
                future.set_result(fn())
            except Exception as exc:
                future.set_exception(exc)

        self._commands.put(command)
        return future

    # ---- worker thread --------------------------------------------------------------------------

    def _run(self) -> None:
        with torch.inference_mode():
            while not self._stopping:
                idle = self._paused or (self._batch is None and not self._waiting)
                if idle:
                    self.trimmer.maybe()  # also an engine no weight update comes to churns its heap
                self._drain_commands(block=idle)
                if self._stopping or self._paused:
                    self._publish()
                    continue
                if self._lease.held():
                    self._yield_to_learner()
                    continue
                if idle and self._waiting:
                    self._collect_arrivals()
                try:
                    self._admit_waiting()
                    if self._batch is not None:
                        self._decode_step()
                except Exception as exc:  # a failing step must not kill the engine: fail its requests
                    log.exception("engine step failed")
                    self._invalidate_kv()  # a forward that failed half-way may have written some layers
                    self._abort_matching(None, f"engine step failed: {type(exc).__name__}: {exc}")
                self._publish()

    def _yield_to_learner(self) -> None:
        """Wait while the learner holds the cores, still taking commands (arrivals, aborts, pauses)."""
        started = time.monotonic()
        while self._lease.held() and not self._stopping and not self._paused:
            time.sleep(YIELD_POLL_S)
            self._drain_commands(block=False)
        self._metrics.yielded_seconds.inc(time.monotonic() - started)

    def _admit_waiting(self) -> None:
        taken = take_round(
            self._waiting,
            room=self._max_batch - self.num_running(),
            max_prefill_tokens=self._max_prefill_tokens,
            capture_routing=self._forward.capture_routing,
        )
        self._prefiller.admit(taken)

    def _join(self, fresh: RunningBatch) -> None:
        """Prefilled rows join the running batch."""
        self._batch = fresh if self._batch is None else self._batch.merge(fresh)

    def _decode_step(self) -> None:
        batch = self._batch
        assert batch is not None
        self.peak_batch = max(self.peak_batch, batch.size)
        mask = torch.cat([batch.mask, batch.mask.new_ones(batch.size, 1)], dim=1)
        logits, captured = self._forward(
            batch.rows,
            input_ids=batch.last_tokens.unsqueeze(1),
            attention_mask=mask,
            position_ids=batch.next_pos.unsqueeze(1),
            cache=batch.cache,
        )
        record_routing(batch.rows, [[0]] * batch.size, captured, replace=False)
        batch.mask = mask
        batch.next_pos = batch.next_pos + 1
        self._outputs.sample_into(batch, logits[:, -1, :])
        if any(r.finished for r in batch.rows):
            self._keep_unfinished()

    def _drain_commands(self, *, block: bool) -> None:
        if block:
            self._execute(self._commands.get())
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            self._execute(command)

    @staticmethod
    def _execute(command: Callable[[], None]) -> None:
        try:
            command()
        except Exception:  # the worker thread must outlive any one command
            log.exception("engine command failed")

    def _collect_arrivals(self) -> None:
        """Wait a few ms after the first request of an idle engine so that requests sent together are
        prefilled together."""
        deadline = time.monotonic() + self._batch_wait_s
        while not self._stopping and not self._paused and len(self._waiting) < self._max_batch:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            try:
                command = self._commands.get(timeout=remaining)
            except queue.Empty:
                return
            self._execute(command)

    def _enqueue(self, requests: list[EngineRequest]) -> None:
        enqueue_by_priority(self._waiting, requests)

    def _publish(self) -> None:
        """Update the gauges, then notify the requests finished since the last call."""
        self._metrics.num_running_reqs.set(self.num_running())
        self._metrics.num_queue_reqs.set(self.num_waiting())
        self._outputs.announce()

    def _abort_matching(self, rid: str | None, message: str) -> None:
        for request in [r for r in self._waiting if rid is None or r.rid == rid]:
            self._waiting.remove(request)
            self._outputs.finish(request, abort_reason("Abort in waiting queue" if rid is None else message))
        batch = self._batch
        if batch is None:
            return
        hit = [i for i, r in enumerate(batch.rows) if rid is None or r.rid == rid]
        for i in hit:
            self._outputs.finish(batch.rows[i], abort_reason(message))
        if hit:
            self._keep_unfinished()

    def _retract_all(self) -> None:
        """Move running rows back to the front of the queue; their KV is dropped and recomputed from
        prompt + output so far when they are admitted again."""
        if self._batch is not None:
            self._reuse.remember(self._batch, range(self._batch.size))
            self._waiting.extendleft(reversed(self._batch.rows))
            self._batch = None

    def _keep_unfinished(self) -> None:
        batch = self._batch
        if batch is None:
            return
        keep = [i for i, r in enumerate(batch.rows) if not r.finished]
        self._reuse.remember(batch, [i for i, r in enumerate(batch.rows) if r.finished])
        self._batch = batch.select(keep) if keep else None

    def _refuse_if_named(self, adapter: str, what: str) -> None:
        running = self._batch.rows if self._batch is not None else []
        if any(r.adapter == adapter for r in [*running, *self._waiting]):
            raise ValueError(f"{what} is still named by a request")

    def _invalidate_kv(self) -> None:
        """Cached KV and the KV of running rows no longer match what the model computes."""
        self._reuse.invalidate()
        self.trimmer.maybe()
