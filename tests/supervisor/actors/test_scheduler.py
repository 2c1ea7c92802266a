"""The scheduler against a fake SGLang through a real EnginePool, the real runner and a real spool."""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pyarrow as pa
import pytest

from envs.api import Action, Environment, StepResult, Task
from pipeline.contracts.schema import batch_to_segments, segments_to_batch
from pipeline.contracts.staleness import written_at
from pipeline.supervisor.actors import late_cut
from pipeline.supervisor.actors.admission import AdmissionController
from pipeline.supervisor.actors.failure_backoff import FailureStreak
from pipeline.supervisor.actors.late_cut import Admitted, GroupCut
from pipeline.supervisor.actors.outcomes import EpisodeOutcome
from pipeline.supervisor.actors.rollout import RolloutSettings
from pipeline.supervisor.actors.scheduler import GroupRecipe, GroupScheduler, Pacing
from pipeline.supervisor.engines.client import EngineClient
from pipeline.supervisor.engines.pool import EnginePool
from pipeline.supervisor.engines.protocol import SamplingParams
from pipeline.supervisor.observability import metrics
from pipeline.tools.bench.async_speedup import CharTokenizer, CoinEnv
from pipeline.tools.fake_sglang import FakeSGLang
from pipeline.transport.spool import SpoolEntry, SpoolReader, SpoolWriter
from tests.helpers.train_groups import one_turn_row

G = 2


@pytest.fixture
async def fake() -> AsyncIterator[FakeSGLang]:
    server = FakeSGLang(vocab_size=CharTokenizer.vocab_size, eos_token_id=CharTokenizer.eos_token_id)
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
async def pool(fake: FakeSGLang) -> AsyncIterator[EnginePool]:
    p = EnginePool([EngineClient(fake.base_url, retries=0, request_timeout_s=10.0)])
    yield p
    await p.close()


def _tasks() -> Iterator[Task]:
    return CoinEnv().tasks(seed=0)


def make_scheduler(
    pool: EnginePool,
    spool_dir: Path,
    *,
    batch: int,
    eta: int,
    max_concurrent: int = 16,
    tasks: Iterator[Task] | None = None,
    factory: Callable[..., Environment] = CoinEnv,
    failure_backoff_s: tuple[float, float] = (0.05, 2.0),
    group_size: int = G,
    cut_late_groups: float = 0.25,
    spool: SpoolWriter | None = None,
    storage_retry_s: tuple[float, float] = (0.5, 10.0),
    notify: Callable[[str], None] | None = None,
    straggler_patience: float = 0.0,
    max_groups: int | None = None,
) -> GroupScheduler:
    return GroupScheduler(
        recipe=GroupRecipe(
            engine=pool,
            tokenizer=CharTokenizer(),
            factory=factory,
            env_name="bench-coin",
            settings=RolloutSettings(sampling=SamplingParams(max_new_tokens=8), max_context_tokens=256),
            group_size=group_size,
            env_options={"turns": 2},
        ),
        admission=AdmissionController(
            batch_groups=batch, max_staleness=eta, max_concurrent=max_concurrent, max_groups=max_groups
        ),
        spool=spool if spool is not None else SpoolWriter(spool_dir),
        tasks=tasks if tasks is not None else _tasks(),
        run_prefix="test",
        pacing=Pacing(
            failure_backoff_s=failure_backoff_s,
            storage_retry_s=storage_retry_s,
            straggler_patience=straggler_patience,
            cut_late_groups=cut_late_groups,
        ),
        notify=notify,
    )


async def until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Poll a plain attribute condition (the scheduler has no event per counter change)."""
    async with asyncio.timeout(timeout_s):
        while not condition():  # noqa: ASYNC110
            await asyncio.sleep(0.005)


async def _settle() -> None:
    """Give the scheduler loop time to admit anything it is allowed to (it must not)."""
    await asyncio.sleep(0.1)


async def test_eta_zero_admits_exactly_one_batch_per_version(pool: EnginePool, tmp_path: Path) -> None:
    sched = make_scheduler(pool, tmp_path, batch=2, eta=0)
    stop = asyncio.Event()
    runner = asyncio.create_task(sched.run(stop))
    await until(lambda: sched.written == 2 and sched.running == 0)
    await _settle()
    assert (sched.started, sched.accepted, sched.capacity()) == (2, 2, 0)
    sched.on_learner_step(1, 2)
    sched.on_version(1)
    await until(lambda: sched.written == 4)
    await _settle()
    assert sched.started == 4
    stop.set()
    await runner
    items = SpoolReader(tmp_path, after_seq=0).poll()
    assert [i.seq for i in items] == [1, 2, 3, 4]
    # each written with the learner version last heard: where its tokens' staleness accrues is known
    assert [written_at(i.batch.schema.metadata) for i in items] == [0, 0, 1, 1]
    assert sorted(i.group_id for i in items) == [f"test-g{k:06d}" for k in range(1, 5)]
    for item in items:
        episodes, rejected = batch_to_segments(item.batch)
        assert rejected == []
        assert len({e.episode_id for e in episodes}) == G
        assert all(e.finish_reason in ("stop", "length") for e in episodes)


async def test_dropped_groups_are_replaced_at_the_same_version(pool: EnginePool, tmp_path: Path) -> None:
    sched = make_scheduler(pool, tmp_path, batch=2, eta=0)
    stop = asyncio.Event()
    runner = asyncio.create_task(sched.run(stop))
    await until(lambda: sched.written == 2 and sched.running == 0)
    sched.on_dropped(1)
    await until(lambda: sched.written == 3)
    await _settle()
    assert (sched.started, sched.accepted) == (3, 2)
    stop.set()
    await runner


async def test_concurrency_caps_running_groups_and_staleness_idle_is_counted(
    fake: FakeSGLang, pool: EnginePool, tmp_path: Path
) -> None:
    await pool.pause_all("in_place")  # groups run but cannot finish
    sched = make_scheduler(pool, tmp_path, batch=4, eta=3, max_concurrent=3)
    stop = asyncio.Event()
    runner = asyncio.create_task(sched.run(stop))
    await until(lambda: sched.running == 3)
    await _settle()
    assert sched.started == 3
    assert sched.actor_idle_s == 0.0  # concurrency, not staleness, holds work back
    stop.set()
    await runner
    assert await sched.drain(0.0) == (0, 3)
    assert sched.running == 0
    assert os.listdir(tmp_path) == []


def _queued_gauge() -> float | None:
    return metrics.REGISTRY.get_sample_value("rollwise_groups_queued")


async def test_groups_queued_counts_admissible_groups_waiting_for_a_slot(
    fake: FakeSGLang, pool: EnginePool, tmp_path: Path
) -> None:
    await pool.pause_all("in_place")  # groups run but cannot finish: all 3 slots stay taken
    sched = make_scheduler(pool, tmp_path, batch=4, eta=3, max_concurrent=3)
    stop = asyncio.Event()
    runner = asyncio.create_task(sched.run(stop))
    await until(lambda: sched.running == 3)
    # staleness allows (η + v + 1)·B − (accepted + running) = (3 + 0 + 1)·4 − 3 = 13, no slot is free
    await until(lambda: _queued_gauge() == 13)
    assert sched.queued == 13
    sched.on_version(1)  # one more version: B = 4 more groups admissible, still no slot
    await until(lambda: _queued_gauge() == 17)
    stop.set()
    await runner
    assert _queued_gauge() == 0  # the loop has ended: nothing waits to be started by it
    await sched.drain(0.0)
    assert sched.queued == 0


async def test_groups_queued_is_zero_when_staleness_not_slots_holds_work(
    pool: EnginePool, tmp_path: Path
) -> None:
    metrics.GROUPS_QUEUED.set(99)
    sched = make_scheduler(pool, tmp_path, batch=1, eta=0, max_concurrent=4)
    stop = asyncio.Event()
    runner = asyncio.create_task(sched.run(stop))
    await until(lambda: sched.written == 1 and sched.running == 0)
    await until(lambda: _queued_gauge() == 0)
    assert (sched.queued, sched.capacity()) == (0, 0)
    stop.set()
    await runner


async def test_actor_idle_accumulates_while_staleness_holds_work(pool: EnginePool, tmp_path: Path) -> None:
    sched = make_scheduler(pool, tmp_path, batch=1, eta=0, max_concurrent=4)
    stop = asyncio.Event()
    runner = asyncio.create_task(sched.run(stop))
    await until(lambda: sched.written == 1 and sched.running == 0)
    idle_before = sched.actor_idle_s
    await asyncio.sleep(0.3)
    sched.on_version(1)  # ends the wait, which books its idle time
    await until(lambda: sched.started == 2)
    stop.set()
    await runner
    # every slot (4 of 4) was free for ~0.3 s
    assert 0.25 <= sched.actor_idle_s - idle_before <= 1.0


async def test_drain_lets_groups_finish_within_grace(
    fake: FakeSGLang, pool: EnginePool, tmp_path: Path
) -> None:
    fake.token_delay_s = 0.01
    sched = make_scheduler(pool, tmp_path, batch=3, eta=0)
    stop = asyncio.Event()
    runner = asyncio.create_task(sched.run(stop))
    await until(lambda: sched.running == 3)
    stop.set()
    await runner
    finished, cancelled = await sched.drain(10.0)
    assert (finished, cancelled) == (3, 0)
    assert len(SpoolReader(tmp_path, after_seq=0).poll()) == 3


async def test_drain_cancels_groups_past_grace_and_writes_nothing_partial(
    fake: FakeSGLang, pool: EnginePool, tmp_path: Path
) -> None:
    await pool.pause_all("in_place")
    sched = make_scheduler(pool, tmp_path, batch=2, eta=0)
    stop = asyncio.Event()
    runner = asyncio.create_task(sched.run(stop))
    await until(lambda: sched.running == 2)
    drained = asyncio.create_task(sched.drain(0.05))
    await runner  # drain also ends the admission loop
    assert await drained == (0, 2)
    assert (sched.running, sched.written, sched.cancelled) == (0, 0, 2)
    assert os.listdir(tmp_path) == []


class _BrokenEnv(CoinEnv):
    def __init__(self, turns: int = 2) -> None:
        raise RuntimeError("env cannot start")


async def test_group_whose_every_episode_failed_is_still_written(pool: EnginePool, tmp_path: Path) -> None:
    sched = make_scheduler(pool, tmp_path, batch=1, eta=0, factory=_BrokenEnv)
    stop = asyncio.Event()
    runner = asyncio.create_task(sched.run(stop))
    await until(lambda: sched.written == 1)
    stop.set()
    await runner
    [item] = SpoolReader(tmp_path, after_seq=0).poll()
    assert item.group_id == "test-g000001"
    assert item.batch.num_rows == 0  # the learner drops it as too_few_members


async def test_engine_errors_are_written_as_untrainable_rows(
    fake: FakeSGLang, pool: EnginePool, tmp_path: Path
) -> None:
    fake.queue_faults("http_500", "http_500")
    sched = make_scheduler(pool, tmp_path, batch=1, eta=0)
    stop = asyncio.Event()
    runner = asyncio.create_task(sched.run(stop))
    await until(lambda: sched.written == 1)
    stop.set()
    await runner
    [item] = SpoolReader(tmp_path, after_seq=0).poll()
    episodes, _ = batch_to_segments(item.batch)
    assert sorted(e.finish_reason for e in episodes) == ["engine_error", "engine_error"]
    assert sched.waste.tokens["failed"] == sum(e.num_generated for e in episodes)


async def test_run_returns_when_the_task_stream_ends(pool: EnginePool, tmp_path: Path) -> None:
    sched = make_scheduler(pool, tmp_path, batch=8, eta=0, tasks=itertools.islice(_tasks(), 3))
    await asyncio.wait_for(sched.run(asyncio.Event()), timeout=5.0)
    assert (sched.started, sched.written, sched.running) == (3, 3, 0)


async def test_group_ids_differ_between_scheduler_instances(pool: EnginePool, tmp_path: Path) -> None:
    a = make_scheduler(pool, tmp_path / "a", batch=1, eta=0)
    recipe = GroupRecipe(
        engine=pool,
        tokenizer=CharTokenizer(),
        factory=CoinEnv,
        env_name="bench-coin",
        settings=RolloutSettings(sampling=SamplingParams(max_new_tokens=4), max_context_tokens=128),
        group_size=G,
    )
    spool = SpoolWriter(tmp_path / "b")
    b = GroupScheduler(recipe=recipe, admission=AdmissionController(1, 0, 1), spool=spool, tasks=_tasks())
    assert a.run_prefix == "test"
    c = GroupScheduler(recipe=recipe, admission=b.admission, spool=spool, tasks=_tasks())
    assert b.run_prefix != c.run_prefix
    assert len(b.run_prefix) == 8


class _BlockingSpool(SpoolWriter):
    """A spool whose writes wait for `release` (a slow disk) or fail with `fail` while it is set."""

    def __init__(self, spool_dir: Path) -> None:
        super().__init__(spool_dir)
        self.release = threading.Event()
        self.entered = threading.Event()
        self.fail: Exception | None = None
        self.refused = 0

    def write_group(self, batch: pa.RecordBatch, *, group_id: str) -> SpoolEntry:
        self.entered.set()
        if self.fail is not None:
            self.refused += 1
            raise self.fail
        self.release.wait(timeout=10)
        return super().write_group(batch, group_id=group_id)


async def test_group_cancelled_during_its_write_is_still_written_and_counted(
    pool: EnginePool, tmp_path: Path
) -> None:
    spool = _BlockingSpool(tmp_path)
    sched = make_scheduler(pool, tmp_path, batch=1, eta=0, spool=spool)
    stop = asyncio.Event()
    runner = asyncio.create_task(sched.run(stop))
    await until(spool.entered.is_set)
    drained = asyncio.create_task(sched.drain(0.0))
    await asyncio.sleep(0.05)
    assert not drained.done()  # drain waits for the write it cannot cancel
    spool.release.set()
    assert await drained == (1, 0)
    await runner
    assert (sched.written, sched.accepted, sched.running, sched.cancelled) == (1, 1, 0, 0)
    assert [i.group_id for i in SpoolReader(tmp_path, after_seq=0).poll()] == ["test-g000001"]


def _storage_errors(kind: str) -> float:
    sample = metrics.REGISTRY.get_sample_value(
        "rollwise_storage_errors_total", {"component": "spool", "kind": kind}
    )
    return sample or 0.0


@pytest.mark.parametrize(
    ("error", "kind"),
    [(OSError(28, "No space left on device"), "ENOSPC"), (OSError(30, "Read-only file system"), "EROFS")],
)
async def test_a_write_the_storage_refuses_holds_the_group_pauses_admission_and_resumes(
    pool: EnginePool, tmp_path: Path, error: OSError, kind: str
) -> None:
    notes: list[str] = []
    spool = _BlockingSpool(tmp_path)
    spool.fail = error
    spool.release.set()
    sched = make_scheduler(
        pool,
        tmp_path,
        batch=100,
        eta=0,
        max_concurrent=2,
        spool=spool,
        storage_retry_s=(0.01, 0.05),
        notify=notes.append,
    )
    before = _storage_errors(kind)
    stop = asyncio.Event()
    runner = asyncio.create_task(sched.run(stop))
    await until(lambda: spool.refused >= 6)
    # Both running groups finished and wait for the disk; nothing new starts meanwhile.
    assert sched.storage_blocked and sched.capacity() == 0
    started = sched.started
    await _settle()
    assert sched.started == started <= 2 and sched.written == 0 and sched.failed == 0
    assert metrics.REGISTRY.get_sample_value("rollwise_storage_blocked", {"component": "spool"}) == 1.0
    assert _storage_errors(kind) - before == spool.refused
    assert len(notes) == 1 and kind in notes[0] and "paused" in notes[0]
    spool.fail = None  # space returns
    await until(lambda: sched.written >= started + 2)
    assert not sched.storage_blocked and sched.failed == 0
    assert metrics.REGISTRY.get_sample_value("rollwise_storage_blocked", {"component": "spool"}) == 0.0
    assert "writable again" in notes[-1]
    stop.set()
    await runner
    await sched.drain(5.0)
    seqs = [i.seq for i in SpoolReader(tmp_path, after_seq=0).poll()]
    assert seqs == list(range(1, sched.written + 1))  # every finished group, in order, none lost
    assert not [name for name in os.listdir(tmp_path) if name.endswith(".tmp")]


async def test_drain_gives_up_a_write_the_storage_keeps_refusing(pool: EnginePool, tmp_path: Path) -> None:
    spool = _BlockingSpool(tmp_path)
    spool.fail = OSError(28, "No space left on device")
    sched = make_scheduler(
        pool, tmp_path, batch=1, eta=0, max_concurrent=1, spool=spool, storage_retry_s=(0.01, 0.05)
    )
    stop = asyncio.Event()
    runner = asyncio.create_task(sched.run(stop))
    await until(lambda: spool.refused >= 2)
    stop.set()
    await runner
    await asyncio.wait_for(sched.drain(0.2), 5.0)
    assert (sched.written, sched.failed, sched.running) == (0, 1, 0)


async def test_failed_write_loses_the_group_and_frees_its_slot(pool: EnginePool, tmp_path: Path) -> None:
    # A failure that is not the storage's (here a bug in the writer) is not retried.
    spool = _BlockingSpool(tmp_path)
    spool.fail = RuntimeError("a bug, not a full disk")
    sched = make_scheduler(pool, tmp_path, batch=1, eta=0, max_concurrent=1, spool=spool)
    stop = asyncio.Event()
    runner = asyncio.create_task(sched.run(stop))
    await until(lambda: sched.failed >= 2)  # the slot came back, so a second group could start
    stop.set()
    await runner
    await sched.drain(0.0)
    assert sched.written == 0
    assert sched.accepted == 0
    assert sched.running == 0
    assert sched.waste.tokens["lost"] > 0  # its trainable episodes' tokens, counted once per lost group


async def test_failing_groups_back_off_admission_instead_of_spinning(
    pool: EnginePool, tmp_path: Path
) -> None:
    # A broken environment (or a dead engine) ends groups in milliseconds; dropped groups free their
    # admission slot at once, so only the backoff keeps the scheduler from writing empty groups in a loop.
    sched = make_scheduler(pool, tmp_path, batch=1, eta=0, factory=_BrokenEnv, failure_backoff_s=(0.05, 0.4))
    stop = asyncio.Event()

    async def learner_drops_everything() -> None:
        while not stop.is_set():
            if sched.accepted > 0:
                sched.on_dropped(sched.accepted)
            await asyncio.sleep(0.001)

    runner = asyncio.create_task(sched.run(stop))
    dropper = asyncio.create_task(learner_drops_everything())
    await asyncio.sleep(1.0)
    stop.set()
    await asyncio.gather(runner, dropper)
    # pauses of 0.05, 0.1, 0.2, 0.4, 0.4 ... s: about 5 groups in one second, not hundreds
    assert 3 <= sched.started <= 8
    assert sched.failed_groups == sched.written


def _episode(reason: str, error: str | None = None) -> EpisodeOutcome:
    return EpisodeOutcome("e", "g", "t", "env", reason, [], [], None, 0, 0.0, error=error)


async def test_a_good_group_resets_the_backoff(pool: EnginePool, tmp_path: Path) -> None:
    sched = make_scheduler(pool, tmp_path, batch=4, eta=0)
    sched.backoff.note("bad", [_episode("engine_error", "x")])
    sched.backoff.note("bad", [_episode("env_error", "y")])
    assert sched.backoff.streak == 2
    sched.backoff.note("good", [_episode("engine_error", "x"), _episode("stop")])
    assert sched.backoff.streak == 0 and sched.backoff.why.groups == 0


async def test_every_episode_failed_says_why(pool: EnginePool, tmp_path: Path) -> None:
    """Issue 33: the warning said only "every episode failed (N in a row)". It now counts the streak's
    episodes by finish reason and shows its most frequent errors (digits ignored when counting)."""
    said: list[str] = []
    sched = make_scheduler(pool, tmp_path, batch=4, eta=0, notify=said.append)
    context = "engine http://a:1: HTTP 400: The input ({n} tokens) is longer than the model's context length"
    for group in range(4):
        episodes = [_episode("engine_error", context.format(n=1020 + i)) for i in range(3)]
        episodes.append(_episode("env_error", "ValueError: bad move") if group == 0 else _episode("timeout"))
        sched.backoff.note(f"g{group}", episodes)
    assert len(said) == 3  # groups 1, 2 and 4 of the streak
    last = said[-1]
    assert "4 groups in a row" in last and "16 episodes ended engine_error 12, timeout 3, env_error 1" in last
    assert '12 x "engine http://a:1: HTTP 400: The input (1020 tokens) is longer than' in last
    assert "1 x 'ValueError: bad move'" in last


def test_a_streak_of_distinct_messages_stays_bounded() -> None:
    streak = FailureStreak()
    for i in range(1000):
        streak.add([_episode("engine_error", f"error kind {chr(65 + i % 26)}{chr(65 + i // 26 % 26)} {i}")])
    assert len(streak.errors) <= FailureStreak.MAX_SHAPES + 1
    assert sum(streak.errors.values()) == 1000


async def test_admission_waits_while_no_engine_can_serve_and_resumes_when_one_answers(
    pool: EnginePool, tmp_path: Path
) -> None:
    """Issue 29, problem 2: with every engine gone, groups started anyway and each episode ended
    engine_error at once (2,812 in 60 s); now admission waits for an engine."""
    up = False
    sched = make_scheduler(pool, tmp_path, batch=2, eta=0)
    sched.engines_up = lambda: up
    stop = asyncio.Event()
    runner = asyncio.create_task(sched.run(stop))
    await _settle()
    assert sched.started == 0 and sched.capacity() == 0
    up = True
    sched.on_engines_changed()
    await until(lambda: sched.written == 2)
    stop.set()
    await runner


async def test_a_pause_holds_new_groups_lets_running_ones_finish_and_resume_continues_the_books(
    fake: FakeSGLang, pool: EnginePool, tmp_path: Path
) -> None:
    """eval.pause_training's mechanism: nothing starts while any holder remains; the counters are
    untouched, so admission resumes exactly where it stood."""
    fake.token_delay_s = 0.02
    sched = make_scheduler(pool, tmp_path, batch=2, eta=1)
    stop = asyncio.Event()
    runner = asyncio.create_task(sched.run(stop))
    await until(lambda: sched.running == 4)  # (eta + 0 + 1) * 2 groups at version 0
    sched.pause("eval v0")
    sched.pause("other")
    sched.on_version(1)  # room for two more, but admission is held
    await until(lambda: sched.written == 4 and sched.running == 0)
    await _settle()
    assert (sched.started, sched.capacity(), sched.paused_by) == (4, 0, {"eval v0", "other"})
    sched.resume("eval v0")
    await _settle()
    assert sched.started == 4  # one holder is left
    sched.resume("other")
    await until(lambda: sched.started == 6)
    stop.set()
    await runner


async def test_a_straggler_from_an_older_version_holds_admission_for_its_patience_only(
    pool: EnginePool, tmp_path: Path
) -> None:
    """Issue 34: a group still running from version 0 would be overtaken by groups admitted at version
    1 and arrive stale; admission budgets from its version while it is protected, then lets go."""
    release = asyncio.Event()
    started: list[Task] = []

    class FirstGroupWaits(CoinEnv):
        async def reset(self, task: Task) -> list[dict[str, str]]:
            started.append(task)
            # The first task's episodes wait: the straggler. Only the second finishes before the release:
            # a third group's duration would move the median that the patience is a multiple of.
            if not task.id.endswith("-1"):
                await release.wait()
            return await super().reset(task)

    sched = make_scheduler(pool, tmp_path, batch=1, eta=1, factory=FirstGroupWaits)
    stop = asyncio.Event()
    runner = asyncio.create_task(sched.run(stop))
    # Budget (η + 0 + 1)·B = 2 at version 0: the straggler and one more group, which finishes.
    await until(lambda: sched.written == 1 and sched.started == 2)
    median_s = sched.stragglers.durations[0]
    sched.stragglers.patience = 0.6 / median_s  # protected for 0.6 s from its start
    sched.on_version(1)
    await _settle()
    # Version 1 alone would allow (1 + 1 + 1)·1 - (1 written + 1 running) = 1 more; the straggler's
    # version 0 allows none, and admission holds.
    floor, until_s = sched.floor()
    assert floor == 0 and until_s is not None
    assert (sched.started, sched.capacity()) == (2, 0)
    # Past its patience it is on its own: the held group starts without any other event.
    await until(lambda: sched.started == 3, timeout_s=3.0)
    assert sched.floor() == (None, None)
    release.set()
    await until(lambda: sched.running == 0)
    stop.set()
    await runner


async def test_no_straggler_protection_with_patience_zero(pool: EnginePool, tmp_path: Path) -> None:
    sched = make_scheduler(pool, tmp_path, batch=1, eta=1)
    sched._admitted["g"] = Admitted(0, 0.0, GroupCut(G))
    sched.stragglers.durations.append(1.0)
    sched.on_version(1)
    assert sched.floor() == (None, None)
    with pytest.raises(ValueError, match="straggler_patience"):
        make_scheduler(pool, tmp_path, batch=1, eta=1, max_concurrent=4, straggler_patience=-1.0)


class _SecondEpisodeHangs(CoinEnv):
    """The second environment made (the first group's second episode) never answers its first step;
    those made after the first four groups' (of 4 episodes) wait for `release` before their reset."""

    made = 0
    release: asyncio.Event
    closing: asyncio.Event | None = None  # when set up, the hung episode's close waits for it

    def __init__(self, turns: int = 2) -> None:
        super().__init__(turns)
        type(self).made += 1
        self.number = type(self).made

    async def reset(self, task: Task) -> list[dict[str, str]]:
        if self.number > 4 * 4:
            await type(self).release.wait()
        return await super().reset(task)

    async def step(self, action: Action) -> StepResult:
        if self.number == 2:
            await asyncio.Event().wait()
        return await super().step(action)

    async def close(self) -> None:
        if self.number == 2 and type(self).closing is not None:
            await type(self).closing.wait()


def _generated() -> float:
    return metrics.REGISTRY.get_sample_value("rollwise_generated_tokens_total", {"env": "bench-coin"}) or 0.0


def _written_tokens(spool_dir: Path) -> int:
    """Generated tokens of every row written to the spool."""
    items = SpoolReader(spool_dir, after_seq=0).poll()
    return sum(row.num_generated for item in items for row in batch_to_segments(item.batch)[0])


async def test_a_group_cancelled_at_drain_counts_what_it_generated_as_lost(
    pool: EnginePool, tmp_path: Path
) -> None:
    generated_before = _generated()
    sched = _a_group_left_behind(tmp_path, pool, cut=0.0)
    stop = asyncio.Event()
    runner = asyncio.create_task(sched.run(stop))
    await until(lambda: sched.written == 3 and sched.running == 1)
    stop.set()
    await runner
    assert await sched.drain(0.0) == (0, 1)
    # the hung group: three finished episodes and the first turn of the hung one, none of it written
    assert sched.waste.tokens["lost"] > 0
    assert _generated() - generated_before == _written_tokens(tmp_path) + sched.waste.tokens["lost"]


async def test_admission_stops_at_the_groups_the_run_trains_and_replaces_a_drop(
    pool: EnginePool, tmp_path: Path
) -> None:
    """run.max_steps · B = 3 groups: staleness would allow 6 (η = 2, B = 2), the run's end allows 3; a
    group the learner drops is replaced, so the last step still gets its groups."""
    sched = make_scheduler(pool, tmp_path, batch=2, eta=2, max_groups=3)
    stop = asyncio.Event()
    runner = asyncio.create_task(sched.run(stop))
    await until(lambda: sched.written == 3 and sched.running == 0)
    await _settle()
    assert (sched.started, sched.capacity(), sched.queued) == (3, 0, 0)
    sched.on_dropped(1)
    await until(lambda: sched.written == 4)
    await _settle()
    assert sched.started == 4
    stop.set()
    await runner


def _episodes_cut() -> float:
    value = metrics.REGISTRY.get_sample_value(
        "rollwise_episodes_total", {"env": "bench-coin", "reason": "cut"}
    )
    return value or 0.0


def _a_group_left_behind(
    tmp_path: Path, pool: EnginePool, *, cut: float, closing: asyncio.Event | None = None
) -> GroupScheduler:
    """Version 0, B = 2, η = 1, G = 4: four groups admitted, the first held by its hung episode."""

    class Hangs(_SecondEpisodeHangs):
        made = 0
        release = asyncio.Event()

    Hangs.closing = closing

    sched = make_scheduler(
        pool, tmp_path, batch=2, eta=1, max_concurrent=4, factory=Hangs, group_size=4, cut_late_groups=cut
    )
    sched.release = Hangs.release  # type: ignore[attr-defined]
    return sched


@pytest.mark.parametrize("earlier", [0, 3])
async def test_a_group_at_its_last_chance_is_cut_and_written_with_its_finished_episodes(
    pool: EnginePool, tmp_path: Path, earlier: int
) -> None:
    """Issue 34: a group whose episode hangs is cut once the learner is at the group's last version and a
    group started later could complete the batch in its place; the episode that finished is written.
    `earlier` groups were written by a previous supervisor (and consumed): the groups waiting are counted
    from the spool's sequence numbers, not from what this scheduler wrote."""
    writer = SpoolWriter(tmp_path)
    for k in range(earlier):
        group_id = f"before-{k}"
        writer.write_group(
            segments_to_batch([one_turn_row(group_id, i, 0) for i in range(2)]), group_id=group_id
        )
    sched = _a_group_left_behind(tmp_path, pool, cut=0.25)
    episodes_cut_before = _episodes_cut()
    groups_cut_before = metrics.REGISTRY.get_sample_value("rollwise_groups_cut_total") or 0.0
    stop = asyncio.Event()
    runner = asyncio.create_task(sched.run(stop))
    await until(lambda: sched.written == 3 and sched.running == 1)
    # The learner trained one batch (version 1 = 0 + η: the hung group's last) and one written group
    # waits. The batch is one group short, and no other group runs: the learner would wait for this one.
    sched.on_learner_step(1, earlier + 2)
    await _settle()
    assert (sched.groups_cut, sched.running, sched.written) == (0, 1, 3)
    # The engines serve version 1: admission starts two groups (held in their reset), either of which
    # could take the place: the admission round cuts the hung group, and it is written before them.
    sched.on_version(1)
    await until(lambda: sched.written == 4)
    assert (sched.groups_cut, sched.started, sched.running) == (1, 6, 2)
    sched.release.set()  # type: ignore[attr-defined]
    await until(lambda: sched.written == 6)
    stop.set()
    await runner
    [first] = [item for item in SpoolReader(tmp_path, after_seq=0).poll() if item.group_id == "test-g000001"]
    segments, rejected = batch_to_segments(first.batch)
    by_episode = {seg.episode_id: seg for seg in segments}
    assert rejected == []
    reasons = {episode: seg.finish_reason for episode, seg in by_episode.items()}
    assert reasons.pop("test-g000001-1") == "cut"  # its first turn, kept for accounting
    assert sorted(reasons) == ["test-g000001-0", "test-g000001-2", "test-g000001-3"]
    assert set(reasons.values()) <= {"stop", "length"}
    assert _episodes_cut() == episodes_cut_before + 1
    assert metrics.REGISTRY.get_sample_value("rollwise_groups_cut_total") == groups_cut_before + 1


async def test_a_cut_group_is_written_before_groups_that_finish_while_it_closes(
    pool: EnginePool, tmp_path: Path
) -> None:
    """The learner completes its batch with whatever lands first: a group admitted after the cut one and
    finished while the cut one closed its episodes would take its place, so its write waits."""
    closing = asyncio.Event()
    sched = _a_group_left_behind(tmp_path, pool, cut=0.25, closing=closing)
    stop = asyncio.Event()
    runner = asyncio.create_task(sched.run(stop))
    await until(lambda: sched.written == 3 and sched.running == 1)
    sched.on_learner_step(1, 2)
    sched.on_version(1)  # two groups start: the hung one is cut, and its hung episode's close hangs
    await until(lambda: sched.groups_cut == 1)
    sched.release.set()  # type: ignore[attr-defined]
    await until(lambda: sched.episodes_finished == 3 * 4 + 2 * 4)  # the two new groups are done playing
    await _settle()
    assert sched.written == 3  # ... and wait to be written
    closing.set()
    await until(lambda: sched.written == 6)
    stop.set()
    await runner
    order = [item.group_id for item in SpoolReader(tmp_path, after_seq=0).poll()]
    assert order[3] == "test-g000001" and sorted(order[4:]) == ["test-g000005", "test-g000006"]


async def test_writes_wait_for_a_cut_group_only_so_long(
    pool: EnginePool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(late_cut, "CUT_WRITES_FIRST_S", 0.3)
    sched = _a_group_left_behind(tmp_path, pool, cut=0.25, closing=asyncio.Event())  # never closes
    stop = asyncio.Event()
    runner = asyncio.create_task(sched.run(stop))
    await until(lambda: sched.written == 3 and sched.running == 1)
    sched.on_learner_step(1, 2)
    sched.on_version(1)
    await until(lambda: sched.groups_cut == 1)
    sched.release.set()  # type: ignore[attr-defined]
    await until(
        lambda: sched.written == 5, timeout_s=3.0
    )  # written after the wait, the cut one still closing
    stop.set()
    await runner
    assert await sched.drain(0.0) == (0, 1)


@pytest.mark.parametrize("share", [-0.1, 1.5])
def test_a_cut_share_outside_zero_to_one_is_refused(pool: EnginePool, tmp_path: Path, share: float) -> None:
    with pytest.raises(ValueError, match=r"cut_late_groups must be a share in \[0, 1\], got"):
        make_scheduler(pool, tmp_path, batch=1, eta=1, cut_late_groups=share)


@pytest.mark.parametrize("share", [0.0, 0.2])
async def test_no_group_is_cut_with_cutting_off_or_a_share_below_one_episode(
    pool: EnginePool, tmp_path: Path, share: float
) -> None:
    generated_before = _generated()
    sched = _a_group_left_behind(tmp_path, pool, cut=share)
    stop = asyncio.Event()
    runner = asyncio.create_task(sched.run(stop))
    await until(lambda: sched.written == 3 and sched.running == 1)
    sched.on_learner_step(1, 2)
    sched.on_version(1)
    sched.release.set()  # type: ignore[attr-defined]
    await until(lambda: sched.written == 5)
    assert (sched.groups_cut, sched.running) == (0, 1)  # at its last chance, not cut
    sched.on_learner_step(2, 2)
    await _settle()
    # Stale now: dropped in flight (in_flight_drops), not cut, not written, its tokens stale waste.
    assert (sched.groups_cut, sched.dropped_in_flight) == (0, 1)
    assert sched.waste.tokens["stale"] > 0
    stop.set()
    await runner
    await sched.drain(0.0)
    # Every generated token is in a written row or counted as waste: stale (the dropped group), lost
    # (groups admitted after it and cancelled by the drain).
    assert _generated() - generated_before == _written_tokens(tmp_path) + sum(sched.waste.tokens.values())
