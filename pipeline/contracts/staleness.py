"""The staleness rule both processes apply (the AReaL paper, arXiv 2505.24298): the actors admit work
within η versions of the policy (pipeline.supervisor.actors.admission), and the learner drops a group that
slipped past it anyway (a weight sync that lagged, a restart). Where a trained token's staleness accrued,
in flight or in the queue, is `split_staleness`'s (prime-rl reports the same split)."""

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


# Contract 1's optional schema metadata: the learner version the supervisor had last heard of when it
# wrote the group (the learner's `step` events). Older spool files lack it.
WRITTEN_AT_KEY = b"rollwise.written_at_version"


def written_at(metadata: dict[bytes, bytes] | None) -> int | None:
    """The version a group's schema metadata says it was written at; None when absent or unreadable (an
    older or foreign writer: its staleness then counts as waiting)."""
    raw = (metadata or {}).get(WRITTEN_AT_KEY)
    try:
        return int(raw) if raw is not None else None
    except ValueError:
        return None


def split_staleness(token_version: int, written_at: int | None, trained_at: int) -> tuple[int, int]:
    """A trained token's staleness `trained_at - token_version` as (versions that passed while its group
    was still generating, versions that passed while it waited to be trained). The write's version is
    clamped into [token_version, trained_at]: the supervisor hears of a version after the learner made it,
    and a group written before a restart may carry a version the resumed learner redoes. Unknown (an
    older spool file): all of it counts as waiting."""
    written = token_version if written_at is None else min(max(written_at, token_version), trained_at)
    return written - token_version, trained_at - written
