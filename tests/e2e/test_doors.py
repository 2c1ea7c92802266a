"""Hostile input at every door: the embedded engine and the supervisor's endpoint answer each bad request
with a 4xx and a message, and go on serving; a port beyond loopback needs an API key; keys appear in no
file or log; weights load only from allowed directories; an unknown subcommand exits 2."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import logging
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from pipeline.contracts.config import (
    ConfigError,
    check_exposed_ports,
    config_to_toml,
    load_config,
    write_resolved,
)
from pipeline.contracts.http_guard import DoorLimits, ExposedWithoutKey, is_loopback
from pipeline.engine.serve import RunningServer, main, start_server
from pipeline.engine.serve_flags import ServerConfig
from pipeline.supervisor.fleet.children import Child, ChildSpec, redact_argv
from pipeline.supervisor.fleet.engine_launch import engine_child_spec, plan_engines
from pipeline.supervisor.http_endpoints import HttpEndpoints
from pipeline.supervisor.wiring import resolve_config
from tests.engine.test_embedded_engine import gen_body, model_dirs

__all__ = ["model_dirs"]  # the session fixture, used by name

KEY = "s3cret-Key-never-logged"


@pytest.fixture
async def guarded(model_dirs: tuple[Path, Path]) -> AsyncIterator[RunningServer]:
    config = ServerConfig(
        model=str(model_dirs[0]),
        port=0,
        weight_version="0",
        seed=0,
        context_length=64,
        limits=DoorLimits(max_body_bytes=64 * 1024, body_timeout_s=0.5, idle_timeout_s=1.0),
    )
    server = await start_server(config)
    try:
        yield server
    finally:
        await server.close()


async def _raw(url: str, body: bytes, path: str = "/generate") -> tuple[int, dict[str, Any]]:
    async with (
        aiohttp.ClientSession() as http,
        http.post(url + path, data=body, headers={"Content-Type": "application/json"}) as r,
    ):
        text = await r.text()
        return r.status, (json.loads(text) if text else {})


HOSTILE_GENERATE: list[tuple[str, bytes, int, str]] = [
    ("too large", json.dumps({"input_ids": [1] * 40000}).encode(), 413, "larger than"),
    ("prompt past the context", json.dumps(gen_body(list(range(1, 80)))).encode(), 400, "context length"),
    ("max_new_tokens over the cap", json.dumps(gen_body([1], max_new_tokens=10**9)).encode(), 400, "cap"),
    ("input_ids a string", b'{"input_ids": "1 2 3"}', 400, "input_ids"),
    ("input_ids floats", b'{"input_ids": [1.5, 2]}', 400, "token id"),
    ("input_ids out of vocab", b'{"input_ids": [99999999999]}', 400, "token id"),
    ("sampling_params a number", b'{"input_ids": [1], "sampling_params": 5}', 400, "sampling_params"),
    ("temperature a string", b'{"input_ids": [1], "sampling_params": {"temperature": "hot"}}', 400, "number"),
    ("rid a number", b'{"input_ids": [1], "rid": 5}', 400, "rid"),
    ("return_logprob a string", b'{"input_ids": [1], "return_logprob": "yes"}', 400, "boolean"),
    ("n huge", b'{"input_ids": [1], "sampling_params": {"n": 1000000}}', 400, "max-batch"),
    ("a body that is a list", b"[1, 2, 3]", 400, "JSON object"),
    ("nested deeply", b"[" * 30_000 + b"]" * 30_000, 400, "nested"),
    ("not UTF-8", b'{"input_ids": [1], "rid": "\xff\xfe"}', 400, "UTF-8"),
    ("not JSON", b"{input_ids: [1]", 400, "malformed JSON"),
    ("empty", b"", 400, "empty"),
]


HOSTILE_CONTROL: list[tuple[str, bytes, str]] = [
    ("/update_weights_from_disk", b'{"model_path": 5}', "model_path"),
    ("/update_weights_from_disk", b'{"model_path": "/x", "abort_all_requests": "yes"}', "boolean"),
    ("/abort_request", b'{"abort_all": "yes"}', "boolean"),
    ("/abort_request", b'{"rid": ["a"]}', "rid"),
    ("/pause_generation", b'{"mode": []}', "mode"),
    ("/continue_generation", b"[[[[", "malformed"),
]


async def test_hostile_bodies_get_a_4xx_naming_the_defect_and_the_engine_goes_on(
    guarded: RunningServer,
) -> None:
    for what, body, status, words in HOSTILE_GENERATE:
        got, reply = await _raw(guarded.url, body)
        assert (got, words in reply["error"]["message"]) == (status, True), (what, reply)
        ok, answer = await _raw(guarded.url, json.dumps(gen_body([1, 2], max_new_tokens=2)).encode())
        assert ok == 200 and len(answer["output_ids"]) == 2, what  # the engine goes on serving
    for path, body, words in HOSTILE_CONTROL:
        got, reply = await _raw(guarded.url, body, path)
        message = reply.get("message") or reply["error"]["message"]
        assert (got, words in message) == (400, True), (path, body, reply)


async def test_slow_loris_clients_are_cut_off_and_never_stall_the_engine(guarded: RunningServer) -> None:
    host, port = "127.0.0.1", guarded.port
    # Headers that never end, and a body that trickles: 30 of each.
    stuck_headers = []
    slow_bodies = []
    for _ in range(30):
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
        await writer.drain()
        stuck_headers.append((reader, writer))
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(b'POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{"input')
        await writer.drain()
        slow_bodies.append((reader, writer))
    started = time.monotonic()
    ok, _ = await _raw(guarded.url, json.dumps(gen_body([1, 2], max_new_tokens=2)).encode())
    assert ok == 200 and time.monotonic() - started < 5.0
    for reader, _ in slow_bodies:
        head = await asyncio.wait_for(reader.read(400), 10.0)
        assert head.startswith(b"HTTP/1.1 408"), head
    for reader, _ in stuck_headers:
        assert await asyncio.wait_for(reader.read(), 10.0) == b""  # closed after idle_timeout_s
    for _, writer in stuck_headers + slow_bodies:
        writer.close()


async def test_an_engine_beyond_loopback_refuses_to_start_without_a_key(
    model_dirs: tuple[Path, Path],
) -> None:
    with pytest.raises(ExposedWithoutKey, match=r"--api-key or ROLLWISE_ENGINE_API_KEY"):
        await start_server(ServerConfig(model=str(model_dirs[0]), host="0.0.0.0", port=0))


def test_the_engine_command_exits_2_beyond_loopback_without_a_key(
    model_dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ROLLWISE_ENGINE_API_KEY", raising=False)
    assert main(["--model", str(model_dirs[0]), "--host", "0.0.0.0", "--port", "0"]) == 2


async def test_a_keyed_engine_wants_the_key_everywhere_but_health_and_never_logs_it(
    model_dirs: tuple[Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    # Plain text allowed: this test is about the key (test_tls_doors.py refuses plain text by default).
    config = ServerConfig(
        model=str(model_dirs[0]), host="0.0.0.0", port=0, api_key=KEY, seed=0, allow_plaintext=True
    )
    server = await start_server(config)
    try:
        url = f"http://127.0.0.1:{server.port}"
        async with aiohttp.ClientSession() as http:
            async with http.get(url + "/health") as r:
                assert r.status == 200
            async with http.post(url + "/generate", json=gen_body([1], max_new_tokens=1)) as r:
                assert r.status == 401 and "API key" in (await r.json())["error"]["message"]
            wrong = {"Authorization": "Bearer nope"}
            async with http.get(url + "/get_model_info", headers=wrong) as r:
                assert r.status == 401
            right = {"Authorization": f"Bearer {KEY}"}
            async with http.post(url + "/generate", json=gen_body([1], max_new_tokens=1), headers=right) as r:
                assert r.status == 200
    finally:
        await server.close()
    assert "requires Authorization: Bearer" in caplog.text
    assert KEY not in caplog.text
    assert KEY not in repr(config)


async def test_weights_load_only_from_allowed_directories(
    model_dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    allowed = model_dirs[1].parent
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (allowed / "link-out").unlink(missing_ok=True)
    (allowed / "link-out").symlink_to(outside)
    config = ServerConfig(model=str(model_dirs[0]), port=0, seed=0, allowed_weights_dirs=(str(allowed),))
    server = await start_server(config)
    try:
        async with aiohttp.ClientSession() as http:
            for path in ("/etc", str(outside), str(allowed / "link-out"), str(allowed / ".." / "x")):
                body = {"model_path": path, "weight_version": "9"}
                async with http.post(server.url + "/update_weights_from_disk", json=body) as r:
                    reply = await r.json()
                    assert r.status == 400 and reply["success"] is False, path
                    assert "outside the directories" in reply["message"]
            body = {"model_path": str(model_dirs[1]), "weight_version": "1"}
            async with http.post(server.url + "/update_weights_from_disk", json=body) as r:
                assert r.status == 200 and (await r.json())["success"] is True
    finally:
        (allowed / "link-out").unlink()
        await server.close()


def test_rollwise_starts_its_engines_allowing_only_the_run_weights_and_the_initial_model(
    tmp_path: Path,
) -> None:
    cfg = load_config(None, [f"run.run_dir={json.dumps(str(tmp_path / 'run'))}", "engine.port=0"])
    spec = engine_child_spec(cfg, plan_engines(cfg)[0], model_dir=tmp_path / "m", version=0, log_dir=tmp_path)
    allowed = [spec.argv[i + 1] for i, a in enumerate(spec.argv) if a == "--allowed-weights-dir"]
    assert allowed == [
        str((tmp_path / "run" / "weights").resolve()),
        str((tmp_path / "run" / "model").resolve()),
    ]


# --- the supervisor's endpoint ---------------------------------------------------------------------------
async def test_the_metrics_endpoint_beyond_loopback_needs_a_key_and_the_probes_stay_open() -> None:
    with pytest.raises(ExposedWithoutKey, match=r"metrics\.api_key"):
        await HttpEndpoints("0.0.0.0", 0, lambda: []).start()
    endpoints = HttpEndpoints("0.0.0.0", 0, lambda: [], api_key=KEY)
    await endpoints.start()
    try:
        url = f"http://127.0.0.1:{endpoints.port}"
        async with aiohttp.ClientSession() as http:
            for path in ("/healthz", "/readyz"):
                async with http.get(url + path) as r:
                    assert r.status == 200
            async with http.get(url + "/metrics") as r:
                assert r.status == 401
            async with http.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}) as r:
                assert r.status == 200 and "rollwise_" in await r.text()
            async with http.post(url + "/metrics", data=io.BytesIO(b"x" * (40 * 2**20))) as r:
                assert r.status in (401, 405, 413)
    finally:
        await endpoints.stop()


def test_a_config_that_binds_beyond_loopback_without_a_key_stops_naming_the_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("ROLLWISE_METRICS_API_KEY", raising=False)
    monkeypatch.delenv("ROLLWISE_ENGINE_API_KEY", raising=False)
    with pytest.raises(ConfigError, match=r"metrics\.api_key is required"):
        check_exposed_ports(load_config(None, ['metrics.host="0.0.0.0"']))
    with pytest.raises(ConfigError, match=r"engine\.api_key is required"):
        check_exposed_ports(load_config(None, ['engine.host="0.0.0.0"']))
    ns = argparse.Namespace(
        config=None, set=['metrics.host="0.0.0.0"'], run_dir=None, max_steps=None, log_format=None
    )
    with pytest.raises(ConfigError, match=r"metrics\.api_key is required"):  # `rollwise run` checks it
        resolve_config(ns)
    monkeypatch.setenv("ROLLWISE_METRICS_API_KEY", KEY)
    check_exposed_ports(load_config(None, ['metrics.host="0.0.0.0"', "tls.allow_plaintext=true"]))
    assert is_loopback("127.0.0.1") and is_loopback("::1") and not is_loopback("0.0.0.0")


def test_keys_never_reach_the_config_copy_messages_or_child_logs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ROLLWISE_ENGINE_API_KEY", KEY)
    cfg = load_config(None, [f'metrics.api_key="{KEY}"', 'metrics.host="0.0.0.0"', "engine.port=0"])
    assert cfg.engine.api_key is not None and cfg.engine.api_key.get_secret_value() == KEY
    written = write_resolved(cfg, tmp_path).read_text()
    assert KEY not in written and "api_key = (set; not written)" in written
    reread = load_config(tmp_path / "config.toml")  # the learner reads this copy: it loads without the key
    assert reread.metrics.host == "0.0.0.0" and reread.metrics.api_key is None
    assert KEY not in config_to_toml(cfg) and KEY not in repr(cfg) and KEY not in str(cfg)
    with pytest.raises(ConfigError) as bad:
        load_config(None, ["metrics.api_key=[1, 2]", f"engine.extra_args=[{json.dumps(KEY)}, 5]"])
    assert "metrics.api_key" in str(bad.value)
    # the embedded engine gets its key through the environment, not its command line (or its log line)
    spec = engine_child_spec(cfg, plan_engines(cfg)[0], model_dir=tmp_path, version=0, log_dir=tmp_path)
    assert KEY not in " ".join(spec.argv) and spec.env["ROLLWISE_ENGINE_API_KEY"] == KEY
    assert KEY not in repr(spec)
    assert redact_argv(["sglang", "--api-key", KEY, "--port", "1", f"--admin-api-key={KEY}"]) == [
        "sglang",
        "--api-key",
        "***",
        "--port",
        "1",
        "--admin-api-key=***",
    ]


async def test_a_child_log_shows_its_command_line_without_the_key(tmp_path: Path) -> None:
    child = Child(ChildSpec("echo", ["/bin/true", "--api-key", KEY], tmp_path / "c.log"))
    await child.start()
    await child.wait()
    text = (tmp_path / "c.log").read_text()
    assert "--api-key ***" in text and KEY not in text


# --- the command line ------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv", [["bench", "nope", "--help"], ["bench", "nope"], ["engine", "srve"]])
def test_an_unknown_subcommand_exits_2_naming_it(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    from pipeline.cli import main as cli

    assert cli(argv) == 2
    assert f"'{argv[1]}'" in capsys.readouterr().err


def test_bench_soak_has_its_own_help(capsys: pytest.CaptureFixture[str]) -> None:
    from pipeline.cli import main as cli

    with pytest.raises(SystemExit) as done:
        cli(["bench", "soak", "--help"])
    assert done.value.code == 0
    assert "--chaos" in capsys.readouterr().out


def test_environment_is_left_clean() -> None:
    assert "ROLLWISE_ENGINE_API_KEY" not in os.environ or os.environ["ROLLWISE_ENGINE_API_KEY"] != KEY
