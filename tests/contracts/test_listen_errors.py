"""A port another process holds is one line naming the address and the setting that moves it, for every
server rollwise opens (pipeline.contracts.http_guard.listen, check_port_free)."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from pipeline.contracts.http_guard import CannotListen, check_port_free
from pipeline.supervisor.fleet.admin import AdminEndpoint, make_admin_app
from pipeline.supervisor.http_endpoints import HttpEndpoints
from pipeline.transport.flight import SpoolFlightService
from pipeline.transport.weights_http import WeightServerThread


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield int(held.getsockname()[1])


def test_check_port_free_names_the_key_and_port_zero_is_always_free(taken_port: int) -> None:
    check_port_free("x", "127.0.0.1", 0, "x.port")
    with pytest.raises(CannotListen) as caught:
        check_port_free("the thing", "127.0.0.1", taken_port, "thing.port")
    text = str(caught.value)
    assert f"127.0.0.1:{taken_port}" in text and "is taken" in text and "set thing.port" in text
    assert "\n" not in text and "Errno" not in text


async def test_the_metrics_endpoint_on_a_taken_port_says_which_key_moves_it(taken_port: int) -> None:
    endpoints = HttpEndpoints("127.0.0.1", taken_port, lambda: [])
    with pytest.raises(
        CannotListen, match=rf"metrics endpoint cannot listen on 127\.0\.0\.1:{taken_port}.*metrics\.port"
    ):
        await endpoints.start()
    await endpoints.stop()


async def test_the_admin_endpoint_on_a_taken_port_says_which_key_moves_it(taken_port: int) -> None:
    app = make_admin_app(None, _NoWeights(), None)  # type: ignore[arg-type]
    admin = AdminEndpoint("127.0.0.1", taken_port, app)
    with pytest.raises(CannotListen, match=r"admin endpoint .* set admin\.port"):
        await admin.start()
    await admin.stop()


def test_the_flight_service_and_the_weight_server_on_a_taken_port(taken_port: int, tmp_path: object) -> None:
    with pytest.raises(CannotListen, match=r"Flight spool service .* set transport\.flight_port"):
        SpoolFlightService(f"{tmp_path}/spool", host="127.0.0.1", port=taken_port)
    server = WeightServerThread(lambda v: tmp_path, "127.0.0.1", taken_port, None, what="the weight server")
    with pytest.raises(CannotListen, match=r"set learner\.remote\.weights_port"):
        server.start()


def test_an_address_this_machine_does_not_have_is_named() -> None:
    with pytest.raises(CannotListen, match=r"192\.0\.2\.1 is not an address of this machine"):
        check_port_free("the thing", "192.0.2.1", 4000, "thing.port")


class _NoWeights:
    def add_routes(self, app: object) -> None:
        return None
