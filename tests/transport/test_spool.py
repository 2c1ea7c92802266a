"""The durable spool: fsync ordering, numbering across restarts, tailing, quarantine, retention."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pytest

from pipeline.contracts.schema import SCHEMA_VERSION_KEY, EpisodeSegment, batch_to_segments, segments_to_batch
from pipeline.transport import spool as spool_mod
from pipeline.transport.spool import (
    QUARANTINE_DIR,
    SpoolReader,
    SpoolWriter,
    deleted_through,
    prune_consumed,
    spool_depth,
    spool_name,
)


def make_group(group_id: str, members: int = 2, version: int = 0) -> pa.RecordBatch:
    """A valid group: each episode = 3 prompt tokens + 2 generated tokens, one turn."""
    episodes = [
        EpisodeSegment(
            episode_id=f"{group_id}-e{i}",
            group_id=group_id,
            task_id="t0",
            env="test-env",
            token_ids=[1, 2, 3, 10 + i, 20],
            prompt_len=3,
            loss_mask=[0, 0, 0, 1, 1],
            logprobs=[0.0, 0.0, 0.0, -0.5, -1.25],
            turn_index=[-1, -1, -1, 0, 0],
            versions=[-1, -1, -1, version, version],
            turn_rewards=[float(i)],
            outcome=float(i % 2),
            num_turns=1,
            finish_reason="stop",
        )
        for i in range(members)
    ]
    return segments_to_batch(episodes)


def test_write_then_read_round_trips_rows_and_group_id(tmp_path: Path) -> None:
    writer = SpoolWriter(tmp_path)
    entry = writer.write_group(make_group("g-a", members=3), group_id="g-a")
    assert entry.seq == 1
    assert entry.path == tmp_path / "g000000000001.arrow"
    assert entry.nbytes == entry.path.stat().st_size > 0
    items = SpoolReader(tmp_path, after_seq=0).poll()
    assert [(i.seq, i.group_id, i.nbytes) for i in items] == [(1, "g-a", entry.nbytes)]
    episodes, rejected = batch_to_segments(items[0].batch)
    assert rejected == []
    assert [e.episode_id for e in episodes] == ["g-a-e0", "g-a-e1", "g-a-e2"]
    assert items[0].batch.schema.metadata[SCHEMA_VERSION_KEY] == b"1"


def test_fsync_file_then_rename_then_fsync_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd: int) -> None:
        calls.append("fsync:" + os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    def rename(src: str | Path, dst: str | Path) -> None:
        calls.append(f"rename:{Path(src).name}->{Path(dst).name}")
        real_rename(src, dst)

    writer = SpoolWriter(tmp_path)
    monkeypatch.setattr(spool_mod.os, "fsync", fsync)
    monkeypatch.setattr(spool_mod.os, "rename", rename)
    writer.write_group(make_group("g1"), group_id="g1")
    assert calls == [
        f"fsync:{tmp_path / 'g000000000001.arrow.tmp'}",
        "rename:g000000000001.arrow.tmp->g000000000001.arrow",
        f"fsync:{tmp_path}",
    ]


def test_failed_write_leaves_no_file_and_reuses_the_number(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = SpoolWriter(tmp_path)

    def broken_fsync(fd: int) -> None:
        raise OSError(5, "I/O error")

    monkeypatch.setattr(spool_mod.os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="I/O error"):
        writer.write_group(make_group("g1"), group_id="g1")
    assert os.listdir(tmp_path) == []
    monkeypatch.undo()
    assert writer.write_group(make_group("g1"), group_id="g1").seq == 1


def test_writer_resumes_numbering_and_removes_unfinished_writes(tmp_path: Path) -> None:
    first = SpoolWriter(tmp_path)
    for k in range(3):
        first.write_group(make_group(f"g{k}"), group_id=f"g{k}")
    (tmp_path / "g000000000004.arrow.tmp").write_bytes(b"half a write")
    second = SpoolWriter(tmp_path)
    assert not (tmp_path / "g000000000004.arrow.tmp").exists()
    assert second.write_group(make_group("g3"), group_id="g3").seq == 4


def test_numbering_never_reuses_quarantined_or_pruned_numbers(tmp_path: Path) -> None:
    writer = SpoolWriter(tmp_path)
    for k in range(3):
        writer.write_group(make_group(f"g{k}"), group_id=f"g{k}")
    (tmp_path / spool_name(3)).write_bytes(b"garbage")
    reader = SpoolReader(tmp_path, after_seq=0)
    assert len(reader.poll()) == 2
    assert reader.poll() == []
    assert [q.seq for q in reader.quarantined] == [3]
    assert prune_consumed(tmp_path, through_seq=2) == 2
    assert deleted_through(tmp_path) == 2
    assert SpoolWriter(tmp_path).next_seq == 4  # 3 lives in quarantine
    for name in os.listdir(tmp_path / QUARANTINE_DIR):
        os.unlink(tmp_path / QUARANTINE_DIR / name)
    assert SpoolWriter(tmp_path).next_seq == 3  # 1..2 pruned: retention.json remembers them


def test_reader_tails_in_order_and_ignores_tmp_files(tmp_path: Path) -> None:
    writer = SpoolWriter(tmp_path)
    reader = SpoolReader(tmp_path, after_seq=0)
    assert reader.poll() == []
    writer.write_group(make_group("a"), group_id="a")
    writer.write_group(make_group("b"), group_id="b")
    (tmp_path / "g000000000003.arrow.tmp").write_bytes(b"in progress")
    assert [i.group_id for i in reader.poll(limit=1)] == ["a"]
    assert [i.group_id for i in reader.poll()] == ["b"]
    assert reader.poll() == []
    writer.write_group(make_group("c"), group_id="c")  # reuses seq 3: the .tmp was not a group
    assert [(i.seq, i.group_id) for i in reader.poll()] == [(3, "c")]
    assert SpoolReader(tmp_path, after_seq=1).poll()[0].group_id == "b"


def _quarantine_reason(root: Path, seq: int) -> str:
    return (root / QUARANTINE_DIR / f"{spool_name(seq)}.reason").read_text()


def test_truncated_and_garbage_files_are_quarantined_and_skipped(tmp_path: Path) -> None:
    writer = SpoolWriter(tmp_path)
    for k in range(4):
        writer.write_group(make_group(f"g{k}"), group_id=f"g{k}")
    whole = (tmp_path / spool_name(2)).read_bytes()
    (tmp_path / spool_name(2)).write_bytes(whole[: len(whole) // 2])
    (tmp_path / spool_name(3)).write_bytes(b"\x00not arrow at all\xff" * 10)
    reader = SpoolReader(tmp_path, after_seq=0)
    assert [i.group_id for i in reader.poll()] == ["g0"]  # stops before the bad file: order is kept
    assert reader.quarantined == []
    assert [i.group_id for i in reader.poll()] == ["g3"]
    bad = reader.drain_quarantined()
    assert [(q.seq, q.file, q.kind) for q in bad] == [
        (2, spool_name(2), "unreadable"),
        (3, spool_name(3), "unreadable"),
    ]
    assert "Arrow IPC" in bad[0].reason
    assert (tmp_path / QUARANTINE_DIR / spool_name(2)).read_bytes() == whole[: len(whole) // 2]
    assert _quarantine_reason(tmp_path, 3).startswith("unreadable: ")
    assert not (tmp_path / spool_name(2)).exists()
    assert reader.drain_quarantined() == []


def test_empty_file_is_quarantined(tmp_path: Path) -> None:
    (tmp_path / spool_name(1)).write_bytes(b"")
    reader = SpoolReader(tmp_path, after_seq=0)
    assert reader.poll() == []
    assert [(q.kind, q.reason) for q in reader.quarantined] == [("empty", "file is empty (0 bytes)")]


def _write_raw(path: Path, batch: pa.RecordBatch) -> None:
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, batch.schema) as stream:
        stream.write_batch(batch)


def test_schema_version_mismatch_is_quarantined(tmp_path: Path) -> None:
    batch = make_group("g-old")
    future = batch.replace_schema_metadata({SCHEMA_VERSION_KEY: b"99"})
    _write_raw(tmp_path / spool_name(1), future)
    SpoolWriter(tmp_path).write_group(make_group("g-ok"), group_id="g-ok")
    reader = SpoolReader(tmp_path, after_seq=0)
    assert [i.group_id for i in reader.poll()] == ["g-ok"]
    [q] = reader.quarantined
    assert (q.seq, q.kind) == (1, "schema")
    assert "'99'" in q.reason
    assert "schema version '99'" in _quarantine_reason(tmp_path, 1)


def test_missing_column_and_mixed_groups_are_quarantined(tmp_path: Path) -> None:
    batch = make_group("g")
    _write_raw(tmp_path / spool_name(1), batch.drop_columns(["logprobs"]))
    mixed = pa.concat_batches([make_group("x"), make_group("y")])
    _write_raw(tmp_path / spool_name(2), mixed)
    reader = SpoolReader(tmp_path, after_seq=0)
    assert reader.poll() == []
    assert [(q.seq, q.kind) for q in reader.quarantined] == [(1, "schema"), (2, "format")]
    assert "logprobs" in reader.quarantined[0].reason


def test_writer_rejects_foreign_schema_and_wrong_group_id(tmp_path: Path) -> None:
    writer = SpoolWriter(tmp_path)
    with pytest.raises(ValueError, match=r"'g2'.*rows carry group ids \['g1'\]"):
        writer.write_group(make_group("g1"), group_id="g2")
    with pytest.raises(ValueError, match="schema version"):
        writer.write_group(
            make_group("g1").replace_schema_metadata({SCHEMA_VERSION_KEY: b"0"}), group_id="g1"
        )
    assert writer.next_seq == 1


def test_depth_counts_unconsumed_groups_and_bytes(tmp_path: Path) -> None:
    writer = SpoolWriter(tmp_path)
    entries = [writer.write_group(make_group(f"g{k}"), group_id=f"g{k}") for k in range(3)]
    assert writer.depth(0) == (3, sum(e.nbytes for e in entries))
    assert spool_depth(tmp_path, 2) == (1, entries[2].nbytes)
    assert spool_depth(tmp_path, 3) == (0, 0)
    # groups the learner took out of order after its watermark are consumed, not waiting
    assert spool_depth(tmp_path, 0, consumed={2, 3}) == (1, entries[0].nbytes)


def test_prune_deletes_only_consumed_files(tmp_path: Path) -> None:
    writer = SpoolWriter(tmp_path)
    for k in range(5):
        writer.write_group(make_group(f"g{k}"), group_id=f"g{k}")
    assert prune_consumed(tmp_path, through_seq=3) == 3
    assert prune_consumed(tmp_path, through_seq=2) == 0  # never goes backwards
    assert sorted(p.name for p in tmp_path.glob("*.arrow")) == [spool_name(4), spool_name(5)]
    assert [i.seq for i in SpoolReader(tmp_path, after_seq=3).poll()] == [4, 5]


def test_group_without_rows_round_trips_by_its_stamped_id(tmp_path: Path) -> None:
    empty = segments_to_batch([])
    SpoolWriter(tmp_path).write_group(empty, group_id="all-failed")
    [item] = SpoolReader(tmp_path, after_seq=0).poll()
    assert (item.group_id, item.batch.num_rows) == ("all-failed", 0)


def test_unstamped_file_without_rows_is_quarantined(tmp_path: Path) -> None:
    _write_raw(tmp_path / spool_name(1), segments_to_batch([]))
    reader = SpoolReader(tmp_path, after_seq=0)
    assert reader.poll() == []
    assert [(q.kind, q.seq) for q in reader.quarantined] == [("empty", 1)]


def test_writer_never_numbers_below_what_the_learner_will_read(tmp_path: Path) -> None:
    writer = SpoolWriter(tmp_path, min_next_seq=501)  # an emptied spool, a learner at consumed_seq 500
    assert writer.write_group(make_group("g"), group_id="g").seq == 501
    assert [i.seq for i in SpoolReader(tmp_path, after_seq=500).poll()] == [501]
    assert SpoolWriter(tmp_path, min_next_seq=10).next_seq == 502


class _StepClock:
    """A clock that advances `tick` seconds on every read: each poll() spans exactly one tick."""

    def __init__(self, tick: float) -> None:
        self.now = 100.0
        self.tick = tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


def test_reader_accumulates_time_spent_in_poll_and_take_resets_it(tmp_path: Path) -> None:
    writer = SpoolWriter(tmp_path)
    for k in range(3):
        writer.write_group(make_group(f"g{k}"), group_id=f"g{k}")
    reader = SpoolReader(tmp_path, after_seq=0, clock=_StepClock(0.25))
    assert [item.group_id for item in reader.poll(limit=2)] == ["g0", "g1"]
    assert [item.group_id for item in reader.poll()] == ["g2"]
    assert reader.poll() == []  # an empty poll still lists the directory: counted too
    assert reader.read_seconds == pytest.approx(0.75)
    assert reader.take_read_seconds() == pytest.approx(0.75)
    assert reader.take_read_seconds() == 0.0


def test_reader_counts_poll_time_when_it_quarantines(tmp_path: Path) -> None:
    (tmp_path / spool_name(1)).write_bytes(b"not arrow")
    reader = SpoolReader(tmp_path, after_seq=0, clock=_StepClock(0.5))
    assert reader.poll() == []
    assert [bad.kind for bad in reader.drain_quarantined()] == ["unreadable"]
    assert reader.take_read_seconds() == pytest.approx(0.5)


def test_reader_read_seconds_with_the_real_clock_is_positive(tmp_path: Path) -> None:
    SpoolWriter(tmp_path).write_group(make_group("g0"), group_id="g0")
    reader = SpoolReader(tmp_path, after_seq=0)
    assert len(reader.poll()) == 1
    assert 0.0 < reader.take_read_seconds() < 5.0
