"""A full or read-only run directory: the spool writer, checkpoints and weight export fail with an event
and a metric, production pauses instead of losing finished groups, nothing half-written is read, and the
daemon goes on by itself when space returns.

The end-to-end test fills a real (tmpfs) file system under a running daemon; it needs root to mount one
and is skipped otherwise. The unit tests inject the errors at the writers' boundary and run anywhere."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from learner.process.shell import StopFlag
from learner.process.storage import DurableWriter, StorageGaveUp
from pipeline.contracts import durable, events
from pipeline.contracts.durable import storage_fault_kind
from pipeline.supervisor.observability.run_health.findings import ranked
from pipeline.supervisor.observability.run_health.health_checks import examine
from pipeline.supervisor.observability.run_health.run_view import load
from pipeline.transport.spool import parse_seq
from tests.e2e.test_run_e2e import TINY, DaemonRun, daemons, tiny_model

__all__ = ["daemons", "tiny_model"]  # fixtures used by name


# --- which failures are the storage's -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (OSError(errno.ENOSPC, "No space left on device"), "ENOSPC"),
        (OSError(errno.EROFS, "Read-only file system"), "EROFS"),
        (OSError(errno.EDQUOT, "Disk quota exceeded"), "EDQUOT"),
        (OSError(errno.EIO, "Input/output error"), "EIO"),
        (OSError(errno.EACCES, "Permission denied"), "other"),
        # torch.save and safetensors raise without an errno; their messages say what happened
        (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 6272 vs 6164"), "EIO"),
        (Exception("Error while serializing: IoError(Os { code: 28, kind: StorageFull })"), "ENOSPC"),
    ],
)
def test_storage_faults_are_named(exc: BaseException, kind: str, tmp_path: Path) -> None:
    assert storage_fault_kind(exc, tmp_path) == kind


def test_a_zip_writer_failure_on_a_nearly_full_file_system_is_enospc(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # torch's zip writer says only "unexpected pos": the free space decides (256 KiB left, as in phase 2
    # of the daemon test below, where this failure was once announced as EIO).
    class _Full:
        f_flag, f_bavail, f_frsize = 0, 64, 4096

    monkeypatch.setattr(durable.os, "statvfs", lambda path: _Full())
    zip_failure = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 6272 vs 6164")
    assert storage_fault_kind(zip_failure, tmp_path) == "ENOSPC"
    assert storage_fault_kind(RuntimeError("file write failed"), tmp_path) == "ENOSPC"


def test_a_writer_names_the_fault_before_its_staged_files_free_their_space(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    zip_failure = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 6272 vs 6164")
    # With room left it stays what it was; on a full disk it becomes the OSError it is, cause kept.
    assert durable.as_storage_error(zip_failure, tmp_path) is zip_failure
    full = OSError(errno.ENOSPC, "No space left on device")
    assert durable.as_storage_error(full, tmp_path) is full
    bug = ValueError("bad tensor shape")
    assert durable.as_storage_error(bug, tmp_path) is bug

    class _Full:
        f_flag, f_bavail, f_frsize = 0, 0, 4096

    monkeypatch.setattr(durable.os, "statvfs", lambda path: _Full())
    error = durable.as_storage_error(zip_failure, tmp_path)
    assert isinstance(error, OSError) and error.errno == errno.ENOSPC and error.__cause__ is zip_failure
    assert "unexpected pos" in str(error)


def test_an_error_that_is_not_the_storages_is_not_a_storage_fault(tmp_path: Path) -> None:
    assert storage_fault_kind(ValueError("bad tensor shape"), tmp_path / "not" / "yet") is None


# --- the learner's retry ----------------------------------------------------------------------------------
class _Events:
    def __init__(self) -> None:
        self.sent: list[events.LearnerEvent] = []

    def emit(self, event: events.LearnerEvent) -> None:
        self.sent.append(event)


def _worker() -> Any:
    return SimpleNamespace(out=_Events(), stop=StopFlag())


def test_a_refused_checkpoint_is_retried_with_events_until_it_goes_through(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("learner.process.storage.retry_delays", lambda: iter([0.01] * 10))
    worker = _worker()
    attempts = []

    def write() -> str:
        attempts.append(1)
        if len(attempts) <= 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return "written"

    assert DurableWriter(worker.out, worker.stop).write("checkpoint", tmp_path, write) == "written"
    sent = worker.out.sent
    assert [(e.component, e.blocked, e.kind) for e in sent] == [
        ("checkpoint", True, "ENOSPC"),
        ("checkpoint", True, "ENOSPC"),
        ("checkpoint", False, "ENOSPC"),
    ]
    assert "No space left" in sent[0].message and "written after" in sent[-1].message
    assert events.decode(json.loads(events.encode(sent[0]))) == sent[0]  # it travels as a learner event


def test_a_stop_while_the_storage_refuses_gives_the_write_up(tmp_path: Path) -> None:
    worker = _worker()
    worker.stop.set("test")

    def write() -> None:
        raise OSError(errno.EROFS, "Read-only file system")

    with pytest.raises(StorageGaveUp, match="EROFS"):
        DurableWriter(worker.out, worker.stop).write("weights", tmp_path, write)


def test_a_bug_in_a_write_is_not_retried(tmp_path: Path) -> None:
    worker = _worker()

    def write() -> None:
        raise KeyError("model.embed_tokens.weight")

    with pytest.raises(KeyError):
        DurableWriter(worker.out, worker.stop).write("checkpoint", tmp_path, write)
    assert worker.out.sent == []


# --- the daemon on a real file system that fills up -------------------------------------------------------
@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 48 MiB tmpfs mounted on tmp_path/run (root only: skipped elsewhere)."""
    mount = tmp_path / "run"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small file system needs root")
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _fill(path: Path, *, leave: int = 0) -> None:
    """Write zeros to `path` until the file system is full, then give `leave` bytes back."""
    chunk = b"\0" * (1 << 20)
    with open(path, "wb", buffering=0) as ballast:
        for size in (1 << 20, 1 << 16, 1 << 12, 512):  # down to the last crumbs: small writes fail too
            try:
                while True:
                    ballast.write(chunk[:size])
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
        if leave:
            ballast.truncate(max(0, ballast.tell() - leave))


@pytest.mark.integration
@pytest.mark.slow
def test_a_full_run_directory_pauses_the_daemon_and_it_resumes_by_itself(
    small_fs: Path, tiny_model: Path, daemons: list[DaemonRun]
) -> None:
    run_dir = small_fs
    overrides = [*TINY, f"model.path={json.dumps(str(tiny_model))}"]
    run = DaemonRun(run_dir, overrides)
    daemons.append(run)
    run.wait_steps(2)
    ballast = run_dir / "ballast"

    def blocked(component: str) -> float:
        return run.metric("rollwise_storage_blocked", {"component": component})

    def messages() -> list[str]:
        return [str(e.get("text")) for e in run.snapshot("message")]

    def wait_message(what: Callable[[str], bool], why: str, since: int = 0) -> None:
        # The gauge is set a moment before the message line reaches the reader thread of the test.
        run.wait_for(lambda r: any(what(t) for t in messages()[since:]), 15, why)

    def learner_blocked() -> float:
        return blocked("weights") + blocked("checkpoint")

    # 1. Full: the next write is refused and waits. Usually that is a finished group (admission pauses), but
    # when the learner publishes first, its next version is refused instead and the actors stop at their
    # staleness bound with nothing left to write: whichever comes first, the daemon pauses and resumes.
    # (The scheduler's own refused-write path is unit-tested in tests/supervisor/actors/test_scheduler.py.)
    _fill(ballast)
    run.wait_for(lambda r: blocked("spool") + learner_blocked() >= 1.0, 60, "a refused write")
    found = ranked(examine(load(run_dir, metrics_text=run.scrape())))  # the advisor on the live daemon
    assert found and found[0].check == "disk_filling", found
    if blocked("spool") == 1.0:
        assert run.metric("rollwise_storage_errors_total", {"component": "spool", "kind": "ENOSPC"}) >= 1
        wait_message(lambda t: "spool write refused (ENOSPC" in t, "the spool's refusal message")
        recovered = "spool writable again"
    else:
        wait_message(
            lambda t: t.startswith("learner ") and "refused (ENOSPC" in t, "the learner's refusal message"
        )
        recovered = "writable again"
    ballast.unlink()
    run.wait_for(
        lambda r: blocked("spool") + learner_blocked() == 0.0, 60, "every writer to take writes again"
    )
    wait_message(lambda t: recovered in t, "the recovery message")
    steps = len(run.steps())
    run.wait_steps(steps + 2)

    # 2. Room for a few small groups but not for the weights of the next version: the learner holds its
    # step and retries; its groups stay in the spool; the actors stop at their staleness bound.
    seen = len(messages())  # phase 1 may have had the learner's messages already
    _fill(ballast, leave=256 * 1024)
    run.wait_for(lambda r: learner_blocked() >= 1.0, 90, "the learner to report a refused write")
    wait_message(
        lambda t: t.startswith("learner ") and "refused (ENOSPC" in t, "the learner's refusal message", seen
    )
    steps_while_full = len(run.steps())
    time.sleep(3.0)
    assert len(run.steps()) == steps_while_full  # a step whose writes were refused does not finish
    ballast.unlink()
    run.wait_for(lambda r: learner_blocked() == 0.0, 60, "the learner to recover")
    run.wait_steps(steps_while_full + 2, timeout_s=90)
    wait_message(
        lambda t: t.startswith("learner ") and "writable again" in t, "the learner's recovery message", seen
    )
    run.signal(signal.SIGTERM)
    assert run.wait(timeout_s=60) == 0, run.tail()

    spool = run_dir / "spool"
    seqs = sorted(s for p in spool.iterdir() if (s := parse_seq(p.name)) is not None)
    retention = spool / "retention.json"
    first = json.loads(retention.read_text())["deleted_through"] + 1 if retention.exists() else 1
    assert seqs == list(range(first, seqs[-1] + 1)), "a finished group was lost"
    assert not list(spool.glob("*.tmp")), "a half-written spool file was left behind"
    assert not list((spool / "quarantine").glob("*.arrow")), "a half-written spool file was read"
    assert not list((run_dir / "checkpoints").glob(".step*")), "a half-written checkpoint was left behind"
    assert not list((run_dir / "weights").glob(".v*")), "a half-written weights directory was left behind"
