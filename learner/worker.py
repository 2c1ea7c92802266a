"""The learner child process (docs/architecture.md, Contract 5).

    python -m learner.worker --config RUN_DIR/config.toml --run-dir RUN_DIR

Loop: tail the spool after the checkpoint's consumed_seq -> drop groups that cannot be trained ->
B accepted groups -> Trainer.step -> publish weights every `sync_every_steps` versions -> checkpoint
every `checkpoint_every` steps. One JSON object per line on stdout (flushed each); logs on stderr.

Events (stdout):
    ready       {version, step, consumed_seq, path}   path = weights of `version` (HF dir)
    dropped     {seq, group_id, reason, groups: 1}    at once, for every group that will never train;
                                                      the supervisor calls Scheduler.on_dropped(groups)
                                                      (dedupe by seq: a restarted learner re-reads
                                                      groups after its checkpoint)
    step        {step, version, groups, group_ids, consumed_seq, metrics: {...}, <the same metrics
                 flat>, staleness: {"<versions behind>": tokens}, dropped: {reason: n since the last
                 step}, skipped: {...}, idle_s, busy_s, spool_read_s, spool_depth_groups,
                 spool_depth_bytes}
                idle_s        seconds spent waiting for spool files to appear since the last step
                busy_s        seconds of this step: train, publish, checkpoint
                spool_read_s  seconds spent reading the spool since the last step: listing it,
                              reading + decoding + validating Arrow IPC files (SpoolReader.poll);
                              waiting for files is idle_s, not this
    published   {version, path}
    checkpoint  {step, path, consumed_seq, duration_s, seconds}
    quarantined {seq, file, kind, reason}               (followed by its `dropped` event)
    error       {message}
Drop reasons: stale (oldest token < v − η), too_few_members (< 2 trainable episodes), quarantined,
invalid_tokens (ids outside the model's vocabulary),
no_update (a step that changed no weight: the version did not move, so its groups count as dropped
to keep the actors' admission count `accepted = v·B + unconsumed` true).

Control (stdin): `{"cmd": "stop"}`, SIGTERM or SIGINT -> finish the current step, checkpoint, exit 0;
EOF on stdin (the parent died) -> the same. A second learner on the same run directory waits on
`learner.lock` until the first one has exited.

Retention: weights/v<k> for the last 3 published versions (older ones are deleted after the next
publish); spool files are deleted once the *oldest retained* checkpoint has consumed them, so falling
back to any checkpoint on disk still finds every group it has not trained on.
"""

from __future__ import annotations

import argparse
import collections
import fcntl
import json
import logging
import math
import os
import re
import shutil
import signal
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, SimpleNamespace
from typing import Any, TextIO

from learner.schema import Episode, batch_to_episodes
from pipeline.actors.admission import is_stale
from pipeline.config import Config, load_config
from pipeline.transport.spool import QuarantinedFile, SpoolItem, SpoolReader, prune_consumed

log = logging.getLogger("rollwise.learner")

POLL_INTERVAL_S = 0.05
KEEP_WEIGHT_VERSIONS = 3
_WEIGHTS_DIR = re.compile(r"^v(\d+)$")


class Events:
    """JSON lines on a stream, one flush per event."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self._lock = threading.Lock()

    def emit(self, event: str, **fields: Any) -> None:
        line = json.dumps({"event": event, **fields}, allow_nan=False, default=str)
        with self._lock:
            self.stream.write(line + "\n")
            self.stream.flush()


class StopFlag:
    """Set by {"cmd": "stop"}, EOF on stdin or SIGTERM; the training loop checks it between steps."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.reason = ""

    def set(self, reason: str) -> None:
        if not self.event.is_set():
            self.reason = reason
            log.info("stop requested: %s", reason)
        self.event.set()

    def is_set(self) -> bool:
        return self.event.is_set()

    def wait(self, timeout_s: float) -> bool:
        return self.event.wait(timeout_s)


def watch_stdin(stream: TextIO, stop: StopFlag, events: Events) -> None:
    """Thread body: commands on stdin; EOF means the parent is gone."""
    for line in stream:
        line = line.strip()
        if not line:
            continue
        try:
            cmd = json.loads(line).get("cmd")
        except (ValueError, AttributeError):
            events.emit("error", message=f"unreadable command on stdin: {line[:200]!r}")
            continue
        if cmd == "stop":
            stop.set("stop command")
        else:
            events.emit("error", message=f"unknown command {cmd!r} on stdin")
    stop.set("stdin closed (parent exited)")


def env_action_token_ids(cfg: Config, tokenizer: Any) -> list[int]:
    """The env's answer tokens for the action prior (learner.action_prior); [] when the prior is off.

    resolve_config already refused a prior for an env without action_hints; an env that lost them since
    (a changed plugin on resume) raises ValueError naming the key rather than training without the prior.
    """
    if cfg.learner.action_prior_coef <= 0.0:
        return []
    from envs.discovery import resolve_env
    from learner.action_prior import action_token_ids

    hints = resolve_env(cfg.env.name)(**cfg.env.options).spec.action_hints
    if not hints:
        raise ValueError(f"learner.action_prior_coef > 0 but env {cfg.env.name!r} declares no action_hints")
    return action_token_ids(tokenizer, hints)


def group_drop_reason(
    episodes: Sequence[Episode], learner_version: int, max_staleness: int, vocab_size: int | None = None
) -> str | None:
    """Why a group cannot be trained (see the module docstring), or None. Mirrors the trainer's filter:
    only valid rows of trainable episodes count, and a group needs two such episodes. Token ids outside
    the model's vocabulary (an engine serving another tokenizer) would crash every restart of the
    learner on the same group, so such a group is dropped as `invalid_tokens`."""
    if vocab_size is not None and any(t < 0 or t >= vocab_size for ep in episodes for t in ep.token_ids):
        return "invalid_tokens"
    trainable = [ep for ep in episodes if ep.trainable]
    if len({ep.episode_id for ep in trainable}) < 2:
        return "too_few_members"
    versions = [v for v in (ep.min_version() for ep in trainable) if v is not None]
    if not versions:
        return "too_few_members"
    if is_stale(min(versions), learner_version, max_staleness):
        return "stale"
    return None


def token_staleness(episodes: Sequence[Episode], learner_version: int) -> collections.Counter[int]:
    """Generated tokens of trainable rows by how many versions behind the learner they were."""
    counts: collections.Counter[int] = collections.Counter()
    for ep in episodes:
        if ep.trainable:
            for version, mask in zip(ep.versions, ep.loss_mask, strict=True):
                if mask:
                    counts[learner_version - version] += 1
    return counts


def prune_weights(weights_dir: Path, newest: int, keep: int = KEEP_WEIGHT_VERSIONS) -> list[int]:
    """Delete weights/v<k> for k <= newest - keep; returns the versions deleted."""
    deleted = []
    for child in weights_dir.iterdir() if weights_dir.is_dir() else []:
        match = _WEIGHTS_DIR.match(child.name)
        if match and int(match.group(1)) <= newest - keep:
            shutil.rmtree(child, ignore_errors=True)
            deleted.append(int(match.group(1)))
    return sorted(deleted)


@dataclass
class _Pending:
    """Groups taken since the last step: the ones to train and every seq/id consumed with them."""

    items: list[SpoolItem] = field(default_factory=list)
    episodes: list[list[Episode]] = field(default_factory=list)
    last_seq: int = 0
    dropped: collections.Counter[str] = field(default_factory=collections.Counter)
    consumed_ids: list[str] = field(default_factory=list)


class LearnerWorker:
    """State of the learner process; `run()` is the loop described in the module docstring."""

    def __init__(self, cfg: Config, run_dir: Path, events: Events, stop: StopFlag) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.events = events
        self.stop = stop
        self.spool_dir = run_dir / "spool"
        self.weights_dir = run_dir / "weights"
        self.checkpoints_dir = run_dir / "checkpoints"
        self.batch_groups = cfg.learner.batch_groups
        self.max_staleness = cfg.async_.max_staleness
        self._setup_model()
        self.reader = SpoolReader(self.spool_dir, after_seq=self.consumed_seq)
        self.queue: collections.deque[SpoolItem] = collections.deque()
        self.pending = _Pending(last_seq=self.consumed_seq)
        self.idle_s = 0.0
        self.last_checkpoint_step = self.trainer.steps
        self.consumed_since_checkpoint: list[str] = []

    # ------------------------------------------------------------------ start-up
    def _setup_model(self) -> None:
        import torch

        from learner.checkpoint import load_latest_checkpoint, restore
        from learner.model import load_policy, resolve_device
        from learner.trainer import Trainer

        torch.set_num_threads(self.cfg.learner.threads)
        device = resolve_device(self.cfg.learner.device)
        model_dir = Path(self.cfg.model.path) if self.cfg.model.path else self.run_dir / "model"
        model, self.tokenizer = load_policy(model_dir, device=device, dtype=self.cfg.learner.dtype)
        seed = getattr(self.cfg.learner, "seed", self.cfg.run.seed)
        settings: Any = SimpleNamespace(**self.cfg.learner.model_dump(), seed=seed)
        self.trainer = Trainer(
            model,
            settings,
            temperature=self.cfg.sampling.temperature,
            device=device,
            action_token_ids=env_action_token_ids(self.cfg, self.tokenizer),
        )
        embeddings = model.get_input_embeddings()
        self.vocab_size = embeddings.num_embeddings if isinstance(embeddings, torch.nn.Embedding) else None
        self.initial_model_dir = model_dir
        ckpt = load_latest_checkpoint(self.checkpoints_dir)
        self.consumed_seq = 0
        self.checkpoint_seqs: collections.deque[int] = collections.deque(
            maxlen=self.cfg.learner.keep_checkpoints
        )
        extra: dict[str, Any] = {}
        if ckpt is not None:
            restore(self.trainer, ckpt)
            self.consumed_seq = max(0, ckpt.consumed.last_seq)
            self.checkpoint_seqs.append(self.consumed_seq)
            extra = ckpt.extra
            log.info(
                "restored %s: step %d, version %d, consumed_seq %d",
                ckpt.path,
                ckpt.step,
                self.trainer.policy_version,
                self.consumed_seq,
            )
        else:
            log.info("no checkpoint in %s: starting from %s", self.checkpoints_dir, model_dir)
        self.last_published = int(extra.get("published_version", self.trainer.policy_version))

    @property
    def version(self) -> int:
        return int(self.trainer.policy_version)

    def weights_path(self, version: int) -> Path:
        return self.weights_dir / f"v{version}" if version > 0 else self.initial_model_dir

    def announce_ready(self) -> None:
        path = self.weights_path(self.version)
        if self.version > 0 and not (path / "config.json").is_file():
            # The engines must be able to load the version the learner resumes from. No "published"
            # event: the ready event names the path, and the supervisor has no engines yet.
            self.publish(announce=False)
        self.events.emit(
            "ready",
            version=self.version,
            step=self.trainer.steps,
            consumed_seq=self.consumed_seq,
            path=str(path),
        )

    # ------------------------------------------------------------------ the loop
    def run(self) -> int:
        self.announce_ready()
        while not self.stop.is_set():
            if len(self.pending.items) >= self.batch_groups:
                self.train_step()
                if self.cfg.run.max_steps is not None and self.trainer.steps >= self.cfg.run.max_steps:
                    self.stop.set("run.max_steps")  # exact: the supervisor's stop could arrive a step late
                continue
            item = self.next_item()
            if item is None:
                waited = time.monotonic()
                self.stop.wait(POLL_INTERVAL_S)
                self.idle_s += time.monotonic() - waited
                continue
            self.take(item)
        self.checkpoint_if_needed()
        log.info(
            "learner stopping (%s) at step %d, version %d", self.stop.reason, self.trainer.steps, self.version
        )
        return 0

    def next_item(self) -> SpoolItem | None:
        if not self.queue:
            items = self.reader.poll(limit=self.batch_groups)
            for bad in self.reader.drain_quarantined():  # they precede `items` in sequence order
                self.report_quarantined(bad)
            self.queue.extend(items)
        return self.queue.popleft() if self.queue else None

    def report_quarantined(self, bad: QuarantinedFile) -> None:
        self.events.emit("quarantined", seq=bad.seq, file=bad.file, kind=bad.kind, reason=bad.reason)
        self.pending.last_seq = max(self.pending.last_seq, bad.seq)
        self.drop(self.pending, bad.seq, bad.file, "quarantined")

    def drop(self, pending: _Pending, seq: int, group_id: str, reason: str) -> None:
        pending.dropped[reason] += 1
        self.events.emit("dropped", seq=seq, group_id=group_id, reason=reason, groups=1)

    def take(self, item: SpoolItem) -> None:
        episodes, rejected = batch_to_episodes(item.batch)
        if rejected:
            log.warning(
                "group %s (seq %d): %d invalid row(s), first: %s",
                item.group_id,
                item.seq,
                len(rejected),
                rejected[0].reason,
            )
        self.pending.last_seq = max(self.pending.last_seq, item.seq)
        self.pending.consumed_ids.append(item.group_id)
        reason = group_drop_reason(episodes, self.version, self.max_staleness, self.vocab_size)
        if reason is not None:
            self.drop(self.pending, item.seq, item.group_id, reason)
            return
        self.pending.items.append(item)
        self.pending.episodes.append(episodes)

    def train_step(self) -> None:
        started = time.monotonic()
        pending, self.pending = self.pending, _Pending(last_seq=self.pending.last_seq)
        version_before = self.version
        metrics = self.trainer.step([item.batch for item in pending.items])
        staleness: collections.Counter[int] = collections.Counter()
        for episodes in pending.episodes:
            staleness.update(token_staleness(episodes, version_before))
        if self.version == version_before:
            for item in pending.items:
                self.drop(pending, item.seq, item.group_id, "no_update")
        self.consumed_seq = pending.last_seq
        self.consumed_since_checkpoint.extend(pending.consumed_ids)
        published = self.version != version_before and (
            self.version - self.last_published >= self.cfg.async_.sync_every_steps
        )
        if published:
            self.publish()
        if self.trainer.steps % self.cfg.learner.checkpoint_every == 0:
            self.checkpoint()
        busy_s = time.monotonic() - started
        depth_groups, depth_bytes = self.reader.depth(self.consumed_seq)
        # JSON has no NaN/Infinity: a non-finite metric (a skipped update) is reported as null.
        flat = {k: (v if math.isfinite(v) else None) for k, v in metrics.items() if isinstance(v, float)}
        self.events.emit(
            "step",
            **flat,
            step=self.trainer.steps,
            version=self.version,
            groups=len(pending.items),
            group_ids=[item.group_id for item in pending.items],
            consumed_seq=self.consumed_seq,
            metrics=flat,
            staleness={str(k): n for k, n in sorted(staleness.items())},
            dropped=dict(pending.dropped),
            skipped={
                "zero_advantage_groups": metrics.get("skipped_zero_adv_groups", 0.0),
                "nonfinite_updates": metrics.get("skipped_steps_nonfinite", 0.0),
            },
            idle_s=self.idle_s,
            busy_s=busy_s,
            spool_read_s=self.reader.take_read_seconds(),
            spool_depth_groups=depth_groups,
            spool_depth_bytes=depth_bytes,
        )
        self.idle_s = 0.0

    # ------------------------------------------------------------------ publishing and checkpoints
    def publish(self, *, announce: bool = True) -> None:
        from learner.model import export_weights

        version = self.version
        path = export_weights(self.trainer, self.tokenizer, self.weights_path(version), version)
        self.last_published = version
        if announce:
            self.events.emit("published", version=version, path=str(path))
        prune_weights(self.weights_dir, version)

    def checkpoint(self) -> None:
        from learner.checkpoint import ConsumedState, save_checkpoint

        started = time.monotonic()
        consumed = ConsumedState(last_seq=self.consumed_seq, group_ids=list(self.consumed_since_checkpoint))
        path = save_checkpoint(
            self.checkpoints_dir,
            self.trainer,
            consumed=consumed,
            extra={"published_version": self.last_published},
            keep=self.cfg.learner.keep_checkpoints,
            tokenizer=self.tokenizer,
        )
        duration = time.monotonic() - started
        self.consumed_since_checkpoint = []
        self.last_checkpoint_step = self.trainer.steps
        self.checkpoint_seqs.append(self.consumed_seq)
        self.events.emit(
            "checkpoint",
            step=self.trainer.steps,
            path=str(path),
            consumed_seq=self.consumed_seq,
            duration_s=duration,
            seconds=duration,
        )
        if len(self.checkpoint_seqs) == self.checkpoint_seqs.maxlen:
            # The oldest checkpoint kept on disk has consumed these; nothing can need them again.
            prune_consumed(self.spool_dir, self.checkpoint_seqs[0])

    def checkpoint_if_needed(self) -> None:
        if self.trainer.steps > self.last_checkpoint_step:
            self.checkpoint()


def acquire_lock(run_dir: Path) -> int:
    """Exclusive flock on run_dir/learner.lock, waiting while a previous learner still holds it."""
    fd = os.open(run_dir / "learner.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        log.info("another learner holds %s; waiting for it to exit", run_dir / "learner.lock")
        fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m learner.worker", description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="resolved config TOML (run_dir/config.toml)")
    parser.add_argument("--run-dir", required=True, help="run directory (spool, weights, checkpoints)")
    args = parser.parse_args(list(argv) if argv is not None else None)
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s learner %(levelname)s %(message)s"
    )
    events = Events(sys.stdout)
    stop = StopFlag()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set(signal.Signals(signum).name)

    # SIGINT too: Ctrl-C reaches the whole process group, and the learner should checkpoint, not die.
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    run_dir = Path(args.run_dir)
    try:
        cfg = load_config(args.config)
        run_dir.mkdir(parents=True, exist_ok=True)
        lock_fd = acquire_lock(run_dir)
        threading.Thread(
            target=watch_stdin, args=(sys.stdin, stop, events), name="stdin", daemon=True
        ).start()
        worker = LearnerWorker(cfg, run_dir, events, stop)
        try:
            return worker.run()
        finally:
            os.close(lock_fd)
    except Exception as exc:
        log.exception("learner failed")
        events.emit("error", message=f"{type(exc).__name__}: {exc}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
