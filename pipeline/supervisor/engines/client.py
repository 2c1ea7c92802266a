"""EngineClient: one SGLang server (or one sglang-router URL) over its native HTTP API.

Retry rules, chosen so that no generation is ever run twice by accident:
- a connection that could not be opened (refused, connect timeout) never reached the server: every call
  is retried, `generate` included;
- 5xx replies and connections lost after the request was sent are retried only for idempotent calls
  (health, info, control calls: pausing twice or loading the same weights twice is harmless).
  `generate` is not idempotent (a duplicate rid, twice the compute), so it is retried after a reply only
  on 503 (the server refused to take it);
- 4xx replies are never retried.
The transport is pipeline.supervisor.engines.http1 (keep-alive HTTP/1.1; its ConnectFailed is "never
sent", its ConnectionLost and TimeoutError "maybe sent").
Backoff is exponential with jitter. A circuit breaker counts consecutive connection failures across
calls (a call that times out counts too); once open it fails calls fast for `circuit_reset_s`, then
lets one trial call through. `health()` bypasses it: the probe is what closes it again.

A `generate` whose caller stops waiting (the task is cancelled: an episode timeout, a drain) or that
outlives `request_timeout_s` is aborted on the server by its rid (`POST /abort_request {"rid"}`, SGLang's
AbortReq), in the background and bounded by `abort_timeout_s` (behind a router, at every worker:
`abort_targets`): closing the socket alone does not stop a
server from decoding (SGLang notices a disconnect late and not at all behind a router), and every token
it decodes for nobody is capacity taken from live episodes. Aborting an unknown rid is a no-op there.
"""

from __future__ import annotations

import asyncio
import json
import random
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal

import pydantic_core

from pipeline.supervisor.engines.engine_load import EngineLoad, parse_load
from pipeline.supervisor.engines.http1 import ConnectFailed, ConnectionLost, Http1Pool
from pipeline.supervisor.engines.protocol import (
    EngineError,
    EngineHTTPError,
    EngineProtocolError,
    EngineUnavailable,
    GenerateResult,
    RoutedExpertsRequest,
    SamplingParams,
    parse_generate_response,
    parse_input_logprobs,
)
from pipeline.supervisor.observability import metrics

PauseMode = Literal["abort", "retract", "in_place"]

# sglang-router's session-affinity header (policy `manual`): one key, one worker.
ROUTING_KEY_HEADER = "X-SMG-Routing-Key"
_JSON_HEADERS = {"Content-Type": "application/json"}

# /health on late-2025+ SGLang generates one token and waits up to 20 s (SGLANG_HEALTH_CHECK_TIMEOUT).
HEALTH_TIMEOUT_S = 25.0


@dataclass(frozen=True, slots=True)
class _Reply:
    status: int
    body: bytes


class CircuitBreaker:
    """Counts consecutive connection failures; open = fail fast; half-open = one trial call."""

    def __init__(self, failures_to_open: int, reset_s: float) -> None:
        self.failures_to_open = failures_to_open
        self.reset_s = reset_s
        self.consecutive_failures = 0
        self.opened_at: float | None = None
        self._trial_in_flight = False

    @property
    def is_open(self) -> bool:
        return self.opened_at is not None

    def admit(self, url: str) -> bool:
        """Raise EngineUnavailable while open; return True when this call is the half-open trial."""
        if self.opened_at is None:
            return False
        waited = time.monotonic() - self.opened_at
        if waited < self.reset_s or self._trial_in_flight:
            raise EngineUnavailable(
                url, f"circuit open after {self.consecutive_failures} consecutive connection failures"
            )
        self._trial_in_flight = True
        return True

    def record_success(self) -> None:
        self.consecutive_failures = 0
        self.opened_at = None
        self._trial_in_flight = False

    def record_failure(self) -> None:
        self.consecutive_failures += 1
        if self._trial_in_flight or self.consecutive_failures >= self.failures_to_open:
            self.opened_at = time.monotonic()
        self._trial_in_flight = False

    def release_trial(self) -> None:
        """A trial that ended without a verdict (cancelled, protocol error) leaves the circuit open."""
        self._trial_in_flight = False


def _error_message(reply: _Reply) -> str:
    """The human message of an SGLang error body: {"error": {"message"}}, {"message"} or plain text."""
    text = reply.body.decode("utf-8", errors="replace").strip()
    try:
        obj = json.loads(text)
    except ValueError:
        return text[:500] or "(empty body)"
    if isinstance(obj, dict):
        error = obj.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if isinstance(error, str):
            return error
        if obj.get("error_message"):  # SGLang's LoRA replies (LoRAUpdateOutput)
            return str(obj["error_message"])
        if "message" in obj:
            return str(obj["message"])
    return text[:500]


class EngineClient:
    """Client of one SGLang HTTP server. Use as `async with EngineClient(url) as c:` or call `close()`.

    `retries` is the number of extra attempts after the first. All timeouts are in seconds; every call
    has one (`request_timeout_s` in total, `connect_timeout_s` to open a socket).
    """

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        request_timeout_s: float = 300.0,
        connect_timeout_s: float = 5.0,
        max_connections: int = 256,
        retries: int = 3,
        backoff_base_s: float = 0.05,
        backoff_max_s: float = 2.0,
        circuit_failures: int = 5,
        circuit_reset_s: float = 5.0,
        abort_timeout_s: float = 5.0,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"EngineClient base_url must start with http:// or https://, got {base_url!r}")
        if max_connections < 1 or retries < 0 or circuit_failures < 1:
            raise ValueError(
                f"EngineClient needs max_connections >= 1, retries >= 0, circuit_failures >= 1; got "
                f"{max_connections}, {retries}, {circuit_failures}"
            )
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.ssl_context = ssl_context  # what an https server is checked against (None: the system's)
        self.request_timeout_s = request_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_connections = max_connections
        self.retries = retries
        self.backoff_base_s = backoff_base_s
        self.backoff_max_s = backoff_max_s
        self.breaker = CircuitBreaker(circuit_failures, circuit_reset_s)
        self.abort_timeout_s = abort_timeout_s
        self._aborts: set[asyncio.Task[None]] = set()  # background aborts of abandoned generations
        # Who receives those aborts: this server, unless it forwards requests it cannot abort itself
        # (sglang-router answers /abort_request with 404): then the workers behind it (EnginePool sets it).
        self.abort_targets: Callable[[], list[EngineClient]] = lambda: [self]
        # Built here so that a URL it cannot use fails now (its limit, connect timeout, key and TLS context
        # are fixed from here on); it binds to the event loop of its first request.
        self._http = Http1Pool(
            self.base_url,
            limit=max_connections,
            connect_timeout_s=connect_timeout_s,
            ssl_context=ssl_context,
            headers={"Authorization": f"Bearer {api_key}"} if api_key else None,
        )
        self._closed = False

    def __repr__(self) -> str:
        return f"EngineClient({self.base_url!r})"

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the connections (after the pending background aborts had their chance). Idempotent;
        the client cannot be used afterwards."""
        if self._aborts:
            await asyncio.wait(set(self._aborts), timeout=self.abort_timeout_s)
        self._closed = True
        await self._http.close()

    def _get_http(self) -> Http1Pool:
        if self._closed:
            raise EngineUnavailable(self.base_url, "client is closed")
        return self._http

    def _backoff_s(self, attempt: int) -> float:
        cap = min(self.backoff_max_s, self.backoff_base_s * (2**attempt))
        return random.uniform(0.5 * cap, cap)

    async def _send_once(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None,
        timeout_s: float,
        headers: dict[str, str] | None = None,
    ) -> _Reply:
        """One exchange. Raises ConnectFailed (never sent), ConnectionLost or TimeoutError (maybe sent)."""
        data = None
        if body is not None:
            # pydantic-core's encoder writes the same JSON for these plain bodies ~4x faster than
            # json.dumps; a /generate body is mostly its input_ids, re-sent in full every turn.
            data = encode_json_body(body)
            headers = _JSON_HEADERS if headers is None else {**headers, **_JSON_HEADERS}
        status, reply = await self._get_http().request(
            method, path, data, timeout_s=timeout_s, headers=headers
        )
        return _Reply(status, reply)

    async def _call(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        idempotent: bool = True,
        headers: dict[str, str] | None = None,
    ) -> _Reply:
        """Send with retries and the circuit breaker. Returns a 2xx reply; raises EngineError else."""
        url = self.base_url + path
        timeout_s = self.request_timeout_s
        attempt = 0
        failure: EngineError
        while True:
            is_trial = self.breaker.admit(url)
            try:
                reply = await self._send_once(method, path, body, timeout_s, headers)
            except ConnectFailed as exc:
                self.breaker.record_failure()
                failure = EngineUnavailable(url, f"cannot connect: {exc}", maybe_sent=False)
                failure.__cause__ = exc
                retryable = True
            except (ConnectionLost, TimeoutError) as exc:
                self.breaker.record_failure()
                if isinstance(exc, TimeoutError):
                    reason = f"no complete reply within {timeout_s} s"
                else:
                    reason = f"connection lost: {type(exc).__name__}: {exc}"
                failure = EngineUnavailable(url, reason, maybe_sent=True)
                failure.__cause__ = exc
                retryable = idempotent
            else:
                self.breaker.record_success()
                if 200 <= reply.status < 300:
                    return reply
                failure = EngineHTTPError(reply.status, _error_message(reply), url)
                retryable = reply.status >= 500 and (idempotent or reply.status == 503)
            finally:
                if is_trial:
                    self.breaker.release_trial()
            if not retryable or attempt >= self.retries:
                raise failure
            await asyncio.sleep(self._backoff_s(attempt))
            attempt += 1

    async def _call_json(
        self, method: str, path: str, body: dict[str, Any] | None = None, *, idempotent: bool = True
    ) -> dict[str, Any]:
        reply = await self._call(method, path, body, idempotent=idempotent)
        obj = _decode_json(reply, self.base_url + path)
        if not isinstance(obj, dict):
            raise EngineProtocolError(f"{path} replied {type(obj).__name__}, expected an object")
        return obj

    async def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        rid: str,
        *,
        routing_key: str | None = None,
        priority: int | None = None,
        lora_path: str | None = None,
        routed_experts: RoutedExpertsRequest | None = None,
    ) -> GenerateResult:
        """One token-in/token-out generation. Raises EngineHTTPError, EngineProtocolError, EngineUnavailable.

        An aborted request is not an error: it returns with finish_reason "abort" and its partial output.
        `routing_key` goes out as sglang-router's `X-SMG-Routing-Key` header (its `manual` policy sends
        every request with one key to the same worker); an engine ignores it.
        `priority` is SGLang's request priority (sent only when given; a server without priority
        scheduling ignores it).
        `lora_path` names a loaded LoRA adapter (SGLang's GenerateReqInput.lora_path); None = the base.
        `routed_experts` asks an MoE engine for each position's experts (`return_routed_experts`,
        `routed_experts_start_len`); the reply must carry them (protocol.parse_routed_experts).
        """
        body: dict[str, Any] = {
            "input_ids": input_ids,
            "sampling_params": sampling.to_wire(),
            "return_logprob": True,
            "rid": rid,
        }
        if priority is not None:
            body["priority"] = priority
        if lora_path is not None:
            body["lora_path"] = lora_path
        if routed_experts is not None:
            body["return_routed_experts"] = True
            body["routed_experts_start_len"] = routed_experts.start_len
        url = self.base_url + "/generate"
        headers = {ROUTING_KEY_HEADER: routing_key} if routing_key is not None else None
        try:
            reply = await self._call("POST", "/generate", body, idempotent=False, headers=headers)
        except asyncio.CancelledError:
            self._abort_in_background(rid, "cancelled")
            raise
        except EngineUnavailable as exc:
            if exc.maybe_sent and isinstance(exc.__cause__, TimeoutError):
                self._abort_in_background(rid, "timeout")
            raise
        try:
            obj = _decode_json(reply, url)
        except EngineProtocolError as exc:
            raise EngineProtocolError(exc.defect, rid=rid, url=url) from None
        try:
            return parse_generate_response(obj, expected_rid=rid, routed_experts=routed_experts)
        except EngineProtocolError as exc:
            raise EngineProtocolError(exc.defect, rid=exc.rid, url=url) from None

    def _abort_in_background(self, rid: str, reason: str) -> None:
        """Tell the server to stop decoding `rid` (module docstring). Best effort: one attempt, no
        retries, no circuit breaker, errors only logged as a counter."""
        loop = asyncio.get_running_loop()
        for target in self.abort_targets():
            if target._closed:
                continue
            task = loop.create_task(target._abort_once(rid, reason), name=f"abort {rid} at {target.base_url}")
            target._aborts.add(task)
            task.add_done_callback(target._aborts.discard)

    async def _abort_once(self, rid: str, reason: str) -> None:
        try:
            reply = await self._send_once("POST", "/abort_request", {"rid": rid}, self.abort_timeout_s)
        except (ConnectionError, TimeoutError, EngineUnavailable):
            return  # the server is gone or unreachable: it decodes nothing for us then either
        if 200 <= reply.status < 300:
            metrics.ENGINE_ABORTS.labels(reason=reason).inc()

    async def prompt_logprobs(
        self, input_ids: list[int], *, rid: str, lora_path: str | None = None
    ) -> list[float]:
        """The engine's teacher-forced log P(ids[i + 1] | ids[: i + 1]) for every i < len(ids) - 1 (raw
        logits, temperature 1): a score-only request (`max_new_tokens = 0`, `logprob_start_len = 0`)
        whose `meta_info.input_token_logprobs` carries them. `lora_path` as in `generate`."""
        body: dict[str, Any] = {
            "input_ids": input_ids,
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": 0,
            "rid": rid,
        }
        if lora_path is not None:
            body["lora_path"] = lora_path
        url = self.base_url + "/generate"
        reply = await self._call("POST", "/generate", body, idempotent=False)
        try:
            return parse_input_logprobs(_decode_json(reply, url), input_ids, start=0, rid=rid)
        except EngineProtocolError as exc:
            raise EngineProtocolError(exc.defect, rid=rid, url=url) from None

    async def load_lora_adapter(self, name: str, path: str, *, pinned: bool = False) -> dict[str, Any]:
        """Load the PEFT adapter directory `path` (readable by the server) under `name`
        (LoadLoRAAdapterReqInput). Returns the reply (`loaded_adapters` maps names to paths); a refusal
        raises EngineHTTPError with SGLang's `error_message`. Never resent once it may have arrived: a
        second load of the same name is an error on the server."""
        path_ = "/load_lora_adapter"
        body = {"lora_name": name, "lora_path": path, "pinned": pinned}
        return self._lora_reply(await self._call_json("POST", path_, body, idempotent=False), path_)

    async def unload_lora_adapter(self, name: str) -> dict[str, Any]:
        """Unload adapter `name` (UnloadLoRAAdapterReqInput); SGLang waits for the requests using it."""
        path_ = "/unload_lora_adapter"
        return self._lora_reply(await self._call_json("POST", path_, {"lora_name": name}), path_)

    def _lora_reply(self, reply: dict[str, Any], path: str) -> dict[str, Any]:
        if reply.get("success") is not True:
            message = reply.get("error_message") or "success is not true"
            raise EngineHTTPError(200, str(message), self.base_url + path)
        return reply

    async def health(self, timeout_s: float = HEALTH_TIMEOUT_S) -> bool:
        """Readiness probe: 200 -> True; 5xx (503 = still starting), refused or timeout -> False.

        Bypasses the circuit breaker (it is the probe that closes it) and never retries. A 4xx (e.g. 401,
        a wrong api key) is a configuration error and raises EngineHTTPError.
        """
        url = self.base_url + "/health"
        try:
            reply = await self._send_once("GET", "/health", None, timeout_s)
        except (ConnectionError, TimeoutError):
            return False
        if reply.status == 200:
            self.breaker.record_success()
            return True
        if 400 <= reply.status < 500:
            raise EngineHTTPError(reply.status, _error_message(reply), url)
        return False

    async def wait_ready(self, timeout_s: float, *, poll_interval_s: float = 0.2) -> None:
        """Poll /health until it answers 200; raise EngineUnavailable after `timeout_s` seconds."""
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise EngineUnavailable(self.base_url, f"/health not ready after {timeout_s} s")
            if await self.health(timeout_s=max(0.05, min(HEALTH_TIMEOUT_S, remaining))):
                return
            await asyncio.sleep(min(poll_interval_s, max(0.0, deadline - time.monotonic())))

    async def model_info(self) -> dict[str, Any]:
        """`/model_info` (2026 SGLang), falling back to `/get_model_info` on servers that answer 404."""
        try:
            return await self._call_json("GET", "/model_info")
        except EngineHTTPError as exc:
            if exc.status != 404:
                raise
        return await self._call_json("GET", "/get_model_info")

    async def update_weights_from_disk(
        self,
        model_path: str,
        *,
        weight_version: str,
        abort_all_requests: bool = False,
        flush_cache: bool = True,
    ) -> dict[str, Any]:
        """Load weights from `model_path` (a directory the server can read) and label them
        `weight_version`. Returns the server's reply; `success: false` raises EngineHTTPError."""
        path = "/update_weights_from_disk"
        body = {
            "model_path": model_path,
            "weight_version": weight_version,
            "abort_all_requests": abort_all_requests,
            "flush_cache": flush_cache,
        }
        reply = await self._call_json("POST", path, body)
        if reply.get("success") is not True:
            raise EngineHTTPError(200, str(reply.get("message", "success is not true")), self.base_url + path)
        return reply

    async def pause_generation(self, mode: PauseMode = "in_place") -> dict[str, Any]:
        """Pause: `in_place` freezes running requests with their KV, `retract` requeues them, `abort` ends
        them (they return finish_reason abort). New /generate calls wait until continue_generation."""
        return await self._call_json("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> dict[str, Any]:
        return await self._call_json("POST", "/continue_generation", {})

    async def abort_request(self, rid: str | None = None, abort_all: bool = False) -> None:
        """Abort one request by rid, or every request. The aborted calls return finish_reason abort."""
        if (rid is None) == (not abort_all):
            raise ValueError("abort_request needs exactly one of rid=... or abort_all=True")
        body: dict[str, Any] = {"abort_all": True} if abort_all else {"rid": rid}
        await self._call("POST", "/abort_request", body)

    async def load(self) -> int:
        """Requests the engine holds now, running and queued, summed over its DP ranks."""
        return (await self.load_detail()).requests

    async def load_detail(self) -> EngineLoad:
        """SGLang's `/get_load`, summed over the DP ranks (engine_load). Never through sglang-router (it
        404s /get_load): ask each engine."""
        reply = await self._call("GET", "/get_load")
        return parse_load(_decode_json(reply, self.base_url + "/get_load"))

    async def server_info(self) -> dict[str, Any]:
        """`/server_info` (2026 SGLang), falling back to `/get_server_info`: the server's arguments
        (`max_running_requests`, `context_length`...) and `internal_states` (per DP rank: server
        arguments and `effective_max_running_requests_per_dp`; no request counts: see `load`)."""
        try:
            return await self._call_json("GET", "/server_info")
        except EngineHTTPError as exc:
            if exc.status != 404:
                raise
        return await self._call_json("GET", "/get_server_info")

    async def init_weights_update_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> dict[str, Any]:
        """Join the trainer's torch.distributed group for NCCL weight broadcasts (SGLang's GPU path).
        Fields exactly as SGLang 0.5.x's InitWeightsUpdateGroupReqInput; `success: false` raises."""
        body = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        return await self._control("/init_weights_update_group", body)

    async def update_weights_from_distributed(
        self,
        *,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        weight_version: str,
        group_name: str = "weight_update_group",
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        load_format: str | None = None,
    ) -> dict[str, Any]:
        """Receive the named tensors over the group while the trainer broadcasts them (the call stays
        open until they arrived). Fields as SGLang 0.5.x's UpdateWeightsFromDistributedReqInput."""
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError(
                f"names, dtypes and shapes must be parallel lists, got {len(names)}, {len(dtypes)}, "
                f"{len(shapes)} entries"
            )
        body: dict[str, Any] = {
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": group_name,
            "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests,
            "weight_version": weight_version,
        }
        if load_format is not None:
            body["load_format"] = load_format
        return await self._control("/update_weights_from_distributed", body)

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict[str, Any]:
        return await self._control("/destroy_weights_update_group", {"group_name": group_name})

    async def _control(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        reply = await self._call_json("POST", path, body)
        if reply.get("success") is not True:
            raise EngineHTTPError(200, str(reply.get("message", "success is not true")), self.base_url + path)
        return reply

    async def flush_cache(self) -> str:
        """Flush the prefix cache. Returns SGLang's plain-text reply; 400 (requests running) raises."""
        reply = await self._call("POST", "/flush_cache")
        return reply.body.decode("utf-8", errors="replace")


def encode_json_body(body: dict[str, Any]) -> bytes:
    """A request body as EngineClient sends it: compact UTF-8 JSON (json.dumps if pydantic-core refuses)."""
    try:
        return pydantic_core.to_json(body)
    except pydantic_core.PydanticSerializationError:  # e.g. a lone surrogate, which json escapes
        return json.dumps(body).encode()


def _decode_json(reply: _Reply, url: str) -> object:
    try:
        # json.loads accepts NaN/Infinity literals; the validators reject them with a clear defect.
        return json.loads(reply.body)
    except ValueError:
        snippet = reply.body[:200].decode("utf-8", errors="replace")
        raise EngineProtocolError(f"{url} replied non-JSON body {snippet!r}", url=url) from None
