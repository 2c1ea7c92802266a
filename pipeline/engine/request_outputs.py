"""What a sampled token does to its request: recorded, stamped with the weight version, checked against
the stops, and the request finished and announced. Worker thread only.

Stops follow SGLang: an EOS token (unless `ignore_eos`) or one of `stop_token_ids`, `max_new_tokens`, the
context length, or a stop string in the decode of the last `stop_window + 1` tokens. Finished requests
are announced (`announce`) only after the caller has updated its gauges, so a client that reads /metrics
right after its response never sees its own request as still running.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from pipeline.engine.engine_metrics import EngineMetrics
from pipeline.engine.engine_request import EngineRequest
from pipeline.engine.kv_batch import RunningBatch
from pipeline.engine.sampling import batch_sampling, draw_uniforms, sample_next_tokens


class RequestOutputs:
    def __init__(
        self,
        *,
        weight_version: str,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        context_length: int,
        decode: Callable[[list[int]], str] | None,
        metrics: EngineMetrics,
    ) -> None:
        self.weight_version = weight_version  # stamped on every token sampled from now on
        self._vocab_size = vocab_size
        self._eos = eos_token_ids
        self._context_length = context_length
        self._decode = decode  # the tokenizer's decode, for stop strings (None: no tokenizer, none sent)
        self._metrics = metrics
        self._finished: list[EngineRequest] = []

    def sample_into(self, batch: RunningBatch, logits: torch.Tensor) -> None:
        """Sample each row's next token, record it on the request, finish rows that are done."""
        rows = batch.rows
        settings = batch_sampling([r.sampling for r in rows], self._vocab_size)
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
            reason = self.stop_reason(request)
            if reason is not None:
                self.finish(request, reason)
            elif request.stream:
                request.notify(request, False)
        self._metrics.record_generated(len(rows), now)

    def stop_reason(self, request: EngineRequest) -> dict[str, Any] | None:
        token = request.output_ids[-1]
        sampling = request.sampling
        if (not sampling.ignore_eos and token in self._eos) or token in sampling.stop_token_ids:
            return {"type": "stop", "matched": token}
        if len(request.output_ids) >= sampling.max_new_tokens:
            return {"type": "length", "length": sampling.max_new_tokens}
        if len(request.prompt_ids) + len(request.output_ids) >= self._context_length:
            return {"type": "length", "length": len(request.output_ids)}
        if sampling.stop and self._decode is not None:
            # SGLang's Req.check_finished: the decode of the last stop_str_max_len + 1 tokens holds one.
            tail = self._decode(request.output_ids[-(sampling.stop_window + 1) :])
            for stop in sampling.stop:
                if stop in tail:
                    return {"type": "stop", "matched": stop}
        return None

    def finish(self, request: EngineRequest, reason: dict[str, Any]) -> None:
        """Finish `request` (once: later calls do nothing); it is announced by the next `announce`."""
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

    def announce(self) -> None:
        """Notify the requests finished since the last call."""
        finished, self._finished = self._finished, []
        for request in finished:
            request.notify(request, True)
