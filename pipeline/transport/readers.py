"""Which spool reader a learner uses: the run directory's files, or a supervisor's Flight service
(`learner.remote.spool_url`). Both have the same interface (poll, drain_quarantined, drain_reachability,
depth, prune, take_read_seconds) and the same exactly-once rule (pipeline.transport.flight)."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Protocol

from pipeline.contracts.config import Config, FlightTransport, learner_tls, reveal
from pipeline.contracts.tls import ca_bytes
from pipeline.transport.spool import QuarantinedFile, SpoolItem, SpoolReader


class GroupReader(Protocol):
    after_seq: int

    def poll(self, limit: int | None = None, *, wait: bool = True) -> list[SpoolItem]: ...

    def drain_quarantined(self) -> list[QuarantinedFile]: ...

    def depth(self, after_seq: int | None = None, *, consumed: Collection[int] = ()) -> tuple[int, int]: ...

    def prune(self, through_seq: int) -> int: ...

    def take_read_seconds(self) -> float: ...

    def drain_reachability(self) -> list[tuple[bool, str]]: ...


def open_spool_reader(cfg: Config, spool_dir: Path, *, after_seq: int) -> GroupReader:
    """The reader `cfg` asks for, positioned after `after_seq` (the checkpoint's consumed sequence)."""
    if cfg.learner.remote.spool_url is None:
        return SpoolReader(spool_dir, after_seq=after_seq)
    t = cfg.transport
    assert isinstance(t, FlightTransport), "Config refuses learner.remote.spool_url without flight"
    from pipeline.transport.flight import FlightSpoolReader

    return FlightSpoolReader(
        cfg.learner.remote.spool_url,
        after_seq=after_seq,
        token=reveal(t.token),
        wait_s=t.poll_wait_s,
        tls_root_certs=ca_bytes(learner_tls(cfg)),
    )
