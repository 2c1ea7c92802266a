"""What the daemon prints while it runs: a rich live view on a terminal, JSON lines otherwise.

Both read the same numbers: learner step events as they arrive, and a periodic status computed from the
daemon's running totals (deltas since the previous status, so rates and success rates describe the last
interval, not the whole run). JSON lines go to stdout, one object per line:
`{"event": "step", ...}` per learner step and `{"event": "status", ...}` every `interval_s`.
While the JSON stream owns stdout, anything else written to `sys.stdout` (an environment's or a
library's print) becomes a log line (`stray_stdout_to_log`), so the stream stays one object per line.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any, Protocol, TextIO

from pipeline.contracts.run_dir import RunDir


@dataclass(frozen=True)
class Totals:
    """Cumulative counts at one moment, as the daemon's parts keep them: episodes finished and solved (the
    scheduler), trained tokens' staleness and the spool depth (the learner's step events)."""

    at: float
    episodes: float
    successes: float
    staleness_sum: float
    staleness_count: float
    spool_depth_groups: int = 0


def _ratio(num: float, den: float) -> float | None:
    return None if den <= 0 else num / den


@dataclass(frozen=True)
class Status:
    """One status line. Rates and means cover the interval since the previous status."""

    elapsed_s: float
    policy_version: int
    learner_step: int
    episodes: int
    episodes_per_s: float
    reward_mean: float | None
    success_rate: float | None
    staleness_mean: float | None
    learner_step_time_s: float | None
    spool_depth_groups: int
    groups_running: int | None = None  # admitted, not yet written (the scheduler's view)
    groups_accepted: int | None = None  # the staleness control's accepted count
    groups_dropped_in_flight: int | None = None  # since the daemon started (in_flight_drops)
    generated_tokens: int | None = None  # since the daemon started (rollwise_generated_tokens_total)
    # Of those, the ones never trained, by cause (pipeline.contracts.waste), and those of groups trained in
    # name only (their step changed no weight: rollwise_generated_tokens_no_signal_total).
    wasted_tokens: dict[str, int] | None = None
    no_signal_tokens: int | None = None


def status_between(
    before: Totals,
    after: Totals,
    *,
    elapsed_s: float,
    version: int,
    step: int,
    step_time_s: float | None,
    step_rewards: list[float],
) -> Status:
    """`step_rewards` = reward_mean of each learner step in the interval (the episode-reward histogram
    has negative buckets, so prometheus_client exports no _sum to average)."""
    dt = max(after.at - before.at, 1e-9)
    episodes = after.episodes - before.episodes
    return Status(
        elapsed_s=round(elapsed_s, 1),
        policy_version=version,
        learner_step=step,
        episodes=int(after.episodes),
        episodes_per_s=round(episodes / dt, 3),
        reward_mean=_round(_ratio(sum(step_rewards), len(step_rewards))),
        success_rate=_round(_ratio(after.successes - before.successes, episodes)),
        staleness_mean=_round(
            _ratio(after.staleness_sum - before.staleness_sum, after.staleness_count - before.staleness_count)
        ),
        learner_step_time_s=_round(step_time_s),
        spool_depth_groups=after.spool_depth_groups,
    )


def _round(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(x, digits)


class Progress(Protocol):
    def start(self) -> None: ...
    def on_step(self, event: dict[str, Any]) -> None: ...
    def on_status(self, status: Status) -> None: ...
    def on_sync(self, sync: dict[str, Any]) -> None: ...
    def on_eval(self, row: dict[str, Any]) -> None: ...
    def message(self, text: str) -> None: ...
    def error(self, kind: str, text: str, fields: dict[str, Any]) -> None: ...
    def stop(self) -> None: ...


class JsonProgress:
    """One JSON object per line on `out` (stdout by default): steps, statuses and messages."""

    def __init__(self, out: TextIO | None = None) -> None:
        self.out = out or sys.stdout

    def start(self) -> None:
        pass

    def _emit(self, obj: dict[str, Any]) -> None:
        self.out.write(json.dumps(obj, separators=(",", ":")) + "\n")
        self.out.flush()

    def on_step(self, event: dict[str, Any]) -> None:
        self._emit({"event": "step", "time": round(time.time(), 3), **_without(event, "event")})

    def on_status(self, status: Status) -> None:
        self._emit({"event": "status", "time": round(time.time(), 3), **asdict(status)})

    def on_sync(self, sync: dict[str, Any]) -> None:
        self._emit({"event": "sync", "time": round(time.time(), 3), **sync})

    def on_eval(self, row: dict[str, Any]) -> None:
        self._emit({"time": round(time.time(), 3), **row, "event": "eval"})

    def message(self, text: str) -> None:
        self._emit({"event": "message", "time": round(time.time(), 3), "text": text})

    def error(self, kind: str, text: str, fields: dict[str, Any]) -> None:
        self._emit({"event": "error", "time": round(time.time(), 3), "kind": kind, "text": text, **fields})

    def stop(self) -> None:
        self.out.flush()


def _without(event: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in event.items() if k != key}


class RichProgress:
    """A rich Live panel: the latest status plus the last learner step, refreshed in place."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.live import Live

        self.console = Console(stderr=False)
        self._live = Live(console=self.console, refresh_per_second=2, transient=False)
        self._status: Status | None = None
        self._step: dict[str, Any] = {}
        self._sync: dict[str, Any] = {}
        self._eval: dict[str, Any] = {}

    def start(self) -> None:
        self._live.start()
        self._render()

    def on_step(self, event: dict[str, Any]) -> None:
        self._step = event
        self._render()

    def on_status(self, status: Status) -> None:
        self._status = status
        self._render()

    def on_sync(self, sync: dict[str, Any]) -> None:
        self._sync = sync
        self._render()

    def on_eval(self, row: dict[str, Any]) -> None:
        self._eval = row
        self._render()

    def message(self, text: str) -> None:
        self._live.console.print(text)

    def error(self, kind: str, text: str, fields: dict[str, Any]) -> None:
        from rich.markup import escape

        self._live.console.print(f"[bold red]error ({escape(kind)})[/]: {escape(text)}")

    def stop(self) -> None:
        self._live.stop()

    def _render(self) -> None:
        from rich.table import Table

        table = Table(title="rollwise", show_header=False, expand=False)
        table.add_column(style="bold")
        table.add_column()
        s = self._status
        rows: list[tuple[str, str]] = []
        if s is not None:
            rows += [
                ("elapsed", f"{s.elapsed_s:.0f} s"),
                ("policy version", str(s.policy_version)),
                ("learner step", str(s.learner_step)),
                ("episodes", f"{s.episodes} ({s.episodes_per_s:.2f}/s)"),
                ("reward mean", _fmt(s.reward_mean)),
                ("success rate", _fmt(s.success_rate, pct=True)),
                ("staleness (versions)", _fmt(s.staleness_mean)),
                ("learner step time", _fmt(s.learner_step_time_s, unit=" s")),
                ("spool depth", f"{s.spool_depth_groups} groups"),
            ]
        for key in ("loss", "clip_fraction", "grad_norm", "entropy"):
            if isinstance(self._step.get(key), (int, float)):
                rows.append((f"last step {key}", f"{self._step[key]:.4g}"))
        if "publish_to_served_s" in self._sync:
            synced = (
                f"v{self._sync['version']} served {self._sync['publish_to_served_s']:.3f} s after publish"
            )
            rows.append(("last weight sync", synced))
        if self._eval:
            rows.append((f"held-out eval v{self._eval.get('version')}", eval_summary(self._eval)))
        for k, v in rows:
            table.add_row(k, v)
        self._live.update(table)


def eval_summary(row: dict[str, Any]) -> str:
    """One line per evaluation row (pipeline.supervisor.eval_schedule): its modes' success and pass@k."""
    parts = []
    greedy, sampled = row.get("greedy"), row.get("sampled")
    if isinstance(greedy, dict):
        parts.append(f"greedy {_fmt(greedy.get('success'), pct=True)}")
    if isinstance(sampled, dict):
        parts.append(
            f"sampled {_fmt(sampled.get('success'), pct=True)}, "
            f"pass@{sampled.get('k')} {_fmt(sampled.get('pass_at_k'), pct=True)}"
        )
    return f"{row.get('env')}: " + "; ".join(parts) + f" ({row.get('tasks')} tasks)"


def _fmt(x: float | None, *, pct: bool = False, unit: str = "") -> str:
    if x is None:
        return "-"
    return f"{100 * x:.1f}%" if pct else f"{x:.3f}{unit}"


def make_progress(log_format: str, out: TextIO | None = None) -> Progress:
    """`auto` = rich on a terminal, JSON otherwise."""
    stream = out or sys.stdout
    use_rich = log_format == "rich" or (log_format == "auto" and stream.isatty())
    return RichProgress() if use_rich else JsonProgress(stream)


class StrayStdout:
    """A `sys.stdout` that logs each complete line it is given (at INFO on `log`) instead of printing it.
    Prints may come from environment threads at once, hence the lock around the partial line. A write
    made while logging one (a log handler that itself writes to sys.stdout) goes to `fallback`, rather
    than round and round."""

    encoding = "utf-8"

    def __init__(self, log: logging.Logger, fallback: TextIO) -> None:
        self._log = log
        self._fallback = fallback
        self._partial = ""
        self._lock = threading.Lock()
        self._logging = threading.local()

    def write(self, text: str) -> int:
        if getattr(self._logging, "active", False):
            return self._fallback.write(text)
        with self._lock:
            *lines, self._partial = (self._partial + text).split("\n")
        self._emit(lines)
        return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        """Nothing: a line is logged when it is complete (flushing a partial one would split it)."""

    def drain(self) -> None:
        """Log the unterminated rest, if any (at the end of the run)."""
        with self._lock:
            line, self._partial = self._partial, ""
        self._emit([line])

    def isatty(self) -> bool:
        return False

    def writable(self) -> bool:
        return True

    def _emit(self, lines: list[str]) -> None:
        self._logging.active = True
        try:
            for line in lines:
                if line.strip():
                    self._log.info("stdout: %s", line.rstrip())
        finally:
            self._logging.active = False


@contextlib.contextmanager
def stray_stdout_to_log(progress: Progress, log: logging.Logger) -> Iterator[None]:
    """While a JsonProgress writes to the process's stdout, other writes to `sys.stdout` are logged
    instead (restored on exit). A rich live view redirects such prints above itself already."""
    if not isinstance(progress, JsonProgress) or progress.out is not sys.stdout:
        yield
        return
    original = sys.stdout
    stray = StrayStdout(log, original)
    sys.stdout = stray
    try:
        yield
    finally:
        stray.drain()
        sys.stdout = original


def log_to_run_dir(run: RunDir, *, quiet_stderr: bool) -> None:
    """Supervisor log lines go to logs/supervisor.log; stderr keeps only warnings under a live view."""
    run.logs.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(run.log_file("supervisor"))
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    if quiet_stderr:
        for h in root.handlers:
            if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
                h.setLevel(logging.WARNING)
