"""Continuous-batching scheduler of the embedded engine: one worker thread owns the model and KV cache.

Threading: `ContinuousBatcher` runs the model in ONE dedicated thread (torch releases the GIL inside its
kernels, so the aiohttp loop stays responsive). Other threads talk to it only through a thread-safe
command queue (`submit`, `abort`, `pause`, `resume`, `swap_weights`, `flush_cache`); replies come back
as `concurrent.futures.Future`s, and per-request progress through the request's `notify` callback,
which is invoked on the worker thread (the server wraps it in `loop.call_soon_threadsafe`).
`EngineRequest.output_ids / logprobs / versions` are append-only lists written only by the worker;
readers take a prefix of the length announced by `notify`.

KV cache layout: the running batch keeps, per layer, keys/values of shape (B, kv_heads, T, head_dim)
with LEFT padding, a (B, T) attention mask (0 on padding) and explicit per-row position ids, so a
row's numbers do not depend on what it is batched with. New requests are prefilled together (left
padded to their longest prompt), sample their first token from the prefill logits, and are merged
into the running batch by left-padding the shorter KV; finished rows are dropped between steps and
all-padding leading columns trimmed. Every decode step feeds each row's last sampled token. The KV
lives in `GrowableLayer`s (an HF `DynamicCache` whose layers write each step in place into a buffer
with spare room) because DynamicLayer's per-step concatenation copies the whole cache every token.

LoRA (pipeline.engine.lora_slots): while adapters are loaded the model is peft's PeftModel over the
base, and every forward passes `adapter_names` (each row's adapter, "__base__" for none), so one batch
mixes adapters; `attach_adapter`, `refill_adapter` and `detach_adapter` change it between two steps.

Prefix cache (pipeline.engine.prefix_cache, on unless `prefix_cache_bytes` is 0): each prefill first
takes the longest cached prefix of the request's sequence (at most all but its last token, and no
further than `logprob_start_len` when prompt log-probs are wanted) and computes only the rest. The
batch's KV then holds, per row, [padding | cached prefix | padding | new tokens]: the attention mask
hides both paddings and positions are explicit, so the row computes what a full prefill would. In one
admission round, requests whose sequences are identical up to that bound (a group's G episodes, or `n`
samples) are prefilled in two steps: one of them first, the others then reuse its KV. Every prefill
caches its sequence's KV, and a row that leaves the batch (finished, aborted or retracted) caches its
prompt + output, so the next turn of a multi-turn episode reuses the whole conversation so far. KV
computed under other weights never enters or stays: weight swaps, adapter refills, /flush_cache and a
failed step clear the cache and bump `kv_epoch`, and a row whose KV is older than the epoch is not
cached (in-place pauses keep such rows running across a swap). `EngineRequest.cached_tokens` is what
SGLang reports as `meta_info.cached_tokens`: the tokens its first prefill took from the cache.

Prompt log-probs: a request with `logprob_start_len` gets `input_logprobs` from its first prefill, the
log-softmax of the raw logits (SGLang's `input_token_logprobs`: one entry per token from the start, the
first null). A request with max_new_tokens = 0 that needs them is scored by a prefill of its own and
never joins the running batch.

Routed experts (MoE, `--enable-return-routed-experts`): a request with `return_routed_experts` records
the top-k experts of every position the engine forwards for it: its prefill's positions (all of them
again after a retraction) and, per decode step, the token fed. So a finished request holds prompt +
completion - 1 positions, the last sampled token never forwarded, as SGLang's capturer
(pipeline.engine.routed_experts). The prefix cache holds KV, not routing: such a request's prefill takes
from it only positions before its `routed_experts_start` (those the reply leaves out; filler rows in the
record), so every position it returns was computed by this request's own forwards. (SGLang's reply
covers [routed_experts_start_len, seqlen - 1) whatever its radix cache held; so does this one.)

Weight versions: every generated token is stamped with the weight version active when it was sampled
(`EngineRequest.versions`, sent as `meta_info.output_token_weight_versions`); `meta_info.weight_version`
is the version at finish. Weight swaps happen between two steps, never inside one. Rows that keep their
KV across a swap (in-place pause, or no pause at all) continue on the new weights with the old KV;
retracted rows recompute their KV with whatever weights are active when they are re-admitted.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import inspect
import logging
import queue
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from pipeline.contracts.malloc_trim import Trimmer
from pipeline.engine import routed_experts
from pipeline.engine.engine_metrics import EngineMetrics, version_value
from pipeline.engine.prefix_cache import LayerKV, PrefixCache, PrefixMatch
from pipeline.engine.routed_experts import Captured
from pipeline.engine.sampling import (
    RequestSampling,
    batch_sampling,
    draw_uniforms,
    sample_next_tokens,
)

log = logging.getLogger(__name__)

PauseMode = Literal["abort", "retract", "in_place"]
PAUSE_MODES: tuple[str, ...] = ("abort", "retract", "in_place")
GROW_MIN = 64  # spare KV positions added at least when a GrowableLayer is (re)allocated
# One more prefill forward costs about as much as this many more prompt tokens: the tiny preset on one
# CPU thread runs ~1.4 ms of fixed work per forward and ~60-75k prompt tokens/s (B=1 x 40 tokens: 1.95
# ms; B=64 x 40: 43 ms). On a GPU a forward's fixed cost is worth far more tokens, so there it splits
# more than it should; the embedded engine is the CPU stand-in for SGLang, not a GPU server.
PREFILL_CALL_COST_TOKENS = 128
# Shape-defining config fields: weights whose config differs here cannot reuse the running KV cache.
_ARCH_FIELDS = (
    "num_hidden_layers", "num_key_value_heads", "head_dim", "hidden_size", "vocab_size", "num_experts",
    "num_experts_per_tok",
)  # fmt: skip


def cache_kwarg(model: Any) -> str:
    """The name under which ``model.forward`` takes its KV cache: transformers 5.24 renamed
    ``past_key_values`` to ``cache`` and warns on the old name (an error under the test suite's filters),
    while the releases the package still supports (>= 4.51) only know the old one."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def abort_reason(message: str) -> dict[str, Any]:
    """SGLang's FINISH_ABORT json."""
    return {"type": "abort", "message": message, "status_code": None, "err_type": None}


@dataclass(eq=False)
class EngineRequest:
    """One sequence to generate. `notify(request, finished)` is called on the worker thread after each
    new token when `stream` is true, and once when the request finishes (finish_reason set first)."""

    rid: str
    prompt_ids: list[int]
    sampling: RequestSampling
    notify: Callable[[EngineRequest, bool], None]
    stream: bool = False
    priority: int = 0  # SGLang's request priority: higher is admitted first, ties in arrival order
    arrival: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    finish_time: float | None = None
    finish_version: str | None = None  # weight version active when the request finished
    adapter: str | None = None  # LoRA adapter the request runs with (its name inside the model)
    logprob_start_len: int | None = None  # first prompt position of input_logprobs; None = not wanted
    input_logprobs: list[float | None] | None = None  # set by the first prefill
    return_routed_experts: bool = False  # record routed experts (needs a capturing batcher)
    # First position whose routed experts the reply carries: a prefill never takes positions from this one
    # on from the prefix cache (their routing must be computed; the record's earlier rows may be filler).
    routed_experts_start: int = 0
    routed: list[torch.Tensor] = field(default_factory=list)  # (positions, layers, topk) int32 chunks
    cached_tokens: int | None = None  # tokens the first prefill took from the prefix cache
    kv_epoch: int = -1  # the batcher's kv_epoch when this request's KV was last computed from scratch
    generator: torch.Generator = field(init=False)

    def __post_init__(self) -> None:
        seed = self.sampling.sampling_seed
        self.generator = torch.Generator()
        self.generator.manual_seed(seed if seed is not None else random.getrandbits(63))

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class GrowableLayer(DynamicLayer):
    """A DynamicLayer whose keys/values live in a buffer with spare room along the sequence axis.

    DynamicLayer concatenates on every update, copying the whole cache each decode step; here a step
    writes its column in place and `keys`/`values` are views of the first `length` positions. The
    buffer grows by half its length when full (amortised O(1) per token). Only `update` and
    `get_seq_length` are supported (the engine never crops or reorders a layer; it builds a new one).
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True
        self._length = keys.shape[2]
        capacity = self._length + max(GROW_MIN, self._length // 2)
        self._key_buffer = self._allocate(keys, capacity)
        self._value_buffer = self._allocate(values, capacity)
        self._expose()

    @staticmethod
    def _allocate(content: torch.Tensor, capacity: int) -> torch.Tensor:
        batch, heads, length, dim = content.shape
        buffer = content.new_empty(batch, heads, capacity, dim)
        buffer[:, :, :length] = content
        return buffer

    def _expose(self) -> tuple[torch.Tensor, torch.Tensor]:
        keys = self._key_buffer[:, :, : self._length]
        values = self._value_buffer[:, :, : self._length]
        self.keys, self.values = keys, values
        return keys, values

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        end = self._length + key_states.shape[2]
        if end > self._key_buffer.shape[2]:
            capacity = end + max(GROW_MIN, end // 2)
            self._key_buffer = self._allocate(self._key_buffer[:, :, : self._length], capacity)
            self._value_buffer = self._allocate(self._value_buffer[:, :, : self._length], capacity)
        self._key_buffer[:, :, self._length : end] = key_states
        self._value_buffer[:, :, self._length : end] = value_states
        self._length = end
        return self._expose()

    def get_seq_length(self) -> int:
        return self._length


def growable_cache(kv: list[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    """A DynamicCache holding `kv` (per layer (B, kv_heads, T, head_dim)) in GrowableLayers."""
    cache = DynamicCache()
    cache.layers = [GrowableLayer(keys, values) for keys, values in kv]
    return cache


@dataclass
class RunningBatch:
    """Rows being decoded, with their left-padded KV cache (see module docstring)."""

    rows: list[EngineRequest]
    cache: DynamicCache
    mask: torch.Tensor  # (B, T) int64, 0 = padding
    next_pos: torch.Tensor  # (B,) int64, position id of the token fed next
    last_tokens: torch.Tensor  # (B,) int64, the token fed next (sampled, not yet in the cache)

    @property
    def size(self) -> int:
        return len(self.rows)

    def kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self.kv_of(self.cache)

    @staticmethod
    def kv_of(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
        # getattr: transformers types `layers` as a union that includes linear-attention layers.
        return [(getattr(layer, "keys"), getattr(layer, "values")) for layer in cache.layers]  # noqa: B009

    def select(self, keep: list[int]) -> RunningBatch:
        """The batch restricted to rows `keep`, with all-padding leading columns trimmed."""
        index = torch.tensor(keep, dtype=torch.long, device=self.mask.device)
        mask = self.mask.index_select(0, index)
        used = mask.any(dim=0).nonzero()
        start = int(used[0]) if used.numel() else mask.shape[1]
        kv = [
            (k.index_select(0, index)[:, :, start:], v.index_select(0, index)[:, :, start:])
            for k, v in self.kv()
        ]
        return RunningBatch(
            rows=[self.rows[i] for i in keep],
            cache=growable_cache(kv),
            mask=mask[:, start:],
            next_pos=self.next_pos.index_select(0, index),
            last_tokens=self.last_tokens.index_select(0, index),
        )

    def merge(self, other: RunningBatch) -> RunningBatch:
        """Both batches' rows in one batch; the shorter side is left-padded with masked zeros."""
        length = max(self.mask.shape[1], other.mask.shape[1])
        merged_kv = [
            (
                torch.cat([_left_pad(k1, length), _left_pad(k2, length)]),
                torch.cat([_left_pad(v1, length), _left_pad(v2, length)]),
            )
            for (k1, v1), (k2, v2) in zip(self.kv(), other.kv(), strict=True)
        ]
        return RunningBatch(
            rows=self.rows + other.rows,
            cache=growable_cache(merged_kv),
            mask=torch.cat([_left_pad_mask(self.mask, length), _left_pad_mask(other.mask, length)]),
            next_pos=torch.cat([self.next_pos, other.next_pos]),
            last_tokens=torch.cat([self.last_tokens, other.last_tokens]),
        )


def _left_pad(kv: torch.Tensor, length: int) -> torch.Tensor:
    missing = length - kv.shape[2]
    if missing == 0:
        return kv
    pad = kv.new_zeros(kv.shape[0], kv.shape[1], missing, kv.shape[3])
    return torch.cat([pad, kv], dim=2)


def _left_pad_mask(mask: torch.Tensor, length: int) -> torch.Tensor:
    missing = length - mask.shape[1]
    if missing == 0:
        return mask
    return torch.cat([mask.new_zeros(mask.shape[0], missing), mask], dim=1)


def prefill_buckets(lengths: list[int], call_cost_tokens: int) -> list[list[int]]:
    """Split one admission round into prefill forwards: indices into ``lengths``, grouped so that
    sum(rows x longest + call_cost_tokens) over the groups is least (each forward pads to its longest).

    Multi-turn prompts come in a few lengths far apart (guess-number's turns are 19, 31, 43, 55 and 67
    tokens): one forward over all of them pads every row to the longest and computes ~1.5x the tokens
    it needs. Optimal over contiguous runs of the sorted distinct lengths (a dynamic programme over at
    most max_batch values)."""
    if not lengths:
        return []
    by_length: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        by_length.setdefault(n, []).append(i)
    distinct = sorted(by_length)
    counts = [len(by_length[n]) for n in distinct]
    # best[j]: least cost of the first j distinct lengths; cut[j]: where the last group starts.
    best = [0] * (len(distinct) + 1)
    cut = [0] * (len(distinct) + 1)
    for j in range(1, len(distinct) + 1):
        rows = 0
        best[j] = -1
        for i in range(j - 1, -1, -1):  # last group = distinct[i:j], padded to distinct[j - 1]
            rows += counts[i]
            cost = best[i] + rows * distinct[j - 1] + call_cost_tokens
            if best[j] < 0 or cost < best[j]:
                best[j], cut[j] = cost, i
    groups: list[list[int]] = []
    j = len(distinct)
    while j > 0:
        i = cut[j]
        groups.append([index for n in distinct[i:j] for index in by_length[n]])
        j = i
    return groups[::-1]


def _row_gather(kv: LayerKV, row: int, columns: torch.Tensor) -> Callable[[int, int], LayerKV]:
    """The prefix cache's view of one batch row: the KV of its tokens [start, end), whose columns in the
    batch are `columns` (padding skipped)."""

    def gather(start: int, end: int) -> LayerKV:
        index = columns[start:end]
        return [(k[row].index_select(1, index), v[row].index_select(1, index)) for k, v in kv]

    return gather


@dataclass
class PrefixStats:
    """Prefix-cache counts since the engine started (/server_info; the metrics count the same)."""

    lookups: int = 0  # requests prefilled with the cache on
    hits: int = 0  # of those, requests that reused at least one cached token
    prompt_tokens: int = 0  # tokens of the sequences prefilled
    cached_tokens: int = 0  # of those, tokens taken from the cache (prefill saved)

    def record(self, lookups: int, hits: int, prompt_tokens: int, cached_tokens: int) -> None:
        self.lookups += lookups
        self.hits += hits
        self.prompt_tokens += prompt_tokens
        self.cached_tokens += cached_tokens

    @property
    def hit_rate(self) -> float:
        """Share of prefilled tokens taken from the cache (SGLang's cache_hit_rate)."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def input_logprobs(kept: torch.Tensor, sequence: list[int], start: int) -> list[float | None]:
    """SGLang's `input_token_logprobs` values of `sequence` from position `start`: None, then log P(seq[i]
    | seq[:i]) for i in (start, len). `kept` (k, V) holds the logits of the sequence's last k positions
    (k >= len - start; a left-padded row's extra positions come first and are not read)."""
    length, k = len(sequence), kept.shape[0]
    if not 0 <= start < length or k < length - start:
        raise ValueError(f"need 0 <= start < {length} and {k} >= {length - start} kept positions")
    rows = kept[start - length + k : k - 1].float()
    targets = torch.tensor(sequence[start + 1 :], dtype=torch.long, device=kept.device)
    values = torch.log_softmax(rows, dim=-1).gather(1, targets[:, None])[:, 0]
    return [None, *(float(v) for v in values.tolist())]


def architecture_mismatch(old: Any, new: Any) -> str | None:
    """Name the first shape-defining config field that differs between two model configs."""
    for name in _ARCH_FIELDS:
        before, after = getattr(old, name, None), getattr(new, name, None)
        if before != after:
            return f"config.{name} differs: loaded model has {before!r}, new weights have {after!r}"
    return None


class ContinuousBatcher:
    """Owns the model; batches, decodes and finishes requests on its own worker thread."""

    def __init__(
        self,
        model: Any,
        *,
        weight_version: str,
        eos_token_ids: frozenset[int],
        context_length: int,
        metrics: EngineMetrics,
        max_batch: int = 64,
        batch_wait_s: float = 0.003,
        max_prefill_tokens: int = 16384,
        decode: Callable[[list[int]], str] | None = None,
        capture_routing: bool = False,
        prefix_cache_bytes: int = 0,
    ) -> None:
        self.model = model
        self._decode = decode  # the tokenizer's decode, for stop strings (None: no tokenizer, none sent)
        # Record routed experts for the requests that ask (--enable-return-routed-experts, MoE only).
        self.capture_routing = capture_routing
        self.weight_version = weight_version
        self.vocab_size = int(model.config.vocab_size)
        self.context_length = context_length
        self._eos = eos_token_ids
        self._metrics = metrics
        self._max_batch = max_batch
        self._batch_wait_s = batch_wait_s
        self._max_prefill_tokens = max_prefill_tokens
        self._device = next(model.parameters()).device
        self._cache_kwarg = cache_kwarg(model)
        self._lora_active = False  # the model is a PeftModel (adapters loaded): forwards name them
        self._active_adapter: str | None = None  # peft's active adapter, as last set here
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._waiting: deque[EngineRequest] = deque()
        self._batch: RunningBatch | None = None
        self._paused = False
        self._stopping = False
        # Finished requests are announced only after the gauges stop counting them, so a client that
        # reads /metrics right after its response never sees its own request as still running.
        self._finished: list[EngineRequest] = []
        self.peak_batch = 0  # most rows ever decoded in one step (diagnostics, tests)
        self.prefix_cache = PrefixCache(prefix_cache_bytes) if prefix_cache_bytes > 0 else None
        self.kv_epoch = 0  # bumped whenever cached KV stops matching the served weights
        self.prefix_stats = PrefixStats()
        self.trimmer = Trimmer()  # hands the freed KV's pages back (pipeline/contracts/malloc_trim.py)
        self._thread = threading.Thread(target=self._run, name="rollwise-engine-worker", daemon=True)
        metrics.weight_version.set(version_value(weight_version))

    # ---- thread-safe API -------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort everything in flight and end the worker thread."""

        def command() -> None:
            self._abort_matching(None, "engine shutting down")
            self._stopping = True

        self._commands.put(command)
        self._thread.join(timeout)

    def submit(self, requests: list[EngineRequest]) -> None:
        self._commands.put(lambda: self._enqueue(requests))

    def abort(self, rid: str | None, message: str = "Aborted by /abort_request") -> None:
        """Abort the request `rid` (running or waiting), or every request when rid is None."""
        self._commands.put(lambda: self._abort_matching(rid, message))

    def pause(self, mode: PauseMode) -> concurrent.futures.Future[None]:
        def command() -> None:
            if mode == "abort":
                self._abort_matching(None, "Aborted by /pause_generation")
            elif mode == "retract":
                self._retract_all()
            self._paused = True

        return self._call(command)

    def resume(self) -> concurrent.futures.Future[None]:
        def command() -> None:
            self._paused = False

        return self._call(command)

    def swap_weights(
        self, model: Any, weight_version: str | None, abort_all: bool
    ) -> concurrent.futures.Future[int]:
        """Replace the model between two steps; resolves to the number of requests held by a pause.
        Fails (ValueError) if the new model's architecture differs; then nothing changes."""

        def command() -> int:
            mismatch = architecture_mismatch(self.model.config, model.config)
            if mismatch:
                raise ValueError(f"cannot swap weights: {mismatch}")
            if abort_all:
                self._abort_matching(None, "Aborted by weight update (abort_all_requests)")
            self.model = model  # same architecture, same loader: the cache keyword stays
            self._invalidate_kv()
            if weight_version is not None:
                self.weight_version = weight_version
                self._metrics.weight_version.set(version_value(weight_version))
            return self.num_requests() if self._paused else 0

        return self._call(command)

    def attach_adapter(
        self, name: str, config: Any, weights: dict[str, Any]
    ) -> concurrent.futures.Future[None]:
        """Inject LoRA adapter `name` between two steps (pipeline.engine.lora_slots)."""
        from pipeline.engine.lora_slots import attach_adapter

        def command() -> None:
            self.model = attach_adapter(self.model, name, config, weights)
            self._lora_active = True
            self._active_adapter = None

        return self._call(command)

    def refill_adapter(self, slot: str, weights: dict[str, Any]) -> concurrent.futures.Future[None]:
        """Copy new LoRA weights into the free adapter `slot` between two steps."""
        from pipeline.engine.lora_slots import refill_adapter

        def command() -> None:
            if any(r.adapter == slot for r in self._all_requests()):
                raise ValueError(f"adapter slot {slot} is still named by a request")
            refill_adapter(self.model, slot, weights)
            if self.prefix_cache is not None:
                self.prefix_cache.clear_namespace(slot)
                self._publish_prefix_size()

        return self._call(command)

    def detach_adapter(self, name: str) -> concurrent.futures.Future[None]:
        """Remove LoRA adapter `name` between two steps; no request may still name it."""
        from pipeline.engine.lora_slots import detach_adapter

        def command() -> None:
            if any(r.adapter == name for r in self._all_requests()):
                raise ValueError(f"adapter {name} is still named by a request")
            self.model = detach_adapter(self.model, name)
            self._lora_active = hasattr(self.model, "peft_config")
            if self.prefix_cache is not None:
                self.prefix_cache.clear_namespace(name)
                self._publish_prefix_size()
            self._active_adapter = None

        return self._call(command)

    def _all_requests(self) -> list[EngineRequest]:
        running = self._batch.rows if self._batch is not None else []
        return [*running, *self._waiting]

    def _forward_kwargs(self, rows: list[EngineRequest]) -> dict[str, Any]:
        """The cache keyword's name aside, what a forward over `rows` needs: their adapters, if any.

        Rows that all name one adapter (the usual batch: every request names the served version) run
        with it as peft's active adapter, a plain forward; rows that differ (around a sync, or with the
        base) run as peft's mixed-adapter batch. `rollwise bench lora` measured both."""
        if not self._lora_active:
            if any(r.adapter is not None for r in rows):
                raise ValueError("a request names a LoRA adapter but none is loaded")
            return {}
        from pipeline.engine.lora_slots import adapter_names

        names = {r.adapter for r in rows}
        if len(names) == 1 and None not in names:
            (name,) = names
            if name != self._active_adapter:
                self.model.set_adapter(name)
                self._active_adapter = name
            return {}
        return {"adapter_names": adapter_names([r.adapter for r in rows])}

    def flush_cache(self) -> concurrent.futures.Future[bool]:
        """Drop the prefix cache if the engine is idle (SGLang flushes only then); True if it was."""

        def command() -> bool:
            if self.num_requests() > 0:
                return False
            self._invalidate_kv()
            return True

        return self._call(command)

    def _invalidate_kv(self) -> None:
        """Cached KV and the KV of running rows no longer match what the model computes."""
        self.kv_epoch += 1
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
            self._publish_prefix_size()
        self.trimmer.maybe()

    def _publish_prefix_size(self) -> None:
        cache = self.prefix_cache
        if cache is not None:
            self._metrics.record_prefix_cache_size(cache.bytes, cache.tokens, cache.evicted_tokens)

    def num_running(self) -> int:
        batch = self._batch
        return batch.size if batch is not None else 0

    def num_waiting(self) -> int:
        return len(self._waiting)

    def num_requests(self) -> int:
        return self.num_running() + self.num_waiting()

    @property
    def alive(self) -> bool:
        """The worker thread is running (False before start, after stop, or if it died)."""
        return self._thread.is_alive()

    @property
    def paused(self) -> bool:
        return self._paused

    def _call(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def command() -> None:
            try:
                future.set_result(fn())
            except Exception as exc:
                future.set_exception(exc)

        self._commands.put(command)
        return future

    # ---- worker thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        with torch.inference_mode():
            while not self._stopping:
                idle = self._paused or (self._batch is None and not self._waiting)
                if idle:
                    self.trimmer.maybe()  # also an engine no weight update comes to churns its heap
                self._drain_commands(block=idle)
                if self._stopping or self._paused:
                    self._publish()
                    continue
                if idle and self._waiting:
                    self._collect_arrivals()
                try:
                    self._admit_waiting()
                    if self._batch is not None:
                        self._decode_step()
                except Exception as exc:  # a failing step must not kill the engine: fail its requests
                    log.exception("engine step failed")
                    self._invalidate_kv()  # a forward that failed half-way may have written some layers
                    self._abort_matching(None, f"engine step failed: {type(exc).__name__}: {exc}")
                self._publish()

    def _drain_commands(self, *, block: bool) -> None:
        if block:
            self._execute(self._commands.get())
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            self._execute(command)

    @staticmethod
    def _execute(command: Callable[[], None]) -> None:
        try:
            command()
        except Exception:  # the worker thread must outlive any one command
            log.exception("engine command failed")

    def _collect_arrivals(self) -> None:
        """Wait a few ms after the first request of an idle engine so that requests sent together are
        prefilled together."""
        deadline = time.monotonic() + self._batch_wait_s
        while not self._stopping and not self._paused and len(self._waiting) < self._max_batch:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            try:
                command = self._commands.get(timeout=remaining)
            except queue.Empty:
                return
            self._execute(command)

    def _enqueue(self, requests: list[EngineRequest]) -> None:
        """Queue behind every waiting request of the same or a higher priority (SGLang's priority
        scheduling: higher values first, arrival order among equals). With one priority, a plain append."""
        waiting = self._waiting
        for request in requests:
            at = len(waiting)
            while at > 0 and waiting[at - 1].priority < request.priority:
                at -= 1
            if at == len(waiting):
                waiting.append(request)
            else:
                waiting.insert(at, request)

    def _publish(self) -> None:
        """Update the gauges, then notify the requests finished since the last call."""
        self._metrics.num_running_reqs.set(self.num_running())
        self._metrics.num_queue_reqs.set(self.num_waiting())
        finished, self._finished = self._finished, []
        for request in finished:
            request.notify(request, True)

    def _finish(self, request: EngineRequest, reason: dict[str, Any]) -> None:
        if request.finished:
            return
        request.finish_version = self.weight_version
        request.finish_time = time.monotonic()
        request.finish_reason = reason
        self._metrics.num_requests.inc()
        if reason["type"] == "abort":
            self._metrics.num_aborted_requests.inc()
        self._metrics.e2e_latency.observe(request.finish_time - request.arrival)
        self._finished.append(request)

    def _abort_matching(self, rid: str | None, message: str) -> None:
        for request in [r for r in self._waiting if rid is None or r.rid == rid]:
            self._waiting.remove(request)
            self._finish(request, abort_reason("Abort in waiting queue" if rid is None else message))
        batch = self._batch
        if batch is None:
            return
        hit = [i for i, r in enumerate(batch.rows) if rid is None or r.rid == rid]
        for i in hit:
            self._finish(batch.rows[i], abort_reason(message))
        if hit:
            self._keep_unfinished()

    def _retract_all(self) -> None:
        """Move running rows back to the front of the queue; their KV is dropped and recomputed from
        prompt + output so far when they are admitted again."""
        if self._batch is not None:
            self._remember(self._batch, range(self._batch.size))
            self._waiting.extendleft(reversed(self._batch.rows))
            self._batch = None

    def _keep_unfinished(self) -> None:
        batch = self._batch
        if batch is None:
            return
        keep = [i for i, r in enumerate(batch.rows) if not r.finished]
        self._remember(batch, [i for i, r in enumerate(batch.rows) if r.finished])
        self._batch = batch.select(keep) if keep else None

    def _admit_waiting(self) -> None:
        admitted: list[EngineRequest] = []
        lengths: list[int] = []
        scored: list[EngineRequest] = []
        longest = 0
        while self._waiting and self.num_running() + len(admitted) < self._max_batch:
            request = self._waiting[0]
            if request.sampling.max_new_tokens == 0:
                self._waiting.popleft()
                start = request.logprob_start_len
                wants_routing = self.capture_routing and request.return_routed_experts
                if (start is not None and start < len(request.prompt_ids) - 1) or wants_routing:
                    scored.append(request)  # score-only: a prefill of its own below
                    continue
                self._metrics.prompt_tokens.inc(len(request.prompt_ids))
                if start is not None:
                    request.input_logprobs = [None]
                self._finish(request, {"type": "length", "length": 0})
                continue
            length = len(request.prompt_ids) + len(request.output_ids)
            if admitted and max(longest, length) * (len(admitted) + 1) > self._max_prefill_tokens:
                break
            longest = max(longest, length)
            admitted.append(self._waiting.popleft())
            lengths.append(length)
        if scored:
            try:
                self._score(scored)
            except Exception as exc:
                for request in scored:
                    self._finish(request, abort_reason(f"prefill failed: {type(exc).__name__}: {exc}"))
                raise
        if not admitted:
            return
        try:
            if self.prefix_cache is None:
                for bucket in prefill_buckets(lengths, PREFILL_CALL_COST_TOKENS):
                    self._prefill([admitted[i] for i in bucket])
            else:
                self._prefill_with_prefixes(admitted)
        except Exception as exc:
            # The failed bucket and those after it are in neither the queue nor the batch: finish them
            # here. Rows of earlier buckets may be in the batch; finished too, the caller then drops them.
            for request in admitted:
                self._finish(request, abort_reason(f"prefill failed: {type(exc).__name__}: {exc}"))
            raise

    def _left_padded(self, sequences: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids, mask, positions) of `sequences` left-padded to the longest, on the model's device."""
        width = max(len(s) for s in sequences)
        ids = torch.zeros(len(sequences), width, dtype=torch.long)
        mask = torch.zeros(len(sequences), width, dtype=torch.long)
        for row, seq in enumerate(sequences):
            ids[row, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
            mask[row, width - len(seq) :] = 1
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        return ids.to(self._device), mask.to(self._device), positions.to(self._device)

    @staticmethod
    def _needs_input_logprobs(request: EngineRequest) -> bool:
        return request.logprob_start_len is not None and request.input_logprobs is None

    def _kept_positions(self, requests: list[EngineRequest], sequences: list[list[int]]) -> int:
        """Positions whose logits the prefill must keep: the last one, and every prompt log-prob's."""
        spans = [
            len(seq) - (r.logprob_start_len or 0)
            for r, seq in zip(requests, sequences, strict=True)
            if self._needs_input_logprobs(r)
        ]
        return max([1, *spans])

    def _record_input_logprobs(
        self, requests: list[EngineRequest], sequences: list[list[int]], logits: torch.Tensor
    ) -> None:
        for row, (request, seq) in enumerate(zip(requests, sequences, strict=True)):
            if self._needs_input_logprobs(request):
                assert request.logprob_start_len is not None
                request.input_logprobs = input_logprobs(logits[row], seq, request.logprob_start_len)

    def _score(self, requests: list[EngineRequest]) -> None:
        """Prompt log-probs of max_new_tokens = 0 requests: one prefill without a KV cache."""
        sequences = [r.prompt_ids for r in requests]
        ids, mask, positions = self._left_padded(sequences)
        with self._routing(requests) as captured:
            out = self.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                use_cache=False,
                logits_to_keep=self._kept_positions(requests, sequences),
                **self._forward_kwargs(requests),
            )
        self._record_routing(requests, sequences, captured, replace=True)
        self._metrics.prompt_tokens.inc(sum(len(s) for s in sequences))
        self._record_input_logprobs(requests, sequences, out.logits)
        for request in requests:
            self._finish(request, {"type": "length", "length": 0})

    def _reuse_limit(self, request: EngineRequest) -> int:
        """Most leading tokens a prefill of `request` may take from the prefix cache: all but the last
        (its logits pick the next token), none past the first prompt log-prob wanted, and none past the
        first position whose routed experts it returns."""
        limit = len(request.prompt_ids) + len(request.output_ids) - 1
        if self._needs_input_logprobs(request):
            limit = min(limit, request.logprob_start_len or 0)
        if self.capture_routing and request.return_routed_experts:
            limit = min(limit, request.routed_experts_start)  # the routing it returns must be computed
        return limit

    def _prefill_with_prefixes(self, admitted: list[EngineRequest]) -> None:
        """Prefill one admission round through the prefix cache (module docstring): requests whose
        reusable parts are identical to an earlier one's wait for it, then reuse its KV."""
        assert self.prefix_cache is not None
        seen: set[tuple[Any, ...]] = set()
        first: list[EngineRequest] = []
        later: list[EngineRequest] = []
        for request in admitted:
            limit = self._reuse_limit(request)
            key = (request.adapter, tuple((request.prompt_ids + request.output_ids)[:limit]))
            (later if key in seen and limit > 0 else first).append(request)
            seen.add(key)
        for phase in (first, later):
            matches = [
                self.prefix_cache.match(r.adapter, r.prompt_ids + r.output_ids, self._reuse_limit(r))
                for r in phase
            ]
            suffixes = [
                len(r.prompt_ids) + len(r.output_ids) - m.length for r, m in zip(phase, matches, strict=True)
            ]
            for bucket in prefill_buckets(suffixes, PREFILL_CALL_COST_TOKENS):
                self._prefill([phase[i] for i in bucket], [matches[i] for i in bucket])

    def _prefill(self, requests: list[EngineRequest], matches: list[PrefixMatch] | None = None) -> None:
        """Compute the KV of `requests`' sequences, minus each one's cached prefix in `matches` (None: no
        prefix cache), sample their first tokens and merge the rows into the running batch."""
        sequences = [r.prompt_ids + r.output_ids for r in requests]
        reused = [m.length for m in matches] if matches is not None else [0] * len(requests)
        ids, mask, positions = self._left_padded([s[n:] for s, n in zip(sequences, reused, strict=True)])
        cache: DynamicCache
        if max(reused) > 0:
            assert matches is not None
            positions = positions + torch.tensor(reused, dtype=torch.long, device=self._device)[:, None]
            cache, prefix_mask = self._prefix_kv(matches)
            mask = torch.cat([prefix_mask, mask], dim=1)
        else:
            cache = DynamicCache()
        with self._routing(requests) as captured:
            out = self.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                use_cache=True,
                logits_to_keep=self._kept_positions(requests, sequences),
                **{self._cache_kwarg: cache},
                **self._forward_kwargs(requests),
            )
        # A retracted request is prefilled again over prompt + output: its record starts over.
        self._record_routing(requests, sequences, captured, replace=True, reused=reused)
        self._count_prefill(requests, sequences, reused)
        self._record_input_logprobs(requests, sequences, out.logits)
        lengths = torch.tensor([len(s) for s in sequences], dtype=torch.long, device=self._device)
        fresh = RunningBatch(
            rows=requests,
            cache=cache if max(reused) > 0 else growable_cache(RunningBatch.kv_of(cache)),
            mask=mask,
            next_pos=lengths,
            last_tokens=lengths.clone(),
        )
        for request in requests:
            request.kv_epoch = self.kv_epoch
        self._remember(fresh, range(len(requests)))
        self._sample_into(fresh, out.logits[:, -1, :])
        keep = [i for i, r in enumerate(requests) if not r.finished]  # the finished ones are cached above
        if not keep:
            return
        fresh = fresh.select(keep) if len(keep) < len(requests) else fresh
        self._batch = fresh if self._batch is None else self._batch.merge(fresh)

    def _prefix_kv(self, matches: list[PrefixMatch]) -> tuple[DynamicCache, torch.Tensor]:
        """A cache holding each row's matched prefix right-aligned in the longest one's width, and the
        (B, width) mask of those columns."""
        longest = max(m.length for m in matches)
        sample = next(m for m in matches if m.length > 0).pieces[0]
        keys = [k.new_zeros(len(matches), k.shape[0], longest, k.shape[2]) for k, _ in sample]
        values = [v.new_zeros(len(matches), v.shape[0], longest, v.shape[2]) for _, v in sample]
        mask = torch.zeros(len(matches), longest, dtype=torch.long, device=self._device)
        for row, match in enumerate(matches):
            if match.length:
                match.write(keys, values, row)
                mask[row, longest - match.length :] = 1
        return growable_cache(list(zip(keys, values, strict=True))), mask

    def _count_prefill(
        self, requests: list[EngineRequest], sequences: list[list[int]], reused: list[int]
    ) -> None:
        total = sum(len(s) for s in sequences)
        self._metrics.prompt_tokens.inc(total)
        if self.prefix_cache is None:
            return
        hits = sum(1 for n in reused if n > 0)
        self.prefix_stats.record(len(requests), hits, total, sum(reused))
        self._metrics.record_prefix_cache(len(requests), hits, total, sum(reused))
        for request, n in zip(requests, reused, strict=True):
            if request.cached_tokens is None:
                request.cached_tokens = n

    def _remember(self, batch: RunningBatch, rows: Iterable[int]) -> None:
        """Cache the KV of `rows` of `batch`: each row's sequence so far (the last sampled token has no KV
        yet). Rows whose KV predates the current weights are skipped."""
        cache = self.prefix_cache
        if cache is None:
            return
        kv = batch.kv()
        for row in rows:
            request = batch.rows[row]
            if request.kv_epoch != self.kv_epoch:
                continue
            columns = batch.mask[row].nonzero()[:, 0]
            tokens = (request.prompt_ids + request.output_ids)[: columns.numel()]
            cache.insert(request.adapter, tokens, _row_gather(kv, row, columns))
        self._publish_prefix_size()

    def _decode_step(self) -> None:
        batch = self._batch
        assert batch is not None
        self.peak_batch = max(self.peak_batch, batch.size)
        mask = torch.cat([batch.mask, batch.mask.new_ones(batch.size, 1)], dim=1)
        with self._routing(batch.rows) as captured:
            out = self.model(
                input_ids=batch.last_tokens.unsqueeze(1),
                attention_mask=mask,
                position_ids=batch.next_pos.unsqueeze(1),
                use_cache=True,
                **{self._cache_kwarg: batch.cache},
                **self._forward_kwargs(batch.rows),
            )
        self._record_routing(batch.rows, [[0]] * batch.size, captured, replace=False)
        batch.mask = mask
        batch.next_pos = batch.next_pos + 1
        self._sample_into(batch, out.logits[:, -1, :])
        if any(r.finished for r in batch.rows):
            self._keep_unfinished()

    @contextlib.contextmanager
    def _routing(self, rows: list[EngineRequest]) -> Iterator[Captured | None]:
        """Capture the forward's routed experts when a row asked for them (and the engine records)."""
        if not self.capture_routing or not any(r.return_routed_experts for r in rows):
            yield None
            return
        with routed_experts.capture(self.model, len(rows)) as captured:
            yield captured

    @staticmethod
    def _record_routing(
        rows: list[EngineRequest],
        sequences: list[list[int]],
        captured: Captured | None,
        *,
        replace: bool,
        reused: list[int] | None = None,
    ) -> None:
        """Each asking row's positions of the captured forward (its last len(seq) - reused, rows being
        left padded): its record's start (`replace`, a prefill) or one more decoded position. The
        `reused` leading positions a prefill took from the prefix cache were not forwarded: their rows
        are filler (-1), never sent (`_reuse_limit` keeps them before routed_experts_start)."""
        if captured is None or captured.ids is None:
            return
        for row, (request, seq) in enumerate(zip(rows, sequences, strict=True)):
            if not request.return_routed_experts:
                continue
            skipped = reused[row] if reused is not None else 0
            positions = captured.ids[row, captured.ids.shape[1] - (len(seq) - skipped) :]
            if skipped:
                filler = positions.new_full((skipped, *positions.shape[1:]), -1)
                positions = torch.cat([filler, positions])
            if replace:
                request.routed = [positions]
            else:
                request.routed.append(positions)

    def _sample_into(self, batch: RunningBatch, logits: torch.Tensor) -> None:
        """Sample each row's next token, record it on the request, finish rows that are done."""
        rows = batch.rows
        settings = batch_sampling([r.sampling for r in rows], self.vocab_size)
        uniforms = draw_uniforms([r.generator for r in rows])
        tokens, logprobs = sample_next_tokens(logits, settings, uniforms)
        batch.last_tokens = tokens
        now = time.monotonic()
        version = self.weight_version
        for request, token, logprob in zip(rows, tokens.tolist(), logprobs.tolist(), strict=True):
            if not request.output_ids:
                self._metrics.time_to_first_token.observe(now - request.arrival)
            request.output_ids.append(token)
            request.logprobs.append(logprob)
            request.versions.append(version)
            reason = self._stop_reason(request)
            if reason is not None:
                self._finish(request, reason)
            elif request.stream:
                request.notify(request, False)
        self._metrics.record_generated(len(rows), now)

    def _stop_reason(self, request: EngineRequest) -> dict[str, Any] | None:
        token = request.output_ids[-1]
        sampling = request.sampling
        if (not sampling.ignore_eos and token in self._eos) or token in sampling.stop_token_ids:
            return {"type": "stop", "matched": token}
        if len(request.output_ids) >= sampling.max_new_tokens:
            return {"type": "length", "length": sampling.max_new_tokens}
        if len(request.prompt_ids) + len(request.output_ids) >= self.context_length:
            return {"type": "length", "length": len(request.output_ids)}
        if sampling.stop and self._decode is not None:
            # SGLang's Req.check_finished: the decode of the last stop_str_max_len + 1 tokens holds one.
            tail = self._decode(request.output_ids[-(sampling.stop_window + 1) :])
            for stop in sampling.stop:
                if stop in tail:
                    return {"type": "stop", "matched": stop}
        return None
