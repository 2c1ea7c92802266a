"""The supervisor's machine-readable logs in the run directory, each readable without the daemon
(`rollwise report`, `rollwise doctor`, `bench learn`):

- `logs/steps.jsonl`: the learner's step events (learner_dispatch.StepLog);
- `logs/status.jsonl`: each status line the daemon shows (status_report), so a run's history of
  episodes, successes and tokens outlives the terminal it was printed on;
- `logs/metrics.prom`: the registry's Prometheus exposition, replaced (write, then rename) at each
  status and after the drain: a stopped run keeps the counters a scrape would have shown.

A full or read-only run directory costs lines of them (counted in rollwise_storage_errors_total under
the log's component, logged once per outage), never the daemon. The JSON-lines logs are rotated with the
others (log_rotation); the snapshot is one file of bounded size."""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import IO

from prometheus_client import generate_latest

from pipeline.contracts.durable import RefusedWrites, storage_fault_kind
from pipeline.supervisor.observability import metrics

log = logging.getLogger("rollwise.supervisor")


class JsonLinesLog:
    """Appends lines to `path` (opened by `open`); `component` labels its refused writes."""

    def __init__(self, path: Path, component: str) -> None:
        self.path = path
        self.component = component
        self.refusals = RefusedWrites(path.parent)
        self.file: IO[str] | None = None
        self.wanted = False  # open() was called: a file refused then is retried, not a caller's mistake

    def open(self) -> bool:
        """Open for appending; False when the storage refuses (counted; each `append` tries again)."""
        self.wanted = True
        try:
            self.file = self.path.open("a", encoding="utf-8")
        except OSError as exc:
            self._refused(exc)
            return False
        return True

    def append(self, line: str) -> None:
        if self.file is None:
            if not self.wanted:
                raise RuntimeError(f"{self.path} is not open")
            if not self.open():
                return  # still refused: this line is lost, counted
        assert self.file is not None
        try:
            self.file.write(line + "\n")
            self.file.flush()
        except OSError as exc:
            self._refused(exc)
        else:
            if self.refusals.wrote() is not None:
                log.warning("%s takes writes again", self.path)

    def _refused(self, exc: OSError) -> None:
        refusal = self.refusals.refused(exc)
        kind = refusal.kind if refusal is not None else "other"
        metrics.STORAGE_ERRORS.labels(component=self.component, kind=kind).inc()
        if refusal is None or refusal.first:
            log.error("cannot append to %s (%s: %s); its lines are lost meanwhile", self.path, kind, exc)

    def close(self) -> None:
        if self.file is not None:
            with contextlib.suppress(OSError):  # its last lines may not fit on a full disk
                self.file.close()
            self.file = None
        self.wanted = False


def write_metrics_snapshot(path: Path) -> bool:
    """Replace `path` with the registry's exposition text (a reader never sees half of it); False when the
    storage refused (counted under component "metrics_snapshot")."""
    partial = path.with_name(path.name + ".partial")
    try:
        partial.write_bytes(generate_latest(metrics.REGISTRY))
        os.replace(partial, path)
    except OSError as exc:
        kind = storage_fault_kind(exc, path.parent) or "other"
        metrics.STORAGE_ERRORS.labels(component="metrics_snapshot", kind=kind).inc()
        with contextlib.suppress(OSError):
            partial.unlink()
        return False
    return True
