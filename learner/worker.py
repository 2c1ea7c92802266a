"""The learner process (docs/architecture.md, Contract 5).

    python -m learner.worker --config RUN_DIR/config.toml --run-dir RUN_DIR

Loop: tail the spool after the checkpoint's consumed_seq -> decode each group once and triage it (train,
or drop and say why: learner.groups) -> B trainable groups -> Trainer.step -> publish weights every
`sync_every_steps` versions -> checkpoint every `checkpoint_every` steps. It tells the supervisor what
happened as typed events (learner.events), one JSON line each on stdout; logs go to stderr.

Control (stdin): `{"cmd": "stop"}`, SIGTERM or SIGINT -> finish the current step, checkpoint, exit 0;
EOF on stdin (the parent died) -> the same. At run.max_steps it sends `finished`, checkpoints and exits 0.
A second learner on the same run directory waits on `learner.lock` until the first one has exited.

Retention: weights/v<k> for the last 3 published versions (older ones are deleted after the next
publish); spool files are deleted once the *oldest retained* checkpoint has consumed them, so falling
back to any checkpoint on disk still finds every group it has not trained on.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import TYPE_CHECKING, Any, TextIO

from learner import events
from learner.groups import TrainGroup, token_staleness, triage_group
from learner.schema import batch_to_segments
from pipeline.config import Config, load_config
from pipeline.run_dir import (
    PUBLISHED_VERSION_KEY,
    RunDir,
    acquire_learner_lock,
    is_published_dir,
    prune_weights,
    published_version,
)
from pipeline.transport.spool import QuarantinedFile, SpoolItem, SpoolReader, prune_consumed

if TYPE_CHECKING:
    from learner.lora import LoraPolicy

log = logging.getLogger("rollwise.learner")

POLL_INTERVAL_S = 0.05


class EventStream:
    """Typed events as JSON lines on a stream, one flush per event (the stdin thread writes too)."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self._lock = threading.Lock()

    def emit(self, event: events.LearnerEvent) -> None:
        line = events.encode(event)
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


def watch_stdin(stream: TextIO, stop: StopFlag, out: EventStream) -> None:
    """Thread body: commands on stdin; EOF means the parent is gone."""
    for line in stream:
        line = line.strip()
        if not line:
            continue
        try:
            cmd = json.loads(line).get("cmd")
        except (ValueError, AttributeError):
            out.emit(events.Error(f"unreadable command on stdin: {line[:200]!r}"))
            continue
        if cmd == "stop":
            stop.set("stop command")
        else:
            out.emit(events.Error(f"unknown command {cmd!r} on stdin"))
    stop.set("stdin closed (parent exited)")


def env_action_token_ids(cfg: Config, tokenizer: Any) -> list[int]:
    """The env's answer tokens for the action prior (learner.action_prior); [] when the prior is off.

    `rollwise run` already refused a prior for an env without action_hints; an env that lost them since
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


@dataclass
class _Pending:
    """Groups taken since the last step: the ones to train and every seq/id consumed with them."""

    items: list[tuple[SpoolItem, TrainGroup]] = field(default_factory=list)
    last_seq: int = 0
    consumed_ids: list[str] = field(default_factory=list)


class LearnerWorker:
    """State of the learner process; `run()` is the loop described in the module docstring."""

    def __init__(self, cfg: Config, run: RunDir, out: EventStream, stop: StopFlag) -> None:
        self.cfg = cfg
        self.run_dir = run
        self.out = out
        self.stop = stop
        self.batch_groups = cfg.learner.batch_groups
        self._setup_model()
        self.reader = SpoolReader(run.spool, after_seq=self.consumed_seq)
        self.queue: collections.deque[SpoolItem] = collections.deque()
        self.pending = _Pending(last_seq=self.consumed_seq)
        self.idle_s = 0.0
        self.last_checkpoint_step = self.trainer.steps
        self.consumed_since_checkpoint: list[str] = []
        self.probe: list[int] = []  # the served-policy check's probe (learner.served_probe)

    # ------------------------------------------------------------------ start-up
    def _setup_model(self) -> None:
        import torch

        from learner.checkpoint import load_latest_checkpoint, restore
        from learner.model import load_policy, resolve_device
        from learner.precision import resolve_precision
        from learner.trainer import Trainer

        cfg = self.cfg
        torch.set_num_threads(cfg.learner.threads)
        device = resolve_device(cfg.learner.device)
        precision = resolve_precision(cfg.learner.precision, device)
        model, self.tokenizer = load_policy(
            self.run_dir.initial_model, device=device, dtype=precision.param_dtype_name
        )
        self.lora: LoraPolicy | None = None
        if cfg.learner.lora.enabled:
            from learner.lora import apply_lora

            # The base stays the initial model; only the adapter trains, is checkpointed and published.
            self.lora = apply_lora(model, cfg.learner.lora, seed=cfg.run.seed)
            model = self.lora.model
        reference = None
        if cfg.learner.kl_coef > 0.0:
            # The initial weights, frozen; in bf16 when the compute is (it runs under the same autocast).
            dtype = "bfloat16" if precision.autocast_dtype is not None else precision.param_dtype_name
            reference, _ = load_policy(self.run_dir.initial_model, device=device, dtype=dtype)
        self.trainer = Trainer(
            model,
            cfg.learner,
            temperature=cfg.sampling.temperature,
            seed=cfg.run.seed,
            device=device,
            action_token_ids=env_action_token_ids(cfg, self.tokenizer),
            reference=reference,
        )
        embeddings = model.get_input_embeddings()
        self.vocab_size = embeddings.num_embeddings if isinstance(embeddings, torch.nn.Embedding) else None
        ckpt = load_latest_checkpoint(self.run_dir.checkpoints)
        self.consumed_seq = 0
        self.checkpoint_seqs: collections.deque[int] = collections.deque(maxlen=cfg.learner.keep_checkpoints)
        self.last_published = 0
        if ckpt is not None:
            restore(self.trainer, ckpt, adapter=self.lora)
            self.consumed_seq = max(0, ckpt.consumed.last_seq)
            self.checkpoint_seqs.append(self.consumed_seq)
            self.last_published = published_version(ckpt.path)
            log.info(
                "restored %s: step %d, version %d, consumed_seq %d",
                ckpt.path,
                ckpt.step,
                self.trainer.policy_version,
                self.consumed_seq,
            )
        else:
            log.info(
                "no checkpoint in %s: starting from %s", self.run_dir.checkpoints, self.run_dir.initial_model
            )

    @property
    def version(self) -> int:
        return int(self.trainer.policy_version)

    def announce_ready(self) -> None:
        path = self.run_dir.weights_of(self.version)
        if self.version > 0 and not is_published_dir(path):
            # The engines must be able to load the version the learner resumes from. No "published"
            # event: the ready event names the path, and the supervisor has no engines yet.
            self.publish(announce=False)
        self.out.emit(
            events.Ready(
                version=self.version, step=self.trainer.steps, consumed_seq=self.consumed_seq, path=str(path)
            )
        )

    # ------------------------------------------------------------------ the loop
    def run(self) -> int:
        self.announce_ready()
        max_steps = self.cfg.run.max_steps
        while not self.stop.is_set():
            if max_steps is not None and self.trainer.steps >= max_steps:
                # The one place run.max_steps is checked: exact here, and the daemon stops on this event.
                self.out.emit(events.Finished(step=self.trainer.steps, reason=f"run.max_steps = {max_steps}"))
                self.stop.set("run.max_steps")
                break
            if len(self.pending.items) >= self.batch_groups:
                self.train_step()
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
        self.out.emit(events.Quarantined(seq=bad.seq, file=bad.file, kind=bad.kind, reason=bad.reason))
        self.pending.last_seq = max(self.pending.last_seq, bad.seq)
        self.drop(bad.seq, bad.file, "quarantined")

    def drop(self, seq: int, group_id: str, reason: str) -> None:
        self.out.emit(events.Dropped(seq=seq, group_id=group_id, reason=reason))

    def take(self, item: SpoolItem) -> None:
        """Decode and validate the group once, then train it or drop it (learner.groups.triage_group)."""
        rows, rejected = batch_to_segments(item.batch)
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
        verdict = triage_group(
            item.group_id,
            rows,
            learner_version=self.version,
            max_staleness=self.cfg.async_.max_staleness,
            rejected=rejected,
            vocab_size=self.vocab_size,
        )
        if isinstance(verdict, str):
            self.drop(item.seq, item.group_id, verdict)
        else:
            self.pending.items.append((item, verdict))

    def train_step(self) -> None:
        started = time.monotonic()
        pending, self.pending = self.pending, _Pending(last_seq=self.pending.last_seq)
        groups = [group for _, group in pending.items]
        version_before = self.version
        metrics = self.trainer.step(groups)
        updated = self.version != version_before
        if not updated:
            # Keeps the actors' admission count `accepted = v·B + unconsumed` true.
            for item, _ in pending.items:
                self.drop(item.seq, item.group_id, "no_update")
        self.consumed_seq = pending.last_seq
        self.consumed_since_checkpoint.extend(pending.consumed_ids)
        if updated and self.cfg.async_.served_check.enabled:
            from learner.served_probe import probe_ids

            self.probe = probe_ids(groups, self.cfg.async_.served_check.probe_tokens)
        if updated and self.version - self.last_published >= self.cfg.async_.sync_every_steps:
            self.publish()
        if self.trainer.steps % self.cfg.learner.checkpoint_every == 0:
            self.checkpoint()
        depth_groups, depth_bytes = self.reader.depth(self.consumed_seq)
        self.out.emit(
            events.Step(
                step=self.trainer.steps,
                version=self.version,
                groups=len(groups) if updated else 0,
                group_ids=[item.group_id for item, _ in pending.items],
                consumed_seq=self.consumed_seq,
                metrics={k: events.finite_or_none(v) for k, v in metrics.items()},
                staleness=dict(sorted(token_staleness(groups, version_before).items())),
                idle_s=self.idle_s,
                busy_s=time.monotonic() - started,
                spool_read_s=self.reader.take_read_seconds(),
                spool_depth_groups=depth_groups,
                spool_depth_bytes=depth_bytes,
            )
        )
        self.idle_s = 0.0

    # ------------------------------------------------------------------ publishing and checkpoints
    def publish(self, *, announce: bool = True) -> None:
        """Write `weights/v<version>`: HF weights, or with LoRA the PEFT adapter (serving "adapter") or
        the merged weights (serving "merged"); then announce it with the served-policy probe."""
        from learner.lora import directory_bytes
        from learner.model import export_weights
        from learner.served_probe import probe_logprobs

        version = self.version
        target = self.run_dir.weights_of(version)
        if self.lora is None:
            path = export_weights(self.trainer, self.tokenizer, target, version)
        elif self.cfg.learner.lora.serving == "adapter":
            path = self.lora.publish_adapter(target, version)
        else:
            path = self.lora.publish_merged(target, self.tokenizer, version)
        self.last_published = version
        if announce:
            logprobs = probe_logprobs(self.trainer.model, self.probe) if self.probe else []
            self.out.emit(
                events.Published(
                    version=version,
                    path=str(path),
                    bytes=directory_bytes(path),
                    probe_ids=list(self.probe) if logprobs else [],
                    probe_logprobs=logprobs,
                )
            )
        prune_weights(self.run_dir.weights, version)

    def checkpoint(self) -> None:
        from learner.checkpoint import ConsumedState, save_checkpoint

        started = time.monotonic()
        consumed = ConsumedState(last_seq=self.consumed_seq, group_ids=list(self.consumed_since_checkpoint))
        path = save_checkpoint(
            self.run_dir.checkpoints,
            self.trainer,
            consumed=consumed,
            extra={PUBLISHED_VERSION_KEY: self.last_published},
            keep=self.cfg.learner.keep_checkpoints,
            tokenizer=self.tokenizer,
            adapter=self.lora,
        )
        self.consumed_since_checkpoint = []
        self.last_checkpoint_step = self.trainer.steps
        self.checkpoint_seqs.append(self.consumed_seq)
        self.out.emit(
            events.CheckpointSaved(
                step=self.trainer.steps,
                path=str(path),
                consumed_seq=self.consumed_seq,
                seconds=time.monotonic() - started,
            )
        )
        if len(self.checkpoint_seqs) == self.checkpoint_seqs.maxlen:
            # The oldest checkpoint kept on disk has consumed these; nothing can need them again.
            prune_consumed(self.run_dir.spool, self.checkpoint_seqs[0])

    def checkpoint_if_needed(self) -> None:
        if self.trainer.steps > self.last_checkpoint_step:
            self.checkpoint()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m learner.worker", description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="resolved config TOML (run_dir/config.toml)")
    parser.add_argument("--run-dir", required=True, help="run directory (spool, weights, checkpoints)")
    args = parser.parse_args(list(argv) if argv is not None else None)
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s learner %(levelname)s %(message)s"
    )
    out = EventStream(sys.stdout)
    stop = StopFlag()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set(signal.Signals(signum).name)

    # SIGINT too: Ctrl-C reaches the whole process group, and the learner should checkpoint, not die.
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        cfg = load_config(args.config)
        run = RunDir.at(args.run_dir, cfg.model.path)
        lock_fd = acquire_learner_lock(run)
        threading.Thread(target=watch_stdin, args=(sys.stdin, stop, out), name="stdin", daemon=True).start()
        worker = LearnerWorker(cfg, run, out, stop)
        try:
            return worker.run()
        finally:
            os.close(lock_fd)
    except Exception as exc:
        log.exception("learner failed")
        out.emit(events.Error(f"{type(exc).__name__}: {exc}"))
        return 1


if __name__ == "__main__":
    sys.exit(main())
