"""Paths a caller names inside a sandbox's working directory, and the files and directories written there.

One rule for every door (`Sandbox.run_python`'s files, a session's uploads, downloads and binds): a name
is a non-empty relative path without NUL and without "..", so it cannot leave the directory it names a
place in. What is made there belongs to the sandbox's uid when it has one (a root daemon's sandbox).
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath


def check_relative(name: str, label: str, where: str, reserved: str | None = None) -> None:
    """ValueError naming `label`, `name` and `where` unless `name` is a relative path inside (and not the
    `reserved` name)."""
    path = PurePosixPath(name) if isinstance(name, str) else None
    if (
        path is None
        or not name
        or "\0" in name
        or path.is_absolute()
        or ".." in path.parts
        or name == reserved
    ):
        raise ValueError(f"sandbox {label} {name!r} must be a relative path inside {where}")


def make_dirs(work: Path, relative: str | PurePosixPath, uid: int | None) -> None:
    """Make `work/relative` and the directories above it that are missing, owned by `uid` when given."""
    directory = work
    for part in PurePosixPath(relative).parts:
        directory = directory / part
        if not directory.exists():
            directory.mkdir(mode=0o700)
            if uid is not None:
                os.chown(directory, uid, uid)


def write_file(work: Path, name: str, content: str | bytes, uid: int | None) -> None:
    """Write `content` at `work/name` (its directories made), owned by `uid` when given."""
    make_dirs(work, PurePosixPath(name).parent, uid)
    target = work / name
    target.write_bytes(content.encode() if isinstance(content, str) else content)
    if uid is not None:
        os.chown(target, uid, uid)
