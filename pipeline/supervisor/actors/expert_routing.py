"""Routed-expert records of an MoE policy (RolloutSettings.routed_experts), chosen once per episode:
`ExpertRouting` asks each request for the positions its segment has no record of yet and appends a
finished answer's experts to that segment (an aborted attempt's are not kept: its resubmission asks again
from the same position); its twin `NO_ROUTING` (a dense model) asks for nothing and records nothing.
Every row then carries its segment's record (Contract 1's routed_experts column)."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, Protocol

from pipeline.contracts.schema import RoutedExperts
from pipeline.supervisor.actors.chat import ChatBuffer, SegmentBuffer
from pipeline.supervisor.actors.episode_end import engine_failure
from pipeline.supervisor.engines.protocol import GenerateResult, RoutedExpertsRequest, SamplingParams


class RoutingEngine(Protocol):
    """An engine that can return routed experts (the EnginePool)."""

    async def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        rid: str,
        *,
        affinity_key: str,
        routed_experts: RoutedExpertsRequest | None = None,
    ) -> GenerateResult: ...


class RoutingRecord:
    """How an episode's requests ask for routed experts and keep them; this base (NO_ROUTING, a dense
    model) sends requests as they are and records nothing."""

    def generate(
        self, engine: Any, chat: ChatBuffer, sampling: SamplingParams, rid: str, affinity_key: str
    ) -> Awaitable[GenerateResult]:
        """The engine's request (its awaitable, not a coroutine of ours: one frame less per request)."""
        request: Awaitable[GenerateResult] = engine.generate(
            chat.input_ids, sampling, rid, affinity_key=affinity_key
        )
        return request

    def record(self, chat: ChatBuffer, result: GenerateResult) -> None:
        pass

    def of(self, segment: SegmentBuffer) -> RoutedExperts | None:
        return None


NO_ROUTING = RoutingRecord()


class ExpertRouting(RoutingRecord):
    """(layers, topk, num_experts) of the model whose engines return routed experts."""

    def __init__(self, shape: tuple[int, int, int]) -> None:
        self.layers, self.topk, self.experts = shape
        self.width = RoutedExperts.width_for(self.experts)
        self._asked: RoutedExpertsRequest | None = None  # the request in flight's

    def generate(
        self, engine: RoutingEngine, chat: ChatBuffer, sampling: SamplingParams, rid: str, affinity_key: str
    ) -> Awaitable[GenerateResult]:
        asked = RoutedExpertsRequest(
            start_len=chat.current.routed_positions, per_position=self.layers * self.topk
        )
        self._asked = asked
        return engine.generate(chat.input_ids, sampling, rid, affinity_key=affinity_key, routed_experts=asked)

    def record(self, chat: ChatBuffer, result: GenerateResult) -> None:
        """Append a finished answer's routed experts to its segment's record (call after its tokens)."""
        if self._asked is None or result.routed_experts is None or result.finish_reason == "abort":
            return
        if max(result.routed_experts, default=0) >= self.experts:
            raise engine_failure(
                "protocol",
                f"{result.rid}: meta_info.routed_experts names an expert >= the model's {self.experts}",
            )
        ids = RoutedExperts.encode(
            result.routed_experts, layers=self.layers, topk=self.topk, width=self.width
        )
        positions = len(result.routed_experts) // (self.layers * self.topk)
        chat.current.append_routed(self._asked.start_len, positions, ids)

    def of(self, segment: SegmentBuffer) -> RoutedExperts | None:
        return RoutedExperts(layers=self.layers, topk=self.topk, width=self.width, ids=bytes(segment.routed))


def expert_routing(shape: tuple[int, int, int] | None) -> RoutingRecord:
    return NO_ROUTING if shape is None else ExpertRouting(shape)
