"""The supervisor's share of the generated tokens never trained (pipeline.contracts.waste): the episodes
a finished group carries that cannot train, counted when the group finishes, and the trainable episodes
of a group whose write failed or was cancelled, counted then. The learner counts the rest (the trainable
rows of the groups it drops).

A group that fails or is cancelled before it finishes has no outcome to count from: its tokens are in
rollwise_generated_tokens_total and nowhere else (a shutdown's cancelled groups, or a bug, which the
scheduler logs)."""

from __future__ import annotations

import collections

from pipeline.contracts.waste import LOST, episode_cause
from pipeline.supervisor.actors.outcomes import GroupOutcome
from pipeline.supervisor.observability import metrics


class WasteBook:
    """`tokens[cause]`: generated tokens wasted so far, as also added to
    rollwise_generated_tokens_wasted_total{cause}."""

    def __init__(self) -> None:
        self.tokens: collections.Counter[str] = collections.Counter()

    def finished(self, group: GroupOutcome) -> None:
        """A group finished: its episodes that cannot train are waste by their finish reason."""
        for episode in group.episodes:
            if (cause := episode_cause(episode.finish_reason, episode.aborted)) is not None:
                self._add(cause, episode.generated_tokens)

    def lost(self, group: GroupOutcome) -> None:
        """A finished group never became durable: its trainable episodes are waste too."""
        self._add(LOST, sum(episode.generated_tokens for episode in group.episodes if episode.trainable))

    def _add(self, cause: str, tokens: int) -> None:
        if tokens:
            self.tokens[cause] += tokens
            metrics.GENERATED_TOKENS_WASTED.labels(cause=cause).inc(tokens)
