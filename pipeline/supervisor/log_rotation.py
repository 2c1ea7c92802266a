"""The run directory's logs under a size cap: `logs/*.log`, `steps.jsonl`, `eval.jsonl` (not the learner's
ledger `consumed.jsonl`, which the books are read from: it is accounting, not a log).

Every `check_every_s` the supervisor looks at each file; one larger than `logs.max_bytes` is rotated the
way logrotate's `copytruncate` does it: `name.(k-1)` -> `name.k` (the oldest beyond `logs.keep` deleted),
a copy of `name` -> `name.1`, then `name` truncated to zero. Every writer of these files appends
(O_APPEND: the supervisor's own handlers, and the children, whose stderr is the file the supervisor
opened for them), so it goes on writing at the new end; lines written between the copy and the
truncation are lost (a few at most). Readers (`rollwise report`, `rollwise inspect`, the eval log) read
the rotated copies too (pipeline.contracts.run_dir.log_lines). A log therefore takes at most about
(keep + 1) x max_bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
from pathlib import Path

log = logging.getLogger("rollwise.logs")

NOT_ROTATED = frozenset({"consumed.jsonl"})


def rotate(path: Path, keep: int) -> None:
    """copytruncate `path` (module docstring), keeping `keep` rotated copies."""
    oldest = path.with_name(f"{path.name}.{keep}")
    oldest.unlink(missing_ok=True)
    for n in range(keep - 1, 0, -1):
        older = path.with_name(f"{path.name}.{n}")
        if older.exists():
            older.rename(path.with_name(f"{path.name}.{n + 1}"))
    copy = path.with_name(f"{path.name}.1")
    shutil.copyfile(path, copy)
    _drop_torn_tail(copy)
    with open(path, "r+b") as handle:
        handle.truncate(0)


def _drop_torn_tail(path: Path) -> None:
    """Cut `path` after its last newline. A reader can see an append that crosses a page boundary half
    done, so the copy may end in the first part of a line whose rest the truncation then removes: that
    line is lost like the others written between the copy and the truncation, never kept torn."""
    with open(path, "r+b") as handle:
        size = handle.seek(0, os.SEEK_END)
        start = max(0, size - 65536)
        handle.seek(start)
        tail = handle.read()
        cut = tail.rfind(b"\n")
        if cut < 0 or cut == len(tail) - 1:  # no line end to cut at (not a line log), or whole
            return
        handle.truncate(start + cut + 1)


def rotate_large_logs(logs_dir: Path, max_bytes: int, keep: int) -> list[str]:
    """Rotate every log of `logs_dir` larger than `max_bytes`; the names rotated."""
    rotated: list[str] = []
    try:
        entries = list(os.scandir(logs_dir))
    except FileNotFoundError:
        return rotated
    for entry in entries:
        name = entry.name
        if name in NOT_ROTATED or not name.endswith((".log", ".jsonl")) or not entry.is_file():
            continue
        try:
            if entry.stat().st_size > max_bytes:
                rotate(Path(entry.path), keep)
                rotated.append(name)
        except FileNotFoundError:
            continue
    return rotated


async def keep_logs_small(
    logs_dir: Path, max_bytes: int, keep: int, stopping: asyncio.Event, every_s: float = 30.0
) -> None:
    """Rotate large logs every `every_s` until `stopping` is set. A rotation the disk refuses is logged
    and tried again next time (the logs then grow meanwhile; nothing else depends on it)."""
    while not stopping.is_set():
        try:
            rotated = await asyncio.to_thread(rotate_large_logs, logs_dir, max_bytes, keep)
        except OSError as exc:
            log.warning("rotating the logs in %s failed: %s", logs_dir, exc)
        else:
            for name in rotated:
                log.info("rotated %s (larger than %d bytes; %d older copies kept)", name, max_bytes, keep)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stopping.wait(), every_s)
