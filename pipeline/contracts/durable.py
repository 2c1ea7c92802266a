"""Durability on POSIX file systems: what must be fsync'd for a rename to survive a crash.

Imports nothing heavy, so the spool writer (pipeline) and the checkpoint/export code (learner) share it,
and so do their answers to a full or read-only run directory: which fault it is (`storage_fault_kind`)
and how long to wait before trying again (`storage_retry_delays`).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
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
    ("file write failed", "EIO"),
    # torch's zip writer (inline_container.cc) only fails when the file under it does, but its messages
    # ("unexpected pos 6272 vs 6164") do not say why, and the staged files it wrote are already removed
    # (freeing space) by the time the error is classified: such failures are labelled EIO.
    ("inline_container", "EIO"),
    ("pytorchstreamwriter", "EIO"),
)
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
    return "other" if isinstance(exc, OSError) else None


def storage_retry_delays(first_s: float = 0.5, cap_s: float = 10.0) -> Iterator[float]:
    """Seconds to wait before each retry of a write the storage refused: doubling, capped."""
    delay = first_s
    while True:
        yield delay
        delay = min(cap_s, delay * 2)
