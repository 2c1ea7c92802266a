"""The embedded engine's HTTP API: the route table (`build_app`) and the protocol it speaks.

Speaks the subset of SGLang's native HTTP API that rollwise uses (docs/architecture.md, Contract 2),
with SGLang's JSON shapes, key order and status codes:
- POST/PUT /generate: `input_ids` (list -> one object, list of lists -> array) or `text` (tokenised
  with the model's tokenizer, no special tokens added by us beyond the tokenizer's defaults);
  `stream: true` sends cumulative SSE chunks then `data: [DONE]`. Bad requests -> 400
  `{"error": {"message": ...}}`. With `return_logprob`, `input_token_logprobs` from `logprob_start_len`
  (default -1 = the last prompt token only; entry 0 is null, as in SGLang; teacher-forced log-softmax of
  the raw logits); `max_new_tokens = 0` scores the prompt without generating. `top_logprobs_num > 0` and
  `token_ids_logprob` are rejected with 400. `lora_path` names a loaded LoRA adapter (one per batch
  item, or one for all; null = the base).
- `return_routed_experts` (with `--enable-return-routed-experts`, MoE models): the final object's
  `meta_info.routed_experts` = base64 of int32 (positions, layers, topk) for positions
  [`routed_experts_start_len`, prompt + completion - 1), as SGLang (pipeline.engine.routed_experts);
  without the flag no key, as SGLang. `routed_experts_start_len` outside [0, prompt length]: 400.
- LoRA (`--enable-lora`, `--max-lora-rank`, `--lora-target-modules`, `--lora-paths NAME=PATH`):
  /load_lora_adapter, /unload_lora_adapter as SGLang 0.5.x defines them (pipeline.engine.lora_slots).
- Fault injection, for tests of the served-policy check only: `--fault-stale-weights` acknowledges every
  /update_weights_from_disk (and reports its weight_version) and every /load_lora_adapter, but keeps
  serving the weights it started with: an engine the new policy never reached.
- meta_info carries the rollwise extension `output_token_weight_versions`: each generated token is
  stamped with the weight version active when it was sampled; `weight_version` is the version at
  finish (see batcher's docstring for what happens to in-flight requests across a weight swap).
- Control: /update_weights_from_disk (loads through `from_pretrained` in a background thread, swaps
  between two decode steps, bumps `weight_version` only on success), /update_weight_version,
  /pause_generation {abort|retract|in_place}, /continue_generation, /abort_request, /flush_cache.
  A weight update never waits for in-flight requests: they continue on the new weights (SGLang would
  wait unless paused); tokens are stamped accordingly.
- /health (503 until the model is loaded and warmed; no generation), /health_generate (1 token),
  /get_model_info, /model_info, /get_server_info, /server_info, /get_weight_version,
  /metrics (only with --enable-metrics).
- A prompt as long as the context is rejected (400); a generation that reaches the context length
  finishes with `{"type": "length", "length": <tokens generated>}`.
- Its door (pipeline.contracts.http_guard): bodies over `--max-body-bytes` get 413, a body not received within
  `--body-timeout-s` 408, malformed / non-UTF-8 / too deeply nested JSON 400; `max_new_tokens` over
  `--max-new-tokens-cap` (default: the context length), `n` over `--max-batch` and more than 16 x
  `--max-batch` samples in one call get 400; a connection without a complete request for
  `--idle-timeout-s` is closed (slow-loris clients). Binding anything but loopback needs `--api-key` (or
  ROLLWISE_ENGINE_API_KEY): without one the server refuses to start (exit 2). /update_weights_from_disk
  loads only from `--allowed-weights-dir` directories (default: the one holding `--model`), after
  resolving symbolic links, so a reachable port cannot make it read arbitrary paths.

The handlers: generate_route (/generate), control_routes (weights, LoRA, pause, abort, flush), info_routes
(health, info, metrics); the flags: serve_flags; the process: serve.
"""

from __future__ import annotations

import random
from pathlib import Path

from aiohttp import web

from pipeline.contracts.http_guard import api_key_middleware
from pipeline.contracts.tls import client_context
from pipeline.engine.control_routes import (
    abort_request,
    continue_generation,
    flush_cache,
    load_lora_adapter,
    pause_generation,
    unload_lora_adapter,
    update_weight_version,
    update_weights_from_disk,
)
from pipeline.engine.engine_metrics import EngineMetrics
from pipeline.engine.engine_state import STATE, EngineState
from pipeline.engine.generate_route import generate
from pipeline.engine.info_routes import (
    get_weight_version,
    health,
    health_generate,
    metrics,
    model_info,
    server_info,
)
from pipeline.engine.lora_slots import EngineAdapters
from pipeline.engine.serve_flags import ServerConfig

OPEN_PATHS = frozenset({"/health"})


def build_app(config: ServerConfig) -> web.Application:
    """The aiohttp application; call `app[STATE].start()` to load the model (see `serve`)."""
    app = web.Application(
        middlewares=[api_key_middleware(config.api_key, OPEN_PATHS)] if config.api_key else [],
        client_max_size=config.limits.max_body_bytes,
    )
    app[STATE] = EngineState(
        config=config,
        metrics=EngineMetrics(config.served_model_name or config.model),
        model_path=config.model,
        rng=random.Random(config.seed),
        adapters=EngineAdapters(
            enabled=config.enable_lora,
            max_rank=config.max_lora_rank,
            target_modules=config.lora_target_modules,
            stale=config.fault_stale_weights,
        ),
    )
    routes = [
        web.post("/generate", generate),
        web.put("/generate", generate),
        web.post("/update_weights_from_disk", update_weights_from_disk),
        web.post("/update_weight_version", update_weight_version),
        web.post("/load_lora_adapter", load_lora_adapter),
        web.post("/unload_lora_adapter", unload_lora_adapter),
        web.post("/pause_generation", pause_generation),
        web.post("/continue_generation", continue_generation),
        web.post("/abort_request", abort_request),
        web.get("/flush_cache", flush_cache),
        web.post("/flush_cache", flush_cache),
        web.get("/health", health),
        web.get("/health_generate", health_generate),
        web.get("/get_model_info", model_info),
        web.get("/model_info", model_info),
        web.get("/get_server_info", server_info),
        web.get("/server_info", server_info),
        web.get("/get_weight_version", get_weight_version),
    ]
    if config.enable_metrics:
        routes.append(web.get("/metrics", metrics))
    app.add_routes(routes)
    if config.weights_dir is not None:
        from pipeline.transport.weights_http import add_fetch_route

        Path(config.weights_dir).mkdir(parents=True, exist_ok=True)
        add_fetch_route(
            app,
            Path(config.weights_dir),
            ssl_context=client_context(config.tls),
            allow_plaintext=config.allow_plaintext,
        )
    return app
