"""What the soak samples (Linux /proc) and how it judges the curves.

`sample_process(pid)` reads one process's resident memory, open file descriptors and threads;
`daemon_processes(supervisor_pid)` finds the daemon's children by their command lines;
`dir_sizes(run_dir)` sums the run directory by part (spool, weights, checkpoints, logs, other).

`growth(samples, warmup_s)` judges one process life: the median of its first and of its last tenth of
samples taken after `warmup_s`, and the relative change between them (medians, not endpoints, so one
garbage-collection spike does not decide the verdict), plus a least-squares slope per hour.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass
from pathlib import Path

_ROLES = (
    ("pipeline.engine", "engine"),
    ("sglang.launch_server", "engine"),
    ("learner.process", "learner"),
)
RUN_DIR_PARTS = ("spool", "weights", "checkpoints", "logs")


@dataclass(frozen=True)
class ProcessSample:
    """One reading of one process. `rss_bytes` = VmRSS; `anon_bytes` = RssAnon, the part of it the process
    allocated (heap, arenas, stacks), without the pages of the libraries and files it maps (RssFile: a
    library's code pages come in as new code paths run, bounded by its size, and are no leak); `fds` =
    entries of /proc/<pid>/fd."""

    pid: int
    rss_bytes: int
    fds: int
    threads: int
    anon_bytes: int = 0


def sample_process(pid: int) -> ProcessSample | None:
    """The process's resources now; None if it is gone (or not readable)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    try:
        rss_kib = int(fields["VmRSS"].split()[0])
        anon_kib = int(fields["RssAnon"].split()[0])
        threads = int(fields["Threads"])
    except (KeyError, ValueError, IndexError):
        return None  # a zombie has no VmRSS
    return ProcessSample(
        pid=pid, rss_bytes=rss_kib * 1024, fds=fds, threads=threads, anon_bytes=anon_kib * 1024
    )


def _children(pid: int) -> list[int]:
    found: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except FileNotFoundError:
        return found
    for task in tasks:
        try:
            found.extend(int(p) for p in (task / "children").read_text().split())
        except FileNotFoundError:
            continue
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except FileNotFoundError:
        return ""


def daemon_processes(supervisor_pid: int) -> dict[int, str]:
    """pid -> role ("supervisor", "engine", "learner") of the daemon's processes alive now."""
    out = {supervisor_pid: "supervisor"}
    for child in _children(supervisor_pid):
        cmd = _cmdline(child)
        for needle, role in _ROLES:
            if needle in cmd:
                out[child] = role
                break
    return out


def dir_sizes(run_dir: Path) -> dict[str, int]:
    """Bytes on disk under `run_dir` by part (RUN_DIR_PARTS, the rest is "other"); files that vanish
    while walking (retention, renames) are skipped."""
    sizes = dict.fromkeys((*RUN_DIR_PARTS, "other"), 0)

    def walk(path: Path, part: str) -> None:
        try:
            entries = list(os.scandir(path))
        except (FileNotFoundError, NotADirectoryError):
            return
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    walk(Path(entry.path), part)
                elif entry.is_file(follow_symlinks=False):
                    sizes[part] += entry.stat(follow_symlinks=False).st_blocks * 512
            except FileNotFoundError:
                continue

    for entry in os.scandir(run_dir) if run_dir.is_dir() else []:
        part = entry.name if entry.name in RUN_DIR_PARTS else "other"
        if entry.is_dir(follow_symlinks=False):
            walk(Path(entry.path), part)
        else:
            try:
                sizes[part] += entry.stat(follow_symlinks=False).st_blocks * 512
            except FileNotFoundError:
                continue
    return sizes


@dataclass(frozen=True)
class Growth:
    """One process life after its warm-up: `first`/`last` = medians of the first and last tenth of the
    samples, `relative` = last / first - 1, `slope_per_hour` = least-squares slope / first x 3600."""

    samples: int
    span_s: float
    first: float
    last: float
    relative: float
    slope_per_hour: float


def growth(points: list[tuple[float, float]], warmup_s: float, *, min_span_s: float = 60.0) -> Growth | None:
    """`points` = (seconds since the process started, value). None when fewer than 10 samples or less
    than `min_span_s` remain after the warm-up (too short a life to judge)."""
    kept = [(t, v) for t, v in points if t >= warmup_s]
    if len(kept) < 10 or kept[-1][0] - kept[0][0] < min_span_s:
        return None
    tenth = max(1, len(kept) // 10)
    first = statistics.median(v for _, v in kept[:tenth])
    last = statistics.median(v for _, v in kept[-tenth:])
    if first <= 0:
        return None
    ts = [t for t, _ in kept]
    vs = [v for _, v in kept]
    mean_t, mean_v = statistics.fmean(ts), statistics.fmean(vs)
    var_t = sum((t - mean_t) ** 2 for t in ts)
    slope = sum((t - mean_t) * (v - mean_v) for t, v in kept) / var_t if var_t > 0 else 0.0
    return Growth(
        samples=len(kept),
        span_s=kept[-1][0] - kept[0][0],
        first=first,
        last=last,
        relative=last / first - 1.0,
        slope_per_hour=slope / first * 3600.0,
    )
