"""The ports the daemon picks for its children stay theirs (fleet/port_reservations.py).

Seen in CI: engine0's port, picked by binding port 0 and closing the socket, was handed to another
listener before the engine bound it; /health answered 404 from the stranger and the engine was killed and
restarted onto the same port three times, which stopped the daemon."""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import sys
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from pipeline.contracts.config import load_config
from pipeline.contracts.run_dir import RunDir
from pipeline.supervisor.engines.client import EngineClient
from pipeline.supervisor.fleet.children import Child, ChildSpec
from pipeline.supervisor.fleet.engine_fleet import EngineFleet, ready_or_exited
from pipeline.supervisor.fleet.port_reservations import PortReservations


def bind_plain(port: int) -> None:
    """Bind 127.0.0.1:`port` without SO_REUSEADDR (as a program that does not share would)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_a_reserved_port_is_never_handed_out_by_port_zero_and_freed_by_close() -> None:
    ports = PortReservations()
    port = ports.take("127.0.0.1")
    assert ports.ports == [port]
    with pytest.raises(OSError) as taken:
        bind_plain(port)
    assert taken.value.errno == errno.EADDRINUSE
    handed = set()
    for _ in range(3000):  # servers ask for port 0 with SO_REUSEADDR set, as aiohttp does
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", 0))
            handed.add(s.getsockname()[1])
    assert port not in handed
    ports.close()
    ports.close()  # idempotent
    assert ports.ports == []
    bind_plain(port)


async def test_a_server_binding_the_reserved_port_by_number_listens_and_answers() -> None:
    """The child's side: aiohttp binds it with SO_REUSEADDR beside the reservation, twice (a restart)."""

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/health", health)
    ports = PortReservations()
    port = ports.take("127.0.0.1")
    try:
        for _ in range(2):
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            async with (
                aiohttp.ClientSession() as session,
                session.get(f"http://127.0.0.1:{port}/health") as reply,
            ):
                assert (reply.status, await reply.text()) == (200, "ok")
            await runner.cleanup()
    finally:
        ports.close()


async def test_the_fleet_holds_its_engine_and_router_ports_until_it_stops(tmp_path: Path) -> None:
    cfg = load_config(None, ["engine.num_engines=2", "engine.port=0", "engine.router.kind='sglang-router'"])
    run = RunDir.at(str(tmp_path / "run"), None)
    fleet = EngineFleet(cfg, run, asyncio.Event(), served_version=lambda: 0, fail=lambda why: None)
    held = fleet.ports.ports
    router_port = int((fleet.router_url or "").rsplit(":", 1)[1])
    router_ports = [router_port, fleet._router_prometheus_port]
    assert sorted(held) == sorted([s.port for s in fleet.slots] + router_ports)
    assert len(set(held)) == 4
    for port in held:
        with pytest.raises(OSError):
            bind_plain(port)
    await fleet.stop(1.0)
    assert fleet.ports.ports == []
    for port in held:
        bind_plain(port)


async def test_a_stranger_answering_on_the_engine_port_is_named_and_the_child_killed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """What CI saw, now with its reason in the log: /health answers 404 from a program that is not the
    engine, so the start fails at once and the child is killed, not left holding the run."""
    app = web.Application()  # no /health route: aiohttp answers 404
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    client = EngineClient(f"http://127.0.0.1:{port}")
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    child = Child(ChildSpec("engine0", sleeper, tmp_path / "e.log"))
    await child.start()
    try:
        with caplog.at_level(logging.WARNING, logger="rollwise.engine_fleet"):
            assert not await asyncio.wait_for(ready_or_exited(client, child, timeout_s=30.0), 10.0)
        assert await asyncio.wait_for(child.wait(), 5.0) == -9
        assert "engine0" in caplog.text and "404" in caplog.text
    finally:
        child.kill()
        await client.close()
        await runner.cleanup()


def test_reservations_of_an_owner_that_never_closed_them_are_freed_when_it_is_collected() -> None:
    ports = PortReservations()
    port = ports.take("127.0.0.1")
    del ports
    bind_plain(port)
