"""The HTTP/1.1 client EngineClient speaks (pipeline.supervisor.engines.http1), against a raw TCP server that
writes exact bytes: framing, keep-alive, broken replies, timeouts, cancellation, the connection limit."""

from __future__ import annotations

import asyncio
import gc
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest

from pipeline.supervisor.engines.http1 import ConnectFailed, ConnectionLost, Http1Pool, _Reply
from pipeline.tools.fake_sglang import free_port

# (request head, request body) -> (bytes to write, close the connection afterwards)
Reply = Callable[[bytes, bytes], Awaitable[tuple[bytes, bool]]]


@dataclass
class RawServer:
    url: str = ""
    connections: int = 0  # opened so far
    open_now: int = 0
    most_open: int = 0
    requests: list[tuple[int, bytes, bytes]] = field(default_factory=list)  # (connection, head, body)
    client_closed: int = 0  # connections the client closed (EOF or reset while the server waited)


async def _read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes] | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    return head, await reader.readexactly(length)


@asynccontextmanager
async def raw_server(reply: Reply) -> AsyncIterator[RawServer]:
    state = RawServer()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        state.connections += 1
        number = state.connections
        state.open_now += 1
        state.most_open = max(state.most_open, state.open_now)
        try:
            while True:
                request = await _read_request(reader)
                if request is None:
                    state.client_closed += 1
                    break
                state.requests.append((number, *request))
                data, close = await reply(*request)
                writer.write(data)
                await writer.drain()
                if close:
                    break
        except ConnectionError:
            state.client_closed += 1
        finally:
            state.open_now -= 1
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    state.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        yield state
    finally:
        server.close()


def ok(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


def always(data: bytes, close: bool = False) -> Reply:
    async def reply(head: bytes, body: bytes) -> tuple[bytes, bool]:
        return data, close

    return reply


def never_answers() -> tuple[asyncio.Event, Reply]:
    """A reply that never comes, and the event set once a request has arrived for it."""
    arrived = asyncio.Event()

    async def reply(head: bytes, body: bytes) -> tuple[bytes, bool]:
        arrived.set()
        await asyncio.sleep(30)
        return b"", True

    return arrived, reply


def pool(url: str, limit: int = 8, connect_timeout_s: float = 5.0, **kwargs: Any) -> Http1Pool:
    return Http1Pool(url, limit=limit, connect_timeout_s=connect_timeout_s, **kwargs)


async def test_requests_are_written_exactly_and_one_connection_carries_them_all() -> None:
    async def echo(head: bytes, body: bytes) -> tuple[bytes, bool]:
        return ok(b"got " + body), False

    async with raw_server(echo) as server:
        client = pool(server.url + "/v1/", headers={"Authorization": "Bearer k"})
        try:
            first = await client.request(
                "POST", "/generate", b'{"a":1}', timeout_s=5, headers={"X-Key": "g1"}
            )
            second = await client.request("GET", "/health", None, timeout_s=5)
        finally:
            await client.close()
    assert first == (200, b'got {"a":1}')
    assert second == (200, b"got ")
    host = server.url.removeprefix("http://").encode()
    assert [head for _, head, _ in server.requests] == [
        b"POST /v1/generate HTTP/1.1\r\nHost: %s\r\nUser-Agent: rollwise\r\nAuthorization: Bearer k\r\n"
        b"X-Key: g1\r\nContent-Length: 7\r\n\r\n" % host,
        b"GET /v1/health HTTP/1.1\r\nHost: %s\r\nUser-Agent: rollwise\r\nAuthorization: Bearer k\r\n\r\n"
        % host,
    ]
    assert server.connections == 1


CHUNKED = (
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4;x=y\r\nabcd\r\n2\r\nef\r\n0\r\nT: 1\r\n\r\n"
)


@pytest.mark.parametrize(
    ("raw", "close", "status", "body", "reused"),
    [
        (CHUNKED, False, 200, b"abcdef", True),  # a chunk extension and a trailer
        (
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nhi",
            False,
            201,
            b"hi",
            True,
        ),
        (b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nhi", False, 200, b"hi", False),
        (b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nhi", False, 200, b"hi", False),
        (
            b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 2\r\n\r\nhi",
            False,
            200,
            b"hi",
            True,
        ),
        (b"HTTP/1.1 503 Busy\r\n\r\nto the close", True, 503, b"to the close", False),  # no length
        (b"HTTP/1.1 204 No Content\r\n\r\n", False, 204, b"", True),
        # bytes after the reply that nobody asked for: that connection is not trusted again
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhiEXTRA", False, 200, b"hi", False),
    ],
)
async def test_replies_are_framed_and_a_connection_is_reused_only_when_http_allows(
    raw: bytes, close: bool, status: int, body: bytes, reused: bool
) -> None:
    async with raw_server(always(raw, close)) as server:
        client = pool(server.url)
        try:
            assert await client.request("GET", "/a", None, timeout_s=5) == (status, body)
            assert await client.request("GET", "/b", None, timeout_s=5) == (status, body)
        finally:
            await client.close()
    assert server.connections == (1 if reused else 2)


def test_a_reply_split_anywhere_parses_the_same_as_in_one_piece() -> None:
    for cut in range(1, len(CHUNKED)):
        parser = _Reply(head_only=False)
        assert parser.feed(CHUNKED[:cut]) is False
        assert parser.feed(CHUNKED[cut:]) is True, cut
        assert (parser.status, parser.body, parser.keep_alive) == (200, b"abcdef", True)
    parser = _Reply(head_only=False)
    done = [parser.feed(CHUNKED[i : i + 1]) for i in range(len(CHUNKED))]
    assert done == [False] * (len(CHUNKED) - 1) + [True]
    assert parser.body == b"abcdef"


@pytest.mark.parametrize(
    ("raw", "defect"),
    [
        (b"SPDY/3 200 OK\r\nContent-Length: 0\r\n\r\n", "not an HTTP/1.x status line"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nhi", "bad Content-Length"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", "bad Content-Length"),
        (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "bad header line"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "bad chunk size"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabcd\r\n", "chunk not followed by CRLF"),
        (b"HTTP/1.1 200 OK\r\nX: " + b"a" * 70_000, "reply head longer than 65536 bytes"),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"1" * 5000,
            "chunk size line longer than",
        ),
        (CHUNKED[:-2] + b"T: " + b"t" * 70_000, "trailer line longer than"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort", "connection lost before a complete reply"),
        (b"", "connection lost before a complete reply"),  # closed without a word
    ],
)
async def test_a_broken_reply_is_a_lost_connection_naming_the_defect(raw: bytes, defect: str) -> None:
    replies = [(raw, True), (ok(b"fine"), False)]

    async def broken_once(head: bytes, body: bytes) -> tuple[bytes, bool]:
        return replies.pop(0)

    async with raw_server(broken_once) as server:
        client = pool(server.url)
        try:
            with pytest.raises(ConnectionLost, match=defect):
                await client.request("POST", "/generate", b"{}", timeout_s=5)
            # ... and the next request is answered on a fresh connection, unaffected.
            assert await client.request("POST", "/generate", b"{}", timeout_s=5) == (200, b"fine")
        finally:
            await client.close()
    assert server.connections == 2


async def test_a_connection_the_server_closed_while_idle_is_replaced_without_an_error() -> None:
    # The server answers, then closes the connection: what uvicorn does to a connection idle for 5 s.
    async with raw_server(always(ok(b"x"), close=True)) as server:
        client = pool(server.url)
        try:
            assert await client.request("GET", "/", None, timeout_s=5) == (200, b"x")
            await asyncio.sleep(0.05)  # the close reaches the client while the connection sits idle
            assert await client.request("GET", "/", None, timeout_s=5) == (200, b"x")
        finally:
            await client.close()
    assert server.connections == 2


async def test_a_reply_later_than_the_timeout_is_never_read_as_the_next_requests_answer() -> None:
    async def slow_first(head: bytes, body: bytes) -> tuple[bytes, bool]:
        if body == b"first":
            await asyncio.sleep(0.5)
        return ok(b"answer to " + body), False

    async with raw_server(slow_first) as server:
        client = pool(server.url, limit=1)
        try:
            started = time.monotonic()
            with pytest.raises(TimeoutError):
                await client.request("POST", "/", b"first", timeout_s=0.2)
            assert time.monotonic() - started < 0.45
            assert await client.request("POST", "/", b"second", timeout_s=5) == (200, b"answer to second")
        finally:
            await client.close()
    assert server.connections == 2  # the timed-out connection was closed, not reused


async def test_a_cancelled_request_closes_its_connection() -> None:
    arrived, never = never_answers()
    async with raw_server(never) as server:
        client = pool(server.url)
        try:
            task = asyncio.create_task(client.request("POST", "/", b"x", timeout_s=60))
            await arrived.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert client._idle == [] and client._busy == set()
        finally:
            await client.close()


async def test_no_more_than_limit_connections_are_open_and_waiting_counts_against_the_total_timeout() -> None:
    async def slow(head: bytes, body: bytes) -> tuple[bytes, bool]:
        await asyncio.sleep(0.1)
        return ok(body), False

    async with raw_server(slow) as server:
        client = pool(server.url, limit=2)
        try:
            replies = await asyncio.gather(
                *(client.request("POST", "/", b"%d" % i, timeout_s=5) for i in range(6))
            )
            assert replies == [(200, b"%d" % i) for i in range(6)]
            assert server.most_open == 2 and server.connections == 2
            # Two slots busy for 0.1 s each: a third request with 0.05 s in all times out waiting for one.
            busy = [asyncio.create_task(client.request("POST", "/", b"busy", timeout_s=5)) for _ in range(2)]
            await asyncio.sleep(0.01)
            with pytest.raises(TimeoutError):
                await client.request("POST", "/", b"late", timeout_s=0.05)
            await asyncio.gather(*busy)
        finally:
            await client.close()


async def test_a_body_larger_than_the_socket_buffers_goes_through() -> None:
    async def length(head: bytes, body: bytes) -> tuple[bytes, bool]:
        return ok(b"%d" % len(body)), False

    async with raw_server(length) as server:
        client = pool(server.url)
        try:
            assert await client.request("POST", "/", b"7" * 20_000_000, timeout_s=30) == (200, b"20000000")
        finally:
            await client.close()


async def test_refused_and_unanswered_connects_fail_as_never_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    client = pool(f"http://127.0.0.1:{free_port()}")
    with pytest.raises(ConnectFailed, match=r"cannot connect to 127\.0\.0\.1"):
        await client.request("GET", "/", None, timeout_s=5)
    await client.close()

    loop = asyncio.get_running_loop()

    async def hang(*args: Any, **kwargs: Any) -> Any:
        await asyncio.sleep(30)

    monkeypatch.setattr(loop, "create_connection", hang)
    client = pool("http://127.0.0.1:1", connect_timeout_s=0.1)
    started = time.monotonic()
    with pytest.raises(ConnectFailed, match=r"no connection to 127\.0\.0\.1:1 within 0\.1 s"):
        await client.request("GET", "/", None, timeout_s=5)
    assert time.monotonic() - started < 1.0
    await client.close()


async def test_closing_fails_requests_in_flight_and_refuses_new_ones() -> None:
    arrived, never = never_answers()
    async with raw_server(never) as server:
        client = pool(server.url)
        task = asyncio.create_task(client.request("POST", "/", b"x", timeout_s=60))
        await arrived.wait()
        await client.close()
        with pytest.raises(ConnectionLost):
            await task
        with pytest.raises(ConnectFailed, match="closed"):
            await client.request("GET", "/", None, timeout_s=5)


@pytest.mark.parametrize(
    "headers", [{"X-A": "1\r\nInjected: yes"}, {"X-A\r\nInjected": "1"}, {"": "1"}, {"X:A": "1"}]
)
async def test_a_header_that_would_split_the_request_is_refused(headers: dict[str, str]) -> None:
    client = pool("http://127.0.0.1:1")
    with pytest.raises(ValueError, match="line break or a bad name"):
        await client.request("GET", "/", None, timeout_s=5, headers=headers)
    await client.close()


@pytest.mark.parametrize(
    ("url", "defect"),
    [
        ("ftp://host/", "must be http"),
        ("http://", "must be http"),
        ("localhost:30000", "must be http"),
        ("http://user:secret@host:30000", "credentials, a query or a fragment"),
        ("http://host:30000/?x=1", "credentials, a query or a fragment"),
    ],
)
def test_a_base_url_that_is_not_just_a_server_is_refused(url: str, defect: str) -> None:
    with pytest.raises(ValueError, match=defect):
        pool(url)


async def test_an_ipv6_server_gets_its_bracketed_host_header() -> None:
    client = pool("http://[::1]:30000/api")
    assert (client.host, client.port, client.prefix) == ("::1", 30000, "/api")
    assert b"Host: [::1]:30000\r\n" in client._fixed
    await client.close()


async def test_a_server_that_hangs_up_while_a_large_body_is_sent_is_a_lost_connection(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.transport.abort()  # a reset while the client still has megabytes to send

    server = await asyncio.start_server(hang_up, "127.0.0.1", 0)
    client = pool(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
    try:
        with pytest.raises(ConnectionLost, match="connection lost"):
            await client.request("POST", "/", b"7" * 50_000_000, timeout_s=30)
    finally:
        await client.close()
        server.close()
    gc.collect()
    await asyncio.sleep(0)
    assert "never retrieved" not in caplog.text  # the reply's future failed too, and was seen


@pytest.fixture
def uvicorn_url() -> Iterator[tuple[str, list[tuple[str, int]]]]:
    """A real uvicorn server, run as SGLang runs its HTTP server (`uvicorn.run(app, ...,
    timeout_keep_alive=5)` in sglang/srt/entrypoints/http_server.py), with a 1 s keep-alive so that the
    test sees it close an idle connection. Yields its URL and the client address of every request."""
    uvicorn = pytest.importorskip("uvicorn", reason="uvicorn (installed with sglang-router) is missing")
    clients: list[tuple[str, int]] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        clients.append(tuple(scope["client"]))
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        size = int(scope["path"].rsplit("/", 1)[-1]) if scope["path"].startswith("/bytes/") else 0
        reply = b"x" * size if size else b'{"got":%d}' % len(body)
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": reply})

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, log_level="critical", timeout_keep_alive=1, lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.started, "uvicorn did not start"
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", clients
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


async def test_against_uvicorn_connections_are_reused_and_replaced_after_its_keep_alive_closes_them(
    uvicorn_url: tuple[str, list[tuple[str, int]]],
) -> None:
    url, clients = uvicorn_url
    client = pool(url)
    try:
        assert await client.request("POST", "/generate", b"[1,2,3]", timeout_s=5) == (200, b'{"got":7}')
        assert await client.request("POST", "/generate", b"[1]", timeout_s=5) == (200, b'{"got":3}')
        # uvicorn closes the connection once it has been idle for its keep-alive (1 s here).
        idle = client._idle[0]
        for _ in range(200):  # 10 s at most
            if idle.closed:
                break
            await asyncio.sleep(0.05)
        assert idle.closed, "uvicorn kept the idle connection open for 10 s"
        assert await client.request("POST", "/generate", b"[]", timeout_s=5) == (200, b'{"got":2}')
        status, big = await client.request("GET", "/bytes/3000000", None, timeout_s=10)
        assert status == 200 and big == b"x" * 3_000_000
    finally:
        await client.close()
    assert clients[0] == clients[1]  # kept alive
    assert clients[2] != clients[1]  # a fresh connection once the server closed the idle one
    assert clients[3] == clients[2]
