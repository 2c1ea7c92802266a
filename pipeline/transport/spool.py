"""The durable trajectory spool between actors and the learner (docs/architecture.md, Contract 4).

Layout of `<run_dir>/spool/`:

    g<seq:012d>.arrow        one group: an Arrow IPC stream holding one record batch
    g<seq:012d>.arrow.tmp    a write in progress (never read; removed when a writer starts)
    quarantine/<name>        files the reader could not use, each with `<name>.reason`
    retention.json           {"deleted_through": n}: files with seq <= n were pruned after training

Sequence numbers start at 1 (so `consumed_seq = 0` means "nothing consumed") and only grow, across
restarts too: a writer resumes after the highest number found in the spool, in quarantine, or recorded
in retention.json. A group counts as produced only once its file is fsync'd, renamed into place and
the directory entry fsync'd. Writes are serialised, so file n is visible before file n+1 exists: a
reader that sees n+1 can never miss n later.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from pipeline.contracts.durable import fsync_dir
from pipeline.contracts.schema import check_schema

log = logging.getLogger(__name__)

GROUP_ID_KEY = b"rollwise.group_id"
QUARANTINE_DIR = "quarantine"
RETENTION_FILE = "retention.json"
_NAME = re.compile(r"^g(\d{12})\.arrow$")


def spool_name(seq: int) -> str:
    return f"g{seq:012d}.arrow"


def parse_seq(name: str) -> int | None:
    """Sequence number of a complete spool file name, or None for anything else."""
    match = _NAME.match(name)
    return int(match.group(1)) if match else None


def _listed(directory: Path) -> list[tuple[int, Path]]:
    """(seq, path) of complete spool files in `directory`, in sequence order."""
    if not directory.is_dir():
        return []
    found = []
    for entry in os.scandir(directory):
        seq = parse_seq(entry.name)
        if seq is not None and entry.is_file():
            found.append((seq, Path(entry.path)))
    found.sort()
    return found


def _quarantined_seqs(spool_dir: Path) -> list[int]:
    qdir = spool_dir / QUARANTINE_DIR
    return [seq for seq, _ in _listed(qdir)]


def deleted_through(spool_dir: Path) -> int:
    """Highest seq pruned by retention (0 when nothing was)."""
    path = spool_dir / RETENTION_FILE
    try:
        return int(json.loads(path.read_text())["deleted_through"])
    except FileNotFoundError:
        return 0
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path} is not a valid retention record: {exc}") from exc


def spool_depth(spool_dir: Path, after_seq: int, *, consumed: Collection[int] = ()) -> tuple[int, int]:
    """(groups, bytes) of complete spool files with seq > after_seq and not in `consumed` (the seqs the
    learner took out of order, learner.spool_cursor): produced but not yet consumed."""
    groups = 0
    nbytes = 0
    for seq, path in _listed(spool_dir):
        if seq > after_seq and seq not in consumed:
            try:
                nbytes += path.stat().st_size
            except FileNotFoundError:  # pruned or quarantined since the listing
                continue
            groups += 1
    return groups, nbytes


@dataclass(frozen=True)
class SpoolEntry:
    """A group made durable: its sequence number, final path, file size in bytes and how long the durable
    write took (the writer's caller reports it: this room keeps no metrics of its own)."""

    seq: int
    path: Path
    nbytes: int
    write_s: float = 0.0


class SpoolWriter:
    """Writes groups as numbered, fsync'd Arrow IPC files. Thread-safe; every call blocks on disk I/O
    (async callers use `asyncio.to_thread`).

    `min_next_seq`: the supervisor passes the learner's consumed_seq + 1, so a spool directory that was
    emptied by hand can never restart numbering below what the learner will read.
    """

    def __init__(self, spool_dir: str | Path, *, min_next_seq: int = 1) -> None:
        self.spool_dir = Path(spool_dir)
        self.spool_dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        for leftover in self.spool_dir.glob("g*.arrow.tmp"):
            # A write that never reached its rename was never counted as produced.
            log.warning("removing unfinished spool write %s", leftover.name)
            leftover.unlink(missing_ok=True)
        highest = max(
            [seq for seq, _ in _listed(self.spool_dir)]
            + _quarantined_seqs(self.spool_dir)
            + [deleted_through(self.spool_dir)]
        )
        self.next_seq = max(highest + 1, min_next_seq)

    def depth(self, after_seq: int) -> tuple[int, int]:
        return spool_depth(self.spool_dir, after_seq)

    def write_group(self, batch: pa.RecordBatch, *, group_id: str) -> SpoolEntry:
        """Write one group durably and return its entry. The batch's schema metadata is kept and gains
        `rollwise.group_id`; every row's group_id must equal `group_id`."""
        problem = check_schema(batch.schema)
        if problem is not None:
            raise ValueError(f"group {group_id!r} cannot be spooled: {problem}")
        row_ids = set(batch.column("group_id").to_pylist())
        if row_ids - {group_id}:
            raise ValueError(f"group {group_id!r} cannot be spooled: rows carry group ids {sorted(row_ids)}")
        metadata = dict(batch.schema.metadata or {})
        metadata[GROUP_ID_KEY] = group_id.encode()
        batch = batch.replace_schema_metadata(metadata)
        started = time.perf_counter()
        with self._lock:
            seq = self.next_seq
            final = self.spool_dir / spool_name(seq)
            tmp = final.with_name(final.name + ".tmp")
            try:
                with open(tmp, "wb") as handle:
                    with pa.ipc.new_stream(handle, batch.schema) as stream:
                        stream.write_batch(batch)
                    handle.flush()
                    os.fsync(handle.fileno())
                os.rename(tmp, final)
                fsync_dir(self.spool_dir)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            # Only a completed write consumes a number; a failed one is retried under the same seq.
            self.next_seq = seq + 1
            nbytes = final.stat().st_size
        return SpoolEntry(seq=seq, path=final, nbytes=nbytes, write_s=time.perf_counter() - started)


@dataclass(frozen=True)
class SpoolItem:
    """One group read back: its sequence number, group id, the record batch and the file size."""

    seq: int
    group_id: str
    batch: pa.RecordBatch
    nbytes: int


@dataclass(frozen=True)
class QuarantinedFile:
    """A spool file moved to quarantine. `kind` is a low-cardinality label (unreadable, empty, format,
    schema); `reason` the full explanation, also written to `<name>.reason`."""

    seq: int
    file: str
    kind: str
    reason: str


class _Unusable(Exception):
    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind
        self.reason = reason


def read_group_file(path: Path) -> tuple[str, pa.RecordBatch]:
    """(group_id, batch) of one spool file; raises _Unusable(kind, reason) when it cannot be used."""
    if path.stat().st_size == 0:
        raise _Unusable("empty", "file is empty (0 bytes)")
    try:
        with pa.OSFile(str(path), "rb") as source:
            reader = pa.ipc.open_stream(source)
            batches = list(reader)
            schema = reader.schema
    except (pa.ArrowInvalid, pa.ArrowIOError, OSError) as exc:
        raise _Unusable("unreadable", f"not a complete Arrow IPC stream: {exc}") from exc
    problem = check_schema(schema)
    if problem is not None:
        raise _Unusable("schema", problem)
    if len(batches) != 1:
        raise _Unusable("format", f"expected exactly one record batch, found {len(batches)}")
    batch = batches[0]
    stamped = (schema.metadata or {}).get(GROUP_ID_KEY)
    if batch.num_rows == 0 and stamped is None:
        raise _Unusable("empty", "record batch has no rows and no rollwise.group_id")
    # A stamped group with no rows is legitimate: every episode failed before producing a token.
    group_id = stamped.decode() if stamped is not None else str(batch.column("group_id")[0].as_py())
    row_ids = set(batch.column("group_id").to_pylist())
    if row_ids - {group_id}:
        raise _Unusable("format", f"rows carry group ids {sorted(row_ids)}, file says {group_id!r}")
    return group_id, batch


class SpoolReader:
    """Tails the spool in sequence order, from the first file after `after_seq`. Not thread-safe.

    `read_seconds` accumulates the time spent inside `poll()` (listing the directory, reading, decoding
    and validating the Arrow IPC files, quarantining bad ones) - never the time a caller waits between
    polls for files to appear. `take_read_seconds()` returns it and starts a new count. `clock` is
    injectable for tests (seconds, monotonic).
    """

    def __init__(
        self, spool_dir: str | Path, *, after_seq: int, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.spool_dir = Path(spool_dir)
        self.after_seq = after_seq
        self.quarantined: list[QuarantinedFile] = []
        self.read_seconds = 0.0
        self._clock = clock

    def take_read_seconds(self) -> float:
        """Seconds spent in `poll()` since the previous call (or since the reader was made)."""
        seconds, self.read_seconds = self.read_seconds, 0.0
        return seconds

    def drain_reachability(self) -> list[tuple[bool, str]]:
        """A local directory is never unreachable (FlightSpoolReader's counterpart reports outages)."""
        return []

    def depth(self, after_seq: int | None = None, *, consumed: Collection[int] = ()) -> tuple[int, int]:
        return spool_depth(
            self.spool_dir, self.after_seq if after_seq is None else after_seq, consumed=consumed
        )

    def poll(self, limit: int | None = None, *, wait: bool = True) -> list[SpoolItem]:
        """Complete groups after the last one returned, in sequence order (at most `limit`). Never waits
        (`wait` is FlightSpoolReader's: a local directory is listed at once).

        Unusable files are moved to quarantine, appended to `self.quarantined` (the caller drains and
        counts them) and skipped; a gap they leave never stalls the reader. A call returns either good
        groups or quarantines files that precede every good group it returns, so handling the returned
        items and then `quarantined` processes the spool in sequence order.
        """
        started = self._clock()
        try:
            return self._poll(limit)
        finally:
            self.read_seconds += self._clock() - started

    def _poll(self, limit: int | None) -> list[SpoolItem]:
        items: list[SpoolItem] = []
        for seq, path in _listed(self.spool_dir):
            if seq <= self.after_seq:
                continue
            if limit is not None and len(items) >= limit:
                break
            try:
                nbytes = path.stat().st_size
                group_id, batch = read_group_file(path)
            except FileNotFoundError:
                continue  # moved away (retention) between listing and reading
            except _Unusable as bad:
                if items:
                    break  # return the groups before it first: callers see files in sequence order
                self.quarantined.append(self._quarantine(seq, path, bad.kind, bad.reason))
            else:
                items.append(SpoolItem(seq=seq, group_id=group_id, batch=batch, nbytes=nbytes))
            self.after_seq = seq
        return items

    def drain_quarantined(self) -> list[QuarantinedFile]:
        out, self.quarantined = self.quarantined, []
        return out

    def prune(self, through_seq: int) -> int:
        """Retention after a checkpoint (`prune_consumed`); FlightSpoolReader asks its service instead."""
        return prune_consumed(self.spool_dir, through_seq)

    def _quarantine(self, seq: int, path: Path, kind: str, reason: str) -> QuarantinedFile:
        qdir = self.spool_dir / QUARANTINE_DIR
        try:
            qdir.mkdir(exist_ok=True)
            os.rename(path, qdir / path.name)
            fsync_dir(qdir)
            fsync_dir(self.spool_dir)
        except OSError as exc:  # a read-only spool: the file stays, and is skipped like a moved one
            reason = f"{reason} (could not be moved to quarantine: {exc})"
        else:
            try:  # the explanation is a courtesy; a full disk must not turn it into a crash
                (qdir / f"{path.name}.reason").write_text(f"{kind}: {reason}\n")
            except OSError as exc:
                log.error("could not write the reason of quarantined %s: %s", path.name, exc)
        # No metric here: the reader runs in the learner process, which reports quarantines as events.
        log.error("quarantined spool file %s (%s): %s", path.name, kind, reason)
        return QuarantinedFile(seq=seq, file=path.name, kind=kind, reason=reason)


def prune_consumed(spool_dir: str | Path, through_seq: int) -> int:
    """Delete spool files with seq <= `through_seq` (groups a durable checkpoint recorded as consumed).

    retention.json is updated first, so a writer never reuses a pruned number. Returns files deleted.
    Callers pass a checkpoint older than the latest one as margin (see learner.process.checkpointer).
    """
    root = Path(spool_dir)
    if through_seq <= deleted_through(root):
        return 0
    record = root / RETENTION_FILE
    tmp = record.with_name(record.name + ".tmp")
    tmp.write_text(json.dumps({"deleted_through": through_seq}) + "\n")
    with open(tmp, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, record)
    fsync_dir(root)
    deleted = 0
    for seq, path in _listed(root):
        if seq > through_seq:
            break
        path.unlink(missing_ok=True)
        deleted += 1
    return deleted
