"""Experiment trackers (`[trackers]`: W&B offline, MLflow, TensorBoard) fed by the supervisor.

The supervisor sees every learner step (its `Step` events) and every held-out evaluation, so the trackers
run here and the learner process never imports them. Each record is queued and written by one background
thread: a slow or failing tracker cannot hold up the event loop, the learner's events or a weight sync.
A tracker that fails to open is dropped; a failed write is counted in rollwise_tracker_errors_total
{tracker} and logged the first time only; when the thread falls behind by `QUEUE_SIZE` records the newest
are dropped and counted under tracker="queue". What is written:

- at start, the resolved config (as `config.toml` writes it, secrets left out);
- per learner step (x-axis `learner/step`): `learner/<metric>` for every step metric of the trainer
  (loss, entropy, clip fractions, mismatch, ...), plus version, groups, busy and idle seconds and the mean
  staleness of the trained tokens;
- per evaluation (x-axis `eval/step`, the learner step when it started): `eval/<mode>/<number>` for
  success, pass_at_k, reward_mean and turns_mean, and `eval/version`.
"""

from __future__ import annotations

import logging
import queue
import threading
import tomllib
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

from pipeline.contracts import events
from pipeline.contracts.config import Config, config_to_toml
from pipeline.supervisor.observability import metrics

log = logging.getLogger("rollwise.trackers")

QUEUE_SIZE = 10_000
EVAL_NUMBERS = ("success", "pass_at_k", "reward_mean", "turns_mean")


class Tracker(Protocol):
    """One experiment tracker. Every method runs on the trackers' thread and may block or raise."""

    name: str

    def open(self, config: dict[str, Any], config_text: str) -> None: ...

    def log(self, axis: str, step: int, values: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def step_values(event: events.Step) -> dict[str, float]:
    """A learner step as tracker values (non-finite metrics were sent as None and are left out)."""
    values = {f"learner/{key}": value for key, value in event.metrics.items() if value is not None}
    values.update(
        {
            "learner/version": float(event.version),
            "learner/groups": float(event.groups),
            "learner/busy_s": event.busy_s,
            "learner/idle_s": event.idle_s,
        }
    )
    tokens = sum(event.staleness.values())
    if tokens:
        values["learner/staleness_mean"] = sum(lag * n for lag, n in event.staleness.items()) / tokens
    return values


def eval_values(row: dict[str, Any]) -> dict[str, float]:
    """An evaluation row (eval_schedule.eval_row) as tracker values, one group per mode."""
    values = {"eval/version": float(row["version"])}
    for mode in ("greedy", "sampled"):
        block = row.get(mode)
        if isinstance(block, dict):
            for number in EVAL_NUMBERS:
                if isinstance(block.get(number), int | float):
                    values[f"eval/{mode}/{number}"] = float(block[number])
    return values


class Trackers:
    """The enabled trackers behind one queue and one thread (module docstring)."""

    def __init__(self, trackers: Iterable[Tracker], *, queue_size: int = QUEUE_SIZE) -> None:
        self.trackers = list(trackers)
        self.queue: queue.Queue[tuple[str, Any] | None] = queue.Queue(maxsize=queue_size)
        self.thread: threading.Thread | None = None
        self.complained: set[str] = set()  # trackers whose failure was logged already

    def start(self, cfg: Config) -> None:
        """Open every tracker with the resolved config (on the thread: W&B takes a second to start)."""
        text = config_to_toml(cfg)
        self.thread = threading.Thread(target=self._work, name="trackers", daemon=True)
        self.thread.start()
        self._put(("open", (tomllib.loads(text), text)))

    def log_step(self, event: events.Step) -> None:
        self._put(("log", ("learner", event.step, step_values(event))))

    def log_eval(self, row: dict[str, Any]) -> None:
        step = row.get("step")
        self._put(("log", ("eval", int(step) if isinstance(step, int) else 0, eval_values(row))))

    def close(self, timeout_s: float = 10.0) -> None:
        """Write what is queued and close every tracker, waiting at most `timeout_s` seconds."""
        if self.thread is None:
            return
        try:
            self.queue.put(None, timeout=timeout_s)
        except queue.Full:
            log.warning(
                "trackers: the queue did not drain within %.0f s; closing without the rest", timeout_s
            )
            return
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            log.warning("trackers: not closed within %.0f s; their last records may be missing", timeout_s)

    def _put(self, item: tuple[str, Any]) -> None:
        try:
            self.queue.put_nowait(item)
        except queue.Full:
            self._failed("queue", "writing", RuntimeError(f"{QUEUE_SIZE} records behind; dropping"))

    def _work(self) -> None:
        while (item := self.queue.get()) is not None:
            kind, payload = item
            for tracker in list(self.trackers):
                try:
                    if kind == "open":
                        tracker.open(*payload)
                    else:
                        tracker.log(*payload)
                except Exception as exc:
                    self._failed(tracker.name, kind, exc)
                    if kind == "open":
                        self.trackers.remove(tracker)  # never opened: nothing to write to
        for tracker in self.trackers:
            try:
                tracker.close()
            except Exception as exc:
                self._failed(tracker.name, "close", exc)

    def _failed(self, name: str, what: str, exc: Exception) -> None:
        metrics.TRACKER_ERRORS.labels(tracker=name).inc()
        if name not in self.complained:
            self.complained.add(name)
            log.warning(
                "tracker %s failed (%s): %r; training goes on, further failures are only counted",
                name,
                what,
                exc,
            )


def build_trackers(cfg: Config, run_dir: Path) -> Trackers | None:
    """The trackers `[trackers]` turns on (None when none is): each writes under `dir`/<tracker>."""
    from pipeline.supervisor.observability import tracker_backends as backends

    t = cfg.trackers
    root = Path(t.dir) if t.dir is not None else run_dir / "trackers"
    name = t.run_name or run_dir.resolve().name
    chosen: list[Tracker] = []
    if t.wandb:
        chosen.append(backends.WandbTracker(root / "wandb", project=t.project, run_name=name))
    if t.mlflow:
        uri = t.mlflow_uri or (root / "mlflow").resolve().as_uri()
        chosen.append(backends.MlflowTracker(uri, experiment=t.project, run_name=name))
    if t.tensorboard:
        chosen.append(backends.TensorBoardTracker(root / "tensorboard" / name))
    return Trackers(chosen) if chosen else None
