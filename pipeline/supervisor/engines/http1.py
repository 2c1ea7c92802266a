"""A small HTTP/1.1 client for one origin: what EngineClient speaks to an SGLang server or router.

Why not aiohttp: an actor's core is what bounds rollout throughput once the engines are fast, and every
turn of every episode is one /generate request. aiohttp's request path (URL objects, multidict headers,
cookie jar, tracing hooks, stream readers) costs ~100 CPU us per request on this machine; writing the
request as bytes and parsing the reply in one protocol object costs ~35 (`rollwise bench actors`).
EngineClient's calls are all small JSON exchanges with a server we know, so the client needs only:

- keep-alive connections, at most `limit` at once (requests beyond it wait for one, and that wait counts
  against the request's total timeout, not its connect timeout), reused most-recent first;
- TLS (the context given, else the system's trust with the host name checked);
- replies framed by Content-Length, by chunked transfer coding, or by the server closing the connection;
  1xx interim replies skipped; `Connection: close` and HTTP/1.0 honoured;
- errors that say whether the request may have reached the server: `ConnectFailed` (it did not: no
  connection could be opened in `connect_timeout_s`), `ConnectionLost` (it may have: the connection broke
  or the reply was not HTTP), `TimeoutError` (no complete reply within the total timeout).

A connection is reused only after a complete reply: one that was cancelled, timed out or broke is
closed, so no late reply can ever be read as the answer to the next request.

Why not httptools (llhttp, uvicorn's parser): it parses a 48-token /generate reply in ~1.3 us against
~3.8 us for `_Reply` (a 512-token chunked one: ~3 vs ~12 us; `python -m pipeline.tools.bench.http1_parser`,
both in one process, one httptools parser per connection), so it would save ~2.5 of the ~35 us per
request. It would not replace the framing code: httptools has no end-of-input call (replies framed by
the server closing), no body skip for HEAD, no limit on a reply head, trailer or chunk-size line; it
takes RTSP/ and ICE/ status lines, refuses a repeated equal Content-Length, raises on bytes after a
complete reply and names defects in llhttp's words. Keeping the contract above would wrap it in about as
much code as `_Reply` is.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Mapping
from urllib.parse import urlsplit

MAX_HEAD_BYTES = 64 * 1024  # status line + headers of one reply
MAX_CHUNK_LINE_BYTES = 4096


class ConnectFailed(ConnectionError):
    """No connection could be opened: the request never left this process."""


class ConnectionLost(ConnectionError):
    """The connection broke, or the reply was not valid HTTP, after the request may have been sent."""


def _find(buf: bytearray, separator: bytes, limit: int, what: str) -> int:
    """Where `separator` starts in `buf`, -1 while more bytes may bring it; a defect past `limit` bytes."""
    end = buf.find(separator)
    if end < 0 and len(buf) > limit:
        raise ConnectionLost(f"{what} longer than {limit} bytes")
    return end


class _Reply:
    """The incremental parser of one reply; `feed` returns True once the reply is complete."""

    __slots__ = ("_chunks", "_head_only", "_mode", "_remaining", "body", "buffer", "keep_alive", "status")

    def __init__(self, head_only: bool) -> None:
        self.buffer = bytearray()
        self.status = 0
        self.body = b""
        self.keep_alive = False
        self._mode = "head"  # head -> length | chunk_size | chunk_data | trailers | until_close -> done
        self._remaining = 0
        self._chunks: list[bytes] = []
        self._head_only = head_only

    def feed(self, data: bytes) -> bool:
        self.buffer += data
        return self._advance()

    def _advance(self) -> bool:
        buf = self.buffer
        while True:
            mode = self._mode
            if mode == "head":
                end = _find(buf, b"\r\n\r\n", MAX_HEAD_BYTES, "reply head")
                if end < 0:
                    return False
                head = bytes(buf[:end])
                del buf[: end + 4]
                self._read_head(head)
            elif mode == "length":
                if len(buf) < self._remaining:
                    return False
                self.body = bytes(buf[: self._remaining])
                del buf[: self._remaining]
                return self._done()
            elif mode == "chunk_size":
                end = _find(buf, b"\r\n", MAX_CHUNK_LINE_BYTES, "chunk size line")
                if end < 0:
                    return False
                size_text = bytes(buf[:end]).split(b";", 1)[0].strip()
                del buf[: end + 2]
                try:
                    size = int(size_text, 16)
                except ValueError:
                    raise ConnectionLost(f"bad chunk size {size_text[:40]!r}") from None
                if size < 0:
                    raise ConnectionLost(f"bad chunk size {size_text[:40]!r}")
                self._remaining = size
                self._mode = "chunk_data" if size else "trailers"
            elif mode == "chunk_data":
                if len(buf) < self._remaining + 2:
                    return False
                if buf[self._remaining : self._remaining + 2] != b"\r\n":
                    raise ConnectionLost("chunk not followed by CRLF")
                self._chunks.append(bytes(buf[: self._remaining]))
                del buf[: self._remaining + 2]
                self._mode = "chunk_size"
            elif mode == "trailers":
                end = _find(buf, b"\r\n", MAX_HEAD_BYTES, "trailer line")
                if end < 0:
                    return False
                del buf[: end + 2]
                if end == 0:  # the empty line after the last chunk's trailers
                    self.body = b"".join(self._chunks)
                    return self._done()
            else:  # until_close (or done): completed by `close`
                return False

    def _read_head(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise ConnectionLost(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
        status = int(parts[1])
        http10 = parts[0] == b"HTTP/1.0"
        length: int | None = None
        chunked = False
        close = http10
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep:
                raise ConnectionLost(f"bad header line {line[:80]!r}")
            key = name.strip().lower()
            if key == b"content-length":
                try:
                    n = int(value.strip())
                except ValueError:
                    raise ConnectionLost(f"bad Content-Length {value.strip()[:40]!r}") from None
                if n < 0 or (length is not None and n != length):
                    raise ConnectionLost(f"bad Content-Length {value.strip()[:40]!r}")
                length = n
            elif key == b"transfer-encoding":
                chunked = value.strip().lower().rsplit(b",", 1)[-1].strip() == b"chunked"
            elif key == b"connection":
                tokens = {t.strip() for t in value.lower().split(b",")}
                if b"close" in tokens:
                    close = True
                elif http10 and b"keep-alive" in tokens:
                    close = False
        if 100 <= status < 200:
            return  # an interim reply (100 Continue): the final one follows; stay in "head"
        self.status = status
        self.keep_alive = not close
        if self._head_only or status in (204, 304):
            self._mode = "length"
            self._remaining = 0
        elif chunked:
            self._mode = "chunk_size"
        elif length is not None:
            self._mode = "length"
            self._remaining = length
        else:
            self._mode = "until_close"
            self.keep_alive = False

    def _done(self) -> bool:
        self._mode = "done"
        if self.buffer:  # bytes nobody asked for: the connection's framing cannot be trusted
            self.keep_alive = False
        return True

    def close(self) -> bool:
        """The server closed the connection: True when that completes the reply."""
        if self._mode == "until_close":
            self.body = bytes(self.buffer)
            self.buffer.clear()
            self._mode = "done"
            return True
        return False


class _Connection(asyncio.Protocol):
    """One keep-alive connection; one exchange at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._reply: _Reply | None = None
        self._waiter: asyncio.Future[_Reply] | None = None
        self._drain: asyncio.Future[None] | None = None
        self._paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        reply, waiter = self._reply, self._waiter
        if reply is None or waiter is None or waiter.done():
            self.closed = True  # a reply to nothing: never reuse this connection
            if self.transport is not None:
                self.transport.abort()
            return
        try:
            complete = reply.feed(data)
        except ConnectionLost as exc:
            waiter.set_exception(exc)
            return
        if complete:
            waiter.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        reply, waiter = self._reply, self._waiter
        if waiter is not None and not waiter.done():
            if reply is not None and reply.close():
                waiter.set_result(reply)
            else:
                reason = f"{type(exc).__name__}: {exc}" if exc is not None else "the server closed it"
                waiter.set_exception(ConnectionLost(f"connection lost before a complete reply ({reason})"))
        drain = self._drain
        if drain is not None and not drain.done():
            drain.set_exception(ConnectionLost("connection lost while sending"))

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        drain = self._drain
        if drain is not None and not drain.done():
            drain.set_result(None)

    async def exchange(self, request: bytes, head_only: bool) -> _Reply:
        transport = self.transport
        assert transport is not None
        loop = asyncio.get_running_loop()
        self._reply = _Reply(head_only)
        self._waiter = waiter = loop.create_future()
        try:
            transport.write(request)
            if self._paused:  # a large body: wait until the kernel took it, as a stream writer's drain does
                self._drain = loop.create_future()
                await self._drain
            return await waiter
        finally:
            if waiter.done() and not waiter.cancelled():
                waiter.exception()  # seen: when sending failed, that failure is the one raised
            self._reply = self._waiter = self._drain = None

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


def _header_bytes(headers: Mapping[str, str]) -> bytes:
    lines = []
    for name, value in headers.items():
        if any(c in name for c in "\r\n:") or not name or any(c in value for c in "\r\n"):
            raise ValueError(f"HTTP header {name!r}: {value!r} has a line break or a bad name")
        lines.append(f"{name}: {value}\r\n")
    return "".join(lines).encode("latin-1")


class Http1Pool:
    """Keep-alive HTTP/1.1 connections to the origin of `base_url` (whose path, if any, prefixes every
    request's). Belongs to the event loop of its first request; `close()` ends every connection."""

    def __init__(
        self,
        base_url: str,
        *,
        limit: int,
        connect_timeout_s: float,
        ssl_context: ssl.SSLContext | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"base URL must be http:// or https:// with a host, got {base_url!r}")
        if parts.username is not None or parts.query or parts.fragment:
            raise ValueError(
                f"base URL {base_url!r} has credentials, a query or a fragment: give the server as "
                "scheme://host:port[/path] (an API key goes in api_key)"
            )
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.prefix = parts.path.rstrip("/")
        self.ssl: ssl.SSLContext | None = None
        if parts.scheme == "https":
            self.ssl = ssl_context if ssl_context is not None else ssl.create_default_context()
        self.limit = limit
        self.connect_timeout_s = connect_timeout_s
        authority = parts.netloc.rsplit("@", 1)[-1]
        self._fixed = _header_bytes({"Host": authority, "User-Agent": "rollwise", **(headers or {})})
        self._slots: asyncio.Semaphore | None = None
        self._idle: list[_Connection] = []
        self._busy: set[_Connection] = set()
        self._closed = False

    async def request(
        self,
        method: str,
        path: str,
        body: bytes | None,
        *,
        timeout_s: float,
        headers: Mapping[str, str] | None = None,
    ) -> tuple[int, bytes]:
        """(status, body) of one exchange. Raises ConnectFailed, ConnectionLost, TimeoutError."""
        if self._closed:
            raise ConnectFailed("the client is closed")
        head = b"%s %s HTTP/1.1\r\n" % (method.encode("ascii"), (self.prefix + path).encode("ascii"))
        extra = _header_bytes(headers) if headers else b""
        length = b"Content-Length: %d\r\n" % len(body) if body is not None else b""
        request = b"".join((head, self._fixed, extra, length, b"\r\n", body or b""))
        async with asyncio.timeout(timeout_s):
            slots = self._slots
            if slots is None:
                slots = self._slots = asyncio.Semaphore(self.limit)
            async with slots:
                connection = await self._checkout()
                self._busy.add(connection)
                reusable = False
                try:
                    reply = await connection.exchange(request, head_only=method == "HEAD")
                    reusable = reply.keep_alive
                    return reply.status, reply.body
                finally:
                    self._busy.discard(connection)
                    if reusable and not connection.closed and not self._closed:
                        self._idle.append(connection)
                    else:
                        connection.abort()

    async def _checkout(self) -> _Connection:
        while self._idle:
            connection = self._idle.pop()
            if not connection.closed:
                return connection
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, connection = await loop.create_connection(
                    _Connection,
                    self.host,
                    self.port,
                    ssl=self.ssl,
                    server_hostname=self.host if self.ssl else None,
                )
        except TimeoutError:
            raise ConnectFailed(
                f"no connection to {self.host}:{self.port} within {self.connect_timeout_s} s"
            ) from None
        except (OSError, ssl.SSLError) as exc:  # refused, unreachable, name not found, certificate refused
            raise ConnectFailed(f"cannot connect to {self.host}:{self.port}: {exc}") from exc
        if self._closed:
            connection.abort()
            raise ConnectFailed("the client is closed")
        return connection

    async def close(self) -> None:
        """Close every connection; requests in flight fail with ConnectionLost."""
        self._closed = True
        for connection in [*self._idle, *self._busy]:
            connection.abort()
        self._idle.clear()
        await asyncio.sleep(0)  # let the transports deliver connection_lost
