"""The supervisor's share of the generated tokens never trained (pipeline.contracts.waste): the episodes
a finished group carries that cannot train, counted when the group finishes; all of a group's tokens
when it was dropped in flight (in_flight_drops: it could no longer be trained); the trainable episodes of
a group whose write failed or was cancelled, counted then; and what a group cancelled or failed before
its outcome existed had generated (its GroupCut's `generated`). The learner counts the rest (the
trainable rows of the groups it drops)."""

from __future__ import annotations

import collections

from pipeline.contracts.waste import LOST, STALE, episode_cause
from pipeline.supervisor.actors.late_cut import GroupCut
from pipeline.supervisor.actors.outcomes import GroupOutcome
from pipeline.supervisor.observability import metrics


class WasteBook:
    """`tokens[cause]`: generated tokens wasted so far, as also added to
    rollwise_generated_tokens_wasted_total{cause}."""

    def __init__(self) -> None:
        self.tokens: collections.Counter[str] = collections.Counter()

    def finished(self, group: GroupOutcome, doomed: bool = False) -> None:
        """A group finished: its episodes that cannot train are waste by their finish reason; all of its
        tokens are stale waste when it was `doomed` (dropped in flight, never written)."""
        if doomed:
            self._add(STALE, sum(episode.generated_tokens for episode in group.episodes))
            return
        for episode in group.episodes:
            if (cause := episode_cause(episode.finish_reason, episode.aborted)) is not None:
                self._add(cause, episode.generated_tokens)

    def lost(self, group: GroupOutcome) -> None:
        """A finished group never became durable: its trainable episodes are waste too."""
        self._add(LOST, sum(episode.generated_tokens for episode in group.episodes if episode.trainable))

    def unfinished(self, handle: GroupCut) -> None:
        """A group ended with no outcome (cancelled by a shutdown, or its runner failed): what its engine
        answers held is waste, stale when it had been dropped in flight, lost otherwise."""
        self._add(STALE if handle.doomed else LOST, handle.generated)

    def _add(self, cause: str, tokens: int) -> None:
        if tokens:
            self.tokens[cause] += tokens
            metrics.GENERATED_TOKENS_WASTED.labels(cause=cause).inc(tokens)
