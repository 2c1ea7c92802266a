"""The learner child process: events, publishing, checkpoints, drops, stop paths and crash resume.

The worker runs as a real subprocess on a temporary run directory with a tiny model; groups are
written with the real SpoolWriter. Episodes are synthetic but valid: prompt tokens, three generated
tokens with plausible negative log-probs, and outcomes that differ within the group (a learning signal,
so every step changes the weights and bumps the version).
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from learner.policy_setup import env_action_token_ids
from pipeline.contracts.config import load_config
from pipeline.contracts.run_dir import RunDir, acquire_learner_lock
from pipeline.contracts.schema import segments_to_batch
from pipeline.transport.spool import SpoolWriter, spool_name
from tests.helpers.train_groups import one_turn_row

B = 2


def write_group(
    spool: SpoolWriter, group_id: str, version: int, members: int = 2, outcome: float | None = None
) -> int:
    batch = segments_to_batch([one_turn_row(group_id, i, version, outcome=outcome) for i in range(members)])
    return spool.write_group(batch, group_id=group_id).seq


# ---------------------------------------------------------------------------------------------- unit
def test_env_action_token_ids_come_from_the_env_spec_only_when_the_prior_is_on(tiny_model_dir: Path) -> None:
    from learner.model.model_io import load_policy

    _, tokenizer = load_policy(tiny_model_dir)
    off = load_config(None, [])
    assert env_action_token_ids(off, tokenizer) == []
    narrow = load_config(
        None, ["learner.regularizers.action_prior_coef=0.2", "env.options={low = 1, high = 4}"]
    )
    ids = env_action_token_ids(narrow, tokenizer)
    assert sorted(str(tokenizer.decode([t])).strip() for t in ids) == ["1", "1", "2", "2", "3", "3", "4", "4"]
    no_hints = load_config(None, ["learner.regularizers.action_prior_coef=0.2", "env.name='word-guess'"])
    with pytest.raises(ValueError, match="declares no action_hints"):
        env_action_token_ids(no_hints, tokenizer)


# A SIGTERM at the moment the main thread holds the StopFlag's lock (Event.wait holds it briefly around
# each 50 ms poll): a handler that set the flag itself would wait on its own thread forever.
SIGNAL_INSIDE_THE_LOCK = """
import os, signal, sys
from learner.process.shell import StopFlag, deliver_signals
stop = StopFlag()
deliver_signals((signal.SIGTERM, signal.SIGINT), stop.set)
with stop.event._cond:  # private: the lock Event.wait holds
    os.kill(os.getpid(), signal.SIGTERM)
    for _ in range(100_000):  # bytecodes: the Python-level handler runs among them
        pass
    assert not stop.is_set()  # the relay thread waits for the lock, as it should
print(stop.wait(10), stop.reason)
"""


def test_a_signal_while_the_stop_flag_is_locked_still_stops_the_learner() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SIGNAL_INSIDE_THE_LOCK], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "SIGTERM"]


def test_second_learner_waits_for_the_lock(tmp_path: Path) -> None:
    run = RunDir.at(tmp_path)
    first = acquire_learner_lock(run)
    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(acquire_learner_lock(run)))
    waiter.start()
    time.sleep(0.2)
    assert got == []
    os.close(first)
    waiter.join(timeout=5)
    assert len(got) == 1
    os.close(got[0])


# ---------------------------------------------------------------------------------- subprocess runs
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from learner.model.model_init import init_model

    return init_model(tmp_path_factory.mktemp("model") / "tiny", "tiny", 0)


CONFIG = """
[env]
group_size = 2
[learner]
batch_groups = {batch}
mini_batches = 1
checkpoint_every = 2
keep_checkpoints = 2
device = "cpu"
[learner.optim]
lr = 0.01
[async]
max_staleness = {eta}
sync_every_steps = 1
"""


def make_run_dir(root: Path, model: Path, eta: int = 0) -> Path:
    run_dir = root / "run"
    shutil.copytree(model, run_dir / "model")
    (run_dir / "config.toml").write_text(CONFIG.format(batch=B, eta=eta))
    return run_dir


# The learner with every weight write taking `delay` seconds longer (a slow disk or a large model): the
# module function export_weights calls is replaced before the worker imports it.
SLOW_EXPORT = """
import sys, time
import learner.model.model_io

write = learner.model.model_io.save_hf
def slow(*args, **kwargs):
    time.sleep({delay})
    return write(*args, **kwargs)
learner.model.model_io.save_hf = slow
from learner.process.shell import main
sys.exit(main())
"""


class Worker:
    """A learner subprocess with its events collected by a reader thread."""

    def __init__(self, run_dir: Path, *, export_delay_s: float = 0.0) -> None:
        self.stderr = open(run_dir / f"learner-{time.monotonic_ns()}.log", "wb")  # noqa: SIM115
        launch = (
            ["-c", SLOW_EXPORT.format(delay=export_delay_s)] if export_delay_s else ["-m", "learner.process"]
        )
        self.proc = subprocess.Popen(
            [
                sys.executable,
                *launch,
                "--config",
                str(run_dir / "config.toml"),
                "--run-dir",
                str(run_dir),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        self.events: list[dict[str, Any]] = []
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._queue.put(json.loads(line))
        self._queue.put(None)

    def wait_for(self, match: Callable[[dict[str, Any]], bool], timeout_s: float = 120.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        for event in self.events:
            if match(event):
                return event
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no matching event; got {self.events}")
            received = self._queue.get(timeout=remaining)
            if received is None:
                raise EOFError(f"worker exited ({self.proc.wait()}) without the event; got {self.events}")
            self.events.append(received)
            if match(received):
                return received

    def send(self, obj: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def finish(self, timeout_s: float = 120.0) -> int:
        code = self.proc.wait(timeout=timeout_s)
        self._reader.join(timeout=5)
        while not self._queue.empty():
            event = self._queue.get_nowait()
            if event is not None:
                self.events.append(event)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()
        self.stderr.close()
        return code

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == kind]


@pytest.fixture
def workers() -> Iterator[list[Worker]]:
    started: list[Worker] = []
    yield started
    for w in started:
        if w.proc.poll() is None:
            w.proc.kill()
            w.finish()


def event_is(kind: str, **fields: Any) -> Callable[[dict[str, Any]], bool]:
    return lambda e: e["event"] == kind and all(e.get(k) == v for k, v in fields.items())


@pytest.mark.integration
def test_worker_trains_publishes_checkpoints_and_drops(
    tmp_path: Path, tiny_model: Path, workers: list[Worker]
) -> None:
    from learner.model.model_io import VERSION_FILE, load_policy
    from learner.process.checkpoint_state import load_latest_checkpoint

    run_dir = make_run_dir(tmp_path, tiny_model, eta=0)
    spool = SpoolWriter(run_dir / "spool")
    for k in range(2 * B):
        write_group(spool, f"g{k}", version=k // B)
    w = Worker(run_dir)
    workers.append(w)
    ready = w.wait_for(event_is("ready"))
    assert (ready["version"], ready["step"], ready["consumed_seq"]) == (0, 0, 0)
    step2 = w.wait_for(event_is("step", step=2))
    ckpt = w.wait_for(event_is("checkpoint", step=2))
    step1 = w.of("step")[0]
    assert (step1["version"], step1["groups"], step1["group_ids"]) == (1, B, ["g0", "g1"])
    assert (step2["version"], step2["group_ids"], step2["consumed_seq"]) == (2, ["g2", "g3"], 4)
    assert step2["staleness"] == {"0": 2 * 3 * B}
    # none of it accrued anywhere: these groups were generated by the version that trains them
    assert step2["staleness_in_flight"] == step2["staleness_in_queue"] == {"0": 2 * 3 * B}
    assert step2["metrics"]["optimizer_updates"] >= 1.0
    assert "loss" in step2["metrics"] and "loss" not in step2  # each value sent once
    # reading + decoding the spool files is reported per step, apart from waiting for them (idle_s)
    for step in (step1, step2):
        assert isinstance(step["spool_read_s"], float) and 0.0 < step["spool_read_s"] < 10.0
    assert [(e["version"], e["path"]) for e in w.of("published")] == [
        (1, str(run_dir / "weights" / "v1")),
        (2, str(run_dir / "weights" / "v2")),
    ]
    assert ckpt["consumed_seq"] == 4

    # drops: a stale group (generated at version 0, learner at 2, η = 0), one with a single member,
    # and a corrupt file, each reported at once
    write_group(spool, "old", version=0)
    write_group(spool, "lonely", version=2, members=1)
    (run_dir / "spool" / spool_name(7)).write_bytes(b"not arrow")
    spool.next_seq = 8  # the corrupt file bypassed the writer; it must not reuse 7
    w.wait_for(event_is("dropped", seq=7))
    w.wait_for(event_is("dropped", seq=6))
    # in seq order: the learner reads ahead, and reports a quarantined file when its read reaches it
    # each with its trainable rows' generated tokens (3 per member; a quarantined file's are unknown)
    dropped = sorted((e["seq"], e["group_id"], e["reason"], e["tokens"]) for e in w.of("dropped"))
    assert dropped == [
        (5, "old", "stale", 6),
        (6, "lonely", "too_few_members", 3),
        (7, spool_name(7), "quarantined", 0),
    ]
    [quarantined] = w.of("quarantined")
    assert (quarantined["seq"], quarantined["kind"]) == (7, "unreadable")

    # groups without signal (every member scored the same): the step changes no weight, the version
    # stays, and its groups are reported dropped so the actors' admission count stays exact
    write_group(spool, "flat-a", version=2, outcome=1.0)
    write_group(spool, "flat-b", version=2, outcome=1.0)
    step3 = w.wait_for(event_is("step", step=3))
    assert (step3["version"], step3["group_ids"], step3["consumed_seq"]) == (2, ["flat-a", "flat-b"], 9)
    assert step3["groups"] == 0  # trained into no weights: announced as dropped instead
    assert [(e["group_id"], e["reason"], e["tokens"]) for e in w.of("dropped")][-2:] == [
        ("flat-a", "no_update", 6),
        ("flat-b", "no_update", 6),
    ]
    assert len(w.of("published")) == 2

    # closing stdin = the parent died: checkpoint the step taken since the last checkpoint, and exit
    assert w.proc.stdin is not None
    w.proc.stdin.close()
    assert w.finish() == 0
    assert [e["step"] for e in w.of("checkpoint")] == [2, 3]

    weights = run_dir / "weights" / "v2"
    assert json.loads((weights / VERSION_FILE).read_text()) == {"policy_version": 2}
    model, tokenizer = load_policy(weights)
    assert model.config.vocab_size == len(tokenizer)
    latest = load_latest_checkpoint(run_dir / "checkpoints")
    assert latest is not None
    assert (latest.step, latest.consumed.last_seq) == (3, 9)
    assert latest.consumed.group_ids == ["old", "lonely", "flat-a", "flat-b"]
    # the ledger: of the groups consumed since the previous checkpoint, which were dropped and why
    assert latest.extra["dropped_groups"] == {
        "old": "stale",
        "lonely": "too_few_members",
        "flat-a": "no_update",
        "flat-b": "no_update",
    }
    # retention: the oldest kept checkpoint (step 2) consumed seqs 1..4, so their files are gone
    assert sorted(p.name for p in (run_dir / "spool").glob("*.arrow")) == [
        spool_name(s) for s in (5, 6, 8, 9)
    ]


@pytest.mark.integration
@pytest.mark.parametrize("background", [True, False])
def test_a_slow_weight_write_overlaps_the_next_step_and_every_version_is_published_in_order(
    tmp_path: Path, tiny_model: Path, workers: list[Worker], background: bool
) -> None:
    """Each weight write takes 3 s more. In the background the step that publishes version 1 ends without
    waiting for the write (its busy time stays far below 3 s, with room for a loaded machine); the next
    publish waits for it, so versions 1, 2, 3 are published in that order, none skipped, and a stop
    finishes the write in flight: the last checkpoint records version 3. Inline (export_in_background =
    false) the step holds the write."""
    from learner.model.model_io import VERSION_FILE

    run_dir = make_run_dir(tmp_path, tiny_model, eta=0)
    config = run_dir / "config.toml"
    config.write_text(
        config.read_text().replace(
            "checkpoint_every = 2",
            f"checkpoint_every = 10\nexport_in_background = {str(background).lower()}",
        )
    )
    spool = SpoolWriter(run_dir / "spool")
    for k in range(3 * B):
        write_group(spool, f"g{k}", version=k // B)
    w = Worker(run_dir, export_delay_s=3.0)
    workers.append(w)
    w.wait_for(event_is("step", step=3))
    assert w.proc.stdin is not None
    w.proc.stdin.close()  # stop: the version in flight is written and announced first
    assert w.finish() == 0
    published = [e["version"] for e in w.of("published")]
    assert published == [1, 2, 3]
    step1 = w.of("step")[0]
    if background:
        assert step1["busy_s"] < 2.0
    else:
        assert step1["busy_s"] >= 3.0
    for version in published:
        assert json.loads((run_dir / "weights" / f"v{version}" / VERSION_FILE).read_text()) == {
            "policy_version": version
        }
    [ckpt] = w.of("checkpoint")
    assert ckpt["step"] == 3
    assert (
        json.loads((run_dir / "checkpoints" / "step3" / "state.json").read_text())["extra"][
            "published_version"
        ]
        == 3
    )


@pytest.mark.integration
def test_the_last_version_is_announced_before_the_learner_says_it_finished(
    tmp_path: Path, tiny_model: Path, workers: list[Worker]
) -> None:
    """The daemon stops on `finished` (run.max_steps): a version still being written in the background is
    announced first, or the engines would never load it. The step's checkpoint (checkpoint_every = 2) waits
    for that write too, so it records version 2 as published: a resumed run's engines start on the version
    the learner resumes from instead of syncing it again."""
    run_dir = make_run_dir(tmp_path, tiny_model, eta=0)
    config = run_dir / "config.toml"
    config.write_text("[run]\nmax_steps = 2\n" + config.read_text())
    spool = SpoolWriter(run_dir / "spool")
    for k in range(2 * B):
        write_group(spool, f"g{k}", version=k // B)
    w = Worker(run_dir, export_delay_s=1.5)
    workers.append(w)
    w.wait_for(event_is("finished"))
    kinds = [(e["event"], e.get("version")) for e in w.events]
    assert kinds.index(("published", 2)) < kinds.index(("finished", None))
    assert w.finish() == 0
    [ckpt] = w.of("checkpoint")
    assert ckpt["step"] == 2
    state = json.loads((run_dir / "checkpoints" / "step2" / "state.json").read_text())
    assert state["extra"]["published_version"] == 2


@pytest.mark.integration
@pytest.mark.slow
def test_kill_minus_nine_resumes_from_the_last_checkpoint(
    tmp_path: Path, tiny_model: Path, workers: list[Worker]
) -> None:
    run_dir = make_run_dir(tmp_path, tiny_model, eta=0)
    spool = SpoolWriter(run_dir / "spool")
    for k in range(3 * B):
        write_group(spool, f"g{k}", version=k // B)
    first = Worker(run_dir)
    workers.append(first)
    first.wait_for(event_is("step", step=3))
    assert [e["step"] for e in first.of("checkpoint")] == [2]
    first.proc.send_signal(signal.SIGKILL)
    assert first.finish() == -signal.SIGKILL
    trained_first = {e["step"]: e["group_ids"] for e in first.of("step")}

    second = Worker(run_dir)
    workers.append(second)
    ready = second.wait_for(event_is("ready"))
    assert (ready["step"], ready["version"], ready["consumed_seq"]) == (2, 2, 4)
    second.wait_for(event_is("step", step=3))
    for k in range(3 * B, 4 * B):
        write_group(spool, f"g{k}", version=k // B)
    second.wait_for(event_is("checkpoint", step=4))
    second.send({"cmd": "stop"})
    assert second.finish() == 0
    trained_second = {e["step"]: e["group_ids"] for e in second.of("step")}

    assert sorted(trained_second) == [3, 4]
    assert trained_second[3] == trained_first[3]  # the lost step is redone on the same groups
    kept = [g for step, ids in trained_first.items() if step <= 2 for g in ids]
    redone = [g for ids in trained_second.values() for g in ids]
    assert sorted(kept + redone) == sorted(f"g{k}" for k in range(4 * B))  # none lost, none twice


@pytest.mark.integration
@pytest.mark.slow
def test_sigterm_finishes_with_a_checkpoint(tmp_path: Path, tiny_model: Path, workers: list[Worker]) -> None:
    run_dir = make_run_dir(tmp_path, tiny_model, eta=2)
    spool = SpoolWriter(run_dir / "spool")
    for k in range(B):
        write_group(spool, f"g{k}", version=0)
    w = Worker(run_dir)
    workers.append(w)
    w.wait_for(event_is("step", step=1))
    w.proc.send_signal(signal.SIGTERM)
    assert w.finish() == 0
    [ckpt] = w.of("checkpoint")
    assert (ckpt["step"], ckpt["consumed_seq"]) == (1, B)
    assert (run_dir / "checkpoints" / "step1" / "state.json").is_file()


@pytest.mark.integration
def test_groups_nearest_their_staleness_deadline_go_first_and_a_restart_skips_them(
    tmp_path: Path, tiny_model: Path, workers: list[Worker]
) -> None:
    """Five groups written before the learner starts; the last two ran long (tokens of version 0, the
    others of version 1). The learner reads 2·B = 4 ahead (once per step, and again when what it holds
    cannot fill the batch) and takes the old ones first, so its checkpoint records a watermark below
    groups already trained; a restart trains each group once."""
    from learner.process.checkpoint_state import load_latest_checkpoint

    run_dir = make_run_dir(tmp_path, tiny_model, eta=2)
    spool = SpoolWriter(run_dir / "spool")
    for k, version in enumerate([1, 1, 1, 0, 0]):
        write_group(spool, f"g{k}", version=version)  # seq k + 1
    first = Worker(run_dir)
    workers.append(first)
    first.wait_for(event_is("checkpoint", step=2))
    first.send({"cmd": "stop"})
    assert first.finish() == 0
    steps = first.of("step")
    # step 1 holds seqs 1-4: g3 (version 0) first, then g0; step 2 reads seq 5 and takes g4, then g1
    assert [s["group_ids"] for s in steps] == [["g3", "g0"], ["g4", "g1"]]
    # after step 1 seqs 2-3 wait (watermark 1), after step 2 seq 3 does (watermark 2)
    assert [(s["consumed_seq"], s["consumed_after"]) for s in steps] == [(1, [4]), (2, [4, 5])]
    # what is left to train: spool files after the watermark, less those consumed after it
    assert [s["spool_depth_groups"] for s in steps] == [3, 1]
    [ckpt] = first.of("checkpoint")
    assert (ckpt["consumed_seq"], ckpt["consumed_after"]) == (2, [4, 5])
    latest = load_latest_checkpoint(run_dir / "checkpoints")
    assert latest is not None
    assert (latest.consumed.last_seq, latest.consumed.after) == (2, [4, 5])
    assert latest.consumed.group_ids == ["g3", "g0", "g4", "g1"]

    write_group(spool, "g5", version=1)  # seq 6
    second = Worker(run_dir)
    workers.append(second)
    ready = second.wait_for(event_is("ready"))
    assert (ready["step"], ready["consumed_seq"], ready["consumed_after"]) == (2, 2, [4, 5])
    third = second.wait_for(event_is("step", step=3))
    second.send({"cmd": "stop"})
    assert second.finish() == 0
    assert third["group_ids"] == ["g2", "g5"]  # seqs 4 and 5 were skipped: trained before the restart
    assert (third["consumed_seq"], third["consumed_after"]) == (6, [])
    assert second.of("dropped") == []


def test_a_time_shared_learner_clears_a_stale_lease_and_releases_it_after_each_step(
    tmp_path: Path, tiny_model: Path, workers: list[Worker]
) -> None:
    run_dir = make_run_dir(tmp_path, tiny_model, eta=0)
    config = run_dir / "config.toml"
    config.write_text('[engine]\nshare_cores = "time"\n' + config.read_text())
    lease = run_dir / "cores.lease"
    lease.write_bytes(b"\x01")  # the learner before this one was killed mid-step
    w = Worker(run_dir)
    workers.append(w)
    w.wait_for(event_is("ready"))
    assert lease.read_bytes() == b"\x00"  # released at start: the engines may run
    spool = SpoolWriter(run_dir / "spool")
    for k in range(B):
        write_group(spool, f"g{k}", version=0)
    w.wait_for(event_is("step", step=1))
    assert lease.read_bytes() == b"\x00"  # released once the step is done
    w.proc.stdin.close()
    assert w.finish() == 0
