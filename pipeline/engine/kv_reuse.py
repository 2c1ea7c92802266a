"""The prefix cache as the batcher uses it (on unless `prefix_cache_bytes` is 0).

Every prefill caches its sequence's KV, and a row that leaves the batch (finished, aborted or retracted)
caches its prompt + output, so the next turn of a multi-turn episode reuses the whole conversation so
far. KV computed under other weights never enters or stays: weight swaps, adapter refills, /flush_cache
and a failed step clear the cache and bump `epoch`, and a row whose KV is older than the epoch is not
cached (in-place pauses keep such rows running across a swap).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pipeline.engine.engine_metrics import EngineMetrics
from pipeline.engine.engine_request import EngineRequest
from pipeline.engine.kv_batch import RunningBatch, row_gather
from pipeline.engine.prefix_cache import PrefixCache


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


class KVReuse:
    """The cache (None when off), its epoch and its counts. Worker thread only (counts read anywhere)."""

    def __init__(self, budget_bytes: int, metrics: EngineMetrics) -> None:
        self.cache = PrefixCache(budget_bytes) if budget_bytes > 0 else None
        self.epoch = 0  # bumped whenever cached KV stops matching the served weights
        self.stats = PrefixStats()
        self._metrics = metrics

    def invalidate(self) -> None:
        """Cached KV and the KV of running rows no longer match what the model computes."""
        self.epoch += 1
        if self.cache is not None:
            self.cache.clear()
            self.publish_size()

    def clear_namespace(self, adapter: str) -> None:
        if self.cache is not None:
            self.cache.clear_namespace(adapter)
            self.publish_size()

    def remember(self, batch: RunningBatch, rows: Iterable[int]) -> None:
        """Cache the KV of `rows` of `batch`: each row's sequence so far (the last sampled token has no KV
        yet). Rows whose KV predates the current weights are skipped."""
        cache = self.cache
        if cache is None:
            return
        kv = batch.kv()
        for row in rows:
            request = batch.rows[row]
            if request.kv_epoch != self.epoch:
                continue
            columns = batch.mask[row].nonzero()[:, 0]
            tokens = (request.prompt_ids + request.output_ids)[: columns.numel()]
            cache.insert(request.adapter, tokens, row_gather(kv, row, columns))
        self.publish_size()

    def count(self, requests: list[EngineRequest], prompt_tokens: int, reused: list[int]) -> None:
        """One prefill's lookups: `reused[i]` of request i's tokens came from the cache."""
        if self.cache is None:
            return
        hits = sum(1 for n in reused if n > 0)
        self.stats.record(len(requests), hits, prompt_tokens, sum(reused))
        self._metrics.record_prefix_cache(len(requests), hits, prompt_tokens, sum(reused))
        for request, n in zip(requests, reused, strict=True):
            if request.cached_tokens is None:
                request.cached_tokens = n

    def publish_size(self) -> None:
        cache = self.cache
        if cache is not None:
            self._metrics.record_prefix_cache_size(cache.bytes, cache.tokens, cache.evicted_tokens)
