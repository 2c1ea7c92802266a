"""The embedded engine's waiting queue: its order, and which requests one admission round takes.

Order is SGLang's priority scheduling: higher `priority` first, arrival order among equals. A round takes
requests from the front while the batch has room and the round's padded prefill (its longest sequence
times its rows) stays within `max_prefill_tokens` (one request always fits). Requests with
max_new_tokens = 0 never join the batch: those that want prompt log-probs past their first token, or
routed experts, are scored by a prefill of their own; the others are answered without a forward.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from pipeline.engine.engine_request import EngineRequest


def enqueue_by_priority(waiting: deque[EngineRequest], requests: Iterable[EngineRequest]) -> None:
    """Queue each request behind every waiting one of the same or a higher priority (with one priority,
    a plain append)."""
    for request in requests:
        at = len(waiting)
        while at > 0 and waiting[at - 1].priority < request.priority:
            at -= 1
        if at == len(waiting):
            waiting.append(request)
        else:
            waiting.insert(at, request)


@dataclass
class AdmissionRound:
    """The requests one round took off the queue, in queue order within each list."""

    admitted: list[EngineRequest] = field(default_factory=list)  # prefilled, then decoded
    scored: list[EngineRequest] = field(default_factory=list)  # max_new_tokens = 0, one prefill
    unforwarded: list[EngineRequest] = field(default_factory=list)  # max_new_tokens = 0, no forward


def take_round(
    waiting: deque[EngineRequest], *, room: int, max_prefill_tokens: int, capture_routing: bool
) -> AdmissionRound:
    """Pop one admission round off the front of `waiting`; `room` is how many rows the batch can add."""
    taken = AdmissionRound()
    longest = 0
    while waiting and len(taken.admitted) < room:
        request = waiting[0]
        if request.sampling.max_new_tokens == 0:
            waiting.popleft()
            start = request.logprob_start_len
            wants_routing = capture_routing and request.return_routed_experts
            if (start is not None and start < len(request.prompt_ids) - 1) or wants_routing:
                taken.scored.append(request)
            else:
                taken.unforwarded.append(request)
            continue
        length = len(request.prompt_ids) + len(request.output_ids)
        if taken.admitted and max(longest, length) * (len(taken.admitted) + 1) > max_prefill_tokens:
            break
        longest = max(longest, length)
        taken.admitted.append(waiting.popleft())
    return taken
