"""The learner process's shell: arguments, logging, signals, stdin commands and its own run directory;
it builds the LearnerWorker (learner.process.loop) and runs it.

    python -m learner.process --config RUN_DIR/config.toml --run-dir RUN_DIR
    python -m learner.process --config - --run-dir LEARNER_DIR        (its own run directory)

It tells the supervisor what happened as typed events (pipeline.contracts.events), one JSON line each on
stdout; logs go to stderr.

Control (stdin): `{"cmd": "stop"}`, SIGTERM or SIGINT -> finish the current step, checkpoint, exit 0;
EOF on stdin (the parent died) -> the same. A second learner on the same run directory waits on
`learner.lock` until the first one has exited.

Its own run directory (learner.remote.run_dir, a learner on another machine): started with `--config -`,
it reads the resolved config (and the secrets it needs) as the first line on stdin, writes it to its own
run directory, builds the preset there when model.path is unset, reads the spool over Flight
(learner.remote.spool_url) and serves its published versions over HTTP (learner.remote.weights_host/port);
its `ready` and `published` events say where (weights_url), and `ready` carries the preset's digest.
Checkpoints stay on its disk.

Several ranks (learner.distributed.nproc x learner.distributed.nnodes > 1, started by torchrun): rank 0 alone
reads stdin and writes events; the others follow it (learner.process.group). A rank that dies takes the
learner down (torchrun stops the others); the supervisor restarts it from the last checkpoint.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, TextIO

from learner.distributed import follow_launcher, quiet_stdout, rank_environment
from learner.process.group import join_group
from learner.process.loop import LearnerWorker
from pipeline.contracts import events, memory_trace, tracing
from pipeline.contracts.config import (
    Config,
    ConfigError,
    config_from_toml,
    load_config,
    reveal,
    set_secret,
    write_resolved,
)
from pipeline.contracts.kernel_caches import bound_kernel_caches
from pipeline.contracts.run_dir import RunDir, acquire_learner_lock, model_digest

if TYPE_CHECKING:
    from pipeline.transport.weights_http import WeightServerThread

log = logging.getLogger("rollwise.learner")


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


def deliver_signals(signums: Sequence[signal.Signals], on_signal: Callable[[str], None]) -> None:
    """Call `on_signal(name)` from a thread for each of `signums` (call from the main thread).

    Python runs a signal handler in the main thread between two bytecodes, possibly while that thread
    holds a lock the handler needs: `threading.Event.set` on the StopFlag that `Event.wait` holds a
    moment before and after each poll, or logging's. Taking it there deadlocks the learner for good.
    So the handler does nothing; the interpreter's C handler writes the signal number to the wakeup
    fd, and a daemon thread reads it and calls `on_signal` with no lock held.
    """
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)  # set_wakeup_fd requires it: the C handler must never block
    for signum in signums:
        signal.signal(signum, _note_signal)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    wanted = {int(s) for s in signums}

    def relay() -> None:
        while True:
            for number in os.read(read_fd, 64):
                if number in wanted:
                    on_signal(signal.Signals(number).name)

    threading.Thread(target=relay, name="signals", daemon=True).start()


def _note_signal(signum: int, frame: FrameType | None) -> None:
    """Installed so the signal is caught (and written to the wakeup fd) rather than fatal; the work is
    in deliver_signals' thread."""


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


# The first stdin line of a learner started with `--config -` (a learner with its own run directory):
# {"cmd": "config", "toml": <the resolved config, no secrets>, "secrets": {"transport.token": ...}}.
CONFIG_COMMAND = "config"


def receive_config(stream: TextIO) -> Config:
    """The config the supervisor sends as the first line on stdin (`--config -`): the resolved TOML it
    writes into its own run directory, and the secrets this learner needs, which never touch a disk or a
    command line. ConfigError naming what is wrong."""
    line = stream.readline()
    if not line.strip():
        raise ConfigError("--config -: stdin closed before the supervisor sent the config")
    try:
        message = json.loads(line)
    except ValueError as exc:
        raise ConfigError(f"--config -: the first stdin line is not JSON: {exc}") from None
    if not isinstance(message, dict) or message.get("cmd") != CONFIG_COMMAND:
        raise ConfigError(f"--config -: expected a {CONFIG_COMMAND!r} command first, got {line[:80]!r}")
    text, secrets = message.get("toml"), message.get("secrets") or {}
    if not isinstance(text, str) or not isinstance(secrets, dict):
        raise ConfigError("--config -: the config command needs 'toml' (a string) and 'secrets' (an object)")
    cfg = config_from_toml(text, what="the config received on stdin")
    for key, value in secrets.items():
        if not isinstance(value, str):
            raise ConfigError(f"--config -: secret {key} must be a string")
        try:
            set_secret(cfg, str(key), value)
        except (ValueError, AttributeError) as exc:
            raise ConfigError(f"--config -: {exc}") from None
    return cfg


@dataclass
class OwnRunDir:
    """What a learner with its own run directory (learner.remote.run_dir) sets up before it loads the model:
    its copy of the config, the preset (built here, deterministically; its digest goes to the supervisor)
    and the weight server the supervisor fetches published versions from."""

    server: WeightServerThread
    weights_url: str
    initial_model_digest: str | None

    @staticmethod
    def open(cfg: Config, run: RunDir) -> OwnRunDir:
        from learner.model.model_init import ensure_model
        from pipeline.contracts.config import learner_tls
        from pipeline.contracts.tls import check_files, context_for
        from pipeline.transport.weights_http import WeightServerThread, advertised_url

        write_resolved(cfg, run.root)  # what this learner runs with, secrets left out
        digest = None
        if cfg.model.path is None:
            ensure_model(run.initial_model, preset=cfg.model.preset, seed=cfg.run.seed)
            digest = model_digest(run.initial_model)
        remote = cfg.learner.remote
        tls = learner_tls(cfg)
        check_files(tls, "learner.remote.tls (or tls)")  # paths on this machine: checked here
        context = context_for(remote.weights_host, tls)
        server = WeightServerThread(
            run.weights_of,
            remote.weights_host,
            remote.weights_port,
            reveal(remote.weights_token),
            what="the learner's weight server",
            ssl_context=context,
        )
        port = server.start()
        scheme = "https" if context is not None else "http"
        url = remote.weights_url or advertised_url(remote.weights_host, port, scheme)
        log.info("own run directory %s; published weights served at %s", run.root, url)
        return OwnRunDir(server, url, digest)


def _arguments(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m learner.process", description="The learner process.")
    parser.add_argument(
        "--config",
        required=True,
        help="resolved config TOML (run_dir/config.toml), or - to receive it as the first line on stdin",
    )
    parser.add_argument("--run-dir", required=True, help="run directory (spool, weights, checkpoints)")
    return parser.parse_args(list(argv) if argv is not None else None)


def _set_up_process() -> int:
    """Logging, a rank's ties to its launcher, memory tracing and kernel caches; returns this rank."""
    launched = rank_environment()
    rank = launched[0] if launched is not None else 0
    name = "learner" if launched is None or launched[1] == 1 else f"learner[{rank}]"
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format=f"%(asctime)s {name} %(levelname)s %(message)s"
    )
    if launched is not None:
        follow_launcher()
    if rank != 0:
        quiet_stdout()
    memory_trace.start_from_env(name)
    bound_kernel_caches()  # before the first matmul: micro-batches come in ever new token counts
    return rank


def _on_signal(rank: int, stop: StopFlag, name: str) -> None:
    if rank == 0:
        stop.set(name)
    else:  # rank 0 decides when to stop (and checkpoints with everyone first)
        log.info("rank %d: %s noted; waiting for rank 0", rank, name)


def main(argv: Sequence[str] | None = None) -> int:
    args = _arguments(argv)
    rank = _set_up_process()
    out = EventStream(sys.stdout)
    stop = StopFlag()
    # SIGINT too: Ctrl-C reaches the whole process group, and the learner should checkpoint, not die.
    deliver_signals((signal.SIGTERM, signal.SIGINT), functools.partial(_on_signal, rank, stop))
    own: OwnRunDir | None = None
    try:
        cfg = receive_config(sys.stdin) if args.config == "-" else load_config(args.config)
        if rank == 0:
            tracing.configure(cfg.tracing, process="learner")
        run = RunDir.at(args.run_dir, cfg.model.path)
        lock_fd = acquire_learner_lock(run) if rank == 0 else None
        if cfg.learner.remote.run_dir is not None and rank == 0:
            own = OwnRunDir.open(cfg, run)
        group = join_group(cfg.learner.world_size, cfg.learner.device)
        if rank == 0:
            threading.Thread(
                target=watch_stdin, args=(sys.stdin, stop, out), name="stdin", daemon=True
            ).start()
        worker = LearnerWorker(
            cfg,
            run,
            out,
            stop,
            group,
            weights_url=own.weights_url if own else None,
            initial_model_digest=own.initial_model_digest if own else None,
        )
        try:
            code = worker.run() if group.leader else worker.follow()
        finally:
            if own is not None:  # the port is free before the next learner may take the lock
                own.server.stop()
            if lock_fd is not None:
                os.close(lock_fd)
        group.leave()  # after a failure torchrun ends the other ranks instead
        return code
    except Exception as exc:
        log.exception("learner failed")
        if rank == 0:
            out.emit(events.Error(f"{type(exc).__name__}: {exc}"))
        return 1
    finally:
        if own is not None:
            own.server.stop()
        tracing.shutdown()
