"""Cutting a running group short so that what it finished is trained instead of dropped as stale.

A group admitted while the engines served version a can be trained up to learner version a + η
(pipeline.contracts.staleness). One of its episodes that hangs (an environment stuck until its step
timeout, a very long generation) keeps the whole group running while the learner moves on; when it is
finally written the learner has passed a + η and drops all of it, the finished episodes with the slow
one. Admission cannot prevent it without stalling the learner (`async.straggler_patience`).

So the scheduler cuts such a group at its last chance: once the learner has reached version a + η (the
batch it collects now is the last one the group can join) and that batch lacks at most one group, which
another running group could supply, provided only a few of its episodes are still running. Those end
with finish reason `cut` (their rows are written for accounting, never trained, like a `timeout`), and
the group is written at once with the episodes that finished, to take the last place in that batch.

What this costs, and why the cap: a cut stops sampled work too, and the episodes it stops are the
group's slowest, so a group trained after a cut leaves its longest episodes out of its advantage
baseline (as a group that lost an episode to an `env_error` does): a bias towards short episodes. A group
at its last chance is not certain to go stale (the learner may still take it if it finishes first), so
cutting many of its episodes to save it would waste more than it saves. `async.cut_late_groups` is the
largest share of a group's episodes one cut may stop (0.25 by default: one hung episode in sixteen, not
half of every group in the long tail of generation lengths; 0 = never cut), and a group left with fewer
than two finished episodes (too few for a leave-one-out baseline) is not cut at all.

`cut_due` is the rule, pure; `GroupCut` is the handle a group's episodes share: each episode registers its
episode-timeout scope with it (pipeline.supervisor.actors.rollout.run_episode), and `fire` moves every
registered scope's deadline to now, so the cut goes through the path an episode timeout takes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator


def cut_due(
    *,
    admitted_version: int,
    learner_version: int,
    waiting_groups: int,
    others_running: int,
    batch_groups: int,
    max_staleness: int,
    unfinished: int,
    group_size: int,
    max_share: float,
) -> bool:
    """Whether a group still running should be cut now (module docstring).

    `waiting_groups` = groups written and not yet consumed by the learner (those of the batch it collects
    now); `others_running` = the other groups running or being written, any of which could complete that
    batch in this group's place. The group is not yet at its last chance while the learner is below
    a + η; at it, a batch still short of two or more groups cannot go without it, and one short of exactly
    one waits for it unless another group can complete it. With η = 0 admission never lets that happen
    (the learner waits for the B groups of its version), so no group is ever cut there. `unfinished` of
    the group's `group_size` episodes still run: a cut stops them, so they must be at least one and at
    most `max_share` of the group, and leave two finished."""
    if not 0 < unfinished <= max_share * group_size or group_size - unfinished < 2:
        return False
    if learner_version < admitted_version + max_staleness:
        return False
    if waiting_groups >= batch_groups:
        return True  # the learner has a full batch without this group: only a cut can still catch it
    return waiting_groups == batch_groups - 1 and others_running > 0


class GroupCut:
    """What a group's episodes share so that a cut stops every one of them where it stands."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self._scopes: set[asyncio.Timeout] = set()

    @property
    def fired(self) -> bool:
        return self.reason is not None

    @property
    def unfinished(self) -> int:
        """Episodes still running under this cut's watch (an agent function's episode is never watched)."""
        return len(self._scopes)

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
