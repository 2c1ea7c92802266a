"""Prefill: one admission round's requests computed into KV, their first tokens sampled, their rows
handed to the running batch.

A round is left padded to its longest sequence, split into forwards by `prefill_buckets`. With the prefix
cache on (pipeline.engine.kv_reuse), each prefill first takes the longest cached prefix of the request's
sequence (at most all but its last token, no further than `logprob_start_len` when prompt log-probs are
wanted, and none of the positions from `routed_experts_start` on, whose routing it returns) and computes
only the rest. A row's KV is then [padding | cached prefix | padding | new tokens]: the mask hides both
paddings and positions are explicit, so the row computes what a full prefill would. Requests of one
round whose reusable parts are identical (a group's G episodes, or `n` samples) are prefilled in two
steps: one of them first, the others then reuse its KV. `EngineRequest.cached_tokens` is SGLang's
`meta_info.cached_tokens`: the tokens its first prefill took from the cache.

Prompt log-probs: a request with `logprob_start_len` gets `input_logprobs` from its first prefill, the
log-softmax of the raw logits (SGLang's `input_token_logprobs`: one entry per token from the start, the
first null).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers import DynamicCache

from pipeline.engine.engine_metrics import EngineMetrics
from pipeline.engine.engine_request import EngineRequest, abort_reason
from pipeline.engine.kv_batch import RunningBatch, growable_cache, left_padded
from pipeline.engine.kv_reuse import KVReuse
from pipeline.engine.model_forward import ModelForward, record_routing
from pipeline.engine.prefix_cache import PrefixMatch
from pipeline.engine.request_outputs import RequestOutputs
from pipeline.engine.waiting_queue import AdmissionRound

# One more prefill forward costs about as much as this many more prompt tokens (the tiny preset on one
# CPU thread: ~1.4 ms of fixed work per forward, ~60-75k prompt tokens/s). The embedded engine is the CPU
# stand-in for SGLang, not a GPU server, where a forward's fixed cost is worth far more tokens.
PREFILL_CALL_COST_TOKENS = 128


def prefill_buckets(lengths: list[int], call_cost_tokens: int) -> list[list[int]]:
    """Split one admission round into prefill forwards: indices into ``lengths``, grouped so that
    sum(rows x longest + call_cost_tokens) over the groups is least (each forward pads to its longest).

    Multi-turn prompts come in a few lengths far apart: one forward over all of them would pad every row
    to the longest. Optimal over contiguous runs of the sorted distinct lengths (a dynamic programme
    over at most max_batch values)."""
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


class Prefiller:
    """Prefills admission rounds; `join` receives each forward's rows still running (worker thread)."""

    def __init__(
        self,
        forward: ModelForward,
        reuse: KVReuse,
        outputs: RequestOutputs,
        metrics: EngineMetrics,
        join: Callable[[RunningBatch], None],
    ) -> None:
        self._forward = forward
        self._reuse = reuse
        self._outputs = outputs
        self._metrics = metrics
        self._join = join

    def admit(self, taken: AdmissionRound) -> None:
        """Answer, score and prefill one round. If a forward fails, the requests of its stage and of the
        stages after it that are not in the running batch are finished as aborted (those that are, the
        caller aborts) and the error is raised: every request the round took from the queue is answered."""
        for request in taken.unforwarded:
            self._metrics.prompt_tokens.inc(len(request.prompt_ids))
            if request.logprob_start_len is not None:
                request.input_logprobs = [None]
            self._outputs.finish(request, {"type": "length", "length": 0})
        stages = ((self._score, taken.scored), (self._prefill_round, taken.admitted))
        for index, (stage, requests) in enumerate(stages):
            if not requests:
                continue
            try:
                stage(requests)
            except Exception as exc:
                message = f"prefill failed: {type(exc).__name__}: {exc}"
                for _, left in stages[index:]:
                    for request in left:
                        self._outputs.finish(request, abort_reason(message))
                raise

    def _score(self, requests: list[EngineRequest]) -> None:
        """Prompt log-probs of max_new_tokens = 0 requests: one prefill without a KV cache."""
        sequences = [r.prompt_ids for r in requests]
        ids, mask, positions = left_padded(sequences, self._forward.device)
        logits, captured = self._forward(
            requests,
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            cache=None,
            logits_to_keep=self._kept_positions(requests, sequences),
        )
        record_routing(requests, sequences, captured, replace=True)
        self._metrics.prompt_tokens.inc(sum(len(s) for s in sequences))
        self._record_input_logprobs(requests, sequences, logits)
        for request in requests:
            self._outputs.finish(request, {"type": "length", "length": 0})

    def _prefill_round(self, admitted: list[EngineRequest]) -> None:
        if self._reuse.cache is None:
            lengths = [len(r.prompt_ids) + len(r.output_ids) for r in admitted]
            for bucket in prefill_buckets(lengths, PREFILL_CALL_COST_TOKENS):
                self._prefill([admitted[i] for i in bucket])
        else:
            self._prefill_with_prefixes(admitted)

    def _reuse_limit(self, request: EngineRequest) -> int:
        """Most leading tokens a prefill of `request` may take from the prefix cache."""
        limit = len(request.prompt_ids) + len(request.output_ids) - 1
        if request.needs_input_logprobs:
            limit = min(limit, request.logprob_start_len or 0)
        if self._forward.capture_routing and request.return_routed_experts:
            limit = min(limit, request.routed_experts_start)  # the routing it returns must be computed
        return limit

    def _prefill_with_prefixes(self, admitted: list[EngineRequest]) -> None:
        """Requests whose reusable parts are identical to an earlier one's wait for it, then reuse its KV."""
        cache = self._reuse.cache
        assert cache is not None
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
                cache.match(r.adapter, r.prompt_ids + r.output_ids, self._reuse_limit(r)) for r in phase
            ]
            suffixes = [
                len(r.prompt_ids) + len(r.output_ids) - m.length for r, m in zip(phase, matches, strict=True)
            ]
            for bucket in prefill_buckets(suffixes, PREFILL_CALL_COST_TOKENS):
                self._prefill([phase[i] for i in bucket], [matches[i] for i in bucket])

    def _prefill(self, requests: list[EngineRequest], matches: list[PrefixMatch] | None = None) -> None:
        """Compute the KV of `requests`' sequences, minus each one's cached prefix in `matches` (None: no
        prefix cache), sample their first tokens and join the running rows to the batch."""
        device = self._forward.device
        sequences = [r.prompt_ids + r.output_ids for r in requests]
        reused = [m.length for m in matches] if matches is not None else [0] * len(requests)
        ids, mask, positions = left_padded([s[n:] for s, n in zip(sequences, reused, strict=True)], device)
        cache: DynamicCache
        if max(reused) > 0:
            assert matches is not None
            positions = positions + torch.tensor(reused, dtype=torch.long, device=device)[:, None]
            cache, prefix_mask = self._prefix_kv(matches)
            mask = torch.cat([prefix_mask, mask], dim=1)
        else:
            cache = DynamicCache()
        logits, captured = self._forward(
            requests,
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            cache=cache,
            logits_to_keep=self._kept_positions(requests, sequences),
        )
        # A retracted request is prefilled again over prompt + output: its record starts over.
        record_routing(requests, sequences, captured, replace=True, reused=reused)
        total = sum(len(s) for s in sequences)
        self._metrics.prompt_tokens.inc(total)
        self._reuse.count(requests, total, reused)
        self._record_input_logprobs(requests, sequences, logits)
        lengths = torch.tensor([len(s) for s in sequences], dtype=torch.long, device=device)
        fresh = RunningBatch(
            rows=requests,
            cache=cache if max(reused) > 0 else growable_cache(RunningBatch.kv_of(cache)),
            mask=mask,
            next_pos=lengths,
            last_tokens=lengths.clone(),
        )
        for request in requests:
            request.kv_epoch = self._reuse.epoch
        self._reuse.remember(fresh, range(len(requests)))
        self._outputs.sample_into(fresh, logits[:, -1, :])
        keep = [i for i, r in enumerate(requests) if not r.finished]  # the finished ones are cached above
        if keep:
            self._join(fresh.select(keep) if len(keep) < len(requests) else fresh)

    def _prefix_kv(self, matches: list[PrefixMatch]) -> tuple[DynamicCache, torch.Tensor]:
        """A cache holding each row's matched prefix right-aligned in the longest one's width, and the
        (B, width) mask of those columns."""
        longest = max(m.length for m in matches)
        sample = next(m for m in matches if m.length > 0).pieces[0]
        keys = [k.new_zeros(len(matches), k.shape[0], longest, k.shape[2]) for k, _ in sample]
        values = [v.new_zeros(len(matches), v.shape[0], longest, v.shape[2]) for _, v in sample]
        mask = torch.zeros(len(matches), longest, dtype=torch.long, device=self._forward.device)
        for row, match in enumerate(matches):
            if match.length:
                match.write(keys, values, row)
                mask[row, longest - match.length :] = 1
        return growable_cache(list(zip(keys, values, strict=True))), mask

    @staticmethod
    def _kept_positions(requests: list[EngineRequest], sequences: list[list[int]]) -> int:
        """Positions whose logits the prefill must keep: the last one, and every prompt log-prob's."""
        spans = [
            len(seq) - (r.logprob_start_len or 0)
            for r, seq in zip(requests, sequences, strict=True)
            if r.needs_input_logprobs
        ]
        return max([1, *spans])

    @staticmethod
    def _record_input_logprobs(
        requests: list[EngineRequest], sequences: list[list[int]], logits: torch.Tensor
    ) -> None:
        for row, (request, seq) in enumerate(zip(requests, sequences, strict=True)):
            if request.needs_input_logprobs:
                assert request.logprob_start_len is not None
                request.input_logprobs = input_logprobs(logits[row], seq, request.logprob_start_len)
