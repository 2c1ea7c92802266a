"""The spool over Arrow Flight: a real pyarrow.flight server on 127.0.0.1 and the learner's reader."""

from __future__ import annotations

import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path

import pyarrow.flight as flight
import pytest

from pipeline.contracts.config import ConfigError, check_exposed_ports, load_config
from pipeline.tools.fake_sglang import free_port
from pipeline.transport.flight import FlightSpoolReader, SpoolFlightService
from pipeline.transport.readers import open_spool_reader
from pipeline.transport.spool import SpoolReader, SpoolWriter, spool_name
from tests.transport.test_spool import make_group


@pytest.fixture
def spool(tmp_path: Path) -> Path:
    return tmp_path / "spool"


@pytest.fixture
def service(spool: Path) -> Iterator[SpoolFlightService]:
    svc = SpoolFlightService(spool, host="127.0.0.1", port=0)
    svc.start()
    yield svc
    svc.stop()


def write_groups(spool: Path, names: list[str]) -> None:
    writer = SpoolWriter(spool)
    for name in names:
        writer.write_group(make_group(name, members=3), group_id=name)


def test_flight_reader_returns_the_local_readers_groups_in_order_with_their_metadata(
    spool: Path, service: SpoolFlightService
) -> None:
    write_groups(spool, [f"g{i}" for i in range(5)])
    local = SpoolReader(spool, after_seq=0).poll()
    remote = FlightSpoolReader(service.url, after_seq=0, wait_s=0.0).poll()
    assert [(i.seq, i.group_id) for i in remote] == [(i.seq, i.group_id) for i in local]
    assert [i.seq for i in remote] == [1, 2, 3, 4, 5]
    for a, b in zip(local, remote, strict=True):
        assert b.batch.equals(a.batch, check_metadata=True)
        assert b.batch.schema.metadata[b"rollwise.group_id"] == a.group_id.encode()


def test_each_group_is_returned_once_and_a_new_reader_resumes_after_its_position(
    spool: Path, service: SpoolFlightService
) -> None:
    write_groups(spool, ["a", "b", "c", "d"])
    reader = FlightSpoolReader(service.url, after_seq=0, wait_s=0.0)
    assert [i.group_id for i in reader.poll(limit=3)] == ["a", "b", "c"]
    assert [i.group_id for i in reader.poll(limit=3)] == ["d"]
    assert reader.poll() == []
    resumed = FlightSpoolReader(service.url, after_seq=2, wait_s=0.0)  # a checkpoint's consumed_seq
    assert [i.seq for i in resumed.poll()] == [3, 4]


def test_a_poll_waits_on_the_server_for_the_next_group(spool: Path, service: SpoolFlightService) -> None:
    write_groups(spool, ["first"])
    reader = FlightSpoolReader(service.url, after_seq=1, wait_s=10.0)
    writer = threading.Timer(0.3, write_groups, args=(spool, ["late"]))
    writer.start()
    started = time.monotonic()
    items = reader.poll()
    writer.join()
    assert [i.group_id for i in items] == ["late"]
    assert time.monotonic() - started < 9.0  # answered when the file appeared, not at the deadline
    # a reader with groups in hand asks without waiting: nothing new, an empty answer at once
    started = time.monotonic()
    assert reader.poll(wait=False) == []
    assert time.monotonic() - started < 2.0


def test_a_broken_connection_resumes_where_it_stopped_with_nothing_lost_or_read_twice(spool: Path) -> None:
    port = free_port()
    write_groups(spool, ["g1", "g2", "g3"])
    svc = SpoolFlightService(spool, host="127.0.0.1", port=port)
    svc.start()
    reader = FlightSpoolReader(f"grpc://127.0.0.1:{port}", after_seq=0, wait_s=0.0, timeout_s=2.0)
    got = [i.group_id for i in reader.poll(limit=2)]
    svc.stop()
    write_groups(spool, ["g4"])
    assert reader.poll() == []  # the service is gone: nothing, and the position is kept
    assert reader.reconnects == 1 and reader.after_seq == 2
    svc = SpoolFlightService(spool, host="127.0.0.1", port=port)
    svc.start()
    try:
        for _ in range(50):  # gRPC reconnects with its own backoff
            got += [i.group_id for i in reader.poll()]
            if len(got) >= 4:
                break
    finally:
        svc.stop()
    assert got == ["g1", "g2", "g3", "g4"]


def test_the_wait_before_a_retry_grows_with_failures_in_a_row_and_starts_over_after_an_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two polls fail, one is answered, three fail: the waits are 0.1, 0.2, then 0.1, 0.2, 0.3 s. (They
    grew with every failure of the reader's life before: a long run that had lost the service ten times
    waited the full second after each blip.)"""
    reader = FlightSpoolReader("grpc://127.0.0.1:1", after_seq=0, wait_s=0.0)
    script = iter([True, True, False, True, True, True])  # True: the service is unreachable

    def scripted_poll(limit: int | None, items: list[object], wait_s: float) -> None:
        if next(script):
            raise flight.FlightUnavailableError("connection refused")

    slept: list[float] = []
    monkeypatch.setattr(reader, "_poll", scripted_poll)
    monkeypatch.setattr(
        "pipeline.transport.flight.time",
        types.SimpleNamespace(sleep=slept.append, monotonic=time.monotonic, perf_counter=time.perf_counter),
    )
    for _ in range(6):
        assert reader.poll() == []
    assert slept == pytest.approx([0.1, 0.2, 0.1, 0.2, 0.3])
    assert reader.reconnects == 5
    assert [blocked for blocked, _ in reader.drain_reachability()] == [True, False, True]


def test_an_unusable_file_is_quarantined_by_the_service_and_reported_after_the_groups_before_it(
    spool: Path, service: SpoolFlightService
) -> None:
    write_groups(spool, ["good1"])
    (spool / spool_name(2)).write_bytes(b"not arrow at all")
    writer = SpoolWriter(spool)
    assert writer.next_seq == 3
    writer.write_group(make_group("good3"), group_id="good3")
    reader = FlightSpoolReader(service.url, after_seq=0, wait_s=0.0)
    first = reader.poll()
    assert [i.group_id for i in first] == ["good1"]
    bad = reader.drain_quarantined()
    assert [(q.seq, q.file, q.kind) for q in bad] == [(2, spool_name(2), "unreadable")]
    assert (spool / "quarantine" / spool_name(2)).is_file()
    assert "unreadable" in (spool / "quarantine" / f"{spool_name(2)}.reason").read_text()
    assert [i.group_id for i in reader.poll()] == ["good3"]
    assert reader.drain_quarantined() == []


def test_depth_and_retention_run_on_the_service(spool: Path, service: SpoolFlightService) -> None:
    write_groups(spool, ["a", "b", "c"])
    reader = FlightSpoolReader(service.url, after_seq=0, wait_s=0.0)
    groups, nbytes = reader.depth(1)
    assert groups == 2 and nbytes == sum((spool / spool_name(s)).stat().st_size for s in (2, 3))
    # seqs the learner consumed after its watermark are not counted (learner.spool_cursor)
    assert reader.depth(1, consumed=[3]) == (1, (spool / spool_name(2)).stat().st_size)
    assert reader.prune(2) == 2
    assert sorted(p.name for p in spool.glob("g*.arrow")) == [spool_name(3)]
    assert SpoolWriter(spool).next_seq == 4  # retention.json keeps the numbers moving forward


def test_a_token_protected_service_refuses_a_reader_without_the_token(spool: Path) -> None:
    write_groups(spool, ["secret"])
    svc = SpoolFlightService(spool, host="127.0.0.1", port=0, token="s3cret")
    svc.start()
    try:
        with pytest.raises(flight.FlightUnauthenticatedError):
            FlightSpoolReader(svc.url, after_seq=0, wait_s=0.0, token="wrong").poll()
        items = FlightSpoolReader(svc.url, after_seq=0, wait_s=0.0, token="s3cret").poll()
        assert [i.group_id for i in items] == ["secret"]
    finally:
        svc.stop()


def test_learner_spool_url_selects_the_flight_reader(tmp_path: Path) -> None:
    local = open_spool_reader(load_config(None, []), tmp_path, after_seq=7)
    assert isinstance(local, SpoolReader) and local.after_seq == 7
    cfg = load_config(
        None,
        ['learner.remote.spool_url="grpc://10.0.0.5:8815"', 'transport.kind="flight"', 'transport.token="t"'],
    )
    remote = open_spool_reader(cfg, tmp_path, after_seq=7)
    assert isinstance(remote, FlightSpoolReader) and remote.after_seq == 7
    with pytest.raises(ValueError, match=r"learner\.remote\.spool_url"):
        load_config(None, ['learner.remote.spool_url="http://x:1"'])
    with pytest.raises(ConfigError, match=r"transport\.token"):
        check_exposed_ports(load_config(None, ['transport.kind="flight"', 'transport.flight_host="0.0.0.0"']))


def test_an_unreachable_service_is_announced_once_and_its_return_once(spool: Path) -> None:
    """Issue 33: while the spool service cannot be reached the learner says so once (an `unreachable`
    event to the supervisor), not once per retry, and once more when it answers again."""
    port = free_port()
    reader = FlightSpoolReader(f"grpc://127.0.0.1:{port}", after_seq=0, wait_s=0.0, timeout_s=2.0)
    for _ in range(3):
        assert reader.poll() == []
    changes = reader.drain_reachability()
    assert len(changes) == 1 and changes[0][0] is True
    assert "is unreachable" in changes[0][1] and "resumes after seq 0" in changes[0][1]
    write_groups(spool, ["a"])
    service = SpoolFlightService(spool, host="127.0.0.1", port=port)
    service.start()
    try:
        assert [i.group_id for i in reader.poll()] == ["a"]
        back = reader.drain_reachability()
        assert len(back) == 1 and back[0][0] is False and "answers again after" in back[0][1]
        assert reader.poll() == [] and reader.drain_reachability() == []
    finally:
        reader.close()
        service.stop()
