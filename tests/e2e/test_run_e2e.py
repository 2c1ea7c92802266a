"""End to end: `rollwise run` as a real process (embedded engine, learner child, spool) on tiny settings.

`DaemonRun` is the harness the fault tests share: it starts the daemon with JSON-lines progress on
stdout, collects the events on a reader thread, and signals or kills it by PID.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from pipeline.contracts.run_endpoints import running_endpoints

REPO = Path(__file__).resolve().parents[2]

# Small enough that one learner step takes a fraction of a second on 2 cores.
TINY = [
    "engine.port=0",
    "metrics.port=0",
    "admin.port=0",
    "env.group_size=4",
    "learner.batch_groups=2",
    "learner.mini_batches=1",
    "learner.checkpoint_every=1",
    "learner.loss.clip_low=0.2",
    "learner.loss.clip_high=0.28",
    "sampling.max_new_tokens=4",
    "rollout.max_concurrent_groups=4",
    "async.max_staleness=1",
    "run.shutdown_grace_s=5",
    # As examples/guess_number.toml: one engine thread on 2 cores; fp32, so the served-policy check
    # compares at its fp32 tolerance (1e-3) whatever this CPU would pick by itself.
    "engine.threads=1",
    "engine.dtype=float32",
]


class DaemonRun:
    """One `rollwise run` process. Events = the JSON objects it printed, in order."""

    def __init__(self, run_dir: Path, overrides: list[str], *, max_steps: int | None = None) -> None:
        self.run_dir = run_dir
        argv = [
            sys.executable,
            "-m",
            "pipeline.cli",
            "run",
            "--run-dir",
            str(run_dir),
            "--log-format",
            "json",
        ]
        if max_steps is not None:
            argv += ["--max-steps", str(max_steps)]
        for item in overrides:
            argv += ["--set", item]
        self.stderr_path = run_dir.parent / f"{run_dir.name}.supervisor-{time.monotonic_ns()}.stderr"
        self._stderr = open(self.stderr_path, "wb")  # noqa: SIM115 - closed in wait()
        self.proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=self._stderr)
        self.events: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            try:
                event = json.loads(raw)
            except ValueError:
                continue
            with self._lock:
                self.events.append(event)

    def snapshot(self, kind: str | None = None) -> list[dict[str, Any]]:
        with self._lock:
            return [e for e in self.events if kind is None or e.get("event") == kind]

    def wait_for(self, what: Callable[[DaemonRun], bool], timeout_s: float, why: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not what(self):
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon exited ({self.proc.returncode}) before {why}\n{self.tail()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s} s waiting for {why}\n{self.tail()}")
            time.sleep(0.1)

    def steps(self) -> list[int]:
        return [int(e["step"]) for e in self.snapshot("step")]

    def wait_steps(self, n: int, timeout_s: float = 90.0) -> None:
        self.wait_for(lambda r: len(r.steps()) >= n, timeout_s, f"{n} learner steps")

    def metrics_url(self) -> str:
        for e in self.snapshot("message"):
            text = str(e.get("text", ""))
            if "metrics on " in text:
                return text.split("metrics on ", 1)[1].strip()
        raise AssertionError("the daemon never printed its metrics URL")

    def scrape(self) -> str:
        """The daemon's /metrics now: several `metric(..., text=)` reads of one scrape are consistent."""
        with urllib.request.urlopen(self.metrics_url(), timeout=5) as resp:
            return resp.read().decode()

    def metric(self, name: str, labels: dict[str, str] | None = None, *, text: str | None = None) -> float:
        """Sum of the samples of `name` whose labels include `labels`, from `text` or a fresh scrape."""
        if text is None:
            text = self.scrape()
        total = 0.0
        for line in text.splitlines():
            if not line.startswith(name) or line.startswith("#"):
                continue
            head, value = line.rsplit(" ", 1)
            sample, _, label_text = head.partition("{")
            if sample != name:
                continue
            if all(f'{k}="{v}"' in label_text for k, v in (labels or {}).items()):
                total += float(value)
        return total

    def wait(self, timeout_s: float = 60.0) -> int:
        try:
            rc = self.proc.wait(timeout=timeout_s)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self._reader.join(timeout=5)
            if self.proc.stdout is not None:
                self.proc.stdout.close()
            self._stderr.close()
        return rc

    def signal(self, sig: signal.Signals) -> None:
        os.kill(self.proc.pid, sig)

    def tail(self, n: int = 40) -> str:
        if not self._stderr.closed:  # wait() closes it; a failed wait's message still needs the tail
            self._stderr.flush()
        lines = self.stderr_path.read_text(errors="replace").splitlines()[-n:]
        last = [json.dumps(e)[:300] for e in self.snapshot()[-6:]]
        return "stderr tail:\n" + "\n".join(lines) + "\nlast events:\n" + "\n".join(last)


def checkpoint_state(run_dir: Path) -> dict[str, Any]:
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    return json.loads((run_dir / "checkpoints" / latest / "state.json").read_text())


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One initial model for every daemon test that does not test model creation itself."""
    from learner.model.model_init import init_model

    return init_model(tmp_path_factory.mktemp("model") / "tiny", preset="tiny", seed=0)


@pytest.fixture
def daemons() -> Iterator[list[DaemonRun]]:
    """Every DaemonRun a test appends here is killed (by PID) if it is still running at the end."""
    started: list[DaemonRun] = []
    yield started
    for run in started:
        if run.proc.poll() is None:
            run.proc.kill()
        run.wait(timeout_s=10)


@pytest.mark.integration
@pytest.mark.slow
def test_fresh_run_trains_publishes_and_resumes(tmp_path: Path, daemons: list[DaemonRun]) -> None:
    run_dir = tmp_path / "run"
    first = DaemonRun(run_dir, TINY, max_steps=3)
    daemons.append(first)
    assert first.wait(timeout_s=180) == 0, first.tail()
    assert first.steps() == [1, 2, 3]
    syncs = first.snapshot("sync")
    assert [s["version"] for s in syncs] == [1, 2, 3] and all(s["ok"] for s in syncs)
    for name in ("config.toml", "model/config.json", "weights/v3/config.json", "logs/learner.log"):
        assert (run_dir / name).exists(), name
    assert (run_dir / "logs" / "engine0.log").read_text().count("start:") == 1
    assert checkpoint_state(run_dir)["step"] == 3
    assert any(p.suffix == ".arrow" for p in (run_dir / "spool").iterdir())

    second = DaemonRun(run_dir, TINY, max_steps=5)
    daemons.append(second)
    assert second.wait(timeout_s=180) == 0, second.tail()
    assert second.steps() == [4, 5]  # resumed from the step-3 checkpoint
    assert [s["version"] for s in second.snapshot("sync")] == [4, 5]


@pytest.mark.integration
@pytest.mark.slow
def test_sigterm_stops_gracefully_and_a_second_daemon_is_refused(
    tmp_path: Path, tiny_model: Path, daemons: list[DaemonRun]
) -> None:
    run_dir = tmp_path / "run"
    run = DaemonRun(run_dir, [*TINY, f"model.path={json.dumps(str(tiny_model))}"])
    daemons.append(run)
    run.wait_steps(1)
    intruder = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "run", "--run-dir", str(run_dir), "--log-format", "json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert intruder.returncode == 1
    assert "in use by another rollwise daemon" in intruder.stderr
    # Where it listens, as bound (metrics.port = 0 and admin.port = 0 in TINY), for tools and agents; the
    # refused intruder did not overwrite it.
    endpoints = running_endpoints(run_dir)
    assert endpoints is not None and f"{endpoints['metrics']}/metrics" == run.metrics_url()
    listed = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "engines", "--run-dir", str(run_dir), "list"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert listed.returncode == 0, listed.stderr
    assert [e["weight_version"] is not None for e in json.loads(listed.stdout)] == [True]
    run.signal(signal.SIGTERM)
    assert run.wait(timeout_s=60) == 0, run.tail()
    assert not (run_dir / "endpoints.json").exists()
    last = run.steps()[-1]
    # The learner checkpointed on the way out: the resume point is the last step it reported.
    assert checkpoint_state(run_dir)["step"] == last


@pytest.mark.integration
@pytest.mark.slow
def test_second_signal_exits_at_once_and_the_run_dir_still_resumes(
    tmp_path: Path, tiny_model: Path, daemons: list[DaemonRun]
) -> None:
    run_dir = tmp_path / "run"
    overrides = [*TINY, f"model.path={json.dumps(str(tiny_model))}"]
    first = DaemonRun(run_dir, overrides)
    daemons.append(first)
    first.wait_steps(2)
    first.signal(signal.SIGTERM)
    time.sleep(0.2)
    first.signal(signal.SIGTERM)
    started = time.monotonic()
    assert first.wait(timeout_s=15) == 128 + signal.SIGTERM, first.tail()
    assert time.monotonic() - started < 10  # "at once": no drain, no final checkpoint wait
    # Whatever the hard exit interrupted, the run directory resumes from its last complete checkpoint.
    resumed_from = checkpoint_state(run_dir)["step"] if (run_dir / "checkpoints" / "latest").exists() else 0
    second = DaemonRun(run_dir, overrides)
    daemons.append(second)
    second.wait_steps(1)
    assert second.steps()[0] == resumed_from + 1, second.tail()
    second.signal(signal.SIGTERM)
    assert second.wait(timeout_s=60) == 0, second.tail()
