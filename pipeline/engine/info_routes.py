"""What the engine reports about itself: /health, /health_generate, model and server info, its load
(/get_load), the weight version and Prometheus /metrics."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import torch
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from pipeline.engine.batcher import ContinuousBatcher
from pipeline.engine.engine_state import state_of
from pipeline.engine.http_json import json_reply

HEALTH_GENERATE_TIMEOUT_S = 20.0


async def health(request: web.Request) -> web.Response:
    state = state_of(request)
    healthy = state.ready and state.scheduler is not None and state.scheduler.alive
    return web.Response(status=200 if healthy else 503)


async def health_generate(request: web.Request) -> web.Response:
    state = state_of(request)
    if not state.ready:
        return web.Response(status=503)
    try:
        await asyncio.wait_for(state.generate_internal("HEALTH_CHECK", 1), HEALTH_GENERATE_TIMEOUT_S)
    except TimeoutError:
        return web.Response(status=503)
    return web.Response(status=200)


async def model_info(request: web.Request) -> web.Response:
    state = state_of(request)
    scheduler = state.require_scheduler()
    config = scheduler.model.config
    return json_reply(
        {
            "model_path": state.model_path,
            "tokenizer_path": state.config.model,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": scheduler.weight_version,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": getattr(config, "model_type", None),
            "architectures": getattr(config, "architectures", None),
        }
    )


async def server_info(request: web.Request) -> web.Response:
    state = state_of(request)
    cfg = state.config
    scheduler = state.require_scheduler()
    return json_reply(
        {
            "model_path": state.model_path,
            "tokenizer_path": cfg.model,
            "host": cfg.host,
            "port": cfg.port,
            "served_model_name": cfg.served_model_name or cfg.model,
            "context_length": scheduler.context_length,
            "max_running_requests": cfg.max_batch,
            "max_req_input_len": scheduler.context_length - 1,
            "enable_metrics": cfg.enable_metrics,
            "device": cfg.device,
            "dtype": state.dtype,
            "dtype_reason": state.dtype_reason,
            "threads": torch.get_num_threads(),
            "disable_radix_cache": scheduler.prefix_cache is None,
            "prefix_cache": prefix_cache_info(scheduler),
            # Free pages handed back to the kernel (pipeline/contracts/malloc_trim.py).
            "malloc_trim": {
                "available": scheduler.trimmer.available,
                "every_s": scheduler.trimmer.every_s,
                "trims": scheduler.trimmer.trims,
                "last_ms": round(1e3 * scheduler.trimmer.last_duration_s, 3),
            },
            "weight_version": scheduler.weight_version,
            "internal_states": [
                {
                    "num_running_reqs": scheduler.num_running(),
                    "num_queue_reqs": scheduler.num_waiting(),
                    "paused": scheduler.paused,
                }
            ],
            "version": "rollwise-embedded",
        }
    )


async def get_load(request: web.Request) -> web.Response:
    """SGLang's /get_load: per DP rank (one here) the requests held, running and queued (`num_reqs`
    counts both), those waiting in the queue, and the tokens of the running batch (prompt and output:
    what its KV cache holds). Read without locking, as the worker thread's plain lists stand."""
    scheduler = state_of(request).require_scheduler()
    batch = scheduler.running_batch
    rows = list(batch.rows) if batch is not None else []
    waiting = scheduler.num_waiting()
    entry = {
        "dp_rank": 0,
        "num_reqs": len(rows) + waiting,
        "num_waiting_reqs": waiting,
        "num_tokens": sum(len(row.prompt_ids) + len(row.output_ids) for row in rows),
        "num_pending_tokens": 0,
        "ts_tic": time.time(),
    }
    return json_reply([entry])


def prefix_cache_info(scheduler: ContinuousBatcher) -> dict[str, Any]:
    """The prefix cache's budget, contents and counts since start (read without locking: plain ints
    the worker thread updates)."""
    cache, stats = scheduler.prefix_cache, scheduler.prefix_stats
    return {
        "enabled": cache is not None,
        "budget_bytes": cache.budget_bytes if cache is not None else 0,
        "bytes": cache.bytes if cache is not None else 0,
        "tokens": cache.tokens if cache is not None else 0,
        "evicted_tokens": cache.evicted_tokens if cache is not None else 0,
        "lookups": stats.lookups,
        "hits": stats.hits,
        "prompt_tokens": stats.prompt_tokens,
        "cached_tokens": stats.cached_tokens,
        "cache_hit_rate": round(stats.hit_rate, 6),
        "kv_epoch": scheduler.kv_epoch,
    }


async def get_weight_version(request: web.Request) -> web.Response:
    return json_reply({"weight_version": state_of(request).require_scheduler().weight_version})


async def metrics(request: web.Request) -> web.Response:
    return web.Response(
        body=state_of(request).metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST}
    )
