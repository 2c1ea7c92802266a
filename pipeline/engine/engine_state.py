"""What every handler shares: `EngineState` (config, scheduler, tokenizer, the requests in flight) and
`Tracked`, the event loop's view of one request, with the SGLang response object built from it.

`EngineState.start` loads and warms the model; `track` turns a validated request into an EngineRequest
whose worker-thread notifications land on the event loop; `response_object` shapes a finished request
(or a stream snapshot) the way SGLang's /generate does.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import random
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from aiohttp import web

from pipeline.contracts.core_lease import open_lease
from pipeline.engine import routed_experts
from pipeline.engine.batcher import ContinuousBatcher
from pipeline.engine.engine_metrics import EngineMetrics
from pipeline.engine.engine_request import EngineRequest
from pipeline.engine.lora_slots import EngineAdapters
from pipeline.engine.model_loading import eos_ids, load_model, load_tokenizer, resolve_dtype
from pipeline.engine.sampling import RequestSampling
from pipeline.engine.serve_flags import ServerConfig

log = logging.getLogger(__name__)


@dataclass
class Tracked:
    """Loop-side view of one EngineRequest: resolves `done`, feeds `updates` for streams."""

    request: EngineRequest
    done: asyncio.Future[None]
    updates: asyncio.Queue[int] | None
    return_logprob: bool = False
    text_in_logprobs: bool = False
    index: int | None = None
    lora_name: str | None = None  # the adapter name the request gave (held until it finishes)
    routed_experts_start: int = 0  # first position of meta_info.routed_experts (when recorded)


@dataclass
class EngineState:
    """Everything the handlers share. `scheduler` is None until the model is loaded."""

    config: ServerConfig
    metrics: EngineMetrics
    model_path: str
    scheduler: ContinuousBatcher | None = None
    tokenizer: Any = None
    ready: bool = False
    inflight: dict[str, Tracked] = field(default_factory=dict)
    update_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    loader: concurrent.futures.ThreadPoolExecutor = field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="weight-loader")
    )
    rng: random.Random = field(default_factory=random.Random)
    adapters: EngineAdapters = field(
        default_factory=lambda: EngineAdapters(enabled=False, max_rank=None, target_modules=None)
    )
    dtype: str = "float32"  # what the weights are served in (resolved from config.dtype at start)
    dtype_reason: str = ""

    def require_scheduler(self) -> ContinuousBatcher:
        if self.scheduler is None:
            raise web.HTTPServiceUnavailable(text="engine is still loading the model")
        return self.scheduler

    async def start(self) -> None:
        """Load the model in a worker thread, start the scheduler, warm it up, then report ready."""
        loop = asyncio.get_running_loop()
        cfg = self.config
        self.dtype, self.dtype_reason = resolve_dtype(cfg.dtype, cfg.device)
        log.info("serving in %s (%s)", self.dtype, self.dtype_reason)
        model = await loop.run_in_executor(self.loader, load_model, cfg.model, cfg.device, self.dtype)
        if cfg.enable_return_routed_experts:
            routed_experts.check_routable(model)
        self.tokenizer = await loop.run_in_executor(self.loader, load_tokenizer, cfg.model)
        context = cfg.context_length or int(getattr(model.config, "max_position_embeddings", 2048))
        self.scheduler = ContinuousBatcher(
            model,
            weight_version=cfg.weight_version,
            eos_token_ids=eos_ids(model, self.tokenizer),
            context_length=context,
            metrics=self.metrics,
            max_batch=cfg.max_batch,
            batch_wait_s=cfg.batch_wait_ms / 1000.0,
            max_prefill_tokens=cfg.max_prefill_tokens,
            decode=None if self.tokenizer is None else self.tokenizer.decode,
            capture_routing=cfg.enable_return_routed_experts,
            prefix_cache_bytes=int(cfg.prefix_cache_mb * 2**20),
            lease=open_lease(None if cfg.yield_to is None else Path(cfg.yield_to)),
        )
        self.scheduler.start()
        for name, path in cfg.lora_paths:  # --lora-paths: loaded before the engine reports ready
            status, reply = await self.adapters.load(name, path, self.scheduler, self.loader, cfg.device)
            if status != 200:
                raise RuntimeError(f"--lora-paths {name}={path}: {reply['error_message']}")
        warmup = await self.generate_internal("WARMUP", max_new_tokens=2)
        if warmup.finish_reason is None or warmup.finish_reason["type"] == "abort":
            raise RuntimeError(f"warmup generation failed: {warmup.finish_reason}")
        self.ready = True
        log.info("engine ready: %s (weight_version %s)", cfg.model, cfg.weight_version)

    async def stop(self) -> None:
        if self.scheduler is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.scheduler.stop)
        self.loader.shutdown(wait=False)

    def track(
        self,
        rid: str,
        prompt_ids: list[int],
        sampling: RequestSampling,
        stream: bool,
        lora_name: str | None = None,
    ) -> Tracked:
        """Create an EngineRequest whose worker-thread notifications land on this loop; it holds the
        LoRA adapter `lora_name` (already validated) until it finishes."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        updates: asyncio.Queue[int] | None = asyncio.Queue() if stream else None

        def on_loop(finished: bool, num_tokens: int) -> None:
            if finished:
                if self.inflight.pop(rid, None) is not None:
                    self.adapters.release(lora_name)
                if not done.done():
                    done.set_result(None)
            if updates is not None:
                updates.put_nowait(num_tokens)

        def notify(request: EngineRequest, finished: bool) -> None:
            # The token count is taken here, on the worker thread, where the request's lists agree.
            # RuntimeError = the loop is closed (shutdown): nobody is waiting for this request any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(on_loop, finished, len(request.output_ids))

        if sampling.sampling_seed is None:
            # Unseeded requests draw their seed from the server's RNG (--seed makes a run repeatable).
            sampling = dataclasses.replace(sampling, sampling_seed=self.rng.getrandbits(63))
        request = EngineRequest(
            rid=rid,
            prompt_ids=prompt_ids,
            sampling=sampling,
            notify=notify,
            stream=stream,
            adapter=self.adapters.acquire(lora_name),
        )
        tracked = Tracked(request=request, done=done, updates=updates, lora_name=lora_name)
        self.inflight[rid] = tracked
        return tracked

    def untrack(self, tracked: Tracked) -> None:
        """Forget a request that was tracked but never submitted (its batch was refused)."""
        if self.inflight.pop(tracked.request.rid, None) is tracked:
            self.adapters.release(tracked.lora_name)
        if not tracked.done.done():
            tracked.done.cancel()

    async def generate_internal(self, prefix: str, max_new_tokens: int) -> EngineRequest:
        """A greedy request on prompt [0] (warmup and /health_generate)."""
        scheduler = self.require_scheduler()
        sampling = RequestSampling(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
        tracked = self.track(f"{prefix}_{uuid.uuid4().hex}", [0], sampling, stream=False)
        scheduler.submit([tracked.request])
        await tracked.done
        return tracked.request

    # ---- response shapes ---------------------------------------------------------------------------

    def _text(self, request: EngineRequest, ids: list[int], finished: bool) -> str:
        sampling = request.sampling
        reason = request.finish_reason if finished else None
        matched = reason.get("matched") if reason and reason["type"] == "stop" else None
        if isinstance(matched, int) and not sampling.no_stop_trim and ids:
            ids = ids[:-1]
        text = str(
            self.tokenizer.decode(
                ids,
                skip_special_tokens=sampling.skip_special_tokens,
                spaces_between_special_tokens=sampling.spaces_between_special_tokens,
            )
        )
        if isinstance(matched, str) and matched and not sampling.no_stop_trim:
            # detokenizer_manager.trim_matched_stop: the text ends before the stop string.
            position = text.find(matched)
            text = text if position == -1 else text[:position]
        return text

    def response_object(self, tracked: Tracked, num_tokens: int | None = None) -> dict[str, Any]:
        """SGLang's per-request object. `num_tokens` None = final (finished) object; else a stream
        snapshot of the first `num_tokens` tokens (finish_reason null, no e2e_latency)."""
        request = tracked.request
        finished = num_tokens is None and request.finish_reason is not None
        n = len(request.output_ids) if num_tokens is None else num_tokens
        ids = request.output_ids[:n]
        version = request.finish_version if finished else None
        meta: dict[str, Any] = {
            "id": request.rid,
            "finish_reason": request.finish_reason if finished else None,
            "prompt_tokens": len(request.prompt_ids),
            "weight_version": version or self.require_scheduler().weight_version,
            "completion_tokens": n,
            "cached_tokens": request.cached_tokens or 0,
        }
        if tracked.return_logprob and request.input_logprobs is not None:
            start = len(request.prompt_ids) - len(request.input_logprobs)
            prompt = request.prompt_ids[start:]
            prompt_texts: list[str | None] = (
                [self.tokenizer.decode([t]) for t in prompt]
                if tracked.text_in_logprobs and self.tokenizer is not None
                else [None] * len(prompt)
            )
            meta["input_token_logprobs"] = [
                [lp, t, s] for lp, t, s in zip(request.input_logprobs, prompt, prompt_texts, strict=True)
            ]
        if tracked.return_logprob:
            texts: list[str | None] = (
                [self.tokenizer.decode([t]) for t in ids]
                if tracked.text_in_logprobs and self.tokenizer is not None
                else [None] * n
            )
            meta["output_token_logprobs"] = [
                [lp, t, s] for lp, t, s in zip(request.logprobs[:n], ids, texts, strict=True)
            ]
        meta["output_token_weight_versions"] = request.versions[:n]
        if finished and request.routed:
            # SGLang's rows [routed_experts_start_len, prompt + completion - 1) (engine.routed_experts).
            end = len(request.prompt_ids) + n - 1  # a prompt-only request forwarded its last token too
            rows = torch.cat(request.routed)[tracked.routed_experts_start : end]
            meta["routed_experts"] = routed_experts.encode(rows)
        if finished and request.finish_time is not None:
            meta["e2e_latency"] = round(request.finish_time - request.arrival, 6)
        obj: dict[str, Any] = {}
        if self.tokenizer is not None:
            obj["text"] = self._text(request, ids, finished)
        obj["output_ids"] = ids
        obj["meta_info"] = meta
        if tracked.index is not None:
            obj["index"] = tracked.index
        return obj


STATE: web.AppKey[EngineState] = web.AppKey("engine_state", EngineState)


def state_of(request: web.Request) -> EngineState:
    return request.app[STATE]
