"""The staleness rule both processes apply (the AReaL paper, arXiv 2505.24298): the actors admit work
within η versions of the policy (pipeline.supervisor.actors.admission), and the learner drops a group that
slipped past it anyway (a weight sync that lagged, a restart)."""

from __future__ import annotations


def is_stale(group_min_version: int, learner_version: int, max_staleness: int) -> bool:
    """The learner's guard: a group whose oldest token predates v − η is not trained on."""
    return group_min_version < learner_version - max_staleness
