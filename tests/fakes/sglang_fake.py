"""A fake SGLang HTTP server that speaks the native API byte for byte in shape (sglang_api.md §8).

Only the outer edge is faked: rollwise's real client talks to it over real HTTP on 127.0.0.1.

    fake = FakeSGLang()
    base_url = await fake.start()
    ...
    await fake.stop()

Generation: each request gets a *plan* (output ids, log-probs, final finish reason) from `script`, or
by default a deterministic pseudo-random completion seeded by the prompt; the plan is then emitted one
token at a time so that pause, abort and weight updates act between tokens as they do in SGLang.
`faults` (a queue, one entry per /generate call) or `fault_hook` corrupt a response on purpose;
`fail_next(path, status...)` makes any route answer HTTP errors. Every request is recorded in
`requests` with its raw body; `update_calls` keeps the weight-update bodies.

Strict bodies: a field SGLang 0.5.x does not define for the route (GenerateReqInput, SamplingParams,
UpdateWeightFromDiskReqInput, LoadLoRAAdapterReqInput, ...) is answered with 400 naming it, so rollwise's
client is held to the fields SGLang knows (SGLang itself ignores unknown top-level /generate fields, which
would hide a typo).

Weights: the fake "serves" an identity (its model_path, or with `lora_path` the named adapter's path);
`prompt_logprobs(identity, ids)` is the deterministic teacher-forced log-prob of each token given its
prefix, returned as `input_token_logprobs` from `logprob_start_len` (entry 0 null, as in SGLang), so a
test can predict what a fake serving given weights answers. LoRA: `enable_lora=True` accepts
/load_lora_adapter and /unload_lora_adapter (LoRAUpdateOutput replies) and `lora_path` names a loaded
adapter. `ignore_updates=True` acknowledges weight updates (the weight_version moves) and adapter loads
but keeps serving the start weights: the stale engine of the served-policy check.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import math
import random
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

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

FLUSH_OK = (
    "Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting "
    "requests, the operation will not be performed.)\n"
)
FLUSH_REFUSED = (
    "Cache not flushed.\nPlease check backend logs for more details. (When there are running or waiting "
    "requests, the operation will not be performed.)\n"
)


# GenerateReqInput fields of SGLang 0.5.x (io_struct.py) that a token-in/token-out client may send.
GENERATE_FIELDS = frozenset(
    {
        "text", "input_ids", "input_embeds", "image_data", "video_data", "audio_data", "sampling_params",
        "rid", "return_logprob", "logprob_start_len", "top_logprobs_num", "token_ids_logprob",
        "return_text_in_logprobs", "stream", "log_metrics", "return_hidden_states", "modalities",
        "session_params", "lora_path", "lora_id", "custom_logit_processor", "bootstrap_host",
        "bootstrap_port", "bootstrap_room", "data_parallel_rank", "routed_dp_rank", "background",
        "priority", "extra_key", "no_logs", "custom_labels", "return_bytes", "return_entropy",
        "return_routed_experts", "return_sampling_mask",
    }
)  # fmt: skip
# SamplingParams.__init__ keywords (sampling_params.py); SGLang builds SamplingParams(**params).
SAMPLING_FIELDS = frozenset(
    {
        "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
        "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n",
        "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
        "spaces_between_special_tokens", "no_stop_trim", "custom_params", "stream_interval",
        "logit_bias", "sampling_seed",
    }
)  # fmt: skip
CONTROL_FIELDS: dict[str, frozenset[str]] = {
    "/update_weights_from_disk": frozenset(
        {
            "model_path",
            "load_format",
            "abort_all_requests",
            "weight_version",
            "flush_cache",
            "is_async",
            "torch_empty_cache",
            "keep_pause",
            "recapture_cuda_graph",
            "token_step",
        }
    ),
    "/load_lora_adapter": frozenset({"lora_name", "lora_path", "pinned", "lora_id"}),
    "/unload_lora_adapter": frozenset({"lora_name", "lora_id"}),
    "/pause_generation": frozenset({"mode"}),
    "/continue_generation": frozenset({"torch_empty_cache"}),
    "/abort_request": frozenset({"rid", "abort_all", "finished_reason"}),
}


def prompt_logprobs(identity: str, ids: list[int]) -> list[float]:
    """The fake's log P(ids[i + 1] | ids[: i + 1]) under the weights named `identity` (a path)."""
    values = []
    for i in range(1, len(ids)):
        digest = hashlib.blake2b(dumps([identity, ids[: i + 1]]).encode(), digest_size=4).digest()
        values.append(-0.05 - int.from_bytes(digest, "big") % 5000 / 1000.0)
    return values


def free_port() -> int:
    """A 127.0.0.1 port nothing listens on (bound, then released): connecting to it is refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def dumps(obj: object) -> str:
    """SGLang answers with ORJSONResponse: compact separators, UTF-8 kept as is. Unlike orjson, NaN and
    infinities come out as the `NaN` / `Infinity` literals Python's json writes (for fault injection)."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


@dataclass
class GenerateCall:
    """What a script sees for one sample: the prompt, its sampling params and the sample's rid."""

    input_ids: list[int]
    sampling_params: dict[str, Any]
    rid: str
    sample_index: int
    logprob_start_len: int = -1
    identity: str | None = None  # the weights it is served with (None: the fake's served_weights)


@dataclass
class Plan:
    """The completion to emit. `finish` applies when every id was emitted (unless aborted first);
    `matched` is the stop token for finish "stop" (defaults to the last id). A scripted plan is
    emitted as given, even beyond the request's max_new_tokens: the script is the ground truth."""

    output_ids: list[int]
    logprobs: list[float] | None = None
    finish: str = "stop"
    matched: int | str | None = None


@dataclass
class RecordedRequest:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class _Running:
    rid: str
    abort_message: str | None = None


def default_plan(
    input_ids: list[int], sampling: dict[str, Any], *, vocab_size: int, eos_token_id: int | None, salt: int
) -> Plan:
    """Deterministic completion seeded by the prompt (and sampling_seed, sample index): ids in
    [0, vocab_size), log-probs in (-5, -0.01); each step stops with probability 0.1 on a stop token."""
    seed_src = dumps([input_ids, sampling.get("sampling_seed"), salt]).encode()
    rng = random.Random(int.from_bytes(hashlib.blake2b(seed_src, digest_size=8).digest(), "big"))
    stops = [int(t) for t in sampling.get("stop_token_ids") or []]
    if eos_token_id is not None and not sampling.get("ignore_eos"):
        stops.append(eos_token_id)
    max_new = int(sampling.get("max_new_tokens", 128))
    ids: list[int] = []
    logprobs: list[float] = []
    for _ in range(max_new):
        if stops and rng.random() < 0.1:
            ids.append(rng.choice(stops))
            logprobs.append(-rng.uniform(0.01, 1.0))
            return Plan(ids, logprobs, "stop", ids[-1])
        token = rng.randrange(vocab_size)
        while token in stops:
            token = rng.randrange(vocab_size)
        ids.append(token)
        logprobs.append(-rng.uniform(0.01, 5.0))
    return Plan(ids, logprobs, "length")


def _json_response(obj: object, status: int = 200) -> web.Response:
    # ORJSONResponse sends "application/json" with no charset parameter.
    return web.Response(status=status, body=dumps(obj).encode(), headers={"Content-Type": "application/json"})


def _bad_request(message: str) -> web.Response:
    return _json_response({"error": {"message": message}}, 400)


def _error_response(status: int, message: str, kind: str) -> web.Response:
    body = {"object": "error", "message": message, "type": kind, "param": None, "code": status}
    return _json_response(body, status)


def _validate_sampling(sp: dict[str, Any]) -> str | None:
    top_p = sp.get("top_p", 1.0)
    if not isinstance(top_p, (int, float)) or not 0.0 < top_p <= 1.0:
        return f"top_p must be in (0, 1], got {top_p}."
    temperature = sp.get("temperature", 1.0)
    if not isinstance(temperature, (int, float)) or temperature < 0.0:
        return f"temperature must be non-negative, got {temperature}."
    top_k = sp.get("top_k", -1)
    if not isinstance(top_k, int) or (top_k < 1 and top_k != -1):
        return f"top_k must be -1 (disable), or at least 1, got {top_k}."
    max_new = sp.get("max_new_tokens", 128)
    if not isinstance(max_new, int) or max_new < 0:
        return f"max_new_tokens must be at least 0, got {max_new}."
    return None


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
        eos_token_id: int | None = None,
        script: Callable[[GenerateCall], Plan] | None = None,
        fault_hook: Callable[[GenerateCall], str | None] | None = None,
        token_delay_s: float = 0.0,
        update_delay_s: float = 0.0,
        api_key: str | None = None,
        has_model_info_route: bool = True,
        weights_path_ok: Callable[[str], bool] | None = None,
        report_token_versions: bool = False,
        skip_tokenizer_init: bool = False,
        enable_lora: bool = False,
        ignore_updates: bool = False,
    ) -> None:
        self.ready = ready
        self.ready_after_s = ready_after_s
        self.weight_version = weight_version
        self.model_path = model_path
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.script = script
        self.fault_hook = fault_hook
        self.faults: collections.deque[str] = collections.deque()
        self._route_failures: dict[str, collections.deque[int | tuple[int, object]]] = {}
        self.token_delay_s = token_delay_s
        self.update_delay_s = update_delay_s
        self.api_key = api_key
        self.has_model_info_route = has_model_info_route
        # Which model_path values /update_weights_from_disk can load (default: all but "/missing...";
        # pass os.path.exists to mirror a real server reading the disk).
        self.weights_path_ok = weights_path_ok or (lambda path: not path.startswith("/missing"))
        self.report_token_versions = report_token_versions
        self.skip_tokenizer_init = skip_tokenizer_init
        self.enable_lora = enable_lora
        self.ignore_updates = ignore_updates
        self.served_weights = model_path  # the identity prompt log-probs are computed for
        self.adapters: dict[str, str] = {}  # loaded LoRA adapters: name -> path
        self.adapter_identity: dict[str, str] = {}  # name -> identity its requests are served with
        self.lora_calls: list[tuple[str, dict[str, Any]]] = []
        self.requests: list[RecordedRequest] = []
        self.update_calls: list[dict[str, Any]] = []
        self.weight_groups: set[str] = set()  # NCCL groups joined via /init_weights_update_group
        self.pause_mode: str | None = None
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._running: dict[str, _Running] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        self.peak_running = 0
        self._seen_sequences: collections.deque[list[int]] = collections.deque(maxlen=64)
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
        app.router.add_post("/update_weights_from_disk", self._update_weights_from_disk)
        app.router.add_post("/load_lora_adapter", self._load_lora_adapter)
        app.router.add_post("/unload_lora_adapter", self._unload_lora_adapter)
        app.router.add_post("/pause_generation", self._pause)
        app.router.add_post("/continue_generation", self._continue)
        app.router.add_post("/abort_request", self._abort_request)
        app.router.add_route("GET", "/flush_cache", self._flush_cache)
        app.router.add_route("POST", "/flush_cache", self._flush_cache)
        app.router.add_get("/metrics", self._metrics)
        # SGLang's NCCL weight path (the GPU option): request shapes only, no tensors move here.
        app.router.add_post("/init_weights_update_group", self._init_weights_update_group)
        app.router.add_post("/update_weights_from_distributed", self._update_weights_from_distributed)
        app.router.add_post("/destroy_weights_update_group", self._destroy_weights_update_group)
        return app

    async def start(self, port: int = 0) -> str:
        """Serve on 127.0.0.1:`port` (0 = any free port). Returns the base URL."""
        self._runner = web.AppRunner(self.make_app(), handle_signals=False, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port, reuse_address=True)
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        self._started_at = time.monotonic()
        return self.base_url

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        """Abort whatever still runs (its client may be gone) so the shutdown does not wait for it."""
        self.pause_mode = None
        self._abort("Server shutting down.")
        self._unpaused.set()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

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
        return list(self._running)

    async def wait_running(self, n: int = 1, timeout_s: float = 5.0) -> None:
        """Wait until at least `n` generations are registered (running or waiting while paused)."""
        deadline = time.monotonic() + timeout_s
        while len(self._running) < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {len(self._running)} of {n} requests running")
            await asyncio.sleep(0.005)

    async def wait_idle(self, timeout_s: float = 5.0) -> bool:
        """Wait until no generation runs; False if some still run after `timeout_s`."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    # ------------------------------------------------------------------ middlewares
    @web.middleware
    async def _record(self, request: web.Request, handler: Any) -> web.StreamResponse:
        body = await request.read()
        self.requests.append(RecordedRequest(request.method, request.path, dict(request.headers), body))
        unknown = _unknown_fields(request.path, body)
        if unknown:
            return _bad_request(f"{request.path} does not take field(s) {unknown} (SGLang 0.5.x)")
        queued = self._route_failures.get(request.path)
        if queued:
            reply = queued.popleft()
            if isinstance(reply, tuple):
                return _json_response(reply[1], reply[0])
            return _error_response(reply, f"injected HTTP {reply}", "InternalServerError")
        response: web.StreamResponse = await handler(request)
        return response

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if self.api_key is not None and request.headers.get("Authorization") != f"Bearer {self.api_key}":
            return _json_response({"error": "Unauthorized"}, 401)
        response: web.StreamResponse = await handler(request)
        return response

    # ------------------------------------------------------------------ /generate
    async def _generate(self, request: web.Request) -> web.StreamResponse:
        try:
            body = json.loads(await request.read())
        except ValueError as exc:
            return _bad_request(f"invalid JSON body: {exc}")
        if not isinstance(body, dict):
            return _bad_request("request body must be a JSON object")
        parsed = self._expand(body)
        if isinstance(parsed, str):
            return _bad_request(parsed)
        calls, is_batch = parsed
        identities = self._identities(body.get("lora_path"), len(calls))
        if isinstance(identities, str):
            return _bad_request(identities)
        for call, identity in zip(calls, identities, strict=True):
            call.identity = identity
        fault = self.faults.popleft() if self.faults else None
        if fault is None and self.fault_hook is not None and calls:
            fault = self.fault_hook(calls[0])
        if fault in ("http_500", "http_503"):
            status = 500 if fault == "http_500" else 503
            return _error_response(status, f"injected HTTP {status}", "InternalServerError")
        if fault == "drop_connection":
            assert request.transport is not None
            request.transport.close()
            return web.Response(status=200)
        want_logprobs = bool(body.get("return_logprob", False))
        if body.get("stream"):
            return await self._stream(request, calls, want_logprobs, is_batch)
        objs = await asyncio.gather(*(self._run_one(c, want_logprobs) for c in calls))
        if fault == "not_json":
            return web.Response(text="<html>502 Bad Gateway</html>", content_type="application/json")
        if fault is not None:
            _corrupt(objs[0], fault)
        payload: object = objs if is_batch else objs[0]
        return _json_response(payload)

    def _expand(self, body: dict[str, Any]) -> tuple[list[GenerateCall], bool] | str:
        """One GenerateCall per sample in SGLang's prompt-major order, or the 400 message."""
        if ("input_ids" in body) == ("text" in body):
            return "Either text or input_ids should be provided."
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
        for sp in sps:
            problem = _validate_sampling(sp)
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
        if start is not None and any(start >= len(p) for p in prompts):
            return "logprob_start_len should be less than the input length."
        calls = [
            GenerateCall(
                list(prompts[i]), dict(sps[i]), rids[i * n + j], j, start if start is not None else -1
            )
            for i in range(len(prompts))
            for j in range(n)
        ]
        for call in calls:
            if call.rid in self._running:
                return f"Duplicate request ID: {call.rid}"
        return calls, is_batch or n > 1

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

    async def _emit(self, call: GenerateCall) -> AsyncIterator[tuple[int, float, str, dict[str, Any] | None]]:
        """Yield (id, logprob, version, finish) per token; finish is set on the last one. An abort or a
        plan with no tokens yields a single (-1, 0, version, finish) sentinel."""
        state = _Running(call.rid)
        self._running[call.rid] = state
        self.peak_running = max(self.peak_running, len(self._running))
        self._idle.clear()
        try:
            await self._unpaused.wait()
            plan = self._plan(call)
            logprobs = plan.logprobs if plan.logprobs is not None else [-0.5] * len(plan.output_ids)
            for i, (token, logprob) in enumerate(zip(plan.output_ids, logprobs, strict=True)):
                if state.abort_message is None and self.token_delay_s > 0:
                    await asyncio.sleep(self.token_delay_s)
                while self.pause_mode in ("in_place", "retract") and state.abort_message is None:
                    await self._unpaused.wait()
                if state.abort_message is not None:
                    break
                last = i == len(plan.output_ids) - 1
                yield token, logprob, self.weight_version, (self._finish(plan, call) if last else None)
                await asyncio.sleep(0)
            if state.abort_message is not None:
                yield -1, 0.0, self.weight_version, _abort_reason(state.abort_message)
            elif not plan.output_ids:
                yield -1, 0.0, self.weight_version, self._finish(plan, call)
        finally:
            del self._running[call.rid]
            if not self._running:
                self._idle.set()

    @staticmethod
    def _finish(plan: Plan, call: GenerateCall) -> dict[str, Any]:
        if plan.finish == "stop":
            matched = plan.matched if plan.matched is not None else plan.output_ids[-1]
            return {"type": "stop", "matched": matched}
        if plan.finish == "length":
            return {"type": "length", "length": int(call.sampling_params.get("max_new_tokens", 128))}
        if plan.finish == "abort":
            return _abort_reason("Abort before finishing." if plan.output_ids else "Abort in waiting queue")
        return {"type": plan.finish}

    async def _run_one(self, call: GenerateCall, want_logprobs: bool) -> dict[str, Any]:
        started = time.monotonic()
        cached = self._cached_tokens(call.input_ids)
        ids: list[int] = []
        lps: list[float] = []
        versions: list[str] = []
        finish: dict[str, Any] | None = None
        async for token, logprob, version, fin in self._emit(call):
            if token >= 0:
                ids.append(token)
                lps.append(logprob)
                versions.append(version)
            finish = fin
        self._seen_sequences.append(call.input_ids + ids)
        latency = time.monotonic() - started
        return self._response(call, ids, lps, versions, finish, want_logprobs, latency, cached)

    def _response(
        self,
        call: GenerateCall,
        ids: list[int],
        lps: list[float],
        versions: list[str],
        finish: dict[str, Any] | None,
        want_logprobs: bool,
        latency: float | None,
        cached: int,
    ) -> dict[str, Any]:
        """A response object with SGLang's key order; `latency` None = a not-yet-final stream chunk."""
        obj: dict[str, Any] = {}
        if not self.skip_tokenizer_init:
            obj["text"] = "".join(f"<{t}>" for t in ids)
        obj["output_ids"] = list(ids)
        meta: dict[str, Any] = {
            "id": call.rid,
            "finish_reason": finish,
            "prompt_tokens": len(call.input_ids),
            "weight_version": self.weight_version,
            "completion_tokens": len(ids),
            "cached_tokens": cached,
        }
        if want_logprobs:
            start = call.logprob_start_len if call.logprob_start_len >= 0 else len(call.input_ids) - 1
            values = prompt_logprobs(call.identity or self.served_weights, call.input_ids)[start:]
            listed = call.input_ids[start:]
            meta["input_token_logprobs"] = [[None, listed[0], None]] + [
                [lp, t, None] for lp, t in zip(values, listed[1:], strict=True)
            ]
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(lps, ids, strict=True)]
        if self.report_token_versions:
            meta["output_token_weight_versions"] = list(versions)
        if latency is not None:
            meta["e2e_latency"] = latency
        obj["meta_info"] = meta
        return obj

    async def _stream(
        self, request: web.Request, calls: list[GenerateCall], want_logprobs: bool, is_batch: bool
    ) -> web.StreamResponse:
        """SSE, cumulative snapshots (SGLang's default non-incremental mode), then `data: [DONE]`."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        lock = asyncio.Lock()

        async def pump(index: int, call: GenerateCall) -> None:
            started = time.monotonic()
            cached = self._cached_tokens(call.input_ids)
            ids: list[int] = []
            lps: list[float] = []
            versions: list[str] = []
            async for token, logprob, version, fin in self._emit(call):
                if token >= 0:
                    ids.append(token)
                    lps.append(logprob)
                    versions.append(version)
                latency = time.monotonic() - started if fin is not None else None
                chunk = self._response(call, ids, lps, versions, fin, want_logprobs, latency, cached)
                if is_batch:
                    chunk["index"] = index
                async with lock:
                    await response.write(f"data: {dumps(chunk)}\n\n".encode())
            self._seen_sequences.append(call.input_ids + ids)

        await asyncio.gather(*(pump(i, c) for i, c in enumerate(calls)))
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
        return _json_response(info)

    async def _json_body(self, request: web.Request) -> dict[str, Any]:
        raw = await request.read()
        if not raw.strip():
            return {}
        obj = json.loads(raw)
        return obj if isinstance(obj, dict) else {}

    def _abort(self, message: str, rid: str | None = None) -> None:
        for state in self._running.values():
            if rid is None or state.rid == rid:
                state.abort_message = message
        # Wake requests frozen by a pause so they report their partial output; set() resolves the current
        # waiters, so closing the gate again right away keeps everyone else paused.
        self._unpaused.set()
        if self.pause_mode is not None:
            self._unpaused.clear()

    async def _update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await self._json_body(request)
        self.update_calls.append(body)
        model_path = body.get("model_path")
        if not isinstance(model_path, str) or not model_path:
            return _bad_request("model_path is required")
        if not self.weights_path_ok(model_path):
            reply = {
                "success": False,
                "message": f"Failed to get weights iterator: {model_path} (repository not found).",
                "num_paused_requests": 0,
            }
            return _json_response(reply, 400)
        if body.get("abort_all_requests"):
            self._abort("Abort for weight update.")
        elif self.pause_mode is None:
            await self._idle.wait()  # SGLang's writer lock waits for in-flight requests
        if self.update_delay_s > 0:
            await asyncio.sleep(self.update_delay_s)  # loading weights takes time
        self.model_path = model_path
        if not self.ignore_updates:
            self.served_weights = model_path
        if body.get("weight_version") is not None:
            self.weight_version = str(body["weight_version"])
        if body.get("flush_cache", True):
            self._seen_sequences.clear()
        reply = {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}
        return _json_response(reply)

    async def _init_weights_update_group(self, request: web.Request) -> web.Response:
        body = await self._json_body(request)
        self.update_calls.append(body)
        problem = _check_fields(body, INIT_GROUP_FIELDS)
        if problem is not None:
            return _bad_request(problem)
        self.weight_groups.add(body.get("group_name", "weight_update_group"))
        return _json_response({"success": True, "message": "Succeeded to initialize custom process group."})

    async def _update_weights_from_distributed(self, request: web.Request) -> web.Response:
        body = await self._json_body(request)
        self.update_calls.append(body)
        problem = _check_fields(body, UPDATE_DISTRIBUTED_FIELDS)
        if problem is None and not len(body["names"]) == len(body["dtypes"]) == len(body["shapes"]):
            problem = "names, dtypes and shapes must have the same length"
        if problem is not None:
            return _bad_request(problem)
        group = body.get("group_name", "weight_update_group")
        if group not in self.weight_groups:
            reply = {"success": False, "message": f"Group {group} not in the process groups."}
            return _json_response(reply, 400)
        if body.get("weight_version") is not None:
            self.weight_version = str(body["weight_version"])
        return _json_response({"success": True, "message": "Succeeded to update parameter online."})

    async def _destroy_weights_update_group(self, request: web.Request) -> web.Response:
        body = await self._json_body(request)
        problem = _check_fields(body, DESTROY_GROUP_FIELDS)
        if problem is not None:
            return _bad_request(problem)
        self.weight_groups.discard(body.get("group_name", "weight_update_group"))
        return _json_response({"success": True, "message": "Succeeded to destroy custom process group."})

    def _identities(self, lora_path: object, count: int) -> list[str | None] | str:
        """Per call, the identity its adapter serves (None = the base), or SGLang's 400 message."""
        if lora_path is None:
            return [None] * count
        names = lora_path if isinstance(lora_path, list) else [lora_path] * count
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
        return _json_response(body, 200 if success else 400)

    async def _load_lora_adapter(self, request: web.Request) -> web.Response:
        body = await self._json_body(request)
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
        body = await self._json_body(request)
        self.lora_calls.append(("unload", body))
        name = body.get("lora_name")
        if name not in self.adapters:
            return self._lora_reply(False, f"LoRA adapter {name} is not loaded.")
        del self.adapters[name]
        del self.adapter_identity[name]
        return self._lora_reply(True)

    async def _pause(self, request: web.Request) -> web.Response:
        body = await self._json_body(request)
        mode = str(body.get("mode", "abort"))
        if mode not in ("abort", "retract", "in_place"):
            return _bad_request(f"Invalid pause mode: {mode}")
        self.pause_mode = mode
        if mode == "abort":
            self._abort("Abort by pause_generation.")
        self._unpaused.clear()
        reply = {"message": "Generation paused successfully.", "status": "ok"}
        return _json_response(reply)

    async def _continue(self, request: web.Request) -> web.Response:
        await self._json_body(request)
        self.pause_mode = None
        self._unpaused.set()
        reply = {"message": "Generation continued successfully.", "status": "ok"}
        return _json_response(reply)

    async def _abort_request(self, request: web.Request) -> web.Response:
        body = await self._json_body(request)
        # SGLang validates the body as AbortReq: rid (str | list[str] | None, from BaseReq), abort_all
        # (bool), finished_reason (dict | None), abort_message (str | None); extra keys are ignored.
        rid = body.get("rid")
        if not (
            rid is None
            or isinstance(rid, str)
            or (isinstance(rid, list) and all(isinstance(r, str) for r in rid))
        ):
            return _error_response(400, f"rid: Input should be a valid string, got {rid!r}", "Bad Request")
        if not isinstance(body.get("abort_all", False), bool):
            return _error_response(400, "abort_all: Input should be a valid boolean", "Bad Request")
        if body.get("abort_all"):
            self._abort("Abort by abort_request (abort_all).")
        elif body.get("rid"):
            self._abort("Abort by abort_request.", str(body["rid"]))
        return web.Response(status=200)

    async def _flush_cache(self, request: web.Request) -> web.Response:
        if self._running:
            return web.Response(status=400, text=FLUSH_REFUSED, content_type="text/plain")
        self._seen_sequences.clear()
        return web.Response(status=200, text=FLUSH_OK, content_type="text/plain")

    async def _metrics(self, request: web.Request) -> web.Response:
        lines = [
            "# HELP sglang:num_running_reqs The number of running requests.",
            "# TYPE sglang:num_running_reqs gauge",
            f'sglang:num_running_reqs{{model_name="{self.model_path}"}} {float(len(self._running))}',
        ]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")


# Fields of SGLang 0.5.23's io_struct request structs: name -> (accepted JSON types, required). The fake
# refuses unknown fields too (SGLang would ignore a misspelt optional one, silently).
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


def _unknown_fields(path: str, body: bytes) -> list[str]:
    """Fields of a JSON object body that SGLang 0.5.x does not define for `path` (sampling_params too)."""
    if path in ("/generate",):
        allowed = GENERATE_FIELDS
    elif path in CONTROL_FIELDS:
        allowed = CONTROL_FIELDS[path]
    else:
        return []
    try:
        obj = json.loads(body) if body.strip() else {}
    except ValueError:
        return []  # the handler reports malformed JSON
    if not isinstance(obj, dict):
        return []
    unknown = sorted(k for k in obj if k not in allowed)
    params = obj.get("sampling_params") if path == "/generate" else None
    for item in params if isinstance(params, list) else [params]:
        if isinstance(item, dict):
            unknown += sorted(f"sampling_params.{k}" for k in item if k not in SAMPLING_FIELDS)
    return unknown


def _abort_reason(message: str) -> dict[str, Any]:
    return {"type": "abort", "message": message, "status_code": None, "err_type": None}


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
