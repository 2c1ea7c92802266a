"""The embedded SGLang-compatible engine: an aiohttp server over `batcher.ContinuousBatcher`.

`rollwise engine serve --model DIR --host 127.0.0.1 --port N [--weight-version 0] [--max-batch 64]
[--batch-wait-ms 3] [--context-length L] [--enable-metrics] [--threads T] [--seed S] [--device cpu]`.

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
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import os
import random
import signal
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from pipeline.contracts.http_guard import (
    ENGINE_API_KEY_ENV,
    BadBody,
    DoorLimits,
    ExposedWithoutKey,
    api_key_middleware,
    bind_notice,
    read_json,
    require_key_off_loopback,
    runner_options,
)
from pipeline.engine.batcher import PAUSE_MODES, ContinuousBatcher, EngineRequest
from pipeline.engine.engine_metrics import EngineMetrics
from pipeline.engine.lora_slots import EngineAdapters, lora_reply
from pipeline.engine.sampling import RequestSampling, parse_sampling_params

log = logging.getLogger(__name__)

HEALTH_GENERATE_TIMEOUT_S = 20.0
DISCONNECT_POLL_S = 0.25
FLUSH_MESSAGE = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
API_KEY_ENV = ENGINE_API_KEY_ENV
OPEN_PATHS = frozenset({"/health"})
SAMPLES_PER_CALL_PER_BATCH_SLOT = 16
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default when a request names none


def _dumps(obj: object) -> str:
    return json.dumps(obj, separators=(",", ":"))


def _json(obj: object, status: int = 200) -> web.Response:
    return web.json_response(obj, status=status, dumps=_dumps)


def _error(message: str, status: int = 400) -> web.Response:
    return _json({"error": {"message": message}}, status=status)


@dataclass(frozen=True)
class ServerConfig:
    """Command-line settings of one engine server."""

    model: str
    host: str = "127.0.0.1"
    port: int = 30000
    weight_version: str = "default"
    max_batch: int = 64
    batch_wait_ms: float = 3.0
    context_length: int | None = None
    enable_metrics: bool = False
    device: str = "cpu"
    dtype: str = "float32"
    threads: int | None = None
    seed: int | None = None
    served_model_name: str | None = None
    api_key: str | None = field(default=None, repr=False)
    max_prefill_tokens: int = 16384
    weights_dir: str | None = None  # serve POST /fetch_weights into this directory (weights over HTTP)
    limits: DoorLimits = field(default_factory=DoorLimits)
    max_new_tokens_cap: int | None = None  # None: the context length
    allowed_weights_dirs: tuple[str, ...] = ()  # empty: the directory holding `model`
    enable_lora: bool = False
    max_lora_rank: int | None = None
    lora_target_modules: tuple[str, ...] | None = None
    lora_paths: tuple[tuple[str, str], ...] = ()
    fault_stale_weights: bool = False

    def weights_roots(self) -> list[Path]:
        dirs = self.allowed_weights_dirs or (str(Path(self.model).resolve().parent),)
        # Versions this engine downloaded itself (weights over HTTP) are loaded from its weights_dir.
        fetched = (self.weights_dir,) if self.weights_dir is not None else ()
        return [Path(d).resolve() for d in (*dirs, *fetched)]


def load_model(path: str, device: str, dtype: str) -> Any:
    """HF causal LM from a directory, through `from_pretrained` (the path of a real checkpoint)."""
    from transformers import AutoModelForCausalLM

    if not Path(path).is_dir():
        raise FileNotFoundError(f"model_path {path!r} is not a directory")
    model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=_DTYPES[dtype])
    return model.to(device).eval()


def _load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # token-in/token-out still works; responses then carry no "text"
        log.warning("no tokenizer in %s (%s): responses will have no 'text'", path, exc)
        return None


def _eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    return frozenset(ids)


@dataclass
class _Tracked:
    """Loop-side view of one EngineRequest: resolves `done`, feeds `updates` for streams."""

    request: EngineRequest
    done: asyncio.Future[None]
    updates: asyncio.Queue[int] | None
    return_logprob: bool = False
    text_in_logprobs: bool = False
    index: int | None = None
    lora_name: str | None = None  # the adapter name the request gave (held until it finishes)


@dataclass
class EngineState:
    """Everything the handlers share. `scheduler` is None until the model is loaded."""

    config: ServerConfig
    metrics: EngineMetrics
    model_path: str
    scheduler: ContinuousBatcher | None = None
    tokenizer: Any = None
    ready: bool = False
    inflight: dict[str, _Tracked] = field(default_factory=dict)
    update_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    loader: concurrent.futures.ThreadPoolExecutor = field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="weight-loader")
    )
    rng: random.Random = field(default_factory=random.Random)
    adapters: EngineAdapters = field(
        default_factory=lambda: EngineAdapters(enabled=False, max_rank=None, target_modules=None)
    )

    def require_scheduler(self) -> ContinuousBatcher:
        if self.scheduler is None:
            raise web.HTTPServiceUnavailable(text="engine is still loading the model")
        return self.scheduler

    async def start(self) -> None:
        """Load the model in a worker thread, start the scheduler, warm it up, then report ready."""
        loop = asyncio.get_running_loop()
        cfg = self.config
        model = await loop.run_in_executor(self.loader, load_model, cfg.model, cfg.device, cfg.dtype)
        self.tokenizer = await loop.run_in_executor(self.loader, _load_tokenizer, cfg.model)
        context = cfg.context_length or int(getattr(model.config, "max_position_embeddings", 2048))
        self.scheduler = ContinuousBatcher(
            model,
            weight_version=cfg.weight_version,
            eos_token_ids=_eos_ids(model, self.tokenizer),
            context_length=context,
            metrics=self.metrics,
            max_batch=cfg.max_batch,
            batch_wait_s=cfg.batch_wait_ms / 1000.0,
            max_prefill_tokens=cfg.max_prefill_tokens,
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
    ) -> _Tracked:
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
        tracked = _Tracked(request=request, done=done, updates=updates, lora_name=lora_name)
        self.inflight[rid] = tracked
        return tracked

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
        if reason and reason["type"] == "stop" and not sampling.no_stop_trim and ids:
            ids = ids[:-1]
        return str(
            self.tokenizer.decode(
                ids,
                skip_special_tokens=sampling.skip_special_tokens,
                spaces_between_special_tokens=sampling.spaces_between_special_tokens,
            )
        )

    def response_object(self, tracked: _Tracked, num_tokens: int | None = None) -> dict[str, Any]:
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
            "cached_tokens": 0,
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


def _state(request: web.Request) -> EngineState:
    return request.app[STATE]


async def _json_body(request: web.Request, *, required: bool) -> dict[str, Any]:
    """The JSON object body; an empty body is {} unless required. Raises BadBody (a ValueError with the
    status to answer: 400, 408 for a body too slow to arrive, 413 for one too large)."""
    body = await read_json(request, _state(request).config.limits)
    if body is None:
        if required:
            raise BadBody("request body is empty, expected a JSON object")
        return {}
    if not isinstance(body, dict):
        raise BadBody(f"request body must be a JSON object, got {type(body).__name__}")
    return body


def _bad(exc: ValueError) -> web.Response:
    return _error(str(exc), exc.status if isinstance(exc, BadBody) else 400)


# ---- /generate ---------------------------------------------------------------------------------------


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _prompts(body: dict[str, Any], state: EngineState) -> tuple[list[list[int]], bool]:
    """(prompts as token ids, is_batch). Raises ValueError on malformed input."""
    has_ids, has_text = body.get("input_ids") is not None, body.get("text") is not None
    if has_ids == has_text:
        raise ValueError("exactly one of 'input_ids' and 'text' must be given")
    if has_text:
        if state.tokenizer is None:
            raise ValueError("'text' needs a tokenizer and this model has none; send 'input_ids'")
        text = body["text"]
        texts = text if isinstance(text, list) else [text]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise ValueError("'text' must be a string or a non-empty list of strings")
        return [list(state.tokenizer.encode(t)) for t in texts], isinstance(text, list)
    ids = body["input_ids"]
    if not isinstance(ids, list) or not ids:
        raise ValueError("input_ids must be a non-empty list of token ids (or a list of such lists)")
    if isinstance(ids[0], list):
        for i, item in enumerate(ids):
            if not isinstance(item, list) or not item:
                raise ValueError(f"input_ids[{i}] must be a non-empty list of token ids")
        return ids, True
    return [ids], False


def _check_prompt(ids: list[Any], where: str, vocab_size: int, context_length: int) -> None:
    for pos, token in enumerate(ids):
        if not _is_int(token) or not 0 <= token < vocab_size:
            raise ValueError(f"{where}[{pos}] = {token!r} is not a token id in [0, {vocab_size})")
    if len(ids) >= context_length:
        raise ValueError(
            f"The input ({len(ids)} tokens) is longer than the model's context length "
            f"({context_length} tokens)."
        )


def _per_item(value: Any, count: int, name: str) -> list[Any]:
    if isinstance(value, list):
        if len(value) != count:
            raise ValueError(f"{name} has {len(value)} entries for a batch of {count}")
        return value
    return [value] * count


def _rids(body: dict[str, Any], count: int, is_batch: bool) -> list[str]:
    rid = body.get("rid")
    if rid is None:
        return [uuid.uuid4().hex for _ in range(count)]
    if not is_batch:
        if not isinstance(rid, str):
            raise ValueError(f"rid must be a string, got {rid!r}")
        return [rid]
    if isinstance(rid, str):
        return [f"{rid}_{i}" for i in range(count)]
    rids = _per_item(rid, count, "rid")
    if not all(isinstance(r, str) for r in rids):
        raise ValueError("rid must be a string or a list of strings")
    if len(set(rids)) != len(rids):
        raise ValueError(f"rid list contains duplicates: {rids}")
    return rids


def logprob_starts(body: dict[str, Any], prompts: list[list[int]], n: int) -> list[int | None]:
    """Per expanded request: the first prompt position of its input_token_logprobs (None without
    return_logprob). `logprob_start_len` is an int or one per prompt; -1 (the default) = the last prompt
    token, as SGLang normalises it. ValueError -> 400."""
    if not body.get("return_logprob", False):
        return [None] * len(prompts)
    raw = body.get("logprob_start_len")
    count = len(prompts) // n
    values = _per_item(-1 if raw is None else raw, count, "logprob_start_len")
    starts: list[int | None] = []
    for i, value in enumerate(values):
        length = len(prompts[i * n])
        if not _is_int(value) or value < -1:
            raise ValueError(f"logprob_start_len must be an int >= -1, got {value!r}")
        if value >= length:
            raise ValueError(f"logprob_start_len ({value}) must be less than the input length ({length})")
        starts += [length - 1 if value == -1 else value] * n
    return starts


def _build_requests(body: dict[str, Any], state: EngineState) -> tuple[list[_Tracked], bool]:
    """Validate a /generate body into tracked requests (not yet submitted). Raises ValueError."""
    scheduler = state.require_scheduler()
    if body.get("top_logprobs_num") not in (None, 0):
        raise ValueError("top_logprobs_num > 0 is not supported by the embedded engine")
    if body.get("token_ids_logprob") is not None:
        raise ValueError("token_ids_logprob is not supported by the embedded engine")
    for flag in ("return_logprob", "stream", "return_text_in_logprobs"):
        if not isinstance(body.get(flag, False), bool):
            raise ValueError(f"{flag} must be a boolean, got {body[flag]!r}")
    prompts, is_batch = _prompts(body, state)
    for i, ids in enumerate(prompts):
        where = f"input_ids[{i}]" if is_batch else "input_ids"
        _check_prompt(ids, where, scheduler.vocab_size, scheduler.context_length)
    cfg = state.config
    cap = cfg.max_new_tokens_cap or scheduler.context_length
    raw_params = _per_item(body.get("sampling_params"), len(prompts), "sampling_params")
    default_new = min(DEFAULT_MAX_NEW_TOKENS, cap)
    params = [
        parse_sampling_params(p, vocab_size=scheduler.vocab_size, default_max_new_tokens=default_new)
        for p in raw_params
    ]
    n = params[0].n
    if any(p.n != n for p in params):
        raise ValueError("every batch item must use the same sampling_params.n")
    for p in params:
        if p.max_new_tokens > cap:
            raise ValueError(
                f"sampling_params.max_new_tokens={p.max_new_tokens} exceeds this engine's cap of {cap} "
                "(--max-new-tokens-cap; default: the context length)"
            )
    if n > cfg.max_batch:
        raise ValueError(f"sampling_params.n={n} exceeds --max-batch={cfg.max_batch}")
    most = SAMPLES_PER_CALL_PER_BATCH_SLOT * cfg.max_batch
    if len(prompts) * n > most:
        raise ValueError(f"{len(prompts) * n} samples in one call; at most {most} (16 x --max-batch)")
    is_batch = is_batch or n > 1
    if n > 1:  # prompt-major expansion; every sample gets a fresh rid (as SGLang does)
        prompts = [p for p in prompts for _ in range(n)]
        params = [p for p in params for _ in range(n)]
        rids = [uuid.uuid4().hex for _ in prompts]
    else:
        rids = _rids(body, len(prompts), is_batch)
    busy = [r for r in rids if r in state.inflight]
    if busy:
        raise ValueError(f"Duplicate request ID {busy[0]!r}: a request with this rid is still running")
    stream = bool(body.get("stream", False))
    priority = body.get("priority")
    if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)):
        raise ValueError(f"priority must be an integer, got {priority!r}")
    adapters = state.adapters.resolve(body.get("lora_path"), len(prompts) // n)
    adapters = [a for a in adapters for _ in range(n)]
    starts = logprob_starts(body, prompts, n)
    tracked = []
    for i, (rid, ids, sampling) in enumerate(zip(rids, prompts, params, strict=True)):
        item = state.track(rid, list(ids), sampling, stream=stream, lora_name=adapters[i])
        item.request.logprob_start_len = starts[i]
        item.return_logprob = bool(body.get("return_logprob", False))
        item.text_in_logprobs = bool(body.get("return_text_in_logprobs", False))
        item.index = i if (is_batch and stream) else None
        item.request.priority = priority if priority is not None else 0
        tracked.append(item)
    return tracked, is_batch


async def generate(request: web.Request) -> web.StreamResponse:
    state = _state(request)
    try:
        body = await _json_body(request, required=True)
        tracked, is_batch = _build_requests(body, state)
    except ValueError as exc:
        return _bad(exc)
    scheduler = state.require_scheduler()
    scheduler.submit([t.request for t in tracked])
    if body.get("stream", False):
        return await _stream(request, state, tracked)
    try:
        connected = await _wait_while_connected(request, [t.done for t in tracked])
    except asyncio.CancelledError:
        connected = False
    if not connected:  # free the batch slots at once; nobody will read the answer
        for t in tracked:
            scheduler.abort(t.request.rid, "client disconnected")
        raise web.HTTPBadRequest(text="client disconnected")
    objects = [state.response_object(t) for t in tracked]
    return _json(objects if is_batch else objects[0])


async def _wait_while_connected(request: web.Request, futures: list[asyncio.Future[None]]) -> bool:
    """Wait for every future; False as soon as the client's connection is gone (checked every
    DISCONNECT_POLL_S; aiohttp does not cancel handlers on disconnect)."""
    everything = asyncio.gather(*futures)
    while True:
        done, _ = await asyncio.wait({everything}, timeout=DISCONNECT_POLL_S)
        if done:
            return True
        transport = request.transport
        if transport is None or transport.is_closing():
            return False


async def _stream(request: web.Request, state: EngineState, tracked: list[_Tracked]) -> web.StreamResponse:
    """Cumulative SSE chunks, interleaved across batch items, then `data: [DONE]`."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    scheduler = state.require_scheduler()
    pending: dict[asyncio.Future[int], _Tracked] = {}

    def wait_next(item: _Tracked) -> None:
        assert item.updates is not None
        pending[asyncio.ensure_future(item.updates.get())] = item

    for item in tracked:
        wait_next(item)
    try:
        while pending:
            ready, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in ready:
                item = pending.pop(future)
                assert item.updates is not None
                count = future.result()
                while not item.updates.empty():  # coalesce a backlog into its latest snapshot
                    count = item.updates.get_nowait()
                finished = item.done.done()
                obj = state.response_object(item, None if finished else count)
                await response.write(f"data: {_dumps(obj)}\n\n".encode())
                if not finished:
                    wait_next(item)
        await response.write(b"data: [DONE]\n\n")
    except (ConnectionResetError, asyncio.CancelledError):
        for item in tracked:
            scheduler.abort(item.request.rid, "client disconnected")
        raise
    finally:
        for future in pending:
            future.cancel()
    return response


# ---- control --------------------------------------------------------------------------------------


def inside_any(path: str, roots: list[Path]) -> bool:
    """True when `path`, with its symbolic links resolved, is one of `roots` or below one."""
    resolved = Path(path).resolve()
    return any(resolved == root or resolved.is_relative_to(root) for root in roots)


async def update_weights_from_disk(request: web.Request) -> web.Response:
    state = _state(request)
    scheduler = state.require_scheduler()

    def failure(message: str) -> web.Response:
        return _json({"success": False, "message": message, "num_paused_requests": 0}, status=400)

    try:
        body = await _json_body(request, required=True)
    except ValueError as exc:
        return failure(str(exc))
    path = body.get("model_path")
    version = body.get("weight_version")
    if not isinstance(path, str) or not path or "\0" in path:
        return failure("model_path must be a non-empty string")
    if version is not None and not isinstance(version, (str, int)):
        return failure(f"weight_version must be a string, got {version!r}")
    if not isinstance(body.get("abort_all_requests", False), bool):
        return failure("abort_all_requests must be a boolean")
    roots = await asyncio.to_thread(state.config.weights_roots)
    if not await asyncio.to_thread(inside_any, path, roots):
        log.warning("refused update_weights_from_disk outside the allowed directories: %s", path)
        return failure(
            f"model_path {path!r} is outside the directories this engine may load weights from "
            f"({', '.join(map(str, roots))}; --allowed-weights-dir)"
        )
    if state.adapters.loaded:
        return failure(
            "cannot update the base weights while LoRA adapters are loaded "
            f"({sorted(state.adapters.loaded)}); unload them first"
        )
    async with state.update_lock:
        loop = asyncio.get_running_loop()
        cfg = state.config
        if cfg.fault_stale_weights:
            # Fault injection: acknowledge and relabel, keep the old weights (the served-policy check's test).
            log.warning("fault injection: update to %s acknowledged but not loaded", path)
            model = scheduler.model
        else:
            try:
                model = await loop.run_in_executor(state.loader, load_model, path, cfg.device, cfg.dtype)
            except Exception as exc:
                return failure(f"Failed to load weights from {path}: {type(exc).__name__}: {exc}")
        try:
            paused = await asyncio.wrap_future(
                scheduler.swap_weights(
                    model,
                    None if version is None else str(version),
                    bool(body.get("abort_all_requests", False)),
                )
            )
        except ValueError as exc:
            return failure(str(exc))
        state.model_path = path
    return _json(
        {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": paused}
    )


async def load_lora_adapter(request: web.Request) -> web.Response:
    state = _state(request)
    scheduler = state.require_scheduler()
    try:
        body = await _json_body(request, required=True)
    except ValueError as exc:
        return _json(lora_reply(False, str(exc), state.adapters.paths), status=400)
    status, reply = await state.adapters.load(
        body.get("lora_name"), body.get("lora_path"), scheduler, state.loader, state.config.device
    )
    return _json(reply, status=status)


async def unload_lora_adapter(request: web.Request) -> web.Response:
    state = _state(request)
    scheduler = state.require_scheduler()
    try:
        body = await _json_body(request, required=True)
    except ValueError as exc:
        return _json(lora_reply(False, str(exc), state.adapters.paths), status=400)
    status, reply = await state.adapters.unload(body.get("lora_name"), scheduler)
    return _json(reply, status=status)


async def update_weight_version(request: web.Request) -> web.Response:
    state = _state(request)
    scheduler = state.require_scheduler()
    try:
        body = await _json_body(request, required=True)
    except ValueError as exc:
        return _json({"success": False, "message": str(exc)}, status=400)
    new_version = body.get("new_version")
    if not isinstance(new_version, (str, int)):
        return _json({"success": False, "message": "new_version must be a string"}, status=400)
    async with state.update_lock:
        await asyncio.wrap_future(
            scheduler.swap_weights(
                scheduler.model, str(new_version), bool(body.get("abort_all_requests", True))
            )
        )
    return _json({"success": True, "message": "Weight version updated.", "new_version": str(new_version)})


async def pause_generation(request: web.Request) -> web.Response:
    state = _state(request)
    try:
        body = await _json_body(request, required=False)
    except ValueError as exc:
        return _bad(exc)
    mode = body.get("mode", "abort")
    if mode not in PAUSE_MODES:
        return _error(f"mode must be one of {list(PAUSE_MODES)}, got {mode!r}")
    await asyncio.wrap_future(state.require_scheduler().pause(mode))
    return _json({"message": "Generation paused successfully.", "status": "ok"})


async def continue_generation(request: web.Request) -> web.Response:
    state = _state(request)
    try:
        await _json_body(request, required=False)
    except ValueError as exc:
        return _bad(exc)
    await asyncio.wrap_future(state.require_scheduler().resume())
    return _json({"message": "Generation continued successfully.", "status": "ok"})


async def abort_request(request: web.Request) -> web.Response:
    state = _state(request)
    try:
        body = await _json_body(request, required=True)
    except ValueError as exc:
        return _bad(exc)
    scheduler = state.require_scheduler()
    if not isinstance(body.get("abort_all", False), bool):
        return _error("abort_all must be a boolean")
    if body.get("abort_all", False) is True:
        scheduler.abort(None, "Aborted by /abort_request (abort_all)")
    elif isinstance(body.get("rid"), str):
        scheduler.abort(body["rid"])
    else:
        return _error("abort_request needs 'rid' (a string) or 'abort_all': true")
    return web.Response(status=200)


async def flush_cache(request: web.Request) -> web.Response:
    idle = await asyncio.wrap_future(_state(request).require_scheduler().flush_cache())
    return web.Response(text=FLUSH_MESSAGE, status=200 if idle else 400, content_type="text/plain")


# ---- health, info, metrics ----------------------------------------------------------------------------


async def health(request: web.Request) -> web.Response:
    state = _state(request)
    healthy = state.ready and state.scheduler is not None and state.scheduler.alive
    return web.Response(status=200 if healthy else 503)


async def health_generate(request: web.Request) -> web.Response:
    state = _state(request)
    if not state.ready:
        return web.Response(status=503)
    try:
        await asyncio.wait_for(state.generate_internal("HEALTH_CHECK", 1), HEALTH_GENERATE_TIMEOUT_S)
    except TimeoutError:
        return web.Response(status=503)
    return web.Response(status=200)


async def model_info(request: web.Request) -> web.Response:
    state = _state(request)
    scheduler = state.require_scheduler()
    config = scheduler.model.config
    return _json(
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
    state = _state(request)
    cfg = state.config
    scheduler = state.require_scheduler()
    return _json(
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
            "dtype": cfg.dtype,
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


async def get_weight_version(request: web.Request) -> web.Response:
    return _json({"weight_version": _state(request).require_scheduler().weight_version})


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=_state(request).metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})


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
        add_fetch_route(app, Path(config.weights_dir))
    return app


@dataclass
class RunningServer:
    """A started server (see `start_server`): `port` is the bound port (useful with port 0)."""

    app: web.Application
    runner: web.AppRunner
    port: int

    @property
    def state(self) -> EngineState:
        return self.app[STATE]

    @property
    def url(self) -> str:
        return f"http://{self.state.config.host}:{self.port}"

    async def close(self) -> None:
        await self.state.stop()
        await self.runner.cleanup()


async def start_server(config: ServerConfig) -> RunningServer:
    """Bind the HTTP port (so /health answers 503 at once), then load and warm the model. Raises
    ExposedWithoutKey for a non-loopback host without an API key (before binding anything)."""
    require_key_off_loopback("the engine", config.host, config.api_key, f"--api-key or {API_KEY_ENV}")
    app = build_app(config)
    runner = web.AppRunner(app, access_log=None, **runner_options(config.limits))
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    port = int(runner.addresses[0][1]) if runner.addresses else config.port
    log.info("%s", bind_notice("engine", config.host, port, config.api_key, OPEN_PATHS))
    running = RunningServer(app=app, runner=runner, port=port)
    try:
        await running.state.start()
    except BaseException:
        await running.close()
        raise
    return running


def parse_args(argv: list[str]) -> ServerConfig:
    p = argparse.ArgumentParser(prog="rollwise engine serve", description=__doc__.splitlines()[0])
    p.add_argument("--model", "--model-path", required=True, help="HF model directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000, help="0 picks a free port (logged)")
    p.add_argument("--weight-version", default="default", help="initial meta_info.weight_version")
    p.add_argument("--max-batch", type=int, default=64, help="most requests decoded together")
    p.add_argument("--batch-wait-ms", type=float, default=3.0, help="collect requests this long when idle")
    p.add_argument("--context-length", type=int, help="default: config.max_position_embeddings")
    p.add_argument("--enable-metrics", action="store_true", help="serve Prometheus /metrics")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    p.add_argument("--dtype", default="float32", choices=sorted(_DTYPES))
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--seed", type=int, help="seed of unseeded requests' generators")
    p.add_argument("--served-model-name", help="model_name label of the metrics")
    p.add_argument(
        "--api-key",
        help=f"require Authorization: Bearer <key> on every route but /health (default: ${API_KEY_ENV}); "
        "needed to bind anything but loopback",
    )
    p.add_argument("--max-prefill-tokens", type=int, default=16384, help="padded tokens per prefill batch")
    p.add_argument(
        "--weights-dir", help="serve POST /fetch_weights: download published versions over HTTP into it"
    )
    limits = DoorLimits()
    p.add_argument("--max-body-bytes", type=int, default=limits.max_body_bytes, help="larger bodies: 413")
    p.add_argument("--body-timeout-s", type=float, default=limits.body_timeout_s, help="slower bodies: 408")
    p.add_argument(
        "--idle-timeout-s", type=float, default=limits.idle_timeout_s, help="close connections idle this long"
    )
    p.add_argument("--max-new-tokens-cap", type=int, help="largest max_new_tokens (default: context length)")
    p.add_argument(
        "--allowed-weights-dir",
        action="append",
        default=[],
        help="a directory /update_weights_from_disk may load from (repeatable; default: the one holding "
        "--model)",
    )
    p.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (SGLang's flag)")
    p.add_argument("--max-lora-rank", type=int, help="largest adapter rank accepted")
    p.add_argument("--lora-target-modules", nargs="+", help="module names adapters may target")
    p.add_argument(
        "--lora-paths", nargs="+", default=[], metavar="NAME=PATH", help="adapters loaded at start"
    )
    p.add_argument(
        "--fault-stale-weights",
        action="store_true",
        help="TESTS ONLY: acknowledge weight updates and adapter loads but keep serving the start weights",
    )
    a = p.parse_args(argv)
    if a.max_batch < 1:
        p.error("--max-batch must be >= 1")
    if a.max_body_bytes < 1024 or a.body_timeout_s <= 0 or a.idle_timeout_s <= 0:
        p.error("--max-body-bytes must be >= 1024, --body-timeout-s and --idle-timeout-s > 0")
    lora_paths = []
    for item in a.lora_paths:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            p.error(f"--lora-paths takes NAME=PATH items, got {item!r}")
        lora_paths.append((name, path))
    if (lora_paths or a.max_lora_rank or a.lora_target_modules) and not a.enable_lora:
        a.enable_lora = True  # SGLang turns LoRA on when adapters are given at launch
    return ServerConfig(
        model=a.model,
        host=a.host,
        port=a.port,
        weight_version=a.weight_version,
        max_batch=a.max_batch,
        batch_wait_ms=a.batch_wait_ms,
        context_length=a.context_length,
        enable_metrics=a.enable_metrics,
        device=a.device,
        dtype=a.dtype,
        threads=a.threads,
        seed=a.seed,
        served_model_name=a.served_model_name,
        api_key=a.api_key or os.environ.get(API_KEY_ENV) or None,
        max_prefill_tokens=a.max_prefill_tokens,
        weights_dir=a.weights_dir,
        limits=DoorLimits(a.max_body_bytes, a.body_timeout_s, a.idle_timeout_s),
        max_new_tokens_cap=a.max_new_tokens_cap,
        allowed_weights_dirs=tuple(a.allowed_weights_dir),
        enable_lora=a.enable_lora,
        max_lora_rank=a.max_lora_rank,
        lora_target_modules=tuple(a.lora_target_modules) if a.lora_target_modules else None,
        lora_paths=tuple(lora_paths),
        fault_stale_weights=a.fault_stale_weights,
    )


async def serve(config: ServerConfig) -> int:
    """Run until SIGINT/SIGTERM. Returns the process exit code (1 if the model could not be loaded)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = (signal.SIGINT, signal.SIGTERM)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    started = time.monotonic()
    try:
        try:
            running = await start_server(config)
        except ExposedWithoutKey as exc:
            log.error("%s", exc)
            return 2
        except Exception:
            log.exception("engine failed to start with model %s", config.model)
            return 1
        log.info("serving %s on %s (ready in %.1f s)", config.model, running.url, time.monotonic() - started)
        print(f"rollwise engine listening on {running.url}", flush=True)
        try:
            await stop.wait()
        finally:
            await running.close()
        return 0
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)


def main(argv: list[str]) -> int:
    """`rollwise engine serve ...` entry point."""
    config = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if config.threads:
        torch.set_num_threads(config.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one bar per weight update would flood the engine's log
    return asyncio.run(serve(config))


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
