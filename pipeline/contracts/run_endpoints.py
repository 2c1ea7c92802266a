"""Where a running daemon listens, kept in its run directory so that tools and agents find it without
reading its logs: `<run_dir>/endpoints.json` = {"pid", "metrics", "admin", and "flight" with
`transport.kind = "flight"`}, each a base URL.

The daemon writes it (atomically) once its doors are open and removes it when it stops. A daemon killed
by SIGKILL leaves it behind, so readers believe it only while a daemon holds the run directory's lock
(`running_endpoints`). Ports chosen as 0 are written as bound, which is the point: `rollwise engines
--run-dir D` and `rollwise doctor --run-dir D` reach a daemon whose ports were picked for it.

Import-light (standard library only).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from pathlib import Path

from pipeline.contracts.run_dir import SUPERVISOR_LOCK

ENDPOINTS = "endpoints.json"


def write_endpoints(root: Path, **urls: str | None) -> Path:
    """Record this process's listening URLs (None values are left out)."""
    out = root / ENDPOINTS
    tmp = out.with_suffix(".json.tmp")
    record = {"pid": os.getpid(), **{k: v for k, v in urls.items() if v is not None}}
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.replace(out)
    return out


def remove_endpoints(root: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        (root / ENDPOINTS).unlink()


def held_by_a_daemon(root: Path) -> bool:
    """True while a daemon holds `root`'s supervisor.lock (an exclusive flock)."""
    path = root / SUPERVISOR_LOCK
    if not path.exists():
        return False
    with open(path) as handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
    return False


def running_endpoints(root: Path) -> dict[str, str] | None:
    """The URLs of the daemon running on `root`; None when no daemon runs there (or it has not opened its
    doors yet)."""
    if not held_by_a_daemon(root):
        return None
    try:
        record = json.loads((root / ENDPOINTS).read_text())
    except (FileNotFoundError, ValueError):
        return None
    if not isinstance(record, dict):
        return None
    return {k: v for k, v in record.items() if isinstance(v, str)}
