"""Durability on POSIX file systems: what must be fsync'd for a rename to survive a crash.

Imports nothing heavy, so the spool writer (pipeline) and the checkpoint/export code (learner) share it,
and so do their answers to a full or read-only run directory: which fault it is (`storage_fault_kind`)
and how a writer lives through it (`RefusedWrites`).
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (new files, renames) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- a full or read-only run directory ------------------------------------------------------------------
STORAGE_FAULT_NAMES = {errno.ENOSPC: "ENOSPC", errno.EROFS: "EROFS", errno.EDQUOT: "EDQUOT", errno.EIO: "EIO"}
# What libraries with their own I/O layer say instead of raising OSError (torch.save: "file write failed";
# safetensors: the Rust io::Error, "... (os error 28)").
_FAULT_WORDS = (
    ("no space left", "ENOSPC"),
    ("os error 28", "ENOSPC"),
    ("storagefull", "ENOSPC"),
    ("read-only file system", "EROFS"),
    ("os error 30", "EROFS"),
    ("readonlyfilesystem", "EROFS"),
    ("disk quota", "EDQUOT"),
    ("os error 122", "EDQUOT"),
)
# torch's zip writer (inline_container.cc) only fails when the file under it does, but its messages
# ("unexpected pos 6272 vs 6164") do not say why: such a failure is ENOSPC when the file system is (nearly)
# full, else EIO. "Nearly": the staged files of the failed write are removed, freeing their space, by the
# time the error is classified.
_WRITER_WORDS = ("file write failed", "inline_container", "pytorchstreamwriter")
LOW_SPACE_BYTES = 1 << 20


def storage_fault_kind(exc: BaseException, directory: Path) -> str | None:
    """Why a durable write into `directory` failed when the storage is the cause: "ENOSPC", "EROFS",
    "EDQUOT", "EIO" or "other" (another OSError); None when it is not (a bug: let it propagate).

    torch.save and safetensors write through their own I/O layers and raise RuntimeError-like errors
    without an errno, so their messages are read, and the file system itself is asked (read-only flag,
    free space) as the last word."""
    if isinstance(exc, OSError) and exc.errno in STORAGE_FAULT_NAMES:
        return STORAGE_FAULT_NAMES[exc.errno]
    probe = directory
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        fs = os.statvfs(probe)
    except OSError:
        return "EIO"
    if fs.f_flag & os.ST_RDONLY:
        return "EROFS"
    text = str(exc).lower()
    for words, kind in _FAULT_WORDS:
        if words in text:
            return kind
    if fs.f_bavail * fs.f_frsize < LOW_SPACE_BYTES:
        return "ENOSPC"
    if any(words in text for words in _WRITER_WORDS):
        return "EIO"
    return "other" if isinstance(exc, OSError) else None


_FAULT_ERRNO = {"ENOSPC": errno.ENOSPC, "EROFS": errno.EROFS, "EDQUOT": errno.EDQUOT}


def as_storage_error(exc: BaseException, directory: Path) -> BaseException:
    """`exc`, or the OSError of the storage fault it is when it carries no errno (torch's zip writer),
    classified now: a writer calls this before it removes its failed write's staged files, since once
    their space is back a full disk no longer looks full (`storage_fault_kind` would say EIO)."""
    if isinstance(exc, OSError) and exc.errno is not None:
        return exc
    code = _FAULT_ERRNO.get(storage_fault_kind(exc, directory) or "")
    if code is None:
        return exc
    error = OSError(code, f"{os.strerror(code)} ({exc})")
    error.__cause__ = exc
    return error


@dataclass(frozen=True)
class Refusal:
    """One write the storage refused: why (`storage_fault_kind`), and whether it is the first refusal
    since the storage last took a write of this writer (the one to announce)."""

    kind: str
    first: bool


@dataclass(frozen=True)
class Recovered:
    """The storage took a write again after refusing it: the last refusal's kind and the seconds since
    the first one."""

    kind: str
    blocked_s: float


class RefusedWrites:
    """One writer's meaning of "the storage refuses my writes": every refusal classified, the first of a
    run announced once, and the write that goes through again announced once with how long the writer
    was blocked. The spool writer (async, several writes at once), the learner's checkpoints and exports
    (sync) and the daemon's step log (no retry: its lines are lost meanwhile) each keep one and write
    their own loop around it, waiting `retry_delays` between tries."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.kind: str | None = None  # the last refusal's kind while blocked
        self.blocked_since: float | None = None  # monotonic time of the first refusal of this run

    @property
    def blocked(self) -> bool:
        return self.blocked_since is not None

    def refused(self, exc: BaseException) -> Refusal | None:
        """Classify a failed write: a Refusal when the storage is the cause, None when it is not (a bug:
        the caller lets it propagate)."""
        kind = storage_fault_kind(exc, self.directory)
        if kind is None:
            return None
        first = self.blocked_since is None
        if first:
            self.blocked_since = time.monotonic()
        self.kind = kind
        return Refusal(kind, first)

    def wrote(self) -> Recovered | None:
        """A write went through: how the writer was blocked before it, None when it was not."""
        if self.blocked_since is None or self.kind is None:
            return None
        recovered = Recovered(self.kind, time.monotonic() - self.blocked_since)
        self.blocked_since, self.kind = None, None
        return recovered


def retry_delays(first_s: float = 0.5, cap_s: float = 10.0) -> Iterator[float]:
    """Seconds to wait before each retry (of a write the storage refused, a copy that failed): doubling,
    capped."""
    delay = first_s
    while True:
        yield delay
        delay = min(cap_s, delay * 2)
