"""A learner that does not share the supervisor's disk (`learner.remote.run_dir`): its config over stdin, the
preset built on its side and compared by digest, its published versions fetched from its own weight
server and mirrored into the run directory (checked against the manifest), its checkpoints on its disk.

The daemon tests run everything on 127.0.0.1 with two separate directories: nothing of the learner's
reaches the supervisor's directory except through the weight server, and no spool file reaches the
learner's (it reads them over Arrow Flight).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import itertools
import json
import os
import re
import signal
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from learner.process.shell import receive_config
from pipeline.contracts import events
from pipeline.contracts.config import ConfigError, check_exposed_ports, config_to_toml, load_config, reveal
from pipeline.contracts.http_guard import ExposedWithoutKey
from pipeline.contracts.run_dir import RunDir, model_digest
from pipeline.supervisor.learner_child import TRANSPORT_TOKEN_ENV, config_message, learner_child_spec
from pipeline.supervisor.observability import metrics
from pipeline.tools.fake_sglang import FakeSGLang, free_port
from pipeline.transport.spool import read_group_file
from pipeline.transport.weights_http import WeightServer, WeightServerThread, fetch_version
from tests.e2e.test_faults import _child_pids, _cmdline, _lineage_group_ids, _spool_files
from tests.e2e.test_run_e2e import TINY, DaemonRun, checkpoint_state, daemons  # noqa: F401 - fixture
from tests.helpers.lineage import LineageUnderTest, lineage_for

TOKEN = "learner-weights-token-0123456789"


def own_run_dir_overrides(learner_dir: Path) -> list[str]:
    flight_port = free_port()
    return [
        *TINY,
        'transport.kind="flight"',
        f"transport.flight_port={flight_port}",
        f'learner.remote.spool_url="grpc://127.0.0.1:{flight_port}"',
        f"learner.remote.run_dir={json.dumps(str(learner_dir))}",
        "learner.remote.weights_port=0",
    ]


def fake_model(path: Path, weights: bytes) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"model_type": "qwen3", "transformers_version": "4.50.0"}\n')
    (path / "model.safetensors").write_bytes(weights)
    return path


# --- the pieces -----------------------------------------------------------------------------------------
def test_the_config_and_the_secrets_reach_the_learner_on_stdin_and_never_its_argv_or_env(
    tmp_path: Path,
) -> None:
    cfg = load_config(
        None,
        [
            f'learner.remote.run_dir="{tmp_path / "learner"}"',
            'transport.kind="flight"',
            'learner.remote.spool_url="grpc://sup:8815"',
            f'transport.token="{TOKEN}-flight"',
            f'learner.remote.weights_token="{TOKEN}"',
            "learner.optim.lr=3e-3",
        ],
    )
    spec = learner_child_spec(RunDir.at(tmp_path / "run"), cfg.learner, transport_token=TOKEN + "-flight")
    assert spec.argv[1:] == ["-m", "learner.process", "--config", "-", "--run-dir", str(tmp_path / "learner")]
    assert TRANSPORT_TOKEN_ENV not in spec.env and spec.stdin
    message = config_message(cfg)
    assert TOKEN not in message["toml"]  # the config as config.toml holds it
    assert message["secrets"] == {"transport.token": TOKEN + "-flight", "learner.remote.weights_token": TOKEN}

    received = receive_config(io.StringIO(json.dumps(message) + "\n" + '{"cmd": "stop"}\n'))
    assert received.model_dump(mode="json") == cfg.model_dump(mode="json")
    assert reveal(received.learner.remote.weights_token) == TOKEN
    assert reveal(received.transport.token) == TOKEN + "-flight"
    assert config_to_toml(received) == config_to_toml(cfg)


@pytest.mark.parametrize(
    ("first_line", "message"),
    [
        ("", "stdin closed before the supervisor sent the config"),
        ("not json\n", "not JSON"),
        ('{"cmd": "stop"}\n', "expected a 'config' command first"),
        ('{"cmd": "config", "toml": 3, "secrets": {}}\n', "needs 'toml'"),
        ('{"cmd": "config", "toml": "[learner.optim]\\nlr = -1\\n", "secrets": {}}\n', r"learner\.optim\.lr"),
        ('{"cmd": "config", "toml": "", "secrets": {"learner.optim.lr": "x"}}\n', "not a secret setting"),
    ],
)
def test_a_bad_config_line_on_stdin_is_refused_naming_the_problem(first_line: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        receive_config(io.StringIO(first_line))


def test_config_rules_of_a_learner_with_its_own_run_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ROLLWISE_LEARNER_TOKEN", raising=False)
    with pytest.raises(ConfigError, match=r"learner\.remote\.run_dir .* needs learner\.remote\.spool_url"):
        load_config(None, ['learner.remote.run_dir="/data/learner"'])
    with pytest.raises(ConfigError, match="is the run directory itself"):
        load_config(
            None,
            [
                'learner.remote.run_dir="runs/exp/"',
                'run.run_dir="runs/exp"',
                'learner.remote.spool_url="grpc://s:1"',
                'transport.kind="flight"',
            ],
        )
    exposed = [
        'learner.remote.run_dir="/data/l"',
        'learner.remote.spool_url="grpc://s:1"',
        'transport.kind="flight"',
        'learner.remote.weights_host="0.0.0.0"',
    ]
    with pytest.raises(ConfigError, match=r"learner\.remote\.weights_token is required"):
        check_exposed_ports(load_config(None, exposed))
    monkeypatch.setenv("ROLLWISE_LEARNER_TOKEN", TOKEN)
    check_exposed_ports(load_config(None, [*exposed, "tls.allow_plaintext=true"]))
    # A section's rule never echoes the section (it may hold a token).
    with pytest.raises(ConfigError) as refused:
        load_config(None, [f'learner.remote.weights_token="{TOKEN}"', 'learner.remote.run_dir="/l"'])
    assert TOKEN not in str(refused.value)


def test_the_initial_model_digest_covers_weights_and_tokenizer_but_not_the_transformers_version(
    tmp_path: Path,
) -> None:
    a = fake_model(tmp_path / "a", b"\x00" * 64)
    b = fake_model(tmp_path / "b", b"\x00" * 64)
    (b / "config.json").write_text('{"transformers_version": "4.57.1", "model_type": "qwen3"}')
    assert model_digest(a) == model_digest(b)
    (b / "model.safetensors").write_bytes(b"\x00" * 63 + b"\x01")
    assert model_digest(a) != model_digest(b)
    (b / "model.safetensors").write_bytes(b"\x00" * 64)
    (b / "tokenizer.json").write_text("{}")
    assert model_digest(a) != model_digest(b)


def test_ready_and_published_carry_where_to_fetch_and_older_events_still_decode() -> None:
    ready = events.Ready(1, 2, 3, "/l/weights/v1", weights_url="http://c:8816", initial_model_digest="ab")
    published = events.Published(version=4, path="/l/weights/v4", weights_url="http://c:8816")
    for event in (ready, published):
        assert events.decode(json.loads(events.encode(event))) == event
    old = events.decode({"event": "published", "version": 4, "path": "/r/weights/v4"})
    assert old == events.Published(version=4, path="/r/weights/v4", weights_url=None)
    with pytest.raises(ValueError, match=r"ready\.initial_model_digest has 5"):
        events.decode({"event": "ready", "version": 0, "step": 0, "consumed_seq": 0, "path": "p",
                       "initial_model_digest": 5})  # fmt: skip


def test_the_learners_weight_server_wants_its_token_and_a_key_off_loopback(tmp_path: Path) -> None:
    run = RunDir.at(tmp_path / "learner")
    fake_model(run.weights_of(2), b"\x01" * 32)
    with pytest.raises(ExposedWithoutKey, match=r"learner\.remote\.weights_token"):
        WeightServerThread(run.weights_of, "0.0.0.0", 0, None, what="the learner's weight server").start()
    server = WeightServerThread(run.weights_of, "127.0.0.1", 0, TOKEN, what="the learner's weight server")
    port = server.start()
    try:
        url = f"http://127.0.0.1:{port}/weights/v2/manifest"
        with pytest.raises(urllib.error.HTTPError, match="401"):
            urllib.request.urlopen(url, timeout=10)
        request = urllib.request.Request(url, headers={"Authorization": f"Bearer {TOKEN}"})
        with urllib.request.urlopen(request, timeout=10) as resp:
            manifest = json.loads(resp.read())
        assert [f["path"] for f in manifest["files"]] == ["config.json", "model.safetensors"]
    finally:
        server.stop()


def mirror_failures() -> float:
    return metrics.REGISTRY.get_sample_value("rollwise_weight_mirror_failures_total") or 0.0


async def until(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    for _ in itertools.count():
        if condition():
            return
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


@contextlib.asynccontextmanager
async def _mirroring(
    tmp_path: Path, middlewares: Sequence[Any] = ()
) -> AsyncIterator[tuple[RunDir, str, FakeSGLang, LineageUnderTest]]:
    """A learner's run directory and its weight server (behind `middlewares`), and a supervisor's
    lineage that mirrors from it into tmp_path/run and syncs a fake engine."""
    learner = RunDir.at(tmp_path / "learner")
    app = web.Application(middlewares=list(middlewares))
    WeightServer(learner.weights_of).add_routes(app)
    runner, source = await _serve(app)
    fake = FakeSGLang()
    await fake.start()
    overrides = [
        f'learner.remote.run_dir="{learner.root}"',
        'learner.remote.spool_url="grpc://127.0.0.1:1"',
        'transport.kind="flight"',
    ]
    under = lineage_for([fake.base_url], tmp_path / "run", overrides)
    try:
        yield learner, source, fake, under
    finally:
        await under.close()
        await fake.stop()
        await runner.cleanup()


async def test_a_version_published_again_with_other_weights_replaces_the_fetched_copy(tmp_path: Path) -> None:
    learner = RunDir.at(tmp_path / "learner")
    app = web.Application()
    WeightServer(learner.weights_of).add_routes(app)
    runner, source = await _serve(app)
    try:
        fake_model(learner.weights_of(3), b"old lineage")
        local = await fetch_version(source, 3, tmp_path / "mirror")
        inode = (local / "model.safetensors").stat().st_ino
        assert (await fetch_version(source, 3, tmp_path / "mirror")) == local  # the same manifest: kept
        assert (local / "model.safetensors").stat().st_ino == inode
        # The learner restarted from an older checkpoint and publishes version 3 again (a new directory).
        fresh = fake_model(tmp_path / "learner" / "weights" / "v3.new", b"new lineage")
        os.rename(learner.weights_of(3), tmp_path / "gone")
        os.rename(fresh, learner.weights_of(3))
        assert (await fetch_version(source, 3, tmp_path / "mirror")) == local
        assert (local / "model.safetensors").read_bytes() == b"new lineage"
    finally:
        await runner.cleanup()


async def test_copies_are_kept_by_install_order_so_a_rolled_back_version_survives(tmp_path: Path) -> None:
    learner = RunDir.at(tmp_path / "learner")
    app = web.Application()
    WeightServer(learner.weights_of).add_routes(app)
    runner, source = await _serve(app)
    mirror = tmp_path / "mirror"
    try:
        for version in (2, 3, 4, 5, 6):
            fake_model(learner.weights_of(version), bytes([version]) * 16)
        for version in (3, 4, 5):
            await fetch_version(source, version, mirror)
        # The learner restarted at version 2 (older than every copy): the engines go back to it.
        assert (await fetch_version(source, 2, mirror)) == mirror / "v2"
        assert sorted(p.name for p in mirror.iterdir()) == [
            "v2", "v2.manifest.json", "v4", "v4.manifest.json", "v5", "v5.manifest.json"
        ]  # fmt: skip
        await fetch_version(source, 6, mirror)
        assert sorted(p.name for p in mirror.iterdir() if p.is_dir()) == ["v2", "v5", "v6"]
    finally:
        await runner.cleanup()


async def test_a_corrupted_version_is_never_mirrored_or_loaded_and_a_newer_one_supersedes_it(
    tmp_path: Path,
) -> None:
    failures_before = mirror_failures()
    async with _mirroring(tmp_path) as (learner, source, fake, under):
        lineage = under.lineage
        fake_model(learner.weights_of(1), b"\x11" * 4096)
        async with aiohttp.ClientSession() as http, http.get(f"{source}/weights/v1/manifest") as resp:
            assert resp.status == 200  # the server has made (and cached) v1's manifest
        (learner.weights_of(1) / "model.safetensors").write_bytes(b"\x11" * 4095 + b"\x00")  # bit rot
        # Events are handled one after the other, as LearnerChild.follow hands them over: the copy runs
        # in the background, so the next event is heard while it is refused and retried.
        await lineage.on_published(events.Published(1, str(learner.weights_of(1)), weights_url=source))
        await until(lambda: mirror_failures() >= failures_before + 2)  # refused, and again on the retry
        assert len(lineage.background) == 1 and fake.update_calls == []
        good = fake_model(learner.weights_of(2), b"\x22" * 4096)
        await lineage.on_published(events.Published(2, str(good), weights_url=source))
        await asyncio.wait_for(asyncio.gather(*lineage.background), 10)
    assert [c["weight_version"] for c in fake.update_calls] == ["2"]  # version 1 never reached an engine
    mirrored = under.run_dir.weights_of(2)
    assert fake.update_calls[0]["model_path"] == str(mirrored)
    assert (mirrored / "model.safetensors").read_bytes() == b"\x22" * 4096
    assert not under.run_dir.weights_of(1).exists()
    assert lineage.version == 2 and under.served == [2]
    text = under.progress.getvalue()
    assert "copying version 1 from the learner failed" in text and "sha256" in text
    assert "version 1 not copied from the learner" in text


async def test_a_copy_the_link_keeps_breaking_retries_at_once_while_it_progresses_and_backs_off_when_not(
    tmp_path: Path,
) -> None:
    """Version 1's file is cut 4,000 bytes after where each of its first three answers starts: every
    attempt staged bytes, so each retry waits the first delay. Version 2's manifest is refused three
    times (503, nothing staged): the delay doubles, 0.1 -> 0.2 -> 0.4 s. Both arrive whole."""
    weights = bytes(range(256)) * 64  # 16,384 bytes
    seen: list[str] = []

    @web.middleware
    async def hostile(request: web.Request, handler: Any) -> web.StreamResponse:
        version, name = request.path.split("/")[2], request.path.rsplit("/", 1)[-1]
        seen.append(f"{version} {name} {request.headers.get('Range')}")
        if version == "v2" and name == "manifest" and seen.count("v2 manifest None") <= 3:
            return web.Response(status=503, text="overloaded")
        cuts = sum(1 for line in seen if line.startswith("v1 model.safetensors"))
        if version != "v1" or name != "model.safetensors" or cuts > 3:
            return await handler(request)
        asked = request.headers.get("Range")
        start = int(asked[6:-1]) if asked else 0
        cut = web.StreamResponse(status=206 if asked else 200, headers={"Content-Length": str(16384 - start)})
        await cut.prepare(request)
        await cut.write(weights[start : start + 4000])
        assert request.transport is not None
        request.transport.close()
        return cut

    async with _mirroring(tmp_path, [hostile]) as (learner, source, fake, under):
        under.lineage.mirror_retry_s = (0.1, 0.4)
        for version in (1, 2):
            published = fake_model(learner.weights_of(version), weights)
            await under.lineage.on_published(events.Published(version, str(published), weights_url=source))
            await asyncio.wait_for(asyncio.gather(*under.lineage.background), 30)
    assert [c["weight_version"] for c in fake.update_calls] == ["1", "2"]
    for version in (1, 2):
        assert (under.run_dir.weights_of(version) / "model.safetensors").read_bytes() == weights
    assert [line for line in seen if "safetensors" in line and line.startswith("v1")] == [
        "v1 model.safetensors None",
        "v1 model.safetensors bytes=4000-",
        "v1 model.safetensors bytes=8000-",
        "v1 model.safetensors bytes=12000-",
    ]
    retries = re.findall(
        r"copying version (\d) from the learner failed .*?; retrying in ([\d.]+) s", under.progress.getvalue()
    )
    assert retries == [("1", "0.1")] * 3 + [("2", "0.1"), ("2", "0.2"), ("2", "0.4")]


# --- the daemon, end to end -----------------------------------------------------------------------------
def _learner_pid(daemon_pid: int) -> int:
    found = [p for p in _child_pids(daemon_pid) if "learner.process" in _cmdline(p)]
    assert len(found) == 1, found
    return found[0]


def _readies(supervisor_log: Path) -> list[tuple[int, int]]:
    """(version, step) of every ready event the supervisor received, in order."""
    text = supervisor_log.read_text()
    return [(int(v), int(s)) for v, s in re.findall(r"learner ready: Ready\(version=(\d+), step=(\d+)", text)]


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.slow
@pytest.mark.integration
def test_a_learner_with_its_own_run_dir_trains_resumes_after_kill_9_and_shares_no_disk(
    tmp_path: Path,
    daemons: list[DaemonRun],  # noqa: F811
) -> None:
    sup_dir, learner_dir = tmp_path / "supervisor", tmp_path / "learner"
    # Every checkpoint kept (and so every spool file), so each group written can be accounted for; the
    # engine downloads each version from the supervisor in turn (its own disk: fetched/engine0).
    # The launcher starts the learner with an empty environment, as ssh would: its config and both
    # tokens (Flight, its weight server) can only have come through its stdin.
    overrides = [
        *own_run_dir_overrides(learner_dir),
        "learner.keep_checkpoints=1000",
        'engine.weight_transport="http"',
        'learner.distributed.launcher=["env", "-i", "PATH=/usr/bin:/bin"]',
        f'transport.token="{TOKEN}-flight"',
        f'learner.remote.weights_token="{TOKEN}"',
    ]
    run = DaemonRun(sup_dir, overrides)  # the preset is built on both sides: model.path unset
    daemons.append(run)
    run.wait_steps(2, timeout_s=180)

    os.kill(_learner_pid(run.proc.pid), signal.SIGKILL)
    killed_at = checkpoint_state(learner_dir)["step"]  # the dead learner writes nothing more
    run.wait_for(
        lambda r: len(_readies(sup_dir / "logs" / "supervisor.log")) == 2,
        120,
        "the restarted learner's ready",
    )
    first, restarted = _readies(sup_dir / "logs" / "supervisor.log")
    synced_before = len(run.snapshot("sync"))
    run.wait_for(
        lambda r: (
            max(r.steps()) >= killed_at + 2
            and len(syncs := r.snapshot("sync")) > synced_before
            and syncs[-1]["version"] > restarted[0]
        ),
        120,
        "two steps and a new version synced after the restart",
    )
    run.signal(signal.SIGTERM)
    assert run.wait(timeout_s=90) == 0, run.tail()

    # The restarted learner resumed its own checkpoint (the supervisor holds none).
    assert first == (0, 0) and restarted[1] == killed_at
    # Its stderr comes through the launcher's pipe into the supervisor's logs/learner.log.
    assert (sup_dir / "logs" / "learner.log").read_text().count("--config - --run-dir") == 2
    # No disk shared: no checkpoint on the supervisor's side, no spool file on the learner's.
    assert not (sup_dir / "checkpoints").exists()
    # Its own trace files (learner.trace, s<step>.arrow) are the only Arrow files it writes.
    assert not (learner_dir / "spool").exists() and not list(learner_dir.rglob("g*.arrow"))
    # The learner got the supervisor's config over stdin and built the same preset.
    assert (learner_dir / "config.toml").read_text() == (sup_dir / "config.toml").read_text()
    assert model_digest(learner_dir / "model") == model_digest(sup_dir / "model")

    # Versions advanced and the engines served each from the supervisor's mirror, equal to the learner's.
    syncs = run.snapshot("sync")
    assert syncs and all(s["ok"] for s in syncs) and all("mirror_s" in s for s in syncs)
    # The newest version all three disks still hold (each keeps 3) is one the restarted learner made.
    held = [
        {int(p.name[1:]) for p in d.iterdir() if re.fullmatch(r"v\d+", p.name)}
        for d in (learner_dir / "weights", sup_dir / "weights", sup_dir / "fetched" / "engine0")
    ]
    newest = max(set.intersection(*held))
    assert newest > restarted[0]
    for name in ("config.json", "model.safetensors"):
        learners = _sha(learner_dir / "weights" / f"v{newest}" / name)
        assert _sha(sup_dir / "weights" / f"v{newest}" / name) == learners
        assert _sha(sup_dir / "fetched" / "engine0" / f"v{newest}" / name) == learners

    # Exactly once across the kill: every group in the supervisor's spool up to the learner's consumed
    # sequence, and those it consumed after it (taken out of write order), was consumed once along its
    # checkpoint chain, none twice, none lost.
    trained = _lineage_group_ids(learner_dir)
    assert len(trained) == len(set(trained)), "a consumed group was trained twice"
    written = {seq: read_group_file(path)[0] for seq, path in _spool_files(sup_dir / "spool")}
    assert sorted(written) == list(range(1, max(written) + 1))
    consumed = checkpoint_state(learner_dir)["consumed"]
    last_seq, after = int(consumed["last_seq"]), set(consumed["after"])
    assert {gid for seq, gid in written.items() if seq <= last_seq or seq in after} == set(trained)

    # A new daemon on both directories: the version to serve comes from the learner's ready event (the
    # supervisor's directory holds no checkpoint), and training goes on from the learner's checkpoint.
    # (More steps than the groups left in the spool can feed: the actors must sample new ones.)
    final = checkpoint_state(learner_dir)
    again = DaemonRun(sup_dir, overrides, max_steps=int(final["step"]) + 6)
    daemons.append(again)
    assert again.wait(timeout_s=180) == 0, again.tail()
    assert again.steps() == list(range(int(final["step"]) + 1, int(final["step"]) + 7))
    resumed = _readies(sup_dir / "logs" / "supervisor.log")[2]
    assert resumed == (int(final["counters"]["policy_version"]), int(final["step"]))
    # The engines started on the initial model and moved to the learner's version (or to one it
    # published right after, if that came first), never back to an older one.
    versions = [sync["version"] for sync in again.snapshot("sync")]
    assert versions and versions[0] >= resumed[0] > 0 and versions == sorted(versions)


@pytest.mark.integration
def test_a_learner_whose_preset_differs_is_refused_naming_both_digests(
    tmp_path: Path,
    daemons: list[DaemonRun],  # noqa: F811
) -> None:
    from learner.model.model_init import init_model

    sup_dir, learner_dir = tmp_path / "supervisor", tmp_path / "learner"
    init_model(learner_dir / "model", preset="tiny", seed=1)  # left over from another run (seed 1)
    run = DaemonRun(sup_dir, own_run_dir_overrides(learner_dir))  # this run: seed 0
    daemons.append(run)
    assert run.wait(timeout_s=180) == 1, run.tail()
    stderr = run.stderr_path.read_text()
    assert "the learner's initial model differs from the supervisor's" in stderr
    assert model_digest(learner_dir / "model") in stderr and model_digest(sup_dir / "model") in stderr
    assert not run.steps() and not (learner_dir / "checkpoints").exists()  # nothing trained
