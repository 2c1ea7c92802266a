"""One view of a run for the checks: plain data read once from its run directory and, for a running
daemon, one scrape of its /metrics (docs/design/run_health.md, "The view").

From the run directory: the learner's step events (logs/steps.jsonl and its rotated parts; the file's
modification time is the last step's), the held-out evaluations (logs/eval.jsonl), the resolved config
(config.toml), whether a daemon holds it (its supervisor.lock), and the free space of its filesystem.
Counters come from a scrape of the running daemon (`metrics_text`) or else from the snapshot the daemon
keeps in logs/metrics.prom (pipeline.supervisor.run_logs: replaced at each status and after the drain);
without either, the checks that need them say nothing rather than guess."""

from __future__ import annotations

import os
import statistics
import time
import tomllib
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from pipeline.contracts.run_dir import RunDir, log_events
from pipeline.contracts.run_endpoints import held_by_a_daemon

Sample = tuple[dict[str, str], float]


@dataclass(frozen=True)
class RunView:
    """`steps`: step events, oldest first; `last_step_at`: when the last one was written (epoch seconds);
    `evals`: evaluation rows; `metrics`: sample name -> (labels, value) of one scrape; `config`: the
    resolved config; `free_share`: free bytes over the filesystem's size; `running`: a daemon holds the
    run directory; `now`: epoch seconds when the view was taken; `stall_after_s`: the operator's limit for
    a step's absence (None: the rule's own)."""

    steps: list[dict[str, Any]] = field(default_factory=list)
    last_step_at: float | None = None
    evals: list[dict[str, Any]] = field(default_factory=list)
    metrics: dict[str, list[Sample]] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    free_share: float | None = None
    running: bool = False
    now: float = 0.0
    stall_after_s: float | None = None

    def step_metric(self, key: str, last: int | None = None) -> list[float]:
        """One trainer metric over the steps (the last `last` of them), skipping steps without it."""
        steps = self.steps if last is None else self.steps[-last:]
        values = [s.get("metrics", {}).get(key) for s in steps]
        return [float(v) for v in values if isinstance(v, int | float)]

    def total(self, name: str, **labels: str) -> float | None:
        """The sum of a metric's samples whose labels include `labels`; None when the scrape lacks it."""
        samples = self.metrics.get(name)
        if samples is None:
            return None
        return sum(v for lab, v in samples if all(lab.get(k) == want for k, want in labels.items()))

    def setting(self, dotted: str) -> Any:
        """A value of the resolved config by its dotted key ("sampling.max_new_tokens"); None if absent."""
        node: Any = self.config
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
        return node

    def step_seconds(self) -> list[float]:
        """Each step's wall time as the learner books it: waiting for data plus its own work."""
        return [float(s.get("idle_s", 0.0)) + float(s.get("busy_s", 0.0)) for s in self.steps]

    def median_step_s(self) -> float | None:
        seconds = [s for s in self.step_seconds() if s > 0]
        return statistics.median(seconds) if seconds else None


def parse_metrics(text: str) -> dict[str, list[Sample]]:
    """Prometheus exposition text -> sample name -> (labels, value)."""
    out: dict[str, list[Sample]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    return out


def scrape(url: str, timeout_s: float = 5.0) -> str:
    """One GET of a /metrics URL (the daemon's `metrics on` address)."""
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--prometheus must be an http(s) URL of the daemon's /metrics, got {url!r}")
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return resp.read().decode()


def free_share(path: Path) -> float | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail / st.f_blocks if st.f_blocks else None


def load(run_dir: str | Path, metrics_text: str | None = None, now: float | None = None) -> RunView:
    """The view of `run_dir` (and of a scrape's text, when the daemon runs)."""
    run = RunDir.at(run_dir)
    if not run.root.is_dir():
        raise FileNotFoundError(f"no run directory at {run.root}")
    steps = log_events(run.step_log, "step")
    snapshot = run.logs / "metrics.prom"
    if metrics_text is None and snapshot.exists():
        metrics_text = snapshot.read_text()
    config_file = run.root / "config.toml"
    config = tomllib.loads(config_file.read_text()) if config_file.exists() else {}
    return RunView(
        steps=steps,
        last_step_at=run.step_log.stat().st_mtime if steps and run.step_log.exists() else None,
        evals=log_events(run.eval_log, "eval"),
        metrics=parse_metrics(metrics_text) if metrics_text else {},
        config=config,
        free_share=free_share(run.root),
        running=held_by_a_daemon(run.root),
        now=time.time() if now is None else now,
    )


def quarters(values: Sequence[float]) -> tuple[list[float], list[float]]:
    """The first and the last quarter of a series (at least one value each when it has four)."""
    n = len(values) // 4
    return (list(values[:n]), list(values[-n:])) if n else ([], [])
