"""The tests' fault proxy on 127.0.0.1 (no namespaces needed): it forwards, delays, drops, resets,
throttles and swallows as told, and counts the secrets it sees on the wire."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from pipeline.tools.hosts.fault_proxy import FaultProxy


@pytest.fixture
def echo() -> Iterator[tuple[str, int]]:
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def handle(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):  # the proxy resets some connections on purpose
            while data := conn.recv(65536):
                conn.sendall(data)

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            threading.Thread(target=handle, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()
    stop.set()
    thread.join()
    server.close()


@pytest.fixture
def proxy(echo: tuple[str, int]) -> Iterator[FaultProxy]:
    p = FaultProxy("127.0.0.1", seed=1)
    p.add("echo", echo)
    p.watch("s3cr3t-token")
    p.start()
    yield p
    p.stop()


def roundtrip(proxy: FaultProxy, payload: bytes, timeout_s: float = 10.0) -> bytes:
    with socket.create_connection(("127.0.0.1", proxy.port("echo")), timeout=timeout_s) as conn:
        conn.sendall(payload)
        conn.shutdown(socket.SHUT_WR)
        got = b""
        while chunk := conn.recv(65536):
            got += chunk
    return got


def test_it_forwards_and_counts_secrets_split_across_chunks(proxy: FaultProxy) -> None:
    payload = b"x" * 65530 + b"s3cr3t-token" + b"y" * 100
    assert roundtrip(proxy, payload) == payload
    assert proxy.seen("s3cr3t-token") == 2  # once each way, split at the 64 KiB chunk boundary


def test_latency_delays_each_chunk_within_its_range(proxy: FaultProxy) -> None:
    proxy.set("echo", latency_s=(0.05, 0.2))
    started = time.monotonic()
    assert roundtrip(proxy, b"ping") == b"ping"
    assert 0.1 <= time.monotonic() - started < 2.0  # two one-way delays of 50-200 ms


def test_dropped_and_reset_connections(proxy: FaultProxy) -> None:
    proxy.set("echo", drop=1.0)
    # closed before a byte was forwarded: an EOF, or (the request still unread) a reset or a socket the
    # peer already left
    with contextlib.suppress(OSError):
        assert roundtrip(proxy, b"ping") == b""
    assert proxy.routes["echo"].dropped == 1
    proxy.set("echo", reset=1.0)
    with pytest.raises(OSError):  # a reset, seen by whichever call of the client comes next
        for _ in range(50):
            roundtrip(proxy, b"ping" * 1000)
    assert proxy.routes["echo"].resets >= 1


def test_a_throttled_link_takes_its_time(proxy: FaultProxy) -> None:
    proxy.set("echo", rate_bps=200_000)
    started = time.monotonic()
    assert roundtrip(proxy, b"z" * 200_000) == b"z" * 200_000
    assert time.monotonic() - started >= 0.8  # 200 kB each way at 200 kB/s, the first second's budget free


def test_a_blackhole_swallows_and_clearing_restores(proxy: FaultProxy) -> None:
    proxy.set("echo", blackhole=True)
    with pytest.raises(TimeoutError):
        roundtrip(proxy, b"ping", timeout_s=0.5)
    proxy.clear()
    assert roundtrip(proxy, b"ping") == b"ping"
