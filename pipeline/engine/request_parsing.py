"""A /generate body, validated, into the engine's requests: prompts (token ids or text), rids,
sampling parameters, LoRA adapters and log-prob starts. Every malformed body raises ValueError, which
the handler answers with 400 and the message.
"""

from __future__ import annotations

import uuid
from typing import Any

from pipeline.engine.engine_state import EngineState, Tracked
from pipeline.engine.sampling import parse_sampling_params

SAMPLES_PER_CALL_PER_BATCH_SLOT = 16
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default when a request names none


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
        for i, t in enumerate(texts):
            _check_unicode(t, f"text[{i}]" if isinstance(text, list) else "text")
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


def _check_unicode(text: str, where: str) -> None:
    """JSON's \\ud800 escapes decode to lone surrogates, which are not text: no tokenizer takes them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{where} holds a lone surrogate ({text[exc.start]!a}) at position {exc.start}: not valid "
            "Unicode text"
        ) from None


def _check_prompt(ids: list[Any], where: str, vocab_size: int, context_length: int) -> None:
    if len(ids) >= context_length:
        raise ValueError(
            f"The input ({len(ids)} tokens) is longer than the model's context length "
            f"({context_length} tokens)."
        )
    # The common case in C (a long batch would hold the event loop in a Python loop); the slow walk
    # below only finds the position of a bad entry.
    if set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < vocab_size:
        return
    for pos, token in enumerate(ids):
        if not _is_int(token) or not 0 <= token < vocab_size:
            raise ValueError(f"{where}[{pos}] = {token!r} is not a token id in [0, {vocab_size})")


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


def routed_experts_starts(body: dict[str, Any], prompts: list[list[int]]) -> int | None:
    """`routed_experts_start_len` of a request with `return_routed_experts` (None without): an int in [0,
    the shortest prompt's length] (SGLang's GenerateReqInput: "Must be in [0, prompt_tokens]"). ValueError
    -> 400."""
    if not body.get("return_routed_experts", False):
        return None
    start = body.get("routed_experts_start_len", 0)
    shortest = min(len(p) for p in prompts)
    if not _is_int(start) or not 0 <= start <= shortest:
        raise ValueError(
            f"routed_experts_start_len must be an int in [0, {shortest}] (the prompt), got {start!r}"
        )
    return int(start)


def build_requests(body: dict[str, Any], state: EngineState) -> tuple[list[Tracked], bool]:
    """Validate a /generate body into tracked requests (not yet submitted). Raises ValueError."""
    scheduler = state.require_scheduler()
    if body.get("top_logprobs_num") not in (None, 0):
        raise ValueError("top_logprobs_num > 0 is not supported by the embedded engine")
    if body.get("token_ids_logprob") is not None:
        raise ValueError("token_ids_logprob is not supported by the embedded engine")
    for flag in ("return_logprob", "stream", "return_text_in_logprobs", "return_routed_experts"):
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
    tokenizer = state.tokenizer
    encode = (
        None if tokenizer is None else lambda text: list(tokenizer.encode(text, add_special_tokens=False))
    )
    params = [
        parse_sampling_params(
            p, vocab_size=scheduler.vocab_size, default_max_new_tokens=default_new, encode=encode
        )
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
    routed = routed_experts_starts(body, prompts)
    tracked: list[Tracked] = []
    try:
        for i, (rid, ids, sampling) in enumerate(zip(rids, prompts, params, strict=True)):
            item = state.track(rid, list(ids), sampling, stream=stream, lora_name=adapters[i])
            tracked.append(item)
            item.request.logprob_start_len = starts[i]
            item.return_logprob = bool(body.get("return_logprob", False))
            item.text_in_logprobs = bool(body.get("return_text_in_logprobs", False))
            item.index = i if (is_batch and stream) else None
            item.request.priority = priority if priority is not None else 0
            if routed is not None:  # recorded only when the engine runs with --enable-return-routed-experts
                item.request.return_routed_experts = state.config.enable_return_routed_experts
                item.routed_experts_start = routed
                item.request.routed_experts_start = routed
    except BaseException:
        # All or nothing: a batch refused halfway must not leave its first items registered (their rids
        # would be "still running" forever, and each held its prompt and adapter).
        for item in tracked:
            state.untrack(item)
        raise
    return tracked, is_batch
