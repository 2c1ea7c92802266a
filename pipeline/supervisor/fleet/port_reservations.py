"""Ports the daemon picks for its children, held until the daemon stops using them.

A port found by binding port 0 and closing the socket is free only for that moment. Until the child
meant to listen there has imported its libraries and bound it (seconds for an engine), any other bind to
port 0 may be handed the same port: the daemon's own metrics endpoint, or another program on the host.
The child then cannot bind, the daemon's /health probe reaches the stranger instead, and the engine is
restarted onto the same taken port until the daemon gives up.

A reservation keeps a socket bound to the port for as long as its owner lives, with SO_REUSEADDR and never
listening. The kernel's choice of a free port skips a port that has a bound socket, so nobody else is
handed it; a server that binds the port by number with SO_REUSEADDR (aiohttp, uvicorn and Rust's
standard library all set it) may still bind and listen beside the reservation, so the child gets its port
at its first start and at every restart.
"""

from __future__ import annotations

import contextlib
import socket
import weakref

from pipeline.contracts.http_guard import socket_family


def _release(held: list[socket.socket]) -> None:
    while held:
        with contextlib.suppress(OSError):
            held.pop().close()


class PortReservations:
    """Ports taken with `take(host)` stay reserved until `close()` (idempotent) or until this object is
    collected (an owner that never stopped, such as a test's)."""

    def __init__(self) -> None:
        self._held: list[socket.socket] = []
        self._finalizer = weakref.finalize(self, _release, self._held)

    def take(self, host: str) -> int:
        """A port on `host` that no other bind to port 0 will be handed while this object holds it."""
        sock = socket.socket(socket_family(host), socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host.strip("[]"), 0))
        except OSError:
            sock.close()
            raise
        self._held.append(sock)
        return int(sock.getsockname()[1])

    @property
    def ports(self) -> list[int]:
        return [int(s.getsockname()[1]) for s in self._held]

    def close(self) -> None:
        _release(self._held)
