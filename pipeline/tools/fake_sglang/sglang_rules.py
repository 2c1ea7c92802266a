"""What SGLang 0.5.23 accepts and how it refuses, as rules the fake applies.

Every rule names the SGLang source it follows (sgl-project/sglang, python/sglang/srt/...), or the
observation of a real server (built from SGLang's sources for its CPU backend, serving the tiny preset;
rollwise issue 29) where the two disagree: the observation wins.
"""

from __future__ import annotations

import base64
import json
import math
import struct
from typing import Any

from aiohttp import web

# GenerateReqInput fields (managers/io_struct.py). SGLang ignores any other top-level field (a pydantic
# dataclass with extra = ignore; sglang#36213 relies on it): the fake ignores them too, and records
# them so that a test can hold rollwise's client to the fields SGLang knows.
GENERATE_FIELDS = frozenset(
    {
        "text", "input_ids", "input_embeds", "image_data", "video_data", "audio_data", "sampling_params",
        "rid", "return_logprob", "logprob_start_len", "top_logprobs_num", "token_ids_logprob",
        "return_text_in_logprobs", "stream", "log_metrics", "return_hidden_states", "modalities",
        "session_params", "lora_path", "lora_id", "custom_logit_processor", "bootstrap_host",
        "bootstrap_port", "bootstrap_room", "data_parallel_rank", "routed_dp_rank", "background",
        "priority", "extra_key", "no_logs", "custom_labels", "return_bytes", "return_entropy",
        "return_routed_experts", "routed_experts_start_len", "return_sampling_mask",
    }
)  # fmt: skip
# SamplingParams keywords (sampling/sampling_params.py, a msgspec Struct). SGLang builds
# SamplingParams(**sampling_params): an unknown key is a TypeError, which generate_request does not
# catch (it catches ValueError only), so Starlette answers 500 "Internal Server Error". Observed: the
# request's state then leaks (its rid stays registered; the server ignores SIGTERM until killed).
SAMPLING_FIELDS = frozenset(
    {
        "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
        "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n",
        "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
        "spaces_between_special_tokens", "no_stop_trim", "custom_params", "stream_interval",
        "logit_bias", "sampling_seed",
    }
)  # fmt: skip
# The control routes' request structs (io_struct.py). They are FastAPI bodies: an unknown field is
# ignored like /generate's; the fake records it.
CONTROL_FIELDS: dict[str, frozenset[str]] = {
    # UpdateWeightFromDiskReqInput
    "/update_weights_from_disk": frozenset(
        {
            "model_path", "load_format", "abort_all_requests", "weight_version", "flush_cache", "is_async",
            "torch_empty_cache", "keep_pause", "recapture_cuda_graph", "token_step", "manifest",
        }
    ),
    "/load_lora_adapter": frozenset({"lora_name", "lora_path", "pinned", "lora_id"}),
    "/unload_lora_adapter": frozenset({"lora_name", "lora_id"}),
    "/pause_generation": frozenset({"mode"}),  # PauseGenerationReqInput
    "/continue_generation": frozenset({"torch_empty_cache"}),  # ContinueGenerationReqInput
    "/abort_request": frozenset({"rid", "abort_all", "finished_reason", "abort_message"}),  # AbortReq
}  # fmt: skip
PAUSE_MODES = ("abort", "retract", "in_place")

# entrypoints/http_server.py, /flush_cache: "Cache flushed..." 200, or 400 with `ret.message or
# "Flush cache failed.\n"` (text/plain) when the scheduler is not fully idle.
FLUSH_OK = (
    "Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting "
    "requests, the operation will not be performed.)\n"
)
FLUSH_FAILED = "Flush cache failed.\n"
# managers/scheduler_components/weight_updater.py, flush_cache_after_weight_update: the assertion a
# flushing weight update hits when requests are queued or running (a paused scheduler: in_place keeps
# its running batch, retract moves it to the waiting queue). Nothing catches it: run_scheduler_process
# logs "Scheduler hit an exception" and SIGQUITs the server, which kills its whole process tree.
FLUSH_CRASH = (
    "Scheduler hit an exception: flush_cache_after_weight_update: AssertionError: Cache flush failed "
    "after updating weights"
)


def dumps(obj: object) -> str:
    """SGLang answers with ORJSONResponse: compact separators, UTF-8 kept as is. (For fault injection the
    fake can still write the NaN literal Python's json writes; orjson never would.)"""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def json_response(obj: object, status: int = 200) -> web.Response:
    # ORJSONResponse sends "application/json" with no charset parameter.
    return web.Response(status=status, body=dumps(obj).encode(), headers={"Content-Type": "application/json"})


def request_error(message: str, status: int = 400) -> web.Response:
    """A refused request: the OpenAI-style ErrorResponse of http_server.py's validation handler
    (`{"object": "error", "message", "type": <the status phrase>, "param": null, "code"}`). The real
    server observed answered every validation error of /generate this way."""
    phrase = {400: "Bad Request", 404: "Not Found", 500: "Internal Server Error"}.get(status, str(status))
    body = {"object": "error", "message": message, "type": phrase, "param": None, "code": status}
    return json_response(body, status)


def internal_server_error() -> web.Response:
    """Starlette's answer to an exception the route does not catch (a TypeError in /generate)."""
    return web.Response(status=500, text="Internal Server Error", content_type="text/plain")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _checked_int(text: str) -> int:
    value = int(text)
    if not -(2**63) <= value < 2**64:
        raise ValueError(f"integer {text} does not fit 64 bits")
    return value


def parse_json_body(raw: bytes) -> Any:
    """http_server.py's ORJSONRequest: stricter than Python's json on bare NaN/Infinity and on integers
    beyond 64 bits ("those now 400 instead of parsing"). ValueError naming the problem."""
    return json.loads(raw, parse_constant=_no_constant, parse_int=_checked_int)


def sampling_problem(sp: dict[str, Any]) -> str | None:
    """SamplingParams.verify (sampling/sampling_params.py): the message of the ValueError, or None."""
    temperature = sp.get("temperature", 1.0)
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature < 0.0:
        return f"temperature must be a non-negative finite number, got {temperature}."
    top_p = sp.get("top_p", 1.0)
    if not isinstance(top_p, (int, float)) or not 0.0 < top_p <= 1.0:
        return f"top_p must be in (0, 1], got {top_p}."
    min_p = sp.get("min_p", 0.0)
    if not isinstance(min_p, (int, float)) or not 0.0 <= min_p <= 1.0:
        return f"min_p must be in [0, 1], got {min_p}."
    top_k = sp.get("top_k", -1)
    if not isinstance(top_k, int) or (top_k < 1 and top_k != -1):
        return f"top_k must be -1 (disable) or at least 1, got {top_k}."
    max_new = sp.get("max_new_tokens", 128)
    if not isinstance(max_new, int) or max_new < 0:
        return f"max_new_tokens must be at least 0, got {max_new}."
    stop_ids = sp.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) for t in stop_ids):
        return f"stop_token_ids must be a list of ints, got {stop_ids!r}."
    stop = sp.get("stop")
    if stop is not None and not (
        isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))
    ):
        return f"stop must be a string or a list of strings, got {stop!r}."
    return None


def context_problem(prompt_tokens: int, max_new_tokens: int, context_length: int) -> str | None:
    """TokenizerManager._validate_one_request (managers/tokenizer_manager.py): a prompt as long as the
    context, or one that leaves no room for max_new_tokens, is refused (400); SGLang truncates only with
    --allow-auto-truncate."""
    if prompt_tokens >= context_length:
        return (
            f"The input ({prompt_tokens} tokens) is longer than the model's context length "
            f"({context_length} tokens)."
        )
    total = prompt_tokens + max_new_tokens
    if total > context_length:
        return (
            f"Requested token count exceeds the model's maximum context length of {context_length} tokens. "
            f"You requested a total of {total} tokens: {prompt_tokens} tokens from the input messages and "
            f"{max_new_tokens} tokens for the completion. Please reduce the number of tokens in the input "
            "messages or the completion to fit within the limit."
        )
    return None


def out_of_vocab(ids: list[int], vocab_size: int) -> int | None:
    """The first id outside [0, vocab_size), or None. TokenizerManager has `_validate_input_ids_in_vocab`
    but 0.5.23 never calls it: observed, such an id reaches the embedding lookup and kills the server."""
    for token in ids:
        if not 0 <= token < vocab_size:
            return token
    return None


def abort_finish(*, waiting: bool) -> dict[str, Any]:
    """finish_reason of an aborted request (managers/tokenizer_manager.py, _handle_abort_req and
    _handle_batch_output): one aborted while still in the waiting queue reports "Abort in waiting
    queue" and no status_code/err_type keys (its meta_info has no prompt_tokens or cached_tokens); one
    aborted while running is FINISH_ABORT() ("Aborted", status_code and err_type null) and its output
    holds the token of the one more decode step it still ran."""
    if waiting:
        return {"type": "abort", "message": "Abort in waiting queue"}
    return {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}


# --- routed experts (MoE routing replay) ---------------------------------------------------------------
# GenerateReqInput (managers/io_struct.py): `return_routed_experts: bool = False` and
# `routed_experts_start_len: int = 0`, "Absolute start position for returned routings; response covers
# [routed_experts_start_len, seqlen - 1). Must be in [0, prompt_tokens]." The scheduler collects them for
# a finished request (managers/scheduler_components/batch_result_processor.py,
# `_maybe_collect_routed_experts`: `capturer.get_topk(..., seqlen=req.seqlen, start_len=start_len)`,
# expected rows `seqlen - 1 - start_len`) only when the server has a capturer, i.e. was launched with
# `--enable-return-routed-experts` (state_capturer/routed_experts.py, `RoutedExpertsCapturer.create`
# returns None otherwise): a server without the flag answers without the key. The tokenizer manager puts
# them in `meta_info["routed_experts"]` as `pybase64.b64encode(val.numpy().tobytes())` of the int32
# tensor, "Underlying tensor shape is (token, layer, top_k)" (managers/tokenizer_manager.py,
# `_handle_batch_output`; state_capturer/routed_experts.py `extract_routed_experts_from_meta_info` decodes
# it with np.frombuffer(..., dtype=np.int32)); the layer axis is num_hidden_layers and the k axis
# num_experts_per_tok (RoutedExpertsCapturer.__init__). Sources read at sgl-project/sglang commits
# 024911f2 (routed_experts.py) and c60799d0 (tokenizer_manager.py).
# Not confirmed in SGLang's source: how a start outside [0, prompt_tokens] is refused. The fake answers
# 400 with the documented range, as the embedded engine does.


def routed_experts_problem(body: dict[str, Any], prompt_lengths: list[int]) -> str | None:
    """Why a /generate body's routed-experts fields are invalid, or None."""
    flag = body.get("return_routed_experts", False)
    if not isinstance(flag, bool):
        return f"return_routed_experts must be a boolean, got {flag!r}"
    start = body.get("routed_experts_start_len", 0)
    if not flag:
        return None
    shortest = min(prompt_lengths) if prompt_lengths else 0
    if not isinstance(start, int) or isinstance(start, bool) or not 0 <= start <= shortest:
        return f"routed_experts_start_len must be in [0, prompt_tokens] = [0, {shortest}], got {start!r}"
    return None


def encode_routed_experts(values: list[int]) -> str:
    """SGLang's wire form of the int32 (positions, layers, top_k) ids, flattened C-order."""
    return base64.b64encode(struct.pack(f"<{len(values)}i", *values)).decode("ascii")


def unknown_fields(path: str, body: object) -> list[str]:
    """Fields of a JSON object body that SGLang 0.5.23 does not define for `path` (top level)."""
    allowed = GENERATE_FIELDS if path == "/generate" else CONTROL_FIELDS.get(path)
    if allowed is None or not isinstance(body, dict):
        return []
    return sorted(k for k in body if k not in allowed)


def unknown_sampling_keys(body: object) -> list[str]:
    """Keys of /generate's sampling_params that SamplingParams does not take (a 500, see above)."""
    if not isinstance(body, dict):
        return []
    params = body.get("sampling_params")
    unknown: list[str] = []
    for item in params if isinstance(params, list) else [params]:
        if isinstance(item, dict):
            unknown += sorted(k for k in item if k not in SAMPLING_FIELDS)
    return unknown


# --- stop strings ------------------------------------------------------------------------------------
# sampling/sampling_params.py, `normalize`: `stop` (a string or a list) becomes the list `stop_strs`, and
# `stop_str_max_len` the longest of them in tokens (`tokenizer.encode(stop_str, add_special_tokens=False)`;
# in characters without a tokenizer). `raise_if_tokenizer_required`: with --skip-tokenizer-init a stop
# string is a ValueError (400) with this message.
# managers/schedule_batch.py, `Req.check_finished`, after every sampled token and in this order: the
# length limit (FINISH_LENGTH), a stop token id (FINISH_MATCHED_TOKEN, `matched` the id), then the stop
# strings: `tail_str = tokenizer.decode(output_ids[-(stop_str_max_len + 1):])` and the first stop string
# found in it ends the request as FINISH_MATCHED_STR, `{"type": "stop", "matched": "<the string>"}`.
# The output ids are never trimmed (detokenizer_manager.py returns `decode_ids` whole); only the text is
# (`trim_matched_stop`: cut before the string's first occurrence, or left whole with no_stop_trim).


def stop_strings(sampling_params: dict[str, Any]) -> list[str]:
    """`stop_strs` after normalize (the request was already checked by `sampling_problem`)."""
    stop = sampling_params.get("stop")
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def tokenizer_required_problem(stop_strs: list[str]) -> str:
    """raise_if_tokenizer_required's message for stop strings on a server without a tokenizer."""
    return (
        f"stop={stop_strs!r} is unavailable when skip_tokenizer_init=True "
        "(requires tokenizer to decode tokens to text for matching)."
    )


def stop_window(stop_strs: list[str], encode: Any | None) -> int:
    """`stop_str_max_len`: the longest stop string in tokens (`encode(text) -> ids`), else in characters."""
    if encode is None:
        return max((len(s) for s in stop_strs), default=0)
    return max((len(encode(s)) for s in stop_strs), default=0)


def matched_stop_string(stop_strs: list[str], output_ids: list[int], window: int, decode: Any) -> str | None:
    """The stop string check_finished finds after the latest token: the first of `stop_strs` (in request
    order) inside the decode of the last `window + 1` output ids, or None."""
    if not stop_strs or not output_ids:
        return None
    tail = decode(output_ids[-(window + 1) :])
    for stop in stop_strs:
        if stop in tail:
            return stop
    return None


def trim_matched_stop(text: str, finish: dict[str, Any] | None, no_stop_trim: bool) -> str:
    """The response `text` of a request that ended on a stop string (detokenizer_manager.py)."""
    matched = (finish or {}).get("matched")
    if no_stop_trim or not isinstance(matched, str) or not matched:
        return text
    position = text.find(matched)
    return text if position == -1 else text[:position]
