"""Cutting a running group short so that what it finished is trained instead of dropped as stale.

A group admitted while the engines served version a can be trained up to learner version a + η
(pipeline.contracts.staleness). One of its episodes that hangs (an environment stuck until its step
timeout, a very long generation) keeps the whole group running while the learner moves on; when it is
finally written the learner has passed a + η and drops all of it, the finished episodes with the slow
one. Admission cannot prevent it without stalling the learner (`async.straggler_patience`).

So the scheduler cuts such groups at their last chance: once the learner has reached version a + η (the
batch it collects now is the last one they can join) and they would complete that batch with the groups
already written, while another group could complete it in their place, provided only a few of their
episodes are still running. Those end with finish reason `cut` (their rows are written for accounting,
never trained, like a `timeout`), and each group is written at once with the episodes that finished, to
take its place in that batch: the learner takes the groups it holds earliest deadline first, and the
scheduler holds other groups' writes until the cut ones are written (GroupScheduler).

What this costs, and why the cap: a cut stops sampled work too, and the episodes it stops are the
group's slowest, so a group trained after a cut leaves its longest episodes out of its advantage
baseline (as a group that lost an episode to an `env_error` does): a bias towards short episodes. A group
at its last chance is not certain to go stale (the learner may still take it if it finishes first), so
cutting many of its episodes to save it would waste more than it saves. `async.cut_late_groups` is the
largest share of a group's episodes one cut may stop (0.25 by default: one hung episode in sixteen, not
half of every group in the long tail of generation lengths; 0 = never cut), and a group left with fewer
than two finished episodes (too few for a leave-one-out baseline) is not cut at all.

`groups_to_cut` is the rule, pure; `GroupCut` is the handle a group's episodes share: each episode
registers its episode-timeout scope with it (pipeline.supervisor.actors.rollout.run_episode), and `fire`
moves every registered scope's deadline to now, so the cut goes through the path an episode timeout takes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RunningGroup:
    """A group still playing: its id, the version it was admitted at, its episodes not yet finished."""

    group_id: str
    admitted_version: int
    unfinished: int


def groups_to_cut(
    running: Sequence[RunningGroup],
    *,
    learner_version: int,
    waiting_groups: int,
    writing_groups: int,
    batch_groups: int,
    max_staleness: int,
    group_size: int,
    max_share: float,
) -> list[str]:
    """The running groups to cut now (module docstring), in the order given.

    A group can be cut when the learner has reached its last chance (version >= admitted + η) and a cut
    would stop at least one and at most `max_share` of its episodes, leaving two finished. Those groups
    are cut together once they would complete the batch the learner collects, with the groups written
    and not yet consumed (`waiting_groups`) and those about to be (`writing_groups`: being written, or
    cut and closing their episodes), and a group that is not to be cut still runs, which could take
    their places; or once that batch is complete without them. Together and not at the last free place,
    because the learner forms its batch the moment it holds B groups (the earliest deadlines first among
    those): groups cut one by one at the last place would each find it just taken by the first of them.
    Not sooner, because a cut is only worth its episodes where the group would otherwise go stale. With
    η = 0 admission never lets that happen (no group outside the learner's B groups of its version
    runs), so nothing is cut there."""
    cuttable = [
        group.group_id
        for group in running
        if learner_version >= group.admitted_version + max_staleness
        and 0 < group.unfinished <= max_share * group_size
        and group_size - group.unfinished >= 2
    ]
    landing = waiting_groups + writing_groups
    if not cuttable or landing + len(cuttable) < batch_groups:
        return []
    if landing >= batch_groups or len(running) > len(cuttable):
        return cuttable
    return []


class GroupCut:
    """What a group's episodes share so that a cut stops every one of them where it stands.

    The group runner counts each episode that finishes (`finished`), and marks the group `uncuttable`
    when one of its episodes is an agent function's (which a cut cannot stop: its agent holds the
    conversation). `unfinished` is then what a cut would stop: 0 for such a group."""

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size
        self.finished = 0
        self.uncuttable = False
        self.reason: str | None = None
        self._scopes: set[asyncio.Timeout] = set()

    @property
    def fired(self) -> bool:
        return self.reason is not None

    @property
    def unfinished(self) -> int:
        """Episodes a cut would stop now (class docstring)."""
        return 0 if self.uncuttable else self.group_size - self.finished

    def fire(self, reason: str) -> None:
        """Cut the group: every episode still running times out now; `reason` becomes each one's error."""
        if self.fired:
            return
        self.reason = reason
        for scope in list(self._scopes):
            self._expire(scope)

    @contextlib.contextmanager
    def watching(self, scope: asyncio.Timeout) -> Iterator[None]:
        """An episode's timeout scope, entered: a cut (before or while it runs) expires it."""
        self._scopes.add(scope)
        if self.fired:
            self._expire(scope)
        try:
            yield
        finally:
            self._scopes.discard(scope)

    @staticmethod
    def _expire(scope: asyncio.Timeout) -> None:
        if not scope.expired():  # an episode timing out on its own already ends the same way
            scope.reschedule(asyncio.get_running_loop().time())
