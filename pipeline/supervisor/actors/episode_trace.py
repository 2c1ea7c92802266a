"""Spans of one episode below its root (`[tracing]`), chosen once per episode: `EpisodeTrace` for an
episode whose root span was sampled (turn spans, engine-request spans, links to the policy versions that
generated it), its twin `UNTRACED` (a plain `Spans`) otherwise: an unsampled or untraced episode opens
no child span (they would cost time and record nothing). Attributes are computed only for a span that
records."""

from __future__ import annotations

import time
from collections.abc import Sized
from contextlib import AbstractContextManager
from typing import Any

from envs.api import StepResult
from pipeline.contracts import tracing
from pipeline.supervisor.engines.protocol import GenerateResult


class Spans:
    """The child spans of an episode; this base opens none (UNTRACED): every span is the shared NO_SPAN."""

    trace_id: str | None = None  # stored with the rows of sampled traces only

    def turn(self, turn: int) -> AbstractContextManager[Any]:
        return tracing.NO_SPAN

    def stepped(self, span: Any, step: StepResult) -> None:
        pass

    def request(self, rid: str) -> AbstractContextManager[Any]:
        return tracing.NO_SPAN

    def answered(
        self, span: Any, result: GenerateResult, versions: list[int], prompt: Sized, started: float
    ) -> None:
        pass


UNTRACED = Spans()


class EpisodeTrace(Spans):
    """The child spans of a sampled episode whose root span is `root`."""

    def __init__(self, root: Any, trace_id: str) -> None:
        self.root = root
        self.trace_id = trace_id
        self._linked: set[int] = set()  # policy versions the episode span links to

    def turn(self, turn: int) -> AbstractContextManager[Any]:
        return tracing.span("turn", {"rollwise.turn": turn})

    def stepped(self, span: Any, step: StepResult) -> None:
        if span.is_recording():
            span.set_attributes(
                {"rollwise.reward": step.reward, "rollwise.done": bool(step.done or step.truncated)}
            )

    def request(self, rid: str) -> AbstractContextManager[Any]:
        return tracing.span("engine.generate", {"rollwise.rid": rid})

    def answered(
        self, span: Any, result: GenerateResult, versions: list[int], prompt: Sized, started: float
    ) -> None:
        """The attributes of an engine request's span (`prompt`: the ids it was sent); the episode links to
        each version once."""
        if not span.is_recording():
            return
        version = versions[0] if versions else -1
        span.set_attributes(
            {
                "rollwise.policy_version": version,
                "rollwise.finish_reason": result.finish_reason,
                "rollwise.latency_s": time.perf_counter() - started,
                "gen_ai.usage.input_tokens": len(prompt),
                "gen_ai.usage.output_tokens": len(result.output_ids),
            }
        )
        if version >= 0 and version not in self._linked:
            self._linked.add(version)
            tracing.link_version(self.root, version)


def episode_trace(root: Any) -> Spans:
    """The trace of an episode whose root span is `root`: UNTRACED unless that span was sampled."""
    trace_id = tracing.trace_id(root)
    return UNTRACED if trace_id is None else EpisodeTrace(root, trace_id)


def episode_attributes(
    finish_reason: str, turns: int, tool_calls: int, generated_tokens: int, outcome: float | None
) -> dict[str, str | int | float]:
    """The root span's attributes at the episode's end."""
    attributes: dict[str, str | int | float] = {
        "rollwise.finish_reason": finish_reason,
        "rollwise.turns": turns,
        "rollwise.tool_calls": tool_calls,
        "gen_ai.usage.output_tokens": generated_tokens,
    }
    if outcome is not None:
        attributes["rollwise.outcome"] = outcome
    return attributes
