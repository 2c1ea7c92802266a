"""The run directory: every path the supervisor and the learner share, the locks, weight pruning, and the
one reader of "which version did the last checkpoint publish".

    <run_dir>/config.toml              the resolved config (both processes read it)
    <run_dir>/model/                   the initial model when `model.path` is unset (a preset)
    <run_dir>/spool/g<seq>.arrow       finished groups (pipeline.transport.spool)
    <run_dir>/weights/v<n>/            published policy version n, HF format or a PEFT adapter (newest kept)
    <run_dir>/checkpoints/step<n>/     learner checkpoints (learner.checkpoint), `latest` names the newest
    <run_dir>/logs/                    supervisor.log, learner.log, engine<i>.log, steps.jsonl, eval.jsonl,
                                       consumed.jsonl (the learner's consumption ledger)
    <run_dir>/trace/s<step>.arrow      the learner's token trace of a few trained groups (learner.trace)
    <run_dir>/supervisor.lock          one daemon per run directory
    <run_dir>/learner.lock             one learner per run directory

Import-light (standard library only): both processes and `rollwise config show` import it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.contracts.core_lease import LEASE_FILE

log = logging.getLogger("rollwise.run_dir")

SUPERVISOR_LOCK = "supervisor.lock"  # one daemon per run directory (hold_supervisor_lock)
KEEP_WEIGHT_VERSIONS = 3
LATEST_CHECKPOINT = "latest"
CHECKPOINT_STATE = "state.json"
# The key of state.json's "extra" under which the learner records the newest version it published.
PUBLISHED_VERSION_KEY = "published_version"
# ... and the groups it consumed since the previous checkpoint without training them: {group_id: reason}.
# With `consumed.group_ids` it makes the checkpoint chain a ledger: trained = consumed - dropped.
DROPPED_GROUPS_KEY = "dropped_groups"
_WEIGHTS_DIR = re.compile(r"^v(\d+)$")
_STEP_DIR = re.compile(r"^step(\d+)$")


class RunDirInUse(RuntimeError):
    """Another daemon holds the run directory's lock."""


@dataclass(frozen=True)
class RunDir:
    """Paths of one run; build it with `RunDir.at`. `initial_model` is `model.path` when the config names
    one, else `<root>/model`."""

    root: Path
    initial_model: Path
    config_file: Path
    spool: Path
    weights: Path
    checkpoints: Path
    logs: Path
    step_log: Path  # one learner step event per line: `rollwise report --run-dir` reads it
    consumed_log: Path  # the learner's consumption ledger (`append_consumed`, `committed_consumption`)

    @staticmethod
    def at(root: str | Path, model_path: str | Path | None = None) -> RunDir:
        r = Path(root).resolve()
        return RunDir(
            root=r,
            initial_model=Path(model_path) if model_path is not None else r / "model",
            config_file=r / "config.toml",
            spool=r / "spool",
            weights=r / "weights",
            checkpoints=r / "checkpoints",
            logs=r / "logs",
            step_log=r / "logs" / "steps.jsonl",
            consumed_log=r / "logs" / "consumed.jsonl",
        )

    def log_file(self, name: str) -> Path:
        return self.logs / f"{name}.log"

    @property
    def eval_log(self) -> Path:
        """One JSON line per held-out evaluation (pipeline.supervisor.eval_schedule)."""
        return self.logs / "eval.jsonl"

    @property
    def core_lease(self) -> Path:
        """The byte the learner holds while it computes (pipeline.contracts.core_lease)."""
        return self.root / LEASE_FILE

    @property
    def trace(self) -> Path:
        """The learner's per-step token trace for `rollwise inspect` (learner.trace)."""
        return self.root / "trace"

    def weights_of(self, version: int) -> Path:
        """Where version `version` is (or will be) published; version 0 is the initial model."""
        return self.weights / f"v{version}" if version > 0 else self.initial_model

    def serving_weights(self, version: int) -> Path:
        """Weights an engine should load for `version`: the published directory when it is complete, else
        the initial model (with a warning for version > 0: the learner re-publishes on resume)."""
        path = self.weights_of(version)
        if version > 0 and not is_published_dir(path):
            log.warning("weights for version %d not found at %s; serving the initial model", version, path)
            return self.initial_model
        return path


def is_model_dir(path: Path) -> bool:
    """An HF model directory is complete once its config.json is there (it is renamed into place last)."""
    return (path / "config.json").is_file()


def rotated_parts(path: Path) -> list[Path]:
    """`path` and its rotated copies (`path.1` newest ... `path.N` oldest: the supervisor's log rotation),
    oldest first; only those that exist."""
    older = []
    n = 1
    while (part := path.with_name(f"{path.name}.{n}")).exists():
        older.append(part)
        n += 1
    return [*reversed(older), *([path] if path.exists() else [])]


def log_lines(path: Path) -> list[str]:
    """Every line of a log and its rotated copies, oldest first (a copy removed meanwhile is skipped)."""
    lines: list[str] = []
    for part in rotated_parts(path):
        try:
            lines += part.read_text(encoding="utf-8", errors="replace").splitlines()
        except FileNotFoundError:
            continue
    return lines


def log_events(path: Path, event: str) -> list[dict[str, Any]]:
    """The JSON objects of a JSON-lines log (and its rotated copies) whose "event" is `event`, oldest
    first; a line cut by a crash, or one that is not an object, is skipped."""
    found = []
    for line in log_lines(path):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and record.get("event") == event:
            found.append(record)
    return found


# The context length of rollwise's presets (learner.model.model_init builds them with it): known before the
# preset exists, so the config check can use it.
PRESET_CONTEXT_TOKENS = 1024


def model_context_length(model_dir: Path) -> int | None:
    """`max_position_embeddings` of an HF model directory's config.json; None when it does not say."""
    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    value = config.get("max_position_embeddings") if isinstance(config, dict) else None
    return value if isinstance(value, int) and value > 0 else None


def is_published_dir(path: Path) -> bool:
    """A complete published version: an HF model directory, or a PEFT adapter directory (LoRA served as
    adapters: adapter_config.json; both are renamed into place whole)."""
    return is_model_dir(path) or (path / "adapter_config.json").is_file()


def model_digest(model_dir: Path) -> str:
    """sha256 over an HF model directory's files (relative path and content, sorted), with
    config.json's `transformers_version` left out: two machines that build the same preset from the
    same seed get the same digest unless their weights or tokenizer differ, whatever transformers
    wrote down about itself. A learner with its own run directory reports the digest of the preset it
    built; the supervisor compares it with its own before it serves anything."""
    digest = hashlib.sha256()
    for path in sorted(p for p in model_dir.rglob("*") if p.is_file()):
        rel = path.relative_to(model_dir).as_posix()
        if rel == "config.json":
            config = json.loads(path.read_text(encoding="utf-8"))
            config.pop("transformers_version", None)
            file_digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
        else:
            file_digest = hashlib.sha256()
            with open(path, "rb") as handle:
                while block := handle.read(1 << 20):
                    file_digest.update(block)
        digest.update(f"{rel}\0".encode() + file_digest.digest())
    return digest.hexdigest()


def prune_weights(weights_dir: Path, newest: int, keep: int = KEEP_WEIGHT_VERSIONS) -> list[int]:
    """Delete weights/v<k> for k <= newest - keep; returns the versions deleted."""
    deleted = []
    for child in weights_dir.iterdir() if weights_dir.is_dir() else []:
        match = _WEIGHTS_DIR.match(child.name)
        if match and int(match.group(1)) <= newest - keep:
            shutil.rmtree(child, ignore_errors=True)
            deleted.append(int(match.group(1)))
    return sorted(deleted)


# --- checkpoints: names and the `latest` pointer (their contents belong to learner.checkpoint) ----------
def checkpoint_name(step: int) -> str:
    return f"step{step}"


def checkpoint_dirs(checkpoints_dir: Path) -> list[tuple[int, Path]]:
    """Complete step dirs (state.json present), oldest first."""
    found = []
    for child in checkpoints_dir.iterdir() if checkpoints_dir.is_dir() else []:
        match = _STEP_DIR.match(child.name)
        if match and child.is_dir() and (child / CHECKPOINT_STATE).is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


def latest_checkpoint_dir(checkpoints_dir: Path) -> Path | None:
    """The step dir `latest` names; else the newest complete one; None when there is none."""
    pointer = checkpoints_dir / LATEST_CHECKPOINT
    if pointer.is_file():
        named = checkpoints_dir / pointer.read_text(encoding="utf-8").strip()
        if (named / CHECKPOINT_STATE).is_file():
            return named
    dirs = checkpoint_dirs(checkpoints_dir)
    return dirs[-1][1] if dirs else None


def published_version(checkpoint_dir: Path) -> int:
    """The newest policy version published when this checkpoint was written (0: none, or unreadable).

    Checkpoints record it under state.json's extra; those written before it was recorded fall back to
    their policy version, which then was published whenever the learner reached it."""
    try:
        state = json.loads((checkpoint_dir / CHECKPOINT_STATE).read_text(encoding="utf-8"))
        extra = state.get("extra") or {}
        version = extra.get(PUBLISHED_VERSION_KEY, state["counters"]["policy_version"])
        return max(0, int(version))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return 0


def checkpointed_version(run: RunDir) -> int:
    """The version the engines can start on: what the latest checkpoint published, if its weights are
    still on disk (0 otherwise). The learner reports the authoritative version when ready; this only
    lets the engines start in parallel with it."""
    latest = latest_checkpoint_dir(run.checkpoints)
    version = published_version(latest) if latest is not None else 0
    return version if version > 0 and is_published_dir(run.weights_of(version)) else 0


# --- locks ------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def hold_supervisor_lock(run: RunDir) -> Iterator[None]:
    """Exclusive flock on `supervisor.lock` holding this pid; RunDirInUse if another daemon holds it."""
    run.root.mkdir(parents=True, exist_ok=True)
    with open(run.root / SUPERVISOR_LOCK, "a+") as handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown"
            raise RunDirInUse(
                f"run dir {run.root} is in use by another rollwise daemon (pid {holder}); "
                "stop it first or choose another --run-dir"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        yield


def acquire_learner_lock(run: RunDir) -> int:
    """Exclusive flock on `learner.lock`, waiting while a previous learner still holds it; returns the fd
    (closing it releases the lock)."""
    run.root.mkdir(parents=True, exist_ok=True)
    path = run.root / "learner.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        log.info("another learner holds %s; waiting for it to exit", path)
        fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


# --- the consumption ledger ------------------------------------------------------------------------------
# Retention deletes old checkpoints, and with them the record of which groups each step consumed. The
# learner also appends every checkpoint's record here, *before* the checkpoint is committed, and a line
# `{"restored": s}` whenever it resumes from step s: a record appended for a checkpoint that was never
# committed is then superseded (its steps are redone). One short line per checkpoint; not pruned.


def append_consumed(path: Path, record: dict[str, object]) -> None:
    """Append one ledger line: a checkpoint's record (`step`, `consumed`, `extra`, as in its state.json)
    or `{"restored": step}`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def committed_consumption(path: Path) -> dict[int, dict[str, Any]]:
    """Checkpoint records by step, as the ledger leaves them: a `restored` line drops every record after
    the step it names, and a later record of a step replaces an earlier one. A torn last line (a kill
    mid-write) is ignored."""
    records: dict[int, dict[str, Any]] = {}
    if not path.exists():
        return records
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if not isinstance(entry, dict):
            continue
        if "restored" in entry:
            restored = int(entry["restored"])
            records = {step: r for step, r in records.items() if step <= restored}
        elif "step" in entry:
            records[int(entry["step"])] = entry
    return records
