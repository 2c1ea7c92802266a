"""The learner's ranks as the loop sees them: rank 0 tells the others what to do next, they listen.

`join_group` returns `OneProcess` when the learner is a single process: every collective is then a
no-op, so the loop is the same code for one rank or many. With several ranks (`Ranks`, started by
torchrun) rank 0 broadcasts a `Command` before each piece of collective work and the others follow it in
the same order.
"""

from __future__ import annotations

import time
from typing import Protocol

from learner.distributed import Command, Ranks, join, leave

# While rank 0 waits for the spool, the other ranks wait in a broadcast; a `wait` command this often keeps
# it well inside the process group's timeout (minutes: engines may take that long to start).
KEEP_WAITING_S = 30.0


class Group(Protocol):
    """This process's place among the learner's ranks."""

    @property
    def leader(self) -> bool:
        """Rank 0: reads stdin, tails the spool, writes events and decides."""
        ...

    @property
    def rank(self) -> int:
        """This process's rank (0: the leader)."""
        ...

    @property
    def ranks(self) -> Ranks | None:
        """What the Trainer and the checkpoint code take: None in one process."""
        ...

    def tell(self, command: Command) -> None:
        """Rank 0: have the other ranks enter the same work next. A no-op anywhere else."""

    def keep_waiting(self) -> None:
        """Rank 0, idle: keep the others' broadcast from timing out."""

    def listen(self) -> Command:
        """Ranks other than 0: the next command rank 0 tells."""
        ...

    def agree(self, value: str | None, what: str) -> None:
        """Raise unless every rank holds the same `value` (a shared file system's view)."""

    def leave(self) -> None:
        """Tear the process group down together (a clean exit)."""


class OneProcess:
    """The learner as a single process: the leader, with no one to tell."""

    leader = True
    rank = 0
    ranks = None

    def tell(self, command: Command) -> None:
        pass

    def keep_waiting(self) -> None:
        pass

    def listen(self) -> Command:
        raise RuntimeError("a one-process learner has no leader to listen to")

    def agree(self, value: str | None, what: str) -> None:
        pass

    def leave(self) -> None:
        pass


class RankGroup:
    """One rank of several (learner.distributed)."""

    def __init__(self, ranks: Ranks) -> None:
        self._ranks = ranks
        self._told_at = time.monotonic()

    @property
    def leader(self) -> bool:
        return self._ranks.leader

    @property
    def rank(self) -> int:
        return self._ranks.rank

    @property
    def ranks(self) -> Ranks:
        return self._ranks

    def tell(self, command: Command) -> None:
        if self._ranks.leader:
            self._ranks.broadcast(command)
            self._told_at = time.monotonic()

    def keep_waiting(self) -> None:
        if time.monotonic() - self._told_at > KEEP_WAITING_S:
            self.tell(Command("wait"))

    def listen(self) -> Command:
        command: Command = self._ranks.broadcast(Command("wait"))  # rank 0's replaces it
        return command

    def agree(self, value: str | None, what: str) -> None:
        seen = self._ranks.gather(value)
        if len(set(seen)) != 1:
            raise RuntimeError(
                f"the learner's ranks see different {what} {seen}: every rank must see the "
                "same run directory (a shared file system across the learner's nodes)"
            )

    def leave(self) -> None:
        leave(self._ranks)


def join_group(world_size: int, device_name: str) -> Group:
    """Join the learner's ranks (learner.distributed.join); OneProcess when there is one."""
    ranks = join(world_size, device_name)
    return OneProcess() if ranks is None else RankGroup(ranks)
