"""Sampling maths of the embedded engine: request validation, next-token choice and log-probs.

Everything here is a pure function of its inputs (no model, no threads), so it is unit-tested alone.

Log-prob meaning (SGLang's): the log-prob reported for a sampled
token is `log_softmax(logits / T)` in fp32, taken BEFORE top-p / top-k / min-p truncation. Greedy rows
(temperature < 1e-6) report `log_softmax(logits)` (T = 1), as SGLang does.

Randomness: each request owns a `torch.Generator`; per decode step it draws exactly one uniform number,
and the token is chosen by inverse-CDF over the truncated distribution. Hence the same seed and the
same prompt give the same tokens whatever other requests share the batch, up to float rounding: other
batch shapes move the logits by ~1e-6 (fp32) or ~1e-2 (bf16), and where the uniform falls that close to
a token's CDF boundary another token is chosen (docs/benchmarks_log.md: on SmolLM2's 49,152-token
vocabulary at T = 1, 3 of 8 fp32 sequences and 8 of 8 bf16 ones differed within 24 tokens).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

GREEDY_TEMPERATURE = 1e-6

# SamplingParams keys SGLang knows. A key outside this set is an error (SGLang builds
# `SamplingParams(**params)`, whose TypeError becomes HTTP 400).
_SUPPORTED_KEYS = frozenset(
    {
        "max_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "stop_token_ids",
        "stop",
        "ignore_eos",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "no_stop_trim",
        "n",
        "sampling_seed",
    }
)
# Known to SGLang but not implemented here: accepted only at their neutral value.
_NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "stop_regex": (None, [], ""),
    "min_new_tokens": (0, None),
    "frequency_penalty": (0, 0.0, None),
    "presence_penalty": (0, 0.0, None),
    "repetition_penalty": (1, 1.0, None),
    "json_schema": (None,),
    "regex": (None,),
    "ebnf": (None,),
    "structural_tag": (None,),
    "logit_bias": (None, {}),
    "custom_params": (None, {}),
}


@dataclass(frozen=True)
class RequestSampling:
    """Validated `sampling_params` of one request."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    sampling_seed: int | None = None
    # SGLang's `stop` strings (sampling_params.py normalize: a string becomes a list of one) and
    # `stop_str_max_len`: how many trailing output tokens, plus one, are decoded to look for them.
    stop: tuple[str, ...] = ()
    stop_window: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def logprob_temperature(self) -> float:
        """Temperature of the distribution whose log-probs are reported (1.0 when greedy)."""
        return 1.0 if self.greedy else self.temperature


def _number(params: Mapping[str, Any], key: str, default: float) -> float:
    value = params.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"sampling_params.{key} must be a number, got {value!r}")
    try:
        number = float(value)
    except OverflowError:  # an integer beyond any float
        number = math.inf
    if not math.isfinite(number):
        raise ValueError(f"sampling_params.{key} must be a finite number, got {value!r:.40}")
    return number


def _integer(params: Mapping[str, Any], key: str, default: int | None) -> int | None:
    value = params.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"sampling_params.{key} must be an integer, got {value!r}")
    return value


def _flag(params: Mapping[str, Any], key: str, default: bool) -> bool:
    value = params.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"sampling_params.{key} must be a boolean, got {value!r}")
    return value


def _stop_strings(
    raw: Mapping[str, Any], encode: Callable[[str], list[int]] | None
) -> tuple[tuple[str, ...], int]:
    """(stop strings, stop window) as SGLang's SamplingParams.normalize makes them; ValueError without a
    tokenizer (raise_if_tokenizer_required: matching needs a decode) or for a value that is not a string
    or a list of strings."""
    stop = raw.get("stop")
    if stop is None or stop == []:
        return (), 0
    strings = [stop] if isinstance(stop, str) else stop
    if not isinstance(strings, list) or not all(isinstance(s, str) for s in strings):
        raise ValueError(f"sampling_params.stop must be a string or a list of strings, got {stop!r}")
    if encode is None:
        raise ValueError(
            f"stop={strings!r} is unavailable when skip_tokenizer_init=True "
            "(requires tokenizer to decode tokens to text for matching)."
        )
    return tuple(strings), max(len(encode(s)) for s in strings)


def parse_sampling_params(
    raw: object,
    *,
    vocab_size: int,
    default_max_new_tokens: int = 128,
    encode: Callable[[str], list[int]] | None = None,
) -> RequestSampling:
    """Validate a request's `sampling_params` dict; raises ValueError naming the bad key. `encode` (the
    engine's tokenizer, no special tokens added) sizes the stop strings' window; None: no tokenizer."""
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ValueError(f"sampling_params must be an object, got {type(raw).__name__}")
    unknown = sorted(k for k in raw if k not in _SUPPORTED_KEYS and k not in _NEUTRAL_VALUES)
    if unknown:
        raise ValueError(f"sampling_params has unknown key(s) {unknown}")
    for key, neutral in _NEUTRAL_VALUES.items():
        if key in raw and raw[key] not in neutral:
            raise ValueError(f"sampling_params.{key}={raw[key]!r} is not supported by the embedded engine")

    max_new_tokens = _integer(raw, "max_new_tokens", default_max_new_tokens)
    assert max_new_tokens is not None
    temperature = _number(raw, "temperature", 1.0)
    top_p = _number(raw, "top_p", 1.0)
    top_k = _integer(raw, "top_k", -1)
    assert top_k is not None
    min_p = _number(raw, "min_p", 0.0)
    n = _integer(raw, "n", 1)
    assert n is not None
    seed = _integer(raw, "sampling_seed", None)

    if max_new_tokens < 0:
        raise ValueError(f"sampling_params.max_new_tokens must be >= 0, got {max_new_tokens}")
    if temperature < 0.0:
        raise ValueError(f"sampling_params.temperature must be >= 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"sampling_params.top_p must be in (0, 1], got {top_p}")
    if top_k == 0 or top_k < -1:
        raise ValueError(f"sampling_params.top_k must be -1 (whole vocabulary) or >= 1, got {top_k}")
    if not 0.0 <= min_p <= 1.0:
        raise ValueError(f"sampling_params.min_p must be in [0, 1], got {min_p}")
    if n < 1:
        raise ValueError(f"sampling_params.n must be >= 1, got {n}")
    if seed is not None and not 0 <= seed < 2**64:  # a torch generator's seed is 64 bits
        raise ValueError(f"sampling_params.sampling_seed must be in [0, 2**64), got {seed}")

    stop_raw = raw.get("stop_token_ids") or []
    if not isinstance(stop_raw, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in stop_raw
    ):
        raise ValueError(f"sampling_params.stop_token_ids must be a list of integers, got {stop_raw!r}")
    bad_stop = [t for t in stop_raw if not 0 <= t < vocab_size]
    if bad_stop:
        raise ValueError(
            f"sampling_params.stop_token_ids {bad_stop} are outside the vocabulary [0, {vocab_size})"
        )

    stop, stop_window = _stop_strings(raw, encode)
    return RequestSampling(
        stop=stop,
        stop_window=stop_window,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        stop_token_ids=tuple(stop_raw),
        ignore_eos=_flag(raw, "ignore_eos", False),
        skip_special_tokens=_flag(raw, "skip_special_tokens", True),
        spaces_between_special_tokens=_flag(raw, "spaces_between_special_tokens", True),
        no_stop_trim=_flag(raw, "no_stop_trim", False),
        n=n,
        sampling_seed=seed,
    )


@dataclass(frozen=True)
class BatchSampling:
    """Per-row sampling settings of a decode batch, as CPU tensors of shape (B,)."""

    temperature: torch.Tensor  # float32; already 1.0 on greedy rows
    greedy: torch.Tensor  # bool
    top_p: torch.Tensor  # float32
    top_k: torch.Tensor  # int64; the vocabulary size where the request said -1
    min_p: torch.Tensor  # float32
    vocab_size: int

    @property
    def needs_truncation(self) -> bool:
        """False when every row samples from the full distribution (the sort can be skipped)."""
        truncating = (self.top_p < 1.0) | (self.min_p > 0.0) | (self.top_k < self.vocab_size)
        return bool(truncating.any())


def batch_sampling(params: list[RequestSampling], vocab_size: int) -> BatchSampling:
    """Stack per-request settings into per-row tensors (CPU)."""
    return BatchSampling(
        temperature=torch.tensor([p.logprob_temperature for p in params], dtype=torch.float32),
        greedy=torch.tensor([p.greedy for p in params], dtype=torch.bool),
        top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32),
        top_k=torch.tensor([vocab_size if p.top_k < 0 else min(p.top_k, vocab_size) for p in params]),
        min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32),
        vocab_size=vocab_size,
    )


def scaled_log_softmax(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits / T) in fp32. logits (B, V), temperature (B,) -> (B, V)."""
    return torch.log_softmax(logits.float() / temperature.to(logits.device).unsqueeze(-1), dim=-1)


def truncated_probs(
    log_probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Top-k, then top-p (nucleus), then min-p truncation of the distribution exp(log_probs).

    Returns unnormalised probabilities in VOCABULARY order (B, V), zero where truncated, so that the
    inverse-CDF draw walks the same order whether or not a row is truncated. The most likely token is
    always kept; top-p keeps the smallest prefix (by descending probability) whose mass reaches top_p.
    """
    sorted_logp, order = torch.sort(log_probs, dim=-1, descending=True)
    sorted_probs = sorted_logp.exp()
    ranks = torch.arange(sorted_probs.shape[-1], device=sorted_probs.device).unsqueeze(0)
    keep = ranks < top_k.to(sorted_probs.device).unsqueeze(-1)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    keep &= mass_before <= top_p.to(sorted_probs.device).unsqueeze(-1)
    keep &= sorted_probs >= min_p.to(sorted_probs.device).unsqueeze(-1) * sorted_probs[:, :1]
    keep[:, 0] = True
    keep_in_vocab_order = torch.zeros_like(keep).scatter_(-1, order, keep)
    return log_probs.exp() * keep_in_vocab_order


def inverse_cdf_choice(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Index i per row with P(i) ∝ weights[i]: the first i whose cumulative weight exceeds u * total.

    weights (B, V) >= 0 with a positive row sum; uniforms (B,) in [0, 1). Zero-weight entries are never
    chosen."""
    cdf = torch.cumsum(weights.double(), dim=-1)
    target = uniforms.to(cdf.device, torch.float64).unsqueeze(-1) * cdf[:, -1:]
    index = torch.searchsorted(cdf, target, right=True)
    return index.clamp_(max=weights.shape[-1] - 1).squeeze(-1)


def sample_next_tokens(
    logits: torch.Tensor, settings: BatchSampling, uniforms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose one token per row and return (token ids (B,) int64, their log-probs (B,) float32).

    logits: (B, V) next-token logits of the model; uniforms: (B,) one draw per row from the row's own
    generator (ignored on greedy rows, which take the argmax of the raw logits)."""
    log_probs = scaled_log_softmax(logits, settings.temperature)
    if settings.needs_truncation:
        weights = truncated_probs(log_probs, settings.top_k, settings.top_p, settings.min_p)
    else:
        weights = log_probs.exp()
    sampled = inverse_cdf_choice(weights, uniforms)
    greedy = settings.greedy.to(logits.device)
    if bool(greedy.any()):
        sampled = torch.where(greedy, logits.argmax(dim=-1), sampled)
    chosen_logprobs = log_probs.gather(-1, sampled.unsqueeze(-1)).squeeze(-1)
    return sampled, chosen_logprobs


def draw_uniforms(generators: list[torch.Generator]) -> torch.Tensor:
    """One uniform in [0, 1) per row, each from that row's generator (CPU generators), shape (B,)."""
    return torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in generators])
