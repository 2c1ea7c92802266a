"""Durability on POSIX file systems: what must be fsync'd for a rename to survive a crash.

Imports nothing heavy, so the spool writer (pipeline) and the checkpoint/export code (learner) share it.
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (new files, renames) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
