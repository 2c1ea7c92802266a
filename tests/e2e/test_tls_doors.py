"""TLS on every door that leaves a host (issue 33), with a CA of the tests' own (`openssl`): each server
speaks TLS with a certificate, each client checks it against the CA (and refuses a server it cannot
verify), paths are checked before anything starts, and plain text beyond loopback is refused unless
allowed explicitly. The doors run on 127.0.0.1 here (their certificates name it); tests/e2e/
test_three_hosts.py runs them between network namespaces."""

from __future__ import annotations

import asyncio
import json
import os
import ssl
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from pipeline.contracts.config import ConfigError, check_exposed_ports, check_tls_files, load_config
from pipeline.contracts.tls import (
    PlaintextRefused,
    TlsFiles,
    ca_bytes,
    client_context,
    pem_pair,
    server_context,
)
from pipeline.engine.serve import start_server
from pipeline.engine.serve_flags import ServerConfig
from pipeline.supervisor.actors.agent_api.openai_endpoint import OpenAIEndpoint
from pipeline.supervisor.engines.client import EngineClient
from pipeline.supervisor.engines.protocol import EngineUnavailable, SamplingParams
from pipeline.supervisor.engines.router import router_argv
from pipeline.supervisor.fleet.admin import AdminEndpoint
from pipeline.supervisor.fleet.engine_launch import engine_argv, plan_engines
from pipeline.supervisor.http_endpoints import HttpEndpoints
from pipeline.tools.hosts.private_ca import PrivateCA
from pipeline.transport.flight import FlightSpoolReader, SpoolFlightService
from pipeline.transport.spool import SpoolWriter
from pipeline.transport.weights_http import WeightServerThread, fetch_version, request_fetch
from tests.e2e.test_run_e2e import REPO
from tests.helpers.tls_ca import needs_openssl

pytestmark = needs_openssl
KEY = "door-key-0123456789abcdef"


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> PrivateCA:
    return PrivateCA.create(tmp_path_factory.mktemp("ca"))


@pytest.fixture(scope="module")
def host(ca: PrivateCA) -> TlsFiles:
    """A certificate for this machine's 127.0.0.1, and the CA beside it."""
    return ca.issue("host", ["127.0.0.1"])


@pytest.fixture(scope="module")
def stranger(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    """A certificate of another CA: a server the clients must not trust."""
    other = PrivateCA.create(tmp_path_factory.mktemp("other-ca"), name="someone-else")
    return other.issue("impostor", ["127.0.0.1"])


# --- the config: paths checked, plain text refused -------------------------------------------------------
def test_missing_or_wrong_tls_files_are_named_before_anything_starts(tmp_path: Path, host: TlsFiles) -> None:
    not_pem = tmp_path / "notes.txt"
    not_pem.write_text("not a certificate\n")
    cases = [
        (
            [f'tls.cert_file="{tmp_path}/absent.pem"', f'tls.key_file="{host.key_file}"'],
            "absent.pem does not exist",
        ),
        ([f'tls.cert_file="{tmp_path}"', f'tls.key_file="{host.key_file}"'], "is not a file"),
        ([f'tls.cert_file="{not_pem}"', f'tls.key_file="{host.key_file}"'], "not a PEM certificate and its"),
        ([f'tls.ca_file="{not_pem}"'], r"tls\.ca_file: .* is not a PEM certificate bundle"),
    ]
    for overrides, message in cases:
        with pytest.raises(ConfigError, match=message):
            check_tls_files(load_config(None, overrides))
    with pytest.raises(ConfigError, match="set together"):
        load_config(None, [f'tls.cert_file="{host.cert_file}"'])
    check_tls_files(
        load_config(None, [f'tls.cert_file="{host.cert_file}"', f'tls.key_file="{host.key_file}"'])
    )


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ([f'metrics.api_key="{KEY}"', 'metrics.host="0.0.0.0"'], "metrics.host"),
        ([f'admin.token="{KEY}"', 'admin.host="0.0.0.0"'], "admin.host"),
        ([f'engine.api_key="{KEY}"', 'engine.host="0.0.0.0"'], "engine.host"),
        (
            [f'transport.token="{KEY}"', 'transport.kind="flight"', 'transport.flight_host="0.0.0.0"'],
            "transport.flight_host",
        ),
        (['engine.kind="external"', 'engine.urls=["http://10.1.2.3:30000"]'], r"engine\.urls\[0\]"),
        (['admin.advertise_url="http://10.1.2.3:9401"'], "admin.advertise_url"),
        (
            ['learner.remote.spool_url="grpc://10.1.2.3:8815"', 'transport.kind="flight"'],
            "learner.remote.spool_url",
        ),
    ],
)
def test_plain_text_beyond_loopback_is_refused_unless_allowed(overrides: list[str], key: str) -> None:
    with pytest.raises(ConfigError, match=rf"{key}.*(plain text|tls\.allow_plaintext)"):
        check_exposed_ports(load_config(None, overrides))
    check_exposed_ports(load_config(None, [*overrides, "tls.allow_plaintext=true"]))


def test_with_a_certificate_or_tls_urls_the_same_doors_are_accepted(host: TlsFiles) -> None:
    tls = [
        f'tls.cert_file="{host.cert_file}"',
        f'tls.key_file="{host.key_file}"',
        f'tls.ca_file="{host.ca_file}"',
    ]
    check_exposed_ports(load_config(None, [*tls, f'metrics.api_key="{KEY}"', 'metrics.host="0.0.0.0"']))
    check_exposed_ports(
        load_config(None, [*tls, 'engine.kind="external"', 'engine.urls=["https://10.1.2.3:30000"]'])
    )
    check_exposed_ports(
        load_config(None, ['engine.kind="external"', 'engine.urls=["http://127.0.0.1:30000"]'])
    )


def test_engines_the_daemon_starts_beyond_loopback_get_the_certificate(host: TlsFiles) -> None:
    tls = [
        f'tls.cert_file="{host.cert_file}"',
        f'tls.key_file="{host.key_file}"',
        f'tls.ca_file="{host.ca_file}"',
    ]
    cfg = load_config(None, [*tls, 'engine.host="10.1.2.3"', "engine.port=30000", f'engine.api_key="{KEY}"'])
    slot = plan_engines(cfg)[0]
    assert slot.url == "https://10.1.2.3:30000"
    argv = engine_argv(cfg, slot, model_dir=Path("/m"), version=0)
    assert argv[argv.index("--ssl-certfile") + 1] == host.cert_file
    assert argv[argv.index("--ssl-keyfile") + 1] == host.key_file
    assert argv[argv.index("--ssl-ca-certs") + 1] == host.ca_file
    on_loopback = load_config(None, [*tls, "engine.port=30000"])
    assert plan_engines(on_loopback)[0].url == "http://127.0.0.1:30000"  # nothing leaves the host
    router = router_argv(
        host="0.0.0.0",
        port=1,
        worker_urls=[],
        policy="manual",
        request_timeout_s=5,
        prometheus_port=2,
        tls=host,
    )
    assert router[router.index("--tls-cert-path") + 1] == host.cert_file
    assert router[router.index("--ca-cert-paths") + 1] == host.ca_file


# --- each door over TLS ----------------------------------------------------------------------------------
async def _get(url: str, context: ssl.SSLContext | None, key: str | None = None) -> int:
    connector = aiohttp.TCPConnector(ssl=context if context is not None else True)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession(connector=connector) as http, http.get(url, headers=headers) as resp:
        return resp.status


async def test_metrics_endpoint_over_tls_trusts_only_its_ca(host: TlsFiles, stranger: TlsFiles) -> None:
    endpoints = HttpEndpoints("127.0.0.1", 0, lambda: [], api_key=KEY, ssl_context=server_context(host))
    await endpoints.start()
    try:
        assert endpoints.url.startswith("https://")
        assert await _get(endpoints.url + "/healthz", client_context(host)) == 200
        with pytest.raises(aiohttp.ClientConnectorCertificateError):
            await _get(endpoints.url + "/healthz", client_context(TlsFiles(ca_file=stranger.ca_file)))
        with pytest.raises(aiohttp.ClientError):  # plain HTTP to a TLS port
            await _get(endpoints.url.replace("https://", "http://") + "/healthz", None)
    finally:
        await endpoints.stop()


async def test_admin_endpoint_and_rollwise_engines_over_tls(host: TlsFiles) -> None:
    app = web.Application()

    async def engines(request: web.Request) -> web.Response:
        return web.json_response([{"url": "https://a:1"}])

    app.router.add_get("/engines", engines)
    admin = AdminEndpoint("127.0.0.1", 0, app, ssl_context=server_context(host))
    await admin.start()
    try:
        argv = [sys.executable, "-m", "pipeline.cli", "engines", "--admin", admin.url]
        listed = await _run([*argv, "--ca-file", str(host.ca_file), "list"])
        assert listed.returncode == 0, listed.stderr
        assert json.loads(listed.stdout) == [{"url": "https://a:1"}]
        untrusted = await _run([*argv, "list"])  # the system's store does not know the test CA
        assert untrusted.returncode == 1 and "certificate verify failed" in untrusted.stderr
        plain = await _run(
            [sys.executable, "-m", "pipeline.cli", "engines", "--admin", "http://10.1.2.3:9401", "list"]
        )
        assert plain.returncode == 2 and "plain text to another host" in plain.stderr
    finally:
        await admin.stop()


async def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "ROLLWISE_ADMIN_TOKEN": ""}
    return await asyncio.to_thread(
        subprocess.run, argv, cwd=REPO, capture_output=True, text=True, timeout=120, env=env
    )


async def test_weight_server_and_fetcher_over_tls(tmp_path: Path, host: TlsFiles, stranger: TlsFiles) -> None:
    published = tmp_path / "weights" / "v3"
    published.mkdir(parents=True)
    (published / "config.json").write_text("{}")
    (published / "model.safetensors").write_bytes(os.urandom(4096))
    server = WeightServerThread(
        lambda v: tmp_path / "weights" / f"v{v}",
        "127.0.0.1",
        0,
        KEY,
        what="weights",
        ssl_context=server_context(host),
    )
    port = server.start()
    try:
        source = f"https://127.0.0.1:{port}"
        copy = await fetch_version(source, 3, tmp_path / "copy", token=KEY, ssl_context=client_context(host))
        assert (copy / "model.safetensors").read_bytes() == (published / "model.safetensors").read_bytes()
        with pytest.raises(aiohttp.ClientConnectorCertificateError):
            await fetch_version(
                source, 3, tmp_path / "copy2", token=KEY, ssl_context=client_context(stranger)
            )
    finally:
        server.stop()


async def test_flight_over_tls_reads_groups_and_refuses_an_unverified_service(
    tmp_path: Path, host: TlsFiles, stranger: TlsFiles, caplog: pytest.LogCaptureFixture
) -> None:
    from tests.transport.test_spool import make_group

    SpoolWriter(tmp_path / "spool").write_group(make_group("g1", members=2), group_id="g1")
    service = SpoolFlightService(tmp_path / "spool", host="127.0.0.1", port=0, token=KEY, tls=pem_pair(host))
    service.start()
    try:
        assert service.url.startswith("grpc+tls://")
        reader = FlightSpoolReader(
            service.url, after_seq=0, token=KEY, wait_s=0.0, tls_root_certs=ca_bytes(host)
        )
        items = await asyncio.to_thread(reader.poll)
        assert [item.group_id for item in items] == ["g1"]
        reader.close()
        wrong = FlightSpoolReader(
            service.url, after_seq=0, token=KEY, wait_s=0.0, tls_root_certs=ca_bytes(stranger), timeout_s=5
        )
        assert await asyncio.to_thread(wrong.poll) == [] and wrong.reconnects == 1
        wrong.close()
    finally:
        await asyncio.to_thread(service.stop)


async def test_embedded_engine_serves_https_and_its_fetcher_checks_its_source(
    tmp_path: Path, tiny_model_dir: Path, host: TlsFiles, one_torch_thread: None
) -> None:
    config = ServerConfig(
        model=str(tiny_model_dir),
        port=0,
        weight_version="0",
        seed=0,
        api_key=KEY,
        weights_dir=str(tmp_path / "fetched"),
        ssl_certfile=host.cert_file,
        ssl_keyfile=host.key_file,
        ssl_ca_certs=host.ca_file,
    )
    running = await start_server(config)
    try:
        assert running.url.startswith("https://")
        async with EngineClient(running.url, api_key=KEY, ssl_context=client_context(host)) as client:
            result = await client.generate([1, 2, 3], SamplingParams(max_new_tokens=2), rid="tls")
            assert len(result.output_ids) == 2
        async with EngineClient(running.url, api_key=KEY, retries=0) as untrusting:
            with pytest.raises(EngineUnavailable):
                await untrusting.generate([1, 2], SamplingParams(max_new_tokens=1), rid="no")
        # Its fetch route refuses to hand a token to a plain source on another host.
        with pytest.raises(Exception, match="plain text to another host"):
            await request_fetch(
                running.url,
                source="http://10.1.2.3:9401",
                version=1,
                token="admin-token",
                ssl_context=client_context(host),
                api_key=KEY,
                timeout_s=10,
            )
    finally:
        await running.close()


async def test_the_engine_and_the_fetch_agent_refuse_plain_text_beyond_loopback(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(PlaintextRefused, match="--ssl-certfile"):
        await start_server(ServerConfig(model=str(tiny_model_dir), host="0.0.0.0", port=0, api_key=KEY))
    agent = [
        sys.executable,
        "-m",
        "pipeline.cli",
        "engine",
        "fetch-agent",
        "--dir",
        str(tmp_path),
        "--port",
        "0",
    ]
    done = await _run([*agent, "--host", "0.0.0.0", "--api-key", KEY])
    assert done.returncode == 2 and "plain text" in done.stderr and "--ssl-certfile" in done.stderr


async def test_the_openai_endpoint_beyond_loopback_needs_tls(host: TlsFiles) -> None:
    endpoint = OpenAIEndpoint(engine=None, tokenizer=_NoTokenizer(), settings=_settings(), host="0.0.0.0")  # type: ignore[arg-type]
    with pytest.raises(PlaintextRefused, match="the OpenAI endpoint"):
        await endpoint.start()
    secure = OpenAIEndpoint(
        engine=None,  # type: ignore[arg-type]
        tokenizer=_NoTokenizer(),
        settings=_settings(),
        host="127.0.0.1",
        ssl_context=server_context(host),
    )
    await secure.start()
    try:
        assert secure.base_url.startswith("https://127.0.0.1:")
        assert await _get(secure.base_url + "/models", client_context(host), secure.service_key) == 200
    finally:
        await secure.close()


class _NoTokenizer:
    eos_token_id = 0

    def convert_tokens_to_ids(self, token: str) -> int:
        return 0


def _settings() -> object:
    from pipeline.supervisor.actors.rollout import RolloutSettings
    from pipeline.supervisor.engines.protocol import SamplingParams as Sampling

    return RolloutSettings(sampling=Sampling(max_new_tokens=4), max_context_tokens=64)
