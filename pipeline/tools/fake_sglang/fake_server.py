"""A fake SGLang 0.5.23 server: the native HTTP API as the real one answers it, failures and crashes
included (rollwise's contract with SGLang, docs/architecture.md "Contract 2"). Only the outer edge is
faked: rollwise's real client talks to it over real HTTP on 127.0.0.1.

    fake = FakeSGLang()
    base_url = await fake.start()
    ...
    await fake.stop()

The server model (each rule cites SGLang's source in pipeline.tools.fake_sglang.sglang_rules or here):
- The tokenizer side: a paused server (any pause mode) and a weight update holding its writer lock keep
  new /generate calls waiting before they are registered (managers/tokenizer_manager.py:
  `is_pause_cond.wait_for`, `model_update_lock`). Body problems answer at once.
- The scheduler: at most `max_running_requests` run; the rest wait in the queue. Pause `in_place`
  freezes the running batch with its KV; `retract` moves it back to the queue keeping its tokens, and
  it is re-prefilled after /continue_generation; `abort` does not pause the scheduler: it aborts every
  request and returns once they are gone (managers/scheduler.py, tokenizer_manager.pause_generation).
- A flushing weight update while requests are queued or running kills the server (FLUSH_CRASH); so does
  an input id outside the vocabulary. A crashed fake closes every connection and its port; `restart()`
  brings it back on the same port serving the weights it was launched with, as a restarted process.
- Routed experts (MoE): with `routed_experts=(layers, topk, num_experts)` the fake is a server launched
  with `--enable-return-routed-experts` on such a model, and a request with `return_routed_experts` gets
  `meta_info.routed_experts` (sglang_rules, `encode_routed_experts`; the ids from
  generation_plans.routed_experts); without it (the default) such a request gets no key, as SGLang.
- Per-token policy versions: none by default (SGLang 0.5.23 reports one `weight_version` per request);
  `reports_weight_spans` adds the newer `meta_info.weight_versions` spans, `report_token_versions` the
  embedded engine's `output_token_weight_versions`.

Generation: each request gets a *plan* (output ids, log-probs, finish) from `script`, or by default a
deterministic pseudo-random completion seeded by the prompt; tokens are emitted one at a time (or in
`latency` chunks) so that pause, abort and weight updates act between them. `faults` (one per
/generate call) or `fault_hook` corrupt a response on purpose; `fail_next(path, ...)` makes a route
answer HTTP errors. Stop strings (`sampling_params.stop`) end a request after the token that completes
one, as SGLang's check_finished does (sglang_rules "stop strings"), decoding with `tokenizer` when given
(else the fake's own text, "<id>" per token). Every request is recorded in `requests`; `update_calls`
keeps the weight-update bodies, `ignored_fields` the fields SGLang would ignore (a test holds the client
to none).

Weights: the fake serves an identity (its model path, or with `lora_path` the named adapter's path);
`prompt_logprobs(identity, ids)` is the teacher-forced log-prob of each token, plus `logprob_noise`
nats of numerical floor. `ignore_updates=True` acknowledges weight updates (the weight_version moves)
and adapter loads but keeps serving the start weights: the stale engine of the served-policy check.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from pipeline.tools.fake_sglang.generation_plans import (
    GenerateCall,
    LatencyModel,
    Plan,
    Script,
    default_plan,
    prompt_logprobs,
    routed_experts,
)
from pipeline.tools.fake_sglang.sglang_rules import (
    FLUSH_CRASH,
    FLUSH_FAILED,
    FLUSH_OK,
    PAUSE_MODES,
    abort_finish,
    context_problem,
    dumps,
    encode_routed_experts,
    internal_server_error,
    json_response,
    matched_stop_string,
    out_of_vocab,
    parse_json_body,
    request_error,
    routed_experts_problem,
    sampling_problem,
    stop_strings,
    stop_window,
    tokenizer_required_problem,
    trim_matched_stop,
    unknown_fields,
    unknown_sampling_keys,
)

log = logging.getLogger("rollwise.fake_sglang")

FAULTS = (
    "missing_logprobs",
    "null_logprob",
    "nan_logprob",
    "inf_logprob",
    "length_mismatch",
    "id_mismatch",
    "unknown_finish",
    "missing_finish_reason",
    "missing_output_ids",
    "wrong_completion_tokens",
    "wrong_rid",
    "bad_token_versions",
    "not_json",
    "http_500",
    "http_503",
    "drop_connection",
)
VERSION = "0.5.23"


def free_port() -> int:
    """A 127.0.0.1 port nothing listens on (bound, then released): connecting to it is refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RecordedRequest:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return parse_json_body(self.body)


@dataclass
class _Generation:
    """One registered request: SGLang's ReqState (tokenizer) and Req (scheduler) in one."""

    call: GenerateCall
    tokens: list[tuple[int, float, str]] = field(default_factory=list)  # (id, logprob, version)
    running: bool = False  # in the running batch (it left the waiting queue and was not retracted)
    ever_ran: bool = False
    abort: bool = False
    retractions: int = 0

    def aborted(self) -> bool:
        """Set by another coroutine (an abort, a pause): read it fresh, never narrowed."""
        return self.abort


class FakeSGLang:
    """A scriptable SGLang lookalike on 127.0.0.1. All knobs are plain attributes tests may flip."""

    def __init__(
        self,
        *,
        ready: bool = True,
        ready_after_s: float = 0.0,
        weight_version: str = "default",
        model_path: str = "fake/model",
        vocab_size: int = 1000,
        context_length: int = 4096,
        max_running_requests: int = 256,
        eos_token_id: int | None = None,
        script: Script | None = None,
        fault_hook: Callable[[GenerateCall], str | None] | None = None,
        token_delay_s: float = 0.0,
        latency: LatencyModel | None = None,
        update_delay_s: float = 0.0,
        api_key: str | None = None,
        has_model_info_route: bool = True,
        skip_tokenizer_init: bool = False,
        weights_path_ok: Callable[[str], bool] | None = None,
        report_token_versions: bool = False,
        reports_weight_spans: bool = False,
        logprob_noise: float = 0.0,
        enable_metrics: bool = False,
        enable_lora: bool = False,
        ignore_updates: bool = False,
        tokenizer: Any = None,
        routed_experts: tuple[int, int, int] | None = None,
    ) -> None:
        self.ready = ready
        self.ready_after_s = ready_after_s
        self.launch_weight_version = weight_version
        self.launch_model_path = model_path
        self.weight_version = weight_version
        self.model_path = model_path
        self.vocab_size = vocab_size
        self.context_length = context_length
        self.max_running_requests = max_running_requests
        self.eos_token_id = eos_token_id
        self.script = script
        self.fault_hook = fault_hook
        self.faults: collections.deque[str] = collections.deque()
        self._route_failures: dict[str, collections.deque[int | tuple[int, object]]] = {}
        self.token_delay_s = token_delay_s
        self.latency = latency
        self.update_delay_s = update_delay_s
        self.api_key = api_key
        self.has_model_info_route = has_model_info_route  # False: an older SGLang (/get_model_info only)
        self.skip_tokenizer_init = skip_tokenizer_init  # True: no `text` in replies, no stop strings
        # What the fake detokenizes with (`text`, stop strings): a tokenizer with `decode`/`encode`, or
        # None for its own text, "<id>" per token.
        self.tokenizer = tokenizer
        # Which model_path values /update_weights_from_disk (and /load_lora_adapter) can load: the disk,
        # as the real server reads it; a test may pass another rule.
        self.weights_path_ok = weights_path_ok or os.path.exists
        self.report_token_versions = report_token_versions
        self.reports_weight_spans = reports_weight_spans
        self.logprob_noise = logprob_noise
        self.enable_metrics = enable_metrics
        self.enable_lora = enable_lora
        self.ignore_updates = ignore_updates
        self.routed_experts = routed_experts  # (layers, topk, num_experts): --enable-return-routed-experts
        self.served_weights = model_path  # the identity prompt log-probs are computed for
        self.adapters: dict[str, str] = {}  # loaded LoRA adapters: name -> path
        self.adapter_identity: dict[str, str] = {}  # name -> identity its requests are served with
        self.lora_calls: list[tuple[str, dict[str, Any]]] = []
        self.requests: list[RecordedRequest] = []
        self.update_calls: list[dict[str, Any]] = []
        self.ignored_fields: list[tuple[str, str]] = []  # (path, field) SGLang would ignore
        self.weight_groups: set[str] = set()  # NCCL groups joined via /init_weights_update_group
        self.crashed: str | None = None  # why the server died (None: alive)
        self.crashes = 0
        self.leaked_rids: set[str] = set()  # requests whose state a 500 left behind
        self.peak_running = 0
        self.busy_s = 0.0  # wall time with at least one request registered (`busy_seconds()`)
        self._busy_from: float | None = None
        # Server state (reset by a restart).
        self.pause_mode: str | None = None  # tokenizer side: new requests wait while set
        self._engine_paused: str | None = None  # scheduler side: in_place or retract
        self._updating = False  # a weight update holds the writer lock
        self._generations: dict[str, _Generation] = {}
        self._changed = asyncio.Condition()
        self._seen_sequences: collections.deque[list[int]] = collections.deque(maxlen=64)
        self._open: dict[int, web.Request] = {}  # in-flight HTTP requests, by id()
        self._dying: set[asyncio.Task[None]] = set()  # a crash's notify and shutdown
        self._started_at = 0.0
        self._runner: web.AppRunner | None = None
        self.port = 0

    # ------------------------------------------------------------------ lifecycle
    def make_app(self) -> web.Application:
        app = web.Application(middlewares=[self._record, self._auth])
        app.router.add_route("POST", "/generate", self._generate)
        app.router.add_route("PUT", "/generate", self._generate)
        app.router.add_get("/health", self._health)
        app.router.add_get("/health_generate", self._health)
        app.router.add_get("/get_model_info", self._model_info)
        if self.has_model_info_route:
            app.router.add_get("/model_info", self._model_info)
        for path in ("/server_info", "/get_server_info"):
            app.router.add_get(path, self._server_info)
        app.router.add_get("/get_load", self._get_load)
        for path in ("/get_weight_version", "/weight_version"):
            app.router.add_get(path, self._weight_version_gone)
        app.router.add_post("/update_weights_from_disk", self._update_weights_from_disk)
        app.router.add_post("/load_lora_adapter", self._load_lora_adapter)
        app.router.add_post("/unload_lora_adapter", self._unload_lora_adapter)
        app.router.add_post("/pause_generation", self._pause)
        app.router.add_post("/continue_generation", self._continue)
        app.router.add_post("/abort_request", self._abort_request)
        app.router.add_route("GET", "/flush_cache", self._flush_cache)
        app.router.add_route("POST", "/flush_cache", self._flush_cache)
        if self.enable_metrics:  # http_server.py adds the Prometheus route only with --enable-metrics
            app.router.add_get("/metrics", self._metrics)
        # SGLang's NCCL weight path (the GPU option): request shapes only, no tensors move here.
        app.router.add_post("/init_weights_update_group", self._init_weights_update_group)
        app.router.add_post("/update_weights_from_distributed", self._update_weights_from_distributed)
        app.router.add_post("/destroy_weights_update_group", self._destroy_weights_update_group)
        return app

    async def start(self, port: int = 0) -> str:
        """Serve on 127.0.0.1:`port` (0 = any free port). Returns the base URL."""
        self._runner = web.AppRunner(
            self.make_app(), handle_signals=False, access_log=None, shutdown_timeout=1.0
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port or self.port, reuse_address=True)
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        self._started_at = time.monotonic()
        return self.base_url

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        """Abort whatever still runs (its client may be gone) so the shutdown does not wait for it."""
        await self._set_paused(None, None)
        await self._abort_all()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def restart(self) -> str:
        """A new server process on the same port: the weights and version it was launched with, nothing
        loaded, nothing cached, nothing running (what a server restarted after a crash serves)."""
        await self.stop()
        self.crashed = None
        self.weight_version = self.launch_weight_version
        self.model_path = self.served_weights = self.launch_model_path
        self.adapters.clear()
        self.adapter_identity.clear()
        self.leaked_rids.clear()
        for rid in list(self._generations):
            self._unregister(rid)
        self._seen_sequences.clear()
        self._updating = False
        return await self.start(self.port)

    def crash(self, reason: str) -> None:
        """The process dies: every open connection is cut and the port closes (requests get no reply)."""
        if self.crashed is not None:
            return
        log.error("fake SGLang on port %d died: %s", self.port, reason)
        self.crashed = reason
        self.crashes += 1
        for request in list(self._open.values()):
            if request.transport is not None:
                request.transport.close()
        for generation in self._generations.values():
            generation.abort = True
        loop = asyncio.get_running_loop()
        tasks = [loop.create_task(self._notify())]
        runner, self._runner = self._runner, None
        if runner is not None:
            tasks.append(loop.create_task(runner.cleanup()))
        for task in tasks:
            self._dying.add(task)
            task.add_done_callback(self._dying.discard)

    # ------------------------------------------------------------------ helpers for tests
    def queue_faults(self, *faults: str) -> None:
        """The next /generate calls (one fault each, in order) get these corruptions."""
        for fault in faults:
            if fault not in FAULTS:
                raise ValueError(f"unknown fault {fault!r}; known: {FAULTS}")
            self.faults.append(fault)

    def fail_next(self, path: str, *replies: int | tuple[int, object]) -> None:
        """The next calls to `path` (any route) get these replies, one each, in order: a status (with an
        SGLang error body) or a (status, JSON body) pair."""
        self._route_failures.setdefault(path, collections.deque()).extend(replies)

    def generate_requests(self) -> list[dict[str, Any]]:
        return [r.json() for r in self.requests if r.path == "/generate"]

    def count(self, path: str) -> int:
        return sum(1 for r in self.requests if r.path == path)

    @property
    def running_rids(self) -> list[str]:
        return list(self._generations)

    async def wait_running(self, n: int = 1, timeout_s: float = 5.0) -> None:
        """Wait until at least `n` generations are registered (running or waiting in the queue)."""
        deadline = time.monotonic() + timeout_s
        while len(self._generations) < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {len(self._generations)} of {n} requests registered")
            await asyncio.sleep(0.005)

    async def wait_idle(self, timeout_s: float = 5.0) -> bool:
        """Wait until no generation is registered; False if some still are after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while self._generations:
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.005)
        return True

    # ------------------------------------------------------------------ middlewares
    @web.middleware
    async def _record(self, request: web.Request, handler: Any) -> web.StreamResponse:
        body = await request.read()
        self.requests.append(RecordedRequest(request.method, request.path, dict(request.headers), body))
        queued = self._route_failures.get(request.path)
        if queued:
            reply = queued.popleft()
            if isinstance(reply, tuple):
                return json_response(reply[1], reply[0])
            return request_error(f"injected HTTP {reply}", reply)
        self._open[id(request)] = request
        try:
            response: web.StreamResponse = await handler(request)
        finally:
            self._open.pop(id(request), None)
        return response

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if self.api_key is not None and request.headers.get("Authorization") != f"Bearer {self.api_key}":
            return json_response({"error": "Unauthorized"}, 401)
        response: web.StreamResponse = await handler(request)
        return response

    async def _body(self, request: web.Request) -> dict[str, Any] | web.Response:
        """The JSON object body (an empty body is {}), or the 400 FastAPI's validation answers."""
        raw = await request.read()
        try:
            body = parse_json_body(raw) if raw.strip() else {}
        except ValueError as exc:
            return request_error(f"JSON decode error: {exc}")
        if not isinstance(body, dict):
            return request_error("Input should be a valid dictionary or object")
        for name in unknown_fields(request.path, body):
            self.ignored_fields.append((request.path, name))
        return body

    # ------------------------------------------------------------------ /generate
    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        async with self._changed:  # tokenizer_manager: wait while paused or while weights load
            await self._changed.wait_for(
                lambda: (self.pause_mode is None and not self._updating) or self.crashed is not None
            )
        if self.crashed is not None:
            return web.Response(status=500)  # never delivered: the connection is gone
        unknown = unknown_sampling_keys(body)
        if unknown:
            rid = body.get("rid")
            if isinstance(rid, str):
                self.leaked_rids.add(rid)
            return internal_server_error()
        parsed = self._expand(body)
        if isinstance(parsed, str):
            return request_error(parsed)
        calls, is_batch = parsed
        for call in calls:
            bad = out_of_vocab(call.input_ids, self.vocab_size)
            if bad is not None:
                self.crash(f"input id {bad} outside the vocabulary of {self.vocab_size}: index out of range")
                return web.Response(status=500)  # never delivered: the connection is gone
        identities = self._identities(body.get("lora_path"), len(calls))
        if isinstance(identities, str):
            return request_error(identities)
        for call, identity in zip(calls, identities, strict=True):
            call.identity = identity
        fault = self.faults.popleft() if self.faults else None
        if fault is None and self.fault_hook is not None and calls:
            fault = self.fault_hook(calls[0])
        if fault in ("http_500", "http_503"):
            return request_error(f"injected HTTP {fault[-3:]}", int(fault[-3:]))
        if fault == "drop_connection":
            assert request.transport is not None
            request.transport.close()
            return web.Response(status=200)
        want_logprobs = bool(body.get("return_logprob", False))
        generations = [self._register(call) for call in calls]
        if body.get("stream"):
            return await self._stream(request, generations, want_logprobs, is_batch)
        objs = await asyncio.gather(*(self._run_one(g, want_logprobs) for g in generations))
        if fault == "not_json":
            return web.Response(text="<html>502 Bad Gateway</html>", content_type="application/json")
        if fault is not None:
            _corrupt(objs[0], fault)
        payload: object = objs if is_batch else objs[0]
        return json_response(payload)

    def _expand(self, body: dict[str, Any]) -> tuple[list[GenerateCall], bool] | str:
        """One GenerateCall per sample in SGLang's prompt-major order, or the 400 message
        (io_struct.GenerateReqInput.normalize, SamplingParams.verify, _validate_one_request)."""
        if ("input_ids" in body) == ("text" in body):
            return "Either text, input_ids or input_embeds should be provided."
        if "text" in body:
            return "The fake SGLang server only accepts input_ids (run with --skip-tokenizer-init)."
        input_ids = body["input_ids"]
        if not isinstance(input_ids, list) or not input_ids:
            return "input_ids cannot be empty."
        start = body.get("logprob_start_len")
        is_batch = isinstance(input_ids[0], list)
        prompts: list[list[int]] = input_ids if is_batch else [input_ids]
        if any(not p for p in prompts):
            return "input_ids cannot be empty."
        raw_sp = body.get("sampling_params") or {}
        sps: list[dict[str, Any]] = raw_sp if isinstance(raw_sp, list) else [raw_sp] * len(prompts)
        if len(sps) != len(prompts):
            return "The number of sampling_params must match the batch size."
        for prompt, sp in zip(prompts, sps, strict=True):
            problem = sampling_problem(sp) or context_problem(
                len(prompt), int(sp.get("max_new_tokens", 128)), self.context_length
            )
            if problem is None and self.skip_tokenizer_init and stop_strings(sp):
                problem = tokenizer_required_problem(stop_strings(sp))
            if problem is not None:
                return problem
        ns = {int(sp.get("n", 1)) for sp in sps}
        if len(ns) != 1:
            return "The n parameter must be the same for all requests in a batch."
        n = ns.pop()
        rid = body.get("rid")
        if n > 1 or rid is None:
            rids = [uuid.uuid4().hex for _ in range(len(prompts) * n)]
        elif not is_batch:
            rids = [str(rid)]
        elif isinstance(rid, list):
            if len(rid) != len(prompts):
                return "The rid should be a list with the same length as the batch."
            if len(set(rid)) != len(rid):
                return f"Duplicate request IDs detected within the request: {rid}"
            rids = [str(r) for r in rid]
        else:
            rids = [f"{rid}_{i}" for i in range(len(prompts))]
        if start is not None and (not isinstance(start, int) or start < -1):
            return f"logprob_start_len must be an int >= -1, got {start!r}"
        for prompt in prompts:
            if start is not None and start >= len(prompt):
                return (
                    f"logprob_start_len, ({start}) is higher than the number of input tokens "
                    f"({len(prompt)}). Request with a lower logprob_start_len."
                )
        routed_problem = routed_experts_problem(body, [len(p) for p in prompts])
        if routed_problem is not None:
            return routed_problem
        routed_start = body.get("routed_experts_start_len", 0) if body.get("return_routed_experts") else None
        calls = [
            GenerateCall(
                list(prompts[i]),
                dict(sps[i]),
                rids[i * n + j],
                j,
                start if start is not None else -1,
                routed_experts_start_len=routed_start,
            )
            for i in range(len(prompts))
            for j in range(n)
        ]
        for call in calls:  # tokenizer_manager._init_req_state
            if call.rid in self._generations or call.rid in self.leaked_rids:
                return f"Duplicate request ID detected: {call.rid}"
        return calls, is_batch or n > 1

    def _register(self, call: GenerateCall) -> _Generation:
        generation = _Generation(call)
        if not self._generations:
            self._busy_from = time.monotonic()
        self._generations[call.rid] = generation
        return generation

    def _unregister(self, rid: str) -> None:
        self._generations.pop(rid, None)
        if not self._generations and self._busy_from is not None:
            self.busy_s += time.monotonic() - self._busy_from
            self._busy_from = None

    def busy_seconds(self) -> float:
        """Wall time so far with at least one request in the server (queued or running); the rest of
        the time the engine idles."""
        open_s = time.monotonic() - self._busy_from if self._busy_from is not None else 0.0
        return self.busy_s + open_s

    def _plan(self, call: GenerateCall) -> Plan:
        if self.script is not None:
            return self.script(call)
        return default_plan(
            call.input_ids,
            call.sampling_params,
            vocab_size=self.vocab_size,
            eos_token_id=self.eos_token_id,
            salt=call.sample_index,
        )

    def _cached_tokens(self, input_ids: list[int]) -> int:
        """Longest prefix of `input_ids` seen before (a radix-cache hit), by binary search on slices."""
        best = 0
        for seq in self._seen_sequences:
            lo, hi = best, min(len(seq), len(input_ids))
            if seq[:lo] != input_ids[:lo]:
                continue
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if seq[:mid] == input_ids[:mid]:
                    lo = mid
                else:
                    hi = mid - 1
            best = lo
        # The last prompt token is always recomputed to produce the first output logits.
        return min(best, len(input_ids) - 1)

    def _may_run(self, generation: _Generation) -> bool:
        if generation.abort:
            return True
        if self._engine_paused is not None:
            return False
        running = sum(1 for g in self._generations.values() if g.running)
        return running < self.max_running_requests

    async def _admit(self, generation: _Generation) -> None:
        """Wait in the queue until the scheduler takes the request into its running batch."""
        async with self._changed:
            await self._changed.wait_for(lambda: self._may_run(generation))
            if not generation.abort:
                generation.running = generation.ever_ran = True
                self.peak_running = max(self.peak_running, sum(g.running for g in self._generations.values()))

    async def _emit(self, generation: _Generation) -> AsyncIterator[dict[str, Any] | None]:
        """Run the request; yields after each token (None) and finally its finish_reason."""
        call = generation.call
        try:
            await self._admit(generation)
            if generation.abort:
                yield abort_finish(waiting=True)
                return
            plan = self._plan(call)
            logprobs = plan.logprobs if plan.logprobs is not None else [-0.5] * len(plan.output_ids)
            stops = stop_strings(call.sampling_params)
            window = stop_window(stops, self._encode if self.tokenizer is not None else None)
            max_new = int(call.sampling_params.get("max_new_tokens", 128))
            matched: str | None = None
            if self.latency is not None:
                await asyncio.sleep(self.latency.prefill_s)
            index = 0
            while index < len(plan.output_ids):
                if self._engine_paused == "retract" and not generation.aborted():
                    generation.running = False  # back to the queue, its tokens kept
                    generation.retractions += 1
                    await self._notify()
                    async with self._changed:
                        await self._changed.wait_for(lambda: self._engine_paused is None or generation.abort)
                    if not generation.aborted():
                        await self._admit(generation)
                    if generation.aborted():  # popped from the queue: the waiting-queue abort
                        yield abort_finish(waiting=True)
                        return
                    if self.latency is not None:
                        await asyncio.sleep(self.latency.prefill_s)  # re-prefilled
                elif self._engine_paused == "in_place":
                    # The running batch is frozen; an abort takes effect at its next forward, after
                    # /continue_generation (the scheduler handles only control requests meanwhile).
                    async with self._changed:
                        await self._changed.wait_for(lambda: self._engine_paused is None or self.crashed)
                count = 1
                if self.latency is not None:
                    count = min(self.latency.chunk_tokens, len(plan.output_ids) - index)
                    await asyncio.sleep(count * self.latency.per_token_s)
                elif self.token_delay_s > 0 and not generation.abort:
                    await asyncio.sleep(self.token_delay_s)
                if self.crashed is not None:
                    return
                for _ in range(count):
                    generation.tokens.append((plan.output_ids[index], logprobs[index], self.weight_version))
                    index += 1
                    # check_finished after each token: a plan's last token ends it the plan's way (its
                    # length or stop token comes first in SGLang's order); before it, a stop string may.
                    if stops and index < len(plan.output_ids) and len(generation.tokens) < max_new:
                        ids = [t for t, _, _ in generation.tokens]
                        matched = matched_stop_string(stops, ids, window, self._decode)
                        if matched is not None:
                            break
                if generation.aborted():  # a running request runs one more decode step, then ends
                    yield abort_finish(waiting=False)
                    return
                if matched is not None:
                    yield {"type": "stop", "matched": matched}
                    return
                if index < len(plan.output_ids):
                    yield None
                await asyncio.sleep(0)
            yield self._finish(plan, call)
        finally:
            self._unregister(call.rid)
            generation.running = False
            await self._notify()

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    @staticmethod
    def _finish(plan: Plan, call: GenerateCall) -> dict[str, Any]:
        if plan.finish == "stop":
            matched = plan.matched if plan.matched is not None else plan.output_ids[-1]
            return {"type": "stop", "matched": matched}
        if plan.finish == "length":
            return {"type": "length", "length": int(call.sampling_params.get("max_new_tokens", 128))}
        if plan.finish == "abort":
            return abort_finish(waiting=not plan.output_ids)
        return {"type": plan.finish}

    async def _run_one(self, generation: _Generation, want_logprobs: bool) -> dict[str, Any]:
        started = time.monotonic()
        cached = self._cached_tokens(generation.call.input_ids)
        finish: dict[str, Any] | None = None
        async for fin in self._emit(generation):
            if fin is not None:
                finish = fin
        ids = [t for t, _, _ in generation.tokens]
        self._seen_sequences.append(generation.call.input_ids + ids)
        return self._response(generation, finish, want_logprobs, time.monotonic() - started, cached)

    def _response(
        self,
        generation: _Generation,
        finish: dict[str, Any] | None,
        want_logprobs: bool,
        latency: float | None,
        cached: int,
    ) -> dict[str, Any]:
        """A response object with SGLang's key order (tokenizer_manager._handle_batch_output); `latency`
        None = a not-yet-final stream chunk."""
        call = generation.call
        ids = [t for t, _, _ in generation.tokens]
        waiting_abort = finish is not None and finish.get("type") == "abort" and "status_code" not in finish
        meta: dict[str, Any] = {"id": call.rid, "finish_reason": finish}
        if not waiting_abort:  # _handle_abort_req builds a shorter meta_info for a queued request
            meta["prompt_tokens"] = len(call.input_ids)
        versions = [v for _, _, v in generation.tokens]
        meta["weight_version"] = (
            versions[-1] if versions and self.reports_weight_spans else self.weight_version
        )
        if self.reports_weight_spans:
            meta["weight_versions"] = _spans(versions)
        if not waiting_abort:
            meta["num_retractions"] = generation.retractions
        meta["completion_tokens"] = len(ids)
        if not waiting_abort:
            meta["cached_tokens"] = cached
        if want_logprobs:
            start = call.logprob_start_len
            if start >= 0:  # the default (-1) lists nothing of the prompt (observed: [])
                identity = call.identity or self.served_weights
                values = prompt_logprobs(identity, call.input_ids, noise=self.logprob_noise)[start:]
                listed = call.input_ids[start:]
                meta["input_token_logprobs"] = [[None, listed[0], None]] + [
                    [lp, t, None] for lp, t in zip(values, listed[1:], strict=True)
                ]
            else:
                meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = [[lp, t, None] for t, lp, _ in generation.tokens]
        if self.report_token_versions:
            meta["output_token_weight_versions"] = versions
        shape, routed_start = self.routed_experts, call.routed_experts_start_len
        if shape is not None and routed_start is not None and latency is not None and not waiting_abort:
            layers, topk, experts = shape
            identity = call.identity or self.served_weights
            routes = routed_experts(
                identity, call.input_ids + ids, routed_start, layers=layers, topk=topk, num_experts=experts
            )
            meta["routed_experts"] = encode_routed_experts(routes)
        if latency is not None:
            meta["e2e_latency"] = latency
        obj: dict[str, Any] = {}
        if not self.skip_tokenizer_init:
            no_trim = bool(call.sampling_params.get("no_stop_trim", False))
            obj["text"] = trim_matched_stop(self._decode(ids), finish, no_trim)
        return {**obj, "output_ids": ids, "meta_info": meta}

    def _decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return "".join(f"<{t}>" for t in ids)
        return str(self.tokenizer.decode(ids))

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    async def _stream(
        self, request: web.Request, generations: list[_Generation], want_logprobs: bool, is_batch: bool
    ) -> web.StreamResponse:
        """SSE, cumulative snapshots (SGLang's default non-incremental mode), then `data: [DONE]`."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        lock = asyncio.Lock()

        async def pump(index: int, generation: _Generation) -> None:
            started = time.monotonic()
            cached = self._cached_tokens(generation.call.input_ids)
            async for fin in self._emit(generation):
                latency = time.monotonic() - started if fin is not None else None
                chunk = self._response(generation, fin, want_logprobs, latency, cached)
                if is_batch:
                    chunk["index"] = index
                async with lock:
                    await response.write(f"data: {dumps(chunk)}\n\n".encode())
            self._seen_sequences.append(generation.call.input_ids + [t for t, _, _ in generation.tokens])

        await asyncio.gather(*(pump(i, g) for i, g in enumerate(generations)))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    # ------------------------------------------------------------------ control and info routes
    async def _health(self, request: web.Request) -> web.Response:
        elapsed = time.monotonic() - self._started_at
        if not self.ready or elapsed < self.ready_after_s:
            return web.Response(status=503)
        return web.Response(status=200)

    async def _model_info(self, request: web.Request) -> web.Response:
        info = {
            "model_path": self.model_path,
            "tokenizer_path": self.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.weight_version,
        }
        return json_response(info)

    async def _server_info(self, request: web.Request) -> web.Response:
        """`{**server_args, **scheduler_info, "internal_states": [...], "version"}` (http_server.py);
        internal_states hold server arguments and `effective_max_running_requests_per_dp`, not the
        request counts (those are /get_load's)."""
        args = {
            "model_path": self.launch_model_path,
            "tokenizer_path": self.launch_model_path,
            "host": "127.0.0.1",
            "port": self.port,
            "context_length": self.context_length,
            "max_running_requests": self.max_running_requests,
            "tp_size": 1,
            "dp_size": 1,
            "enable_metrics": self.enable_metrics,
            "enable_lora": self.enable_lora,
            "weight_version": self.launch_weight_version,
        }
        state = {
            **args,
            "world_size": 1,
            "last_gen_throughput": 0.0,
            "memory_usage": {
                "weight": 0.0,
                "kvcache": 0.0,
                "token_capacity": self.context_length,
                "graph": 0,
            },
            "effective_max_running_requests_per_dp": self.max_running_requests,
        }
        return json_response({**args, "internal_states": [state], "version": VERSION})

    async def _get_load(self, request: web.Request) -> web.Response:
        """/get_load (a shim over /v1/loads, entrypoints/v1_loads.py): one entry per DP rank."""
        running = [g for g in self._generations.values() if g.running]
        waiting = len(self._generations) - len(running)
        tokens = sum(len(g.call.input_ids) + len(g.tokens) for g in running)
        entry = {
            "dp_rank": 0,
            "num_reqs": len(running) + waiting,
            "num_waiting_reqs": waiting,
            "num_tokens": tokens,
            "num_pending_tokens": 0,
            "ts_tic": time.time(),
        }
        return json_response([entry])

    async def _weight_version_gone(self, request: web.Request) -> web.Response:
        message = (
            "Endpoint '/get_weight_version' or '/weight_version' is deprecated. Please use '/model_info' "
            "instead."
        )
        return request_error(message, 404)

    async def _abort_all(self, rid: str | None = None) -> int:
        """Mark requests aborted (one rid, or all); they report their output at their next step."""
        count = 0
        for generation in self._generations.values():
            if rid is None or generation.call.rid.startswith(rid):  # scheduler: a prefix match
                generation.abort = True
                count += 1
        await self._notify()
        return count

    async def _set_paused(self, mode: str | None, engine: str | None) -> None:
        self.pause_mode, self._engine_paused = mode, engine
        await self._notify()

    async def _update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        self.update_calls.append(body)
        model_path = body.get("model_path")
        if not isinstance(model_path, str) or not model_path:
            return request_error("model_path: Field required")
        if not self.weights_path_ok(model_path):  # model_runner: the weights iterator cannot be made
            reply = {
                "success": False,
                "message": f"Failed to get weights iterator: {model_path} (repository not found).",
                "num_paused_requests": 0,
            }
            return json_response(reply, 400)
        if body.get("abort_all_requests"):
            await self._abort_all()
        if self.pause_mode is None:  # the writer lock: wait for in-flight requests, hold new ones
            self._updating = True
            await self.wait_idle(timeout_s=math.inf)
        try:
            delay = self.latency.load_s if self.latency is not None else self.update_delay_s
            if delay > 0:
                await asyncio.sleep(delay)  # loading weights takes time
            self.model_path = model_path
            if not self.ignore_updates:
                self.served_weights = model_path
            if body.get("weight_version") is not None:
                self.weight_version = str(body["weight_version"])
            if body.get("flush_cache", True):
                if self._generations:  # scheduler.flush_cache: only when fully idle
                    self.crash(FLUSH_CRASH)
                    return web.Response(status=500)  # never delivered: the connection is gone
                self._seen_sequences.clear()
        finally:
            self._updating = False
            await self._notify()
        message = "Succeeded to update model weights."
        if body.get("weight_version") is not None:
            message += f" Weight version updated to {body['weight_version']}."
        return json_response({"success": True, "message": message, "num_paused_requests": 0})

    async def _init_weights_update_group(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        self.update_calls.append(body)
        problem = _check_fields(body, INIT_GROUP_FIELDS)
        if problem is not None:
            return request_error(problem)
        self.weight_groups.add(body.get("group_name", "weight_update_group"))
        return json_response({"success": True, "message": "Succeeded to initialize custom process group."})

    async def _update_weights_from_distributed(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        self.update_calls.append(body)
        problem = _check_fields(body, UPDATE_DISTRIBUTED_FIELDS)
        if problem is None and not len(body["names"]) == len(body["dtypes"]) == len(body["shapes"]):
            problem = "names, dtypes and shapes must have the same length"
        if problem is not None:
            return request_error(problem)
        group = body.get("group_name", "weight_update_group")
        if group not in self.weight_groups:
            reply = {"success": False, "message": f"Group {group} not in the process groups."}
            return json_response(reply, 400)
        if body.get("weight_version") is not None:
            self.weight_version = str(body["weight_version"])
        return json_response({"success": True, "message": "Succeeded to update parameter online."})

    async def _destroy_weights_update_group(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        problem = _check_fields(body, DESTROY_GROUP_FIELDS)
        if problem is not None:
            return request_error(problem)
        self.weight_groups.discard(body.get("group_name", "weight_update_group"))
        return json_response({"success": True, "message": "Succeeded to destroy custom process group."})

    def _identities(self, lora_path: object, count: int) -> list[str | None] | str:
        """Per call, the identity its adapter serves (None = the base), or SGLang's 400 message."""
        if lora_path is None:
            return [None] * count
        raw = lora_path if isinstance(lora_path, list) else [lora_path] * count
        names = [None if n is None else str(n) for n in raw]
        if len(names) != count:
            return "lora_path should have one entry per request."
        if any(n is not None for n in names) and not self.enable_lora:
            return "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
        missing = sorted({n for n in names if n is not None and n not in self.adapters})
        if missing:
            return f"The following requested LoRA adapters are not loaded: {', '.join(missing)}"
        return [None if n is None else self.adapter_identity[n] for n in names]

    def _lora_reply(self, success: bool, error: str = "") -> web.Response:
        body = {"success": success, "error_message": error, "loaded_adapters": dict(self.adapters)}
        return json_response(body, 200 if success else 400)

    async def _load_lora_adapter(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        self.lora_calls.append(("load", body))
        if not self.enable_lora:
            return self._lora_reply(False, "LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not isinstance(path, str):
            return self._lora_reply(False, "lora_name and lora_path are required")
        if name in self.adapters:
            return self._lora_reply(False, f"LoRA adapter {name} is already loaded.")
        if not self.weights_path_ok(path):
            return self._lora_reply(False, f"Failed to load LoRA adapter {name}: {path} not found")
        self.adapters[name] = path
        self.adapter_identity[name] = self.served_weights if self.ignore_updates else path
        return self._lora_reply(True)

    async def _unload_lora_adapter(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        self.lora_calls.append(("unload", body))
        name = body.get("lora_name")
        if name not in self.adapters:
            return self._lora_reply(False, f"LoRA adapter {name} is not loaded.")
        del self.adapters[name]
        del self.adapter_identity[name]
        return self._lora_reply(True)

    async def _pause(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        mode = body.get("mode", "abort")
        if mode not in PAUSE_MODES:
            return request_error(f"mode: Input should be 'abort', 'retract' or 'in_place', got {mode!r}")
        if mode == "abort":  # the scheduler keeps running; every request is aborted, then we return
            await self._set_paused("abort", None)
            await self._abort_all()
            await self.wait_idle(timeout_s=math.inf)
        else:
            await self._set_paused(str(mode), str(mode))
        return json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def _continue(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        await self._set_paused(None, None)
        return json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def _abort_request(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        # AbortReq: rid (str | list[str] | None), abort_all (bool); an unknown rid is a no-op, 200.
        rid = body.get("rid")
        if not (rid is None or isinstance(rid, str)):
            return request_error(f"rid: Input should be a valid string, got {rid!r}")
        if not isinstance(body.get("abort_all", False), bool):
            return request_error("abort_all: Input should be a valid boolean")
        if body.get("abort_all"):
            await self._abort_all()
        elif rid and rid in self._generations:  # tokenizer_manager.abort_request: exact rid known
            await self._abort_all(rid)
        return web.Response(status=200)

    async def _flush_cache(self, request: web.Request) -> web.Response:
        if self._generations:
            return web.Response(status=400, text=FLUSH_FAILED, content_type="text/plain")
        self._seen_sequences.clear()
        return web.Response(status=200, text=FLUSH_OK, content_type="text/plain")

    async def _metrics(self, request: web.Request) -> web.Response:
        running = sum(1 for g in self._generations.values() if g.running)
        lines = [
            "# HELP sglang:num_running_reqs The number of running requests.",
            "# TYPE sglang:num_running_reqs gauge",
            f'sglang:num_running_reqs{{model_name="{self.model_path}"}} {float(running)}',
        ]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")


def _spans(versions: list[str]) -> list[dict[str, Any]]:
    """utils/weight_versions.py: output-token index ranges [start, end) per version, merged."""
    spans: list[dict[str, Any]] = []
    for i, version in enumerate(versions):
        if spans and spans[-1]["version"] == version:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": version, "start": i, "end": i + 1})
    return spans


# Fields of SGLang 0.5.23's NCCL weight path structs: name -> (accepted JSON types, required).
_Fields = dict[str, tuple[tuple[type, ...], bool]]
INIT_GROUP_FIELDS: _Fields = {  # InitWeightsUpdateGroupReqInput
    "master_address": ((str,), True),
    "master_port": ((int,), True),
    "rank_offset": ((int,), True),
    "world_size": ((int,), True),
    "group_name": ((str,), False),
    "backend": ((str,), False),
}
UPDATE_DISTRIBUTED_FIELDS: _Fields = {  # UpdateWeightsFromDistributedReqInput
    "names": ((list,), True),
    "dtypes": ((list,), True),
    "shapes": ((list,), True),
    "group_name": ((str,), False),
    "flush_cache": ((bool,), False),
    "abort_all_requests": ((bool,), False),
    "weight_version": ((str, type(None)), False),
    "load_format": ((str, type(None)), False),
    "torch_empty_cache": ((bool,), False),
}
DESTROY_GROUP_FIELDS: _Fields = {"group_name": ((str,), False)}  # DestroyWeightsUpdateGroupReqInput


def _check_fields(body: dict[str, Any], fields: _Fields) -> str | None:
    unknown = sorted(set(body) - set(fields))
    if unknown:
        return f"unknown field(s) {unknown}"
    for name, (types, required) in fields.items():
        if name not in body:
            if required:
                return f"field required: {name}"
            continue
        value = body[name]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            return f"field {name}: expected {'/'.join(t.__name__ for t in types)}, got {value!r}"
    return None


def _corrupt(obj: dict[str, Any], fault: str) -> None:
    """Break one contract rule of a response object (with at least one output token) in place."""
    meta = obj["meta_info"]
    entries = meta.get("output_token_logprobs")
    if fault == "missing_logprobs":
        meta.pop("output_token_logprobs", None)
    elif fault == "null_logprob":
        entries[0][0] = None
    elif fault == "nan_logprob":
        entries[0][0] = math.nan
    elif fault == "inf_logprob":
        entries[0][0] = -math.inf
    elif fault == "length_mismatch":
        entries.pop()
    elif fault == "id_mismatch":
        entries[0][1] = entries[0][1] + 1
    elif fault == "unknown_finish":
        meta["finish_reason"] = {"type": "cancelled"}
    elif fault == "missing_finish_reason":
        meta["finish_reason"] = None
    elif fault == "missing_output_ids":
        del obj["output_ids"]
    elif fault == "wrong_completion_tokens":
        meta["completion_tokens"] += 1
    elif fault == "wrong_rid":
        meta["id"] = uuid.uuid4().hex
    elif fault == "bad_token_versions":
        meta["output_token_weight_versions"] = [meta["weight_version"]] * (len(obj["output_ids"]) + 1)
