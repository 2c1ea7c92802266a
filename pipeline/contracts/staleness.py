"""The staleness rule both processes apply (the AReaL paper, arXiv 2505.24298): the actors admit work
within η versions of the policy (pipeline.supervisor.actors.admission), and the learner drops a group that
slipped past it anyway (a weight sync that lagged, a restart)."""

from __future__ import annotations


def is_stale(group_min_version: int, learner_version: int, max_staleness: int) -> bool:
    """The learner's guard: a group whose oldest token predates v − η is not trained on."""
    return group_min_version < learner_version - max_staleness


def deadline_key(group_min_version: int | None, seq: int) -> tuple[int, int]:
    """The order in which the learner takes the groups waiting for it: earliest staleness deadline first.

    A group with oldest token version m can be trained up to version m + η, so among waiting groups the
    smallest m has the nearest deadline; ties (and η = 0, where every waiting group has the same m) go
    in write order. Each group takes one slot of a step, so if any order of the waiting groups trains
    them all before their deadlines, this one does (Jackson's rule); write order instead trains a group
    that ran long behind groups admitted after it, and those can push it past its bound. A group with no
    generated token (None) comes first: it is dropped at once and costs no slot."""
    return (-1 if group_min_version is None else group_min_version, seq)
