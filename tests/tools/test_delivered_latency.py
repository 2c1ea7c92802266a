"""The engine as a bench run delivered it (pipeline.tools.bench.delivered_latency)."""

from __future__ import annotations

import pytest

from pipeline.supervisor.engines.protocol import GenerateResult, SamplingParams
from pipeline.tools.bench.delivered_latency import TimedEngine, fit_latency, overlap_s


def test_the_fit_recovers_a_line_through_exact_requests() -> None:
    # 25 ms a request and 2.5 ms a token, requests one after another.
    requests, start = [], 0.0
    for tokens in (10, 40, 7, 300, 64):
        end = start + 0.025 + 0.0025 * tokens
        requests.append((start, end, tokens))
        start = end
    per_request, per_token = fit_latency(requests, pauses=[]) or (0.0, 0.0)
    assert per_request == pytest.approx(0.025)
    assert per_token == pytest.approx(0.0025)


def test_paused_time_is_taken_out_of_each_request() -> None:
    # The second request spans a 50 ms sync; without it, both fit 20 ms + 2 ms a token.
    requests = [(0.0, 0.04, 10), (1.0, 1.05 + 0.02 + 0.002 * 30, 30)]
    assert fit_latency(requests, pauses=[(1.01, 1.06)]) == pytest.approx((0.02, 0.002))
    assert overlap_s((1.0, 1.2), [(0.9, 1.05), (1.15, 1.3)]) == pytest.approx(0.1)


def test_no_line_without_two_lengths() -> None:
    assert fit_latency([], []) is None
    assert fit_latency([(0.0, 0.1, 5), (1.0, 1.2, 5)], []) is None


class _Engine:
    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, rid: str, *, affinity_key: str
    ) -> GenerateResult:
        return GenerateResult(
            rid=rid,
            output_ids=[1, 2, 3],
            logprobs=[-1.0] * 3,
            finish_reason="stop",
            weight_version="default",
            token_versions=["default"] * 3,
            prompt_tokens=2,
            completion_tokens=3,
            cached_tokens=0,
        )


async def test_timed_engine_records_each_answer() -> None:
    timed = TimedEngine(_Engine())
    result = await timed.generate([1, 2], SamplingParams(), "r1", affinity_key="g")
    assert result.output_ids == [1, 2, 3]
    [(start, end, tokens)] = timed.requests
    assert tokens == 3 and start <= end
