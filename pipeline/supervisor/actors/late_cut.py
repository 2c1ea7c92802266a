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
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from pipeline.supervisor.actors.admission import AdmissionController
from pipeline.supervisor.observability import metrics
from pipeline.transport.spool import SpoolWriter

log = logging.getLogger(__name__)


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
    conversation). `unfinished` is then what a cut would stop: 0 for such a group.

    Each engine answer of a token-in/token-out episode is noted (`note`): the tokens generated so far
    (`generated`, what a group cancelled before its outcome exists counts as waste) and the oldest version
    among them (`oldest_version`, from which the scheduler knows when the group can no longer be trained:
    in_flight_drops). A group `doomed` that way is cut like a late one, and never written."""

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size
        self.finished = 0
        self.uncuttable = False
        self.reason: str | None = None
        self.generated = 0
        self.oldest_version: int | None = None
        self.doomed = False
        self._scopes: set[asyncio.Timeout] = set()

    def note(self, tokens: int, versions: Sequence[int]) -> None:
        """One engine answer: `tokens` more generated, at `versions` (one per token)."""
        self.generated += tokens
        if versions:
            oldest = min(versions)
            if self.oldest_version is None or oldest < self.oldest_version:
                self.oldest_version = oldest

    def doom(self, reason: str) -> None:
        """The group can no longer be trained: stop its episodes (as `fire`) and mark it not to be written."""
        self.doomed = True
        self.fire(reason)

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


CUT_WRITES_FIRST_S = 2.0  # the longest another group's write waits for the cut groups' writes


class Admitted(NamedTuple):
    """A running group's admission: the version served then, when it started (monotonic), and its cut."""

    version: int
    started: float
    cut: GroupCut


class Cutter:
    """The scheduler's late cuts; this base (`cut_late_groups = 0`) cuts no group and holds no write."""

    groups_cut = 0

    def on_learner_step(self, version: int, consumed_groups: int) -> None:
        pass

    def check(self, admitted: Mapping[str, Admitted], writes: int) -> None:
        pass

    def settled(self, group_id: str) -> None:
        pass

    async def before_write(self, group_id: str) -> None:
        pass


class LateCuts(Cutter):
    """The scheduler's side of the rule: it knows the learner's version and how many spool groups it has
    consumed from its step events (`on_learner_step`: its watermark plus the groups consumed beyond it);
    the groups waiting for it are the spool's highest sequence number less those, exact while groups land
    after the event. `check` cuts at each step event, each group written and each admission round. While
    cut groups close their episodes, any other group's write waits for them (at most
    CUT_WRITES_FIRST_S): the learner completes its batch with whatever lands first, and a group admitted
    later that finished in that window would take the place the cut was for."""

    def __init__(
        self, max_share: float, admission: AdmissionController, group_size: int, spool: SpoolWriter
    ) -> None:
        self.max_share = max_share
        self.batch_groups = admission.batch_groups
        self.max_staleness = admission.max_staleness
        self.group_size = group_size
        self.spool = spool
        self.groups_cut = 0
        self._learner: tuple[int, int] | None = None  # (version, spool groups consumed) at its last step
        self._unwritten: set[str] = set()  # cut groups not yet written (or lost)
        self._all_written = asyncio.Event()  # set while _unwritten is empty
        self._all_written.set()

    def on_learner_step(self, version: int, consumed_groups: int) -> None:
        self._learner = (version, consumed_groups)

    def check(self, admitted: Mapping[str, Admitted], writes: int) -> None:
        """Cut the running groups the rule picks now; `writes` = groups being written."""
        if self._learner is None:
            return
        learner_version, consumed = self._learner
        waiting = max(0, self.spool.next_seq - 1 - consumed)  # spool seqs are 1, 2, ... without gaps
        running = [
            RunningGroup(group_id, entry.version, entry.cut.unfinished)
            for group_id, entry in admitted.items()
            if not entry.cut.fired
        ]
        cut_ids = groups_to_cut(
            running,
            learner_version=learner_version,
            waiting_groups=waiting,
            # the cut ones close their episodes and will be written; a doomed one never is (in_flight_drops)
            writing_groups=writes + sum(1 for e in admitted.values() if e.cut.fired and not e.cut.doomed),
            batch_groups=self.batch_groups,
            max_staleness=self.max_staleness,
            group_size=self.group_size,
            max_share=self.max_share,
        )
        for group_id in cut_ids:
            self._cut(group_id, admitted[group_id], learner_version, waiting, len(cut_ids))

    def _cut(self, group_id: str, entry: Admitted, learner_version: int, waiting: int, together: int) -> None:
        cut = entry.cut
        cut.fire(
            f"cut: the learner reached version {learner_version}, the last at which group {group_id} "
            f"(admitted at {entry.version}, max_staleness {self.max_staleness}) can be trained; "
            f"{waiting} groups waiting and {together} cut at once for its batch of "
            f"{self.batch_groups}; {cut.unfinished} of its {self.group_size} episodes stopped"
        )
        log.info("%s", cut.reason)
        self._unwritten.add(group_id)
        self._all_written.clear()
        self.groups_cut += 1
        metrics.GROUPS_CUT.inc()

    def settled(self, group_id: str) -> None:
        """A cut group was written or lost: the writes held for it may go."""
        self._unwritten.discard(group_id)
        if not self._unwritten:
            self._all_written.set()

    async def before_write(self, group_id: str) -> None:
        """Hold this group's write while cut groups are still to be written (class docstring)."""
        if group_id in self._unwritten or self._all_written.is_set():
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(CUT_WRITES_FIRST_S):
                await self._all_written.wait()


def late_cuts(
    max_share: float, admission: AdmissionController, group_size: int, spool: SpoolWriter
) -> Cutter:
    """The late cuts of a scheduler: none with `max_share` 0 (`async.cut_late_groups`)."""
    if not 0 <= max_share <= 1:
        raise ValueError(f"cut_late_groups must be a share in [0, 1], got {max_share}")
    return LateCuts(max_share, admission, group_size, spool) if max_share else Cutter()
