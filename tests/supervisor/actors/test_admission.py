"""Staleness admission (AReaL's rule) and the learner-side stale guard."""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field

import pytest

from pipeline.contracts.staleness import is_stale
from pipeline.supervisor.actors.admission import AdmissionController


@pytest.mark.parametrize(
    ("eta", "version", "accepted", "running", "expected"),
    [
        (0, 0, 0, 0, 4),  # first batch: B groups
        (0, 0, 2, 2, 0),  # the batch is all admitted
        (0, 1, 4, 0, 4),  # next version opens the next batch
        (2, 0, 0, 0, 10),  # η=2: three batches, capped by max_concurrent=10
        (2, 0, 4, 4, 4),  # (2+0+1)*4 - 8
        (2, 3, 10, 6, 4),  # staleness room (2+3+1)*4 - 16 = 8, concurrency room 10-6 = 4
        (2, 3, 20, 1, 3),  # staleness room 24 - 21 = 3 binds before concurrency room 9
        (1, 0, 9, 0, 0),  # over budget (e.g. after a restart) floors at 0
    ],
)
def test_capacity_table(eta: int, version: int, accepted: int, running: int, expected: int) -> None:
    adm = AdmissionController(batch_groups=4, max_staleness=eta, max_concurrent=10)
    assert adm.capacity(version, accepted, running) == expected


def test_capacity_is_bounded_by_concurrency_and_staleness_separately() -> None:
    adm = AdmissionController(batch_groups=8, max_staleness=4, max_concurrent=3)
    assert adm.capacity(version=0, accepted=0, running=0) == 3
    assert adm.capacity(version=0, accepted=0, running=3) == 0
    assert not adm.held_by_staleness(version=0, accepted=0, running=3)
    assert adm.capacity(version=0, accepted=40, running=0) == 0
    assert adm.held_by_staleness(version=0, accepted=40, running=0)
    assert adm.capacity(version=1, accepted=40, running=0) == 3


def test_invalid_parameters_are_named() -> None:
    with pytest.raises(ValueError, match="batch_groups"):
        AdmissionController(batch_groups=0, max_staleness=0, max_concurrent=1)
    with pytest.raises(ValueError, match="max_staleness"):
        AdmissionController(batch_groups=1, max_staleness=-1, max_concurrent=1)
    with pytest.raises(ValueError, match="max_concurrent"):
        AdmissionController(batch_groups=1, max_staleness=0, max_concurrent=0)


@pytest.mark.parametrize(
    ("min_version", "learner_version", "eta", "stale"),
    [(5, 5, 0, False), (4, 5, 0, True), (3, 5, 2, False), (2, 5, 2, True), (0, 0, 0, False)],
)
def test_is_stale_table(min_version: int, learner_version: int, eta: int, stale: bool) -> None:
    assert is_stale(min_version, learner_version, eta) is stale


@dataclass(order=True)
class _Done:
    at: float
    gid: int = field(compare=True)
    start_version: int = field(compare=False)
    end_version: int = field(compare=False, default=-1)


def _simulate(
    eta: int,
    batch: int,
    max_concurrent: int,
    steps: int,
    seed: int,
    drop_every: int = 0,
    fixed_duration: float | None = None,
    protect: bool = False,
) -> list[tuple[int, list[_Done]]]:
    """Discrete-event run of admission + a learner taking B groups per version, in completion order.
    Groups take lognormal durations (or `fixed_duration`); a learner step takes 1.0 time unit.
    Returns (learner version, groups) per step."""
    rng = random.Random(seed)
    adm = AdmissionController(batch_groups=batch, max_staleness=eta, max_concurrent=max_concurrent)
    now = 0.0
    version = 0
    accepted = 0
    running: list[_Done] = []  # heap by completion time
    spool: list[_Done] = []
    trained: list[tuple[int, list[_Done]]] = []
    learner_busy_until: float | None = None
    next_gid = 0
    written = 0
    while len(trained) < steps:
        older = [g.start_version for g in running if g.start_version < version]
        floor = min(older) if protect and older else None
        for _ in range(adm.capacity(version, accepted, len(running), floor)):
            duration = fixed_duration if fixed_duration is not None else rng.lognormvariate(0.0, 1.0)
            heapq.heappush(running, _Done(now + duration, next_gid, version))
            next_gid += 1
        events = [running[0].at] if running else []
        if learner_busy_until is not None:
            events.append(learner_busy_until)
        now = min(events)
        if learner_busy_until is not None and now == learner_busy_until:
            version += 1
            learner_busy_until = None
        while running and running[0].at <= now:
            done = heapq.heappop(running)
            done.end_version = version
            written += 1
            accepted += 1
            if drop_every and written % drop_every == 0:
                accepted -= 1  # the learner dropped it (e.g. too few trainable members)
            else:
                spool.append(done)
        if learner_busy_until is None and len(spool) >= batch:
            taken, spool = spool[:batch], spool[batch:]
            trained.append((version, taken))
            learner_busy_until = now + 1.0
    return trained


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("drop_every", [0, 3])
def test_eta_zero_reproduces_synchronous_training(seed: int, drop_every: int) -> None:
    trained = _simulate(eta=0, batch=4, max_concurrent=64, steps=20, seed=seed, drop_every=drop_every)
    for step, (learner_version, groups) in enumerate(trained):
        assert learner_version == step
        assert len(groups) == 4
        for g in groups:
            # generated entirely at the version that trains it: started and finished at that version
            assert g.start_version == learner_version
            assert g.end_version == learner_version
            assert not is_stale(g.start_version, learner_version, 0)


@pytest.mark.parametrize("eta", [1, 2, 4])
def test_positive_eta_bounds_lag_when_groups_finish_in_admission_order(eta: int) -> None:
    trained = _simulate(eta=eta, batch=4, max_concurrent=64, steps=30, seed=7, fixed_duration=0.25)
    lags = [v - g.start_version for v, groups in trained for g in groups]
    assert max(lags) == eta  # the whole budget is used (work overlaps training) and never exceeded
    assert all(not is_stale(g.start_version, v, eta) for v, groups in trained for g in groups)


def test_long_tail_groups_can_outrun_admission_so_the_learner_must_guard() -> None:
    # Admission bounds counts, not ages: a slow group admitted early can be overtaken by later ones
    # and arrive beyond v - η. This is why the learner drops with is_stale as well.
    trained = _simulate(eta=1, batch=4, max_concurrent=64, steps=40, seed=7)
    stale = [g for v, groups in trained for g in groups if is_stale(g.start_version, v, 1)]
    assert stale


@pytest.mark.parametrize("eta", [0, 1, 2])
@pytest.mark.parametrize("seed", [7, 8])
def test_budgeting_from_the_oldest_running_group_keeps_every_long_tail_group_within_bound(
    eta: int, seed: int
) -> None:
    # The same long tail with the scheduler's straggler protection (an unbounded patience here): no
    # group admitted while an older one runs can push it past its bound, so none arrives stale.
    trained = _simulate(eta=eta, batch=4, max_concurrent=64, steps=40, seed=seed, protect=True)
    assert all(not is_stale(g.start_version, v, eta) for v, groups in trained for g in groups)
    assert max(v - g.start_version for v, groups in trained for g in groups) == eta  # the budget is used


def test_the_floor_lowers_the_budget_only_below_the_served_version() -> None:
    adm = AdmissionController(batch_groups=4, max_staleness=2, max_concurrent=64)
    # (η + v + 1)·B = 24 at v = 3; a straggler from version 1 makes it (2 + 1 + 1)·4 = 16.
    assert adm.staleness_room(3, accepted=10, running=4) == 10
    assert adm.staleness_room(3, accepted=10, running=4, floor=1) == 2
    assert adm.staleness_room(3, accepted=10, running=4, floor=5) == 10  # never above v
    assert adm.held_by_staleness(3, accepted=12, running=4, floor=1)


def test_the_run_end_caps_the_staleness_budget() -> None:
    """run.max_steps · B = 10 groups: (η + v + 1)·B = 16 would allow 12 more; the run's end allows 6."""
    adm = AdmissionController(batch_groups=4, max_staleness=2, max_concurrent=20, max_groups=10)
    assert adm.staleness_room(version=1, accepted=3, running=1) == 6
    assert adm.capacity(version=1, accepted=9, running=1) == 0
    assert adm.held_by_staleness(version=1, accepted=9, running=1)
    unbounded = AdmissionController(batch_groups=4, max_staleness=2, max_concurrent=20)
    assert unbounded.staleness_room(version=1, accepted=3, running=1) == 12


def test_a_negative_run_end_is_refused() -> None:
    with pytest.raises(ValueError, match="max_groups must be >= 0, got -1"):
        AdmissionController(batch_groups=1, max_staleness=0, max_concurrent=1, max_groups=-1)
