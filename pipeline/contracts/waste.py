"""Generated tokens that are never trained, by cause (docs/design/asynchrony_at_the_limit.md).

A generated token is wasted at exactly one place and counted there once, in tokens:
- the learner, for the trainable rows of a group it drops (`drop_cause` of the drop reason);
- the supervisor, for the episodes a finished group carries that cannot train (`episode_cause` of the
  finish reason: a cut, an abort that was not resumed, a failure), for every token of a group it dropped
  in flight because the learner had passed its oldest token's deadline (`STALE`: it is never written, so
  the learner never sees it), and for the trainable episodes of a group whose write failed, or what a
  group cancelled by a shutdown had generated (`LOST`).

So the trainable rows' tokens are the learner's to count and the others the supervisor's, and no token
is counted by both. A group that updated no weight (every advantage zero, drop reason `no_update`) was
trained in name only: its tokens are reported apart (`NO_SIGNAL`), not as waste of the pipeline, since no
scheduling could have saved them. A quarantined spool file cannot be read, so its tokens are unknown: it
counts as a dropped group, with no tokens.
"""

from __future__ import annotations

from collections.abc import Iterable

from pipeline.contracts.schema import TRAINABLE_FINISH_REASONS, EpisodeSegment

STALE, REJECTED, CUT, ABORTED, FAILED, LOST = "stale", "rejected", "cut", "aborted", "failed", "lost"
WASTE_CAUSES = (STALE, REJECTED, CUT, ABORTED, FAILED, LOST)
NO_SIGNAL = "no_update"

# The learner's drop reasons (learner.groups.triage_group, learner.process.intake) by cause.
_DROP_CAUSES = {
    "stale": STALE,
    "too_few_members": REJECTED,
    "invalid_tokens": REJECTED,
    "routing_mismatch": REJECTED,
}
_FAILED_FINISH_REASONS = frozenset({"env_error", "engine_error", "timeout"})


def drop_cause(reason: str) -> str | None:
    """The waste cause of a group the learner dropped for `reason`; None when its tokens are not waste
    (`no_update`) or unknown (`quarantined`)."""
    return _DROP_CAUSES.get(reason)


def episode_cause(finish_reason: str, aborted: bool = False) -> str | None:
    """The waste cause of an episode that ended with `finish_reason`; None for a trainable one.
    `aborted`: it ended because the engine aborted its generation and it was not resubmitted."""
    if finish_reason in TRAINABLE_FINISH_REASONS:
        return None
    if finish_reason == "cut":
        return CUT
    if finish_reason not in _FAILED_FINISH_REASONS:
        raise ValueError(f"finish reason {finish_reason!r} has no waste cause")
    return ABORTED if aborted else FAILED


def trainable_tokens(rows: Iterable[EpisodeSegment]) -> int:
    """Generated tokens of the trainable rows: what the learner trains of a group, or wastes if it drops
    it."""
    return sum(row.num_generated for row in rows if row.trainable)
