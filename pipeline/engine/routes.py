"""The embedded engine's HTTP API: the route table (`build_app`) and the protocol it speaks.

The subset of SGLang's native HTTP API that rollwise uses (docs/architecture.md, Contract 2), with
SGLang's JSON shapes, key order and status codes:
- POST/PUT /generate: `input_ids` (a list -> one object, a list of lists -> an array) or `text`; `stream`
  sends cumulative SSE chunks then `data: [DONE]`. `return_logprob` gives `input_token_logprobs` from
  `logprob_start_len` (entry 0 null, as SGLang); `max_new_tokens = 0` scores the prompt only;
  `top_logprobs_num > 0` and `token_ids_logprob` are 400s. `lora_path` names a loaded adapter (one per
  item or one for all; null = the base). `return_routed_experts` (MoE, `--enable-return-routed-experts`)
  adds `meta_info.routed_experts` from `routed_experts_start_len` (pipeline.engine.routed_experts).
- meta_info carries rollwise's `output_token_weight_versions` (the weight version each token was sampled
  under); `weight_version` is the version at finish.
- Control: /update_weights_from_disk (loads in a background thread, swaps between two decode steps, bumps
  `weight_version` only on success; in-flight requests continue on the new weights),
  /update_weight_version, /pause_generation {abort|retract|in_place}, /continue_generation,
  /abort_request, /flush_cache, /load_lora_adapter, /unload_lora_adapter (pipeline.engine.lora_slots).
- Info: /health (503 until loaded and warmed), /health_generate, /get_model_info, /model_info,
  /get_server_info, /server_info, /get_load, /get_weight_version, /metrics (with --enable-metrics).
- Limits: a prompt as long as the context is a 400; a generation that reaches it finishes with
  `{"type": "length", ...}`. The door is pipeline.contracts.http_guard (413, 408, 400 for bad JSON,
  `--max-new-tokens-cap`, `--max-batch`, `--idle-timeout-s`); beyond loopback `--api-key` (or
  ROLLWISE_ENGINE_API_KEY) is required; weights load only from `--allowed-weights-dir`, links resolved.
- `--fault-stale-weights` (tests of the served-policy check only): acknowledges every weight update and
  adapter load but keeps serving the weights it started with.

The handlers: generate_route (/generate), control_routes (weights, LoRA, pause, abort, flush),
info_routes (health, info, metrics); the flags: serve_flags; the process: serve.
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
    get_load,
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
        web.get("/get_load", get_load),
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
