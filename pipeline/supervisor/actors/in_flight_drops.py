"""Dropping a group while it still runs, once the learner has passed its staleness bound.

The learner never trains a group whose oldest token predates its version minus η
(pipeline.contracts.staleness.is_stale), and its version only grows. So once a step event says the
learner is at version L, a running group that already holds a token older than L − η can never be
trained: everything it generates from then on is waste, and its admission slot is taken for nothing.
prime-rl cancels such groups before each weight update; here the scheduler drops them at the step event
that dooms them: their episodes stop as a cut stops them (late_cut.GroupCut), the group is not written
(the learner would only drop it), its admission slot frees at once, and its tokens count as stale waste
(waste_book) under rollwise_groups_dropped_total{reason="stale_in_flight"}.

The rule is exact because it reads the versions of the tokens the group holds (noted per engine answer),
not the version it was admitted at: a group whose first request waited through a weight update starts
on the newer version and keeps the later deadline. A group with no token yet is never dropped. A group
whose episodes are agent functions (their tokens go through the OpenAI endpoint) notes no version, so
it runs on and the learner drops it as before. One case sees the learner's version go back: a learner
restarted alone from a checkpoint before L; a group dropped at L might have been trained by it, so
dropping it costs its tokens, as the learner's own drop would have, no more.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from pipeline.contracts.staleness import is_stale
from pipeline.supervisor.actors.late_cut import Admitted
from pipeline.supervisor.observability import metrics

log = logging.getLogger(__name__)

DROP_REASON = "stale_in_flight"


def doomed_groups(admitted: Mapping[str, Admitted], learner_version: int, max_staleness: int) -> list[str]:
    """The running groups (`admitted`, group id -> admission) that the learner at `learner_version` can
    no longer train: they hold a token older than learner_version − max_staleness. A group already cut
    is left to its write (the learner drops it if it is late)."""
    return [
        group_id
        for group_id, entry in admitted.items()
        if not entry.cut.fired
        and entry.cut.oldest_version is not None
        and is_stale(entry.cut.oldest_version, learner_version, max_staleness)
    ]


def drop_doomed(admitted: Mapping[str, Admitted], learner_version: int, max_staleness: int) -> int:
    """Stop the groups `doomed_groups` names; returns how many."""
    doomed = doomed_groups(admitted, learner_version, max_staleness)
    for group_id in doomed:
        cut = admitted[group_id].cut
        cut.doom(
            f"dropped in flight: the learner reached version {learner_version} and group {group_id} holds "
            f"tokens of version {cut.oldest_version} (max_staleness {max_staleness}); it can never be trained"
        )
        log.info("%s", cut.reason)
        metrics.GROUPS_DROPPED.labels(reason=DROP_REASON).inc()
    return len(doomed)
