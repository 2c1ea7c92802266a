"""Prometheus metrics of the embedded engine, under SGLang's names so SGLang dashboards work unchanged.

The engine runs in its own process, so it keeps its own `CollectorRegistry` (not the pipeline's).
Prometheus metric names may contain ':' (reserved for recording rules by convention, but valid in the
exposition format), and prometheus_client accepts them through its normal API; the test parses the
exposition back with prometheus_client's parser to prove it.

Every SGLang metric carries the label `model_name`. rollwise adds `rollwise_engine_weight_version`
(numeric policy version: "default" -> 0, a decimal string -> its value, anything else -> NaN).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
THROUGHPUT_WINDOW_S = 10.0


def version_value(version: str) -> float:
    """Numeric gauge value of a wire weight version."""
    if version == "default":
        return 0.0
    return float(version) if version.isdecimal() else math.nan


class EngineMetrics:
    """The engine's metric objects. Thread-safe: the scheduler thread updates, the HTTP loop renders."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=self.registry)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=self.registry)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, labels, buckets=LATENCY_BUCKETS, registry=self.registry)

        self.num_running_reqs = gauge("sglang:num_running_reqs", "Requests in the running batch.").labels(
            model_name
        )
        self.num_queue_reqs = gauge("sglang:num_queue_reqs", "Requests waiting to be scheduled.").labels(
            model_name
        )
        self.gen_throughput = gauge(
            "sglang:gen_throughput", f"Generated tokens per second over the last {THROUGHPUT_WINDOW_S:.0f} s."
        ).labels(model_name)
        self.prompt_tokens = counter("sglang:prompt_tokens_total", "Prompt tokens prefilled.").labels(
            model_name
        )
        self.generation_tokens = counter("sglang:generation_tokens_total", "Tokens generated.").labels(
            model_name
        )
        self.num_requests = counter("sglang:num_requests_total", "Requests finished.").labels(model_name)
        self.num_aborted_requests = counter(
            "sglang:num_aborted_requests_total", "Requests finished by an abort."
        ).labels(model_name)
        self.e2e_latency = histogram(
            "sglang:e2e_request_latency_seconds", "Seconds from arrival to the last token."
        ).labels(model_name)
        self.time_to_first_token = histogram(
            "sglang:time_to_first_token_seconds", "Seconds from arrival to the first token."
        ).labels(model_name)
        # Prefix cache (pipeline.engine.prefix_cache): SGLang's names where SGLang has the metric.
        self.cached_tokens = counter(
            "sglang:cached_tokens_total", "Prompt tokens taken from the prefix cache (prefill saved)."
        ).labels(model_name)
        self.cache_hit_rate = gauge(
            "sglang:cache_hit_rate", "Share of prefilled tokens taken from the prefix cache since start."
        ).labels(model_name)
        self.evicted_tokens = counter(
            "sglang:evicted_tokens_total", "Tokens evicted from the prefix cache to stay within its budget."
        ).labels(model_name)
        self.prefix_lookups = counter(
            "rollwise_engine_prefix_cache_lookups_total", "Requests prefilled with the prefix cache on."
        ).labels(model_name)
        self.prefix_hits = counter(
            "rollwise_engine_prefix_cache_hits_total",
            "Requests whose prefill reused at least one token from the prefix cache.",
        ).labels(model_name)
        self.prefix_cache_bytes = gauge(
            "rollwise_engine_prefix_cache_bytes", "Bytes of KV the prefix cache holds."
        ).labels(model_name)
        self.prefix_cache_tokens = gauge(
            "rollwise_engine_prefix_cache_tokens", "Tokens whose KV the prefix cache holds."
        ).labels(model_name)
        self.yielded_seconds = counter(
            "rollwise_engine_yielded_seconds_total",
            "Seconds the engine held its decoding while the learner computed (engine.share_cores = time).",
        ).labels(model_name)
        self._prefilled_tokens = 0
        self._reused_tokens = 0
        self._evicted = 0
        self.weight_version = Gauge(
            "rollwise_engine_weight_version",
            "Policy version of the weights the engine samples with ('default' = 0).",
            labels,
            registry=self.registry,
        ).labels(model_name)
        self._window: deque[tuple[float, int]] = deque()
        self._window_lock = threading.Lock()

    def record_generated(self, num_tokens: int, now: float | None = None) -> None:
        """Count tokens produced by one engine step and refresh the throughput gauge."""
        now = time.monotonic() if now is None else now
        self.generation_tokens.inc(num_tokens)
        with self._window_lock:
            self._window.append((now, num_tokens))
        self._refresh_throughput(now)

    def record_prefix_cache(self, lookups: int, hits: int, prompt_tokens: int, cached_tokens: int) -> None:
        """Count one prefill's prefix-cache use: requests, those that hit, their tokens, the reused ones."""
        self.prefix_lookups.inc(lookups)
        self.prefix_hits.inc(hits)
        self.cached_tokens.inc(cached_tokens)
        self._prefilled_tokens += prompt_tokens
        self._reused_tokens += cached_tokens
        self.cache_hit_rate.set(
            self._reused_tokens / self._prefilled_tokens if self._prefilled_tokens else 0.0
        )

    def record_prefix_cache_size(self, num_bytes: int, tokens: int, evicted_total: int) -> None:
        """The prefix cache's size now, and its evictions since start."""
        self.prefix_cache_bytes.set(num_bytes)
        self.prefix_cache_tokens.set(tokens)
        if evicted_total > self._evicted:
            self.evicted_tokens.inc(evicted_total - self._evicted)
            self._evicted = evicted_total

    def _refresh_throughput(self, now: float) -> None:
        with self._window_lock:
            while self._window and self._window[0][0] < now - THROUGHPUT_WINDOW_S:
                self._window.popleft()
            if len(self._window) < 2:
                rate = 0.0
            else:
                # The oldest step's tokens were produced before the window's first timestamp.
                span = max(now - self._window[0][0], 1e-3)
                rate = sum(n for _, n in list(self._window)[1:]) / span
        self.gen_throughput.set(rate)

    def render(self) -> bytes:
        """Prometheus text exposition (format 0.0.4); the throughput gauge decays to 0 when idle."""
        self._refresh_throughput(time.monotonic())
        return generate_latest(self.registry)
