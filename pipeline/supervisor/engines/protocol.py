"""SGLang `/generate` wire protocol: request sampling params, parsed results, typed errors.

Pure data and validation, no I/O. The request and response shapes follow SGLang's native HTTP API
(0.5.x); docs/architecture.md "Contract 2" is the contract.
"""

from __future__ import annotations

import base64
import binascii
import math
import re
import sys
from array import array
from dataclasses import dataclass
from typing import Any, Literal, cast

FinishType = Literal["stop", "length", "abort"]
FINISH_TYPES: frozenset[str] = frozenset({"stop", "length", "abort"})

_DECIMAL = re.compile(r"[0-9]+")


class EngineError(Exception):
    """Base of every error raised while talking to an inference engine."""


class EngineProtocolError(EngineError):
    """A response that breaks the wire contract. `defect` says what was wrong; `rid` which request."""

    def __init__(self, defect: str, *, rid: str | None = None, url: str | None = None) -> None:
        self.defect = defect
        self.rid = rid
        self.url = url
        where = f" from {url}" if url else ""
        super().__init__(f"engine response for rid={rid!r}{where} broke the protocol: {defect}")


class EngineHTTPError(EngineError):
    """An HTTP error status (4xx/5xx) or a control call that reported `success: false`."""

    def __init__(self, status: int, message: str, url: str) -> None:
        self.status = status
        self.message = message
        self.url = url
        super().__init__(f"HTTP {status} from {url}: {message}")


class EngineUnavailable(EngineError):
    """The engine could not be reached: connection refused or lost, timeout, circuit open, pool empty.

    `maybe_sent` is False when the request certainly never reached the server (connection refused,
    circuit open, no pool member), so sending it elsewhere cannot duplicate work.
    """

    def __init__(self, url: str, reason: str, *, maybe_sent: bool = False) -> None:
        self.url = url
        self.reason = reason
        self.maybe_sent = maybe_sent
        super().__init__(f"engine {url} unavailable: {reason}")


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of one request. Defaults are the ones whose log-probs the learner can reproduce
    (log_softmax(logits / temperature), no nucleus truncation)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    # Stop strings (SGLang's `stop`): the engine ends the turn once its decoded output contains one. The
    # tokens are never trimmed (`no_stop_trim`): every token sampled, the whole stop string's included,
    # reaches the trainer; `GenerateResult.matched` says which string ended the turn.
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0.0):
            # SGLang refuses NaN and infinities (as JSON they are not even valid: a 400).
            raise ValueError(
                f"SamplingParams.temperature must be a finite number >= 0, got {self.temperature}"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"SamplingParams.top_k must be -1 (whole vocabulary) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"SamplingParams.min_p must be in [0, 1], got {self.min_p}")
        if self.max_new_tokens < 0:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if not all(isinstance(s, str) and s for s in self.stop):
            # SGLang would accept "", which every output contains: the turn would end at its first token.
            raise ValueError(f"SamplingParams.stop must hold non-empty strings, got {self.stop!r}")

    def to_wire(self) -> dict[str, Any]:
        """SGLang `sampling_params`. Special tokens are kept and stop tokens not trimmed, because the
        trainer needs exactly the ids the engine produced."""
        wire: dict[str, Any] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "max_new_tokens": self.max_new_tokens,
            "stop_token_ids": list(self.stop_token_ids),
            "skip_special_tokens": False,
            "no_stop_trim": True,
        }
        if self.seed is not None:
            wire["sampling_seed"] = self.seed
        if self.stop:
            wire["stop"] = list(self.stop)
        return wire


@dataclass(frozen=True)
class RoutedExpertsRequest:
    """Ask an MoE engine for the experts it routed each position to (SGLang's `return_routed_experts`,
    `routed_experts_start_len`): positions [start_len, prompt + completion - 1), `per_position` =
    layers x top-k ids each (what the reply is checked against)."""

    start_len: int
    per_position: int

    def __post_init__(self) -> None:
        if self.start_len < 0 or self.per_position < 1:
            raise ValueError(
                f"RoutedExpertsRequest needs start_len >= 0 and per_position >= 1, got {self.start_len}, "
                f"{self.per_position}"
            )


@dataclass
class GenerateResult:
    """One completed `/generate` call. `output_ids`, `logprobs` and `token_versions` have equal length;
    `logprobs[i]` is the engine's log-prob of `output_ids[i]` (finite, <= 0 for a real engine).

    `versions_exact`: the engine said which version produced each token (SGLang's `weight_versions`
    spans, or the embedded engine's `output_token_weight_versions`); False when it reported one
    `weight_version` for the whole reply, which is every token's only when no weight update happened
    while it ran. `prompt_tokens` is None for a request aborted in SGLang's waiting queue (its reply
    has neither prompt_tokens nor cached_tokens)."""

    rid: str
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishType
    weight_version: str
    token_versions: list[str]
    prompt_tokens: int | None
    completion_tokens: int
    cached_tokens: int
    abort_message: str | None = None
    versions_exact: bool = False
    matched: str | None = None  # the stop string that ended it (finish "stop" on a string, not a token)
    # With a RoutedExpertsRequest: the int32 expert ids of positions [start_len, prompt + completion - 1),
    # `per_position` per position, C-ordered (position, layer, k); None for an abort that carried none.
    routed_experts: array[int] | None = None


def version_to_int(version: str) -> int:
    """Policy version of a wire weight version: "default" -> 0, "12" -> 12."""
    if version == "default":
        return 0
    if isinstance(version, str) and _DECIMAL.fullmatch(version):
        return int(version)
    raise EngineProtocolError(f"weight_version {version!r} is neither 'default' nor a decimal integer")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_logprob_entries_fast(entries: object) -> tuple[list[float], list[int]] | None:
    """The common all-valid case at C speed; None means "check entry by entry for the defect"."""
    if not isinstance(entries, list) or not all(type(e) is list and len(e) >= 2 for e in entries):
        return None
    logprobs = [e[0] for e in entries]
    ids = [e[1] for e in entries]
    if not all(type(x) is float for x in logprobs) or not all(type(t) is int for t in ids):
        return None
    # A NaN or an infinity makes the sum non-finite; finite log-probs cannot overflow it.
    if not math.isfinite(sum(logprobs)):
        return None
    return logprobs, ids


def _parse_logprob_entries(entries: object, rid: str) -> tuple[list[float], list[int]]:
    fast = _parse_logprob_entries_fast(entries)
    if fast is not None:
        return fast
    if not isinstance(entries, list):
        raise EngineProtocolError(
            f"meta_info.output_token_logprobs is {type(entries).__name__}, expected a list", rid=rid
        )
    logprobs: list[float] = []
    ids: list[int] = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, list) or len(entry) < 2:
            raise EngineProtocolError(
                f"meta_info.output_token_logprobs[{i}] is {entry!r}, expected [logprob, token_id, text]",
                rid=rid,
            )
        logprob, token_id = entry[0], entry[1]
        if logprob is None:
            raise EngineProtocolError(f"meta_info.output_token_logprobs[{i}] logprob is null", rid=rid)
        if isinstance(logprob, bool) or not isinstance(logprob, (int, float)) or not math.isfinite(logprob):
            raise EngineProtocolError(
                f"meta_info.output_token_logprobs[{i}] logprob {logprob!r} is not a finite number", rid=rid
            )
        if not _is_int(token_id):
            raise EngineProtocolError(
                f"meta_info.output_token_logprobs[{i}] token id {token_id!r} is not an int", rid=rid
            )
        logprobs.append(float(logprob))
        ids.append(cast(int, token_id))
    return logprobs, ids


def _parse_finish(meta: dict[str, Any], rid: str) -> tuple[FinishType, str | None]:
    finish = meta.get("finish_reason")
    if not isinstance(finish, dict):
        raise EngineProtocolError(f"meta_info.finish_reason is {finish!r}, expected an object", rid=rid)
    kind = finish.get("type")
    if kind not in FINISH_TYPES:
        raise EngineProtocolError(
            f"meta_info.finish_reason.type {kind!r} is not one of {sorted(FINISH_TYPES)}", rid=rid
        )
    message = finish.get("message") if kind == "abort" else None
    return cast(FinishType, kind), (str(message) if message is not None else None)


def _matched_string(finish: dict[str, Any]) -> str | None:
    """The stop string of a `{"type": "stop", "matched": <str>}` finish (a stop token's `matched` is an
    int: schedule_batch.py's FINISH_MATCHED_STR vs FINISH_MATCHED_TOKEN)."""
    matched = finish.get("matched")
    return matched if finish.get("type") == "stop" and isinstance(matched, str) else None


def _parse_versions(meta: dict[str, Any], n: int, rid: str) -> tuple[str, list[str], bool]:
    """(weight_version, one version per output token, whether the engine said per token)."""
    weight_version = meta.get("weight_version", "default")
    if not isinstance(weight_version, str):
        raise EngineProtocolError(f"meta_info.weight_version {weight_version!r} is not a string", rid=rid)
    per_token = meta.get("output_token_weight_versions")
    if per_token is not None:
        if not isinstance(per_token, list) or not all(isinstance(v, str) for v in per_token):
            raise EngineProtocolError(
                "meta_info.output_token_weight_versions is not a list of strings", rid=rid
            )
        if len(per_token) != n:
            raise EngineProtocolError(
                f"meta_info.output_token_weight_versions has {len(per_token)} entries for {n} output tokens",
                rid=rid,
            )
        return weight_version, list(per_token), True
    spans = meta.get("weight_versions")
    if spans is not None:
        return weight_version, _versions_of_spans(spans, n, rid), True
    return weight_version, [weight_version] * n, False


def _versions_of_spans(spans: object, n: int, rid: str) -> list[str]:
    """SGLang's `meta_info.weight_versions` (utils/weight_versions.py): `[{"version", "start", "end"}]`,
    output-token index ranges [start, end) per version, in order, covering the completion."""
    if not isinstance(spans, list):
        raise EngineProtocolError(
            f"meta_info.weight_versions is {type(spans).__name__}, expected a list", rid=rid
        )
    versions: list[str] = []
    for i, span in enumerate(spans):
        if (
            not isinstance(span, dict)
            or not isinstance(span.get("version"), str)
            or not _is_int(span.get("start"))
            or not _is_int(span.get("end"))
            or span["start"] != len(versions)
            or span["end"] <= span["start"]
        ):
            raise EngineProtocolError(
                f"meta_info.weight_versions[{i}] is {span!r}, expected "
                f"{{version, start={len(versions)}, end}}",
                rid=rid,
            )
        versions += [span["version"]] * (span["end"] - span["start"])
    if len(versions) != n:
        raise EngineProtocolError(
            f"meta_info.weight_versions covers {len(versions)} tokens of {n} output tokens", rid=rid
        )
    return versions


def _int_field(meta: dict[str, Any], key: str, rid: str, default: int | None = None) -> int:
    value = meta.get(key, default)
    if not _is_int(value):
        raise EngineProtocolError(f"meta_info.{key} is {value!r}, expected an int", rid=rid)
    return cast(int, value)


def _parse_complete_fast(obj: object, expected_rid: str | None) -> GenerateResult | None:
    """The common reply (a finished stop/length generation, every field valid) in one pass.

    Returns exactly what the checked path returns for such a reply, or None for anything else (an
    abort, a missing or odd field), which then goes through the checked path for its defect.
    """
    if type(obj) is not dict:
        return None
    meta = obj.get("meta_info")
    if type(meta) is not dict:
        return None
    rid = meta.get("id")
    finish = meta.get("finish_reason")
    if type(rid) is not str or (expected_rid is not None and rid != expected_rid) or type(finish) is not dict:
        return None
    kind = finish.get("type")
    if kind != "stop" and kind != "length":
        return None
    fast = _parse_logprob_entries_fast(meta.get("output_token_logprobs"))
    raw_ids = obj.get("output_ids")
    if fast is None or type(raw_ids) is not list:
        return None
    logprobs, ids = fast
    n = len(ids)
    # ids holds exact ints, so equal lists whose items are exact ints are the same ids.
    if raw_ids != ids or not all(type(t) is int for t in raw_ids):
        return None
    weight_version = meta.get("weight_version", "default")
    completion_tokens = meta.get("completion_tokens")
    prompt_tokens = meta.get("prompt_tokens")
    cached_tokens = meta.get("cached_tokens", 0)
    if (
        type(weight_version) is not str
        or "output_token_weight_versions" in meta
        or "weight_versions" in meta
        or type(completion_tokens) is not int
        or completion_tokens != n
        or type(prompt_tokens) is not int
        or type(cached_tokens) is not int
    ):
        return None
    return GenerateResult(
        rid=rid,
        output_ids=ids,
        logprobs=logprobs,
        finish_reason=kind,
        weight_version=weight_version,
        token_versions=[weight_version] * n,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        cached_tokens=cached_tokens,
        matched=_matched_string(finish),
    )


def parse_routed_experts(
    meta: dict[str, Any], request: RoutedExpertsRequest, result: GenerateResult
) -> array[int] | None:
    """`meta_info.routed_experts` (base64 of int32, shape (positions, layers, topk)) of a reply to a
    request that asked for them, checked against the positions it must cover. A server that ignored
    `routed_experts_start_len` (it lists every position from 0) is cut to the asked start."""
    rid = result.rid
    value = meta.get("routed_experts")
    if value is None:
        if result.finish_reason == "abort":
            return None
        raise EngineProtocolError(
            "meta_info.routed_experts is missing although return_routed_experts was sent: the engine must "
            "serve an MoE model and be launched with --enable-return-routed-experts (rollwise does so when "
            "learner.moe.record_routing or learner.moe.routing_replay is set)",
            rid=rid,
        )
    try:
        raw = base64.b64decode(value, validate=True) if isinstance(value, str) else None
    except (binascii.Error, ValueError):
        raw = None
    if raw is None or len(raw) % 4:
        raise EngineProtocolError("meta_info.routed_experts is not base64 of int32 values", rid=rid)
    ids: array[int] = array("i")
    ids.frombytes(raw)
    if sys.byteorder != "little":
        ids.byteswap()
    total = (result.prompt_tokens or 0) + result.completion_tokens - 1
    per = request.per_position
    expected = max(0, total - request.start_len) * per
    if len(ids) != expected:
        if request.start_len > 0 and len(ids) == max(0, total) * per:
            ids = ids[request.start_len * per :]  # a server that lists from position 0
        else:
            raise EngineProtocolError(
                f"meta_info.routed_experts holds {len(ids)} ids; positions [{request.start_len}, {total}) "
                f"x {per} per position make {expected}",
                rid=rid,
            )
    if ids and min(ids) < 0:
        raise EngineProtocolError("meta_info.routed_experts holds a negative expert id", rid=rid)
    return ids


def parse_generate_response(
    obj: object, *, expected_rid: str | None, routed_experts: RoutedExpertsRequest | None = None
) -> GenerateResult:
    """Validate one non-streaming `/generate` response object (sent with return_logprob=true; with
    `routed_experts` when the request asked for them).

    Unknown fields are ignored. Every breach raises EngineProtocolError naming the field. An abort with
    no tokens (a request aborted in the waiting queue) may omit `output_token_logprobs`.
    """
    result = _parse_generate(obj, expected_rid)
    if routed_experts is not None:
        meta = cast(dict[str, Any], cast(dict[str, Any], obj)["meta_info"])
        result.routed_experts = parse_routed_experts(meta, routed_experts, result)
    return result


def _parse_generate(obj: object, expected_rid: str | None) -> GenerateResult:
    fast = _parse_complete_fast(obj, expected_rid)
    if fast is not None:
        return fast
    rid = expected_rid or "?"
    if not isinstance(obj, dict):
        raise EngineProtocolError(f"response is a JSON {type(obj).__name__}, expected an object", rid=rid)
    meta = obj.get("meta_info")
    if not isinstance(meta, dict):
        error = obj.get("error")
        detail = f" (server error: {error!r})" if error is not None else ""
        raise EngineProtocolError(f"response has no meta_info object{detail}", rid=rid)
    got_rid = meta.get("id")
    if not isinstance(got_rid, str):
        raise EngineProtocolError(f"meta_info.id is {got_rid!r}, expected a string", rid=rid)
    if expected_rid is not None and got_rid != expected_rid:
        raise EngineProtocolError(f"meta_info.id {got_rid!r} differs from the request's rid", rid=rid)
    finish_reason, abort_message = _parse_finish(meta, got_rid)

    raw_ids = obj.get("output_ids")
    if raw_ids is not None and (not isinstance(raw_ids, list) or not all(type(t) is int for t in raw_ids)):
        raise EngineProtocolError("output_ids is not a list of ints", rid=got_rid)
    entries = meta.get("output_token_logprobs")
    if entries is None:
        if finish_reason == "abort" and not raw_ids:
            entries = []
        else:
            raise EngineProtocolError(
                "meta_info.output_token_logprobs is missing (was return_logprob sent?)", rid=got_rid
            )
    logprobs, logprob_ids = _parse_logprob_entries(entries, got_rid)
    output_ids = cast(list[int], raw_ids) if raw_ids is not None else logprob_ids
    if len(logprob_ids) != len(output_ids):
        raise EngineProtocolError(
            f"meta_info.output_token_logprobs has {len(logprob_ids)} entries for "
            f"{len(output_ids)} output_ids",
            rid=got_rid,
        )
    for i, (a, b) in enumerate(zip(output_ids, logprob_ids, strict=True)):
        if a != b:
            raise EngineProtocolError(
                f"output_ids[{i}]={a} but meta_info.output_token_logprobs[{i}] is for token {b}", rid=got_rid
            )
    completion_tokens = _int_field(meta, "completion_tokens", got_rid)
    if completion_tokens != len(output_ids):
        raise EngineProtocolError(
            f"meta_info.completion_tokens={completion_tokens} but {len(output_ids)} output_ids", rid=got_rid
        )
    weight_version, token_versions, exact = _parse_versions(meta, len(output_ids), got_rid)
    # A request aborted in SGLang's waiting queue gets a shorter meta_info (tokenizer_manager's
    # _handle_abort_req): no prompt_tokens, no cached_tokens.
    queued_abort = finish_reason == "abort" and "prompt_tokens" not in meta
    return GenerateResult(
        rid=got_rid,
        output_ids=list(output_ids),
        logprobs=logprobs,
        finish_reason=finish_reason,
        weight_version=weight_version,
        token_versions=token_versions,
        prompt_tokens=None if queued_abort else _int_field(meta, "prompt_tokens", got_rid),
        completion_tokens=completion_tokens,
        cached_tokens=_int_field(meta, "cached_tokens", got_rid, default=0),
        abort_message=abort_message,
        versions_exact=exact,
        matched=_matched_string(meta["finish_reason"]),
    )


def parse_input_logprobs(obj: object, input_ids: list[int], *, start: int, rid: str) -> list[float]:
    """The prompt log-probs of a `/generate` reply sent with `return_logprob` and `logprob_start_len =
    start`: `meta_info.input_token_logprobs` lists `[logprob, id, text]` for `input_ids[start:]`, entry 0
    null (it has no context in the reply). Returns the floats of entries 1.. (log P(ids[start + i] |
    ids[: start + i]) for i >= 1). EngineProtocolError naming the defect otherwise."""
    if not isinstance(obj, dict) or not isinstance(obj.get("meta_info"), dict):
        raise EngineProtocolError("response has no meta_info object", rid=rid)
    entries = obj["meta_info"].get("input_token_logprobs")
    expected = input_ids[start:]
    if not isinstance(entries, list) or len(entries) != len(expected):
        size = len(entries) if isinstance(entries, list) else entries
        raise EngineProtocolError(
            f"meta_info.input_token_logprobs has {size} entries, expected {len(expected)} "
            f"(logprob_start_len = {start} of {len(input_ids)} prompt tokens)",
            rid=rid,
        )
    values: list[float] = []
    for i, (entry, token) in enumerate(zip(entries, expected, strict=True)):
        if not isinstance(entry, list) or len(entry) < 2 or entry[1] != token:
            raise EngineProtocolError(
                f"meta_info.input_token_logprobs[{i}] is {entry!r}, expected [logprob, {token}, text]",
                rid=rid,
            )
        logprob = entry[0]
        if i == 0:
            continue  # null in SGLang: the first listed token has no logprob in the reply
        if isinstance(logprob, bool) or not isinstance(logprob, (int, float)) or not math.isfinite(logprob):
            raise EngineProtocolError(
                f"meta_info.input_token_logprobs[{i}] logprob {logprob!r} is not a finite number", rid=rid
            )
        values.append(float(logprob))
    return values
