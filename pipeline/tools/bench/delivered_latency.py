"""What an engine delivered in a bench run, in the terms of pipeline.tools.bench.staleness_model.

Each request is timed from the runner's side, the time the engine spent paused for weight syncs within it
is taken out, and the least-squares line `seconds = per_request + per_token · tokens` is drawn through
them: the intercept holds what a request costs whatever its length (prefill, the HTTP round trip, the
host's lag), the slope what each token costs (decoding, and the lag of each chunk). An engine on a busy
host delivers less than its latency model asks for; given these, the model predicts the run that was.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from pipeline.supervisor.actors.rollout import GenerateEngine
from pipeline.supervisor.engines.protocol import GenerateResult, SamplingParams

Span = tuple[float, float]  # (start, end), monotonic seconds


class TimedEngine:
    """The GenerateEngine it wraps, each answered request recorded in `requests` as (start, end, tokens)."""

    def __init__(self, engine: GenerateEngine) -> None:
        self.engine = engine
        self.requests: list[tuple[float, float, int]] = []

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, rid: str, *, affinity_key: str
    ) -> GenerateResult:
        started = time.monotonic()
        result = await self.engine.generate(input_ids, sampling, rid, affinity_key=affinity_key)
        self.requests.append((started, time.monotonic(), len(result.output_ids)))
        return result


def overlap_s(span: Span, pauses: Sequence[Span]) -> float:
    """Seconds of `span` within any of `pauses` (which do not overlap one another)."""
    start, end = span
    return sum(max(0.0, min(end, p_end) - max(start, p_start)) for p_start, p_end in pauses)


def fit_latency(requests: Sequence[tuple[float, float, int]], pauses: Sequence[Span]) -> Span | None:
    """(seconds per request, seconds per token) of the requests (start, end, tokens), paused time taken
    out (module docstring); None without two different lengths to draw a line through."""
    points = [(tokens, end - start - overlap_s((start, end), pauses)) for start, end, tokens in requests]
    if len({tokens for tokens, _ in points}) < 2:
        return None
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x, _ in points)
    return mean_y - slope * mean_x, slope
