"""A TCP proxy that makes the network hostile on purpose: it sits between the hosts (in a namespace of its
own, pipeline.tools.hosts.namespaces) and forwards each route's connections to its target, with faults
set per route while it runs:

- `latency_s = (low, high)`: every chunk is delivered after a delay drawn from [low, high] (order kept);
- `drop`: the share of new connections closed at once, before a byte is forwarded;
- `reset`: the share of forwarded chunks after which the connection is reset (RST, SO_LINGER 0);
- `rate_bps`: a throttled link, bytes per second each way (a token bucket per connection direction);
- `blackhole`: bytes are swallowed and new connections hang (a partition at the proxy).

Every byte that crosses a route is also searched for `needles` (secrets that must never cross in clear):
`seen(needle)` counts the routes' matches, across chunk boundaries. TLS passes through untouched: the
proxy sees only what an eavesdropper on the wire would.

The proxy runs its own event loop in its own thread (`start`, `stop`); settings change from any thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

CHUNK = 64 * 1024


@dataclass
class Faults:
    """What a route does to its traffic now (module docstring)."""

    latency_s: tuple[float, float] = (0.0, 0.0)
    drop: float = 0.0
    reset: float = 0.0
    rate_bps: float | None = None
    blackhole: bool = False


@dataclass
class Route:
    """Connections to `listen_port` on the proxy's address go to `target` (host, port)."""

    name: str
    target: tuple[str, int]
    listen_port: int = 0
    faults: Faults = field(default_factory=Faults)
    connections: int = 0
    dropped: int = 0
    resets: int = 0
    bytes_forwarded: int = 0


class FaultProxy:
    """Routes on one address. `add(name, target)` before `start()`; `port(name)` after."""

    def __init__(self, host: str, *, seed: int = 0, enter: Callable[[], None] | None = None) -> None:
        self.host = host
        self.routes: dict[str, Route] = {}
        self.needles: list[bytes] = []
        self._seen: dict[bytes, int] = {}
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._servers: list[asyncio.AbstractServer] = []
        self._writers: set[asyncio.StreamWriter] = set()
        # Called first in the proxy's thread: moves it into the proxy host's namespace (Network.enter).
        self._enter = enter

    def add(self, name: str, target: tuple[str, int], listen_port: int = 0) -> Route:
        route = Route(name, target, listen_port)
        self.routes[name] = route
        return route

    def port(self, name: str) -> int:
        return self.routes[name].listen_port

    def address(self, name: str) -> str:
        return f"{self.host}:{self.port(name)}"

    def set(self, name: str | None = None, **faults: Any) -> None:
        """Replace the faults of route `name` (every route when None) with `Faults(**faults)`."""
        for route in self.routes.values() if name is None else [self.routes[name]]:
            route.faults = Faults(**faults)

    def clear(self) -> None:
        self.set(None)

    def watch(self, *needles: str) -> None:
        for needle in needles:
            self.needles.append(needle.encode())
            self._seen.setdefault(needle.encode(), 0)

    def seen(self, needle: str) -> int:
        with self._lock:
            return self._seen.get(needle.encode(), 0)

    # --- the loop -------------------------------------------------------------------------------------
    def start(self) -> None:
        ready = threading.Event()
        failed: list[BaseException] = []

        def body() -> None:
            loop = self._loop = asyncio.new_event_loop()
            try:
                loop.run_until_complete(self._listen())
            except BaseException as exc:
                failed.append(exc)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self._shutdown())
            loop.close()

        def thread_main() -> None:
            if self._enter is not None:
                try:
                    self._enter()
                except OSError as exc:
                    failed.append(exc)
                    ready.set()
                    return
            body()

        self._thread = threading.Thread(target=thread_main, name="fault-proxy", daemon=True)
        self._thread.start()
        ready.wait(30)
        if failed:
            raise failed[0]

    async def _listen(self) -> None:
        for route in self.routes.values():
            server = await asyncio.start_server(
                functools.partial(self._serve, route), self.host, route.listen_port, reuse_address=True
            )
            self._servers.append(server)
            route.listen_port = int(server.sockets[0].getsockname()[1])

    def stop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        self._loop = self._thread = None

    async def _shutdown(self) -> None:
        for server in self._servers:
            server.close()
        for writer in list(self._writers):
            _abort(writer)
        for server in self._servers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 2)

    # --- one connection -------------------------------------------------------------------------------
    async def _serve(self, route: Route, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        route.connections += 1
        faults = route.faults
        if faults.blackhole:  # silence, even after the client's EOF, until the partition ends
            self._writers.add(writer)
            await _swallow(reader)
            while route.faults.blackhole:  # noqa: ASYNC110 - set from another thread, polled
                await asyncio.sleep(0.1)
            self._writers.discard(writer)
            _abort(writer)
            return
        if faults.drop and self._rng.random() < faults.drop:
            route.dropped += 1
            writer.close()
            return
        try:
            up_reader, up_writer = await asyncio.wait_for(asyncio.open_connection(*route.target), 10)
        except (OSError, TimeoutError):
            _abort(writer)
            return
        self._writers |= {writer, up_writer}
        tasks = [
            asyncio.ensure_future(self._pipe(route, reader, up_writer, writer)),
            asyncio.ensure_future(self._pipe(route, up_reader, writer, up_writer)),
        ]
        try:
            await asyncio.gather(*tasks)
        finally:
            self._writers -= {writer, up_writer}
            for w in (writer, up_writer):
                _abort(w)

    async def _pipe(
        self,
        route: Route,
        source: asyncio.StreamReader,
        sink: asyncio.StreamWriter,
        peer: asyncio.StreamWriter,
    ) -> None:
        """Copy `source` to `sink` under the route's faults (read each time: they change while it runs)."""
        tail = b""
        budget, last = 0.0, time.monotonic()
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        sender = asyncio.ensure_future(_deliver(queue, sink))
        try:
            while True:
                try:
                    data = await source.read(CHUNK)
                except (ConnectionError, OSError):
                    break
                if not data:
                    break
                faults = route.faults
                if faults.blackhole:
                    continue
                tail = self._search(tail + data)
                if faults.rate_bps:
                    now = time.monotonic()
                    budget = min(faults.rate_bps, budget + (now - last) * faults.rate_bps) - len(data)
                    last = now
                    if budget < 0:
                        await asyncio.sleep(-budget / faults.rate_bps)
                low, high = faults.latency_s
                due = time.monotonic() + (self._rng.uniform(low, high) if high > 0 else 0.0)
                route.bytes_forwarded += len(data)
                await queue.put((due, data))
                if faults.reset and self._rng.random() < faults.reset:
                    route.resets += 1
                    _abort(sink)
                    _abort(peer)
                    break
        finally:
            await queue.put((0.0, b""))
            with contextlib.suppress(Exception):
                await asyncio.wait_for(sender, 5)
            sender.cancel()

    def _search(self, window: bytes) -> bytes:
        """Count the needles in `window`; return the tail a needle split across chunks could start in."""
        if not self.needles:
            return b""
        with self._lock:
            for needle in self.needles:
                self._seen[needle] += window.count(needle)
        keep = max(len(n) for n in self.needles) - 1
        return window[-keep:] if keep > 0 else b""


async def _deliver(queue: asyncio.Queue[tuple[float, bytes]], sink: asyncio.StreamWriter) -> None:
    """Write chunks at their due time, in order; an empty chunk ends the direction (half-close)."""
    while True:
        due, data = await queue.get()
        if not data:
            with contextlib.suppress(Exception):
                if sink.can_write_eof():
                    sink.write_eof()
            return
        delay = due - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        try:
            sink.write(data)
            await sink.drain()
        except (ConnectionError, OSError, RuntimeError):
            return


async def _swallow(reader: asyncio.StreamReader) -> None:
    with contextlib.suppress(Exception):
        while await reader.read(CHUNK):
            pass


def _abort(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP reset (SO_LINGER 0), as a middlebox that gives up on a connection does."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport = writer.transport
    with contextlib.suppress(Exception):
        transport.abort()
