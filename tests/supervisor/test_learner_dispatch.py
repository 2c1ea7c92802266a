"""What the daemon does with each learner event (pipeline.supervisor.learner_dispatch)."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from pipeline.contracts import events
from pipeline.contracts.run_dir import RunDir
from pipeline.supervisor.learner_dispatch import LearnerEvents, StepLog
from pipeline.supervisor.observability import metrics
from pipeline.supervisor.progress import JsonProgress
from tests.helpers.lineage import lineage_for
from tests.supervisor.test_supervisor import _step


class _Admission:
    def __init__(self) -> None:
        self.returned = 0
        self.steps: list[tuple[int, int]] = []

    def on_dropped(self, count: int) -> None:
        self.returned += count

    def on_learner_step(self, version: int, consumed_groups: int) -> None:
        self.steps.append((version, consumed_groups))


@dataclass
class Dispatch:
    handler: LearnerEvents
    out: io.StringIO
    stops: list[str]


@pytest.fixture
async def dispatch(tmp_path: Path) -> AsyncIterator[Dispatch]:
    """LearnerEvents over a lineage whose engine is never called (no event here publishes)."""
    under = lineage_for(["http://127.0.0.1:9"], tmp_path / "run")
    out, stops = io.StringIO(), []
    step_log = StepLog(under.run_dir)
    under.run_dir.logs.mkdir(parents=True)
    step_log.open()
    yield Dispatch(
        LearnerEvents(under.lineage, JsonProgress(out), step_log, request_stop=stops.append), out, stops
    )
    step_log.close()
    await under.close()


async def test_drops_before_the_scheduler_are_handed_over_and_each_spool_seq_counts_once(
    dispatch: Dispatch,
) -> None:
    handler = dispatch.handler
    await handler.handle(events.Dropped(seq=3, group_id="g3", reason="stale"))
    await handler.handle(events.Dropped(seq=3, group_id="g3", reason="stale"))  # a restarted learner
    admission = _Admission()
    assert handler.attach(admission) == 1
    await handler.handle(events.Dropped(seq=4, group_id="g4", reason="too_few_members"))
    await handler.handle(events.Dropped(seq=4, group_id="g4", reason="too_few_members"))
    assert admission.returned == 1 and handler.drops_unclaimed == 0


async def test_a_dropped_groups_tokens_count_as_waste_by_cause_once(dispatch: Dispatch) -> None:
    def wasted(cause: str) -> float:
        return (
            metrics.REGISTRY.get_sample_value("rollwise_generated_tokens_wasted_total", {"cause": cause}) or 0
        )

    def no_signal() -> float:
        return metrics.REGISTRY.get_sample_value("rollwise_generated_tokens_no_signal_total") or 0

    before = {cause: wasted(cause) for cause in ("stale", "rejected")}, no_signal()
    handler = dispatch.handler
    for event in (
        events.Dropped(seq=11, group_id="g11", reason="stale", tokens=40),
        events.Dropped(seq=11, group_id="g11", reason="stale", tokens=40),  # a restarted learner's again
        events.Dropped(seq=12, group_id="g12", reason="invalid_tokens", tokens=7),
        events.Dropped(seq=13, group_id="g13", reason="no_update", tokens=25),
        events.Dropped(seq=14, group_id="f14", reason="quarantined"),
    ):
        await handler.handle(event)
    assert {cause: wasted(cause) - before[0][cause] for cause in ("stale", "rejected")} == {
        "stale": 40,
        "rejected": 7,
    }
    assert no_signal() - before[1] == 25


async def test_a_step_reaches_the_book_the_step_log_and_the_progress_stream(dispatch: Dispatch) -> None:
    handler, out = dispatch.handler, dispatch.out
    await handler.handle(_step(7))
    book = handler.book
    assert (book.step, book.spool_depth_groups) == (7, 3)
    assert (book.staleness_sum, book.staleness_tokens) == (2.0, 7)
    handler.step_log.close()
    logged = [json.loads(line) for line in handler.step_log.path.read_text().splitlines()]
    assert [(line["event"], line["step"]) for line in logged] == [("step", 7)]
    assert json.loads(out.getvalue().splitlines()[-1])["step"] == 7


async def test_each_step_tells_the_scheduler_its_version_and_groups_consumed(
    dispatch: Dispatch,
) -> None:
    handler = dispatch.handler
    await handler.handle(_step(6))  # before the scheduler exists: nothing to tell
    admission = _Admission()
    handler.attach(admission)
    await handler.handle(_step(7))  # watermark 28
    await handler.handle(_step(8, consumed_after=[34, 36]))  # watermark 32, two seqs beyond it
    assert admission.steps == [(7, 28), (8, 34)]


async def test_finished_stops_the_daemon_with_the_learners_reason(dispatch: Dispatch) -> None:
    await dispatch.handler.handle(events.Finished(step=50, reason="run.max_steps reached"))
    assert dispatch.stops == ["the learner finished: run.max_steps reached"]


async def test_storage_faults_of_the_learner_are_announced_once_and_cleared(dispatch: Dispatch) -> None:
    handler, out = dispatch.handler, dispatch.out
    fault = events.StorageFault("checkpoint", blocked=True, kind="ENOSPC", message="No space left")
    before = (
        metrics.REGISTRY.get_sample_value(
            "rollwise_storage_errors_total", {"component": "checkpoint", "kind": "ENOSPC"}
        )
        or 0.0
    )
    await handler.handle(fault)
    await handler.handle(fault)
    blocked = {"component": "checkpoint"}
    assert metrics.REGISTRY.get_sample_value("rollwise_storage_blocked", blocked) == 1.0
    errors = metrics.REGISTRY.get_sample_value(
        "rollwise_storage_errors_total", {"component": "checkpoint", "kind": "ENOSPC"}
    )
    assert errors == before + 2
    await handler.handle(events.StorageFault("checkpoint", blocked=False, kind="ENOSPC", message="ok"))
    assert metrics.REGISTRY.get_sample_value("rollwise_storage_blocked", blocked) == 0.0
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    messages = [line["text"] for line in lines if line["event"] == "message"]
    assert messages == [
        "learner checkpoint write refused (ENOSPC): No space left",
        "learner checkpoint writable again: ok",
    ]


def test_a_full_disk_costs_step_lines_counted_and_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = RunDir.at(tmp_path / "run")
    run.logs.mkdir(parents=True)
    run.step_log.symlink_to("/dev/full")  # every write: ENOSPC
    step_log = StepLog(run)
    step_log.open()
    labels = {"component": "step_log", "kind": "ENOSPC"}
    before = metrics.REGISTRY.get_sample_value("rollwise_storage_errors_total", labels) or 0.0
    with caplog.at_level(logging.ERROR, logger="rollwise.supervisor"):
        for step in (1, 2, 3):
            step_log.append(_step(step))
    assert metrics.REGISTRY.get_sample_value("rollwise_storage_errors_total", labels) == before + 3
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == [f"cannot append to {run.step_log}"]
    step_log.close()


async def test_an_unreachable_spool_is_a_progress_message_while_it_lasts(dispatch: Dispatch) -> None:
    text = "the spool service grpc://b:1 is unreachable"
    lost = events.Unreachable(what="spool", blocked=True, message=text)
    assert events.decode(json.loads(events.encode(lost))) == lost
    await dispatch.handler.handle(lost)
    await dispatch.handler.handle(events.Unreachable(what="spool", blocked=False, message="answers again"))
    said = [json.loads(line)["text"] for line in dispatch.out.getvalue().splitlines()]
    assert said == ["learner: the spool service grpc://b:1 is unreachable", "learner: answers again"]


def test_the_status_line_reads_the_generated_and_wasted_counters() -> None:
    from pipeline.supervisor.observability.learner_metrics import token_books

    generated, wasted = token_books()
    metrics.GENERATED_TOKENS.labels(env="books-env").inc(50)
    metrics.GENERATED_TOKENS_WASTED.labels(cause="cut").inc(7)
    after, wasted_after = token_books()
    assert after - generated == 50 and wasted_after["cut"] - wasted.get("cut", 0) == 7
