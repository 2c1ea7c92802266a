"""What every rollwise HTTP server checks at its door (the embedded engine, the supervisor's endpoint, and
any server added later). Import-light: aiohttp and the standard library.

- Binding: a server bound to anything but a loopback address must require an API key.
  `require_key_off_loopback` raises `ExposedWithoutKey` (the caller refuses to start) and
  `bind_notice` is the line a server logs at start, saying who may call it. Keys are never logged.
- Keys: `api_key_middleware` wants `Authorization: Bearer <key>` on every path but `open_paths` (the
  liveness probes), compared in constant time; 401 with a message otherwise.
- Bodies: `client_max_size` (aiohttp answers 413) and `read_json`: the whole body within
  `body_timeout_s` (408: a client trickling its body cannot hold a handler), then JSON that parses
  (400 naming the defect: malformed, not UTF-8, nested deeper than the parser goes). A body over
  `INLINE_PARSE_BYTES` is parsed in a worker thread, with every number and object passing through a
  Python hook: the C parser alone holds the GIL for the whole body (about 0.1 s per MiB), and the hooks
  let the interpreter hand it to the event loop's thread every switch interval, so a 20 MiB body does
  not stall /health for a second. (Bare NaN and Infinity parse as floats, as Python's json reads
  them: the handler that knows the field refuses them with its name.)
- Slow or idle connections: `runner_options` sets aiohttp's keepalive timeout, which also closes a
  connection whose request line and headers never complete (a slow-loris client) after `idle_timeout_s`.
- Ports: `listen` starts a site and turns a bind failure (a port another daemon holds, an address this
  machine does not have) into `CannotListen`, one line naming the address and the setting that moves
  it, instead of an OSError traceback.
"""

from __future__ import annotations

import asyncio
import errno
import hmac
import ipaddress
import json
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# How rollwise hands an engine it starts its key: the environment, never the command line (which
# /proc/<pid>/cmdline and the child's log show).
ENGINE_API_KEY_ENV = "ROLLWISE_ENGINE_API_KEY"


@dataclass(frozen=True)
class DoorLimits:
    """`max_body_bytes`: largest request body (413 beyond); `body_timeout_s`: time to receive it (408);
    `idle_timeout_s`: a connection without a complete request for this long is closed."""

    max_body_bytes: int = 32 * 2**20
    body_timeout_s: float = 30.0
    idle_timeout_s: float = 75.0


class ExposedWithoutKey(ValueError):
    """A server asked to listen beyond loopback without an API key."""


class CannotListen(Exception):
    """A server could not bind its address; the message is one line naming the setting that moves it."""


def cannot_listen(exc: OSError, what: str, host: str, port: int, key: str) -> CannotListen:
    """The one-line CannotListen for a bind that failed with `exc`."""
    if exc.errno == errno.EADDRINUSE:
        why = f"port {port} is taken (another rollwise daemon, or another program, listens there)"
        fix = f"set {key} to another port (0 picks a free one)"
    elif exc.errno == errno.EADDRNOTAVAIL:
        why = f"{host} is not an address of this machine"
        fix = f"bind an address this machine has (or 0.0.0.0), or change the host next to {key}"
    elif exc.errno == errno.EACCES:
        why = f"port {port} needs privileges this process does not have"
        fix = f"set {key} to a port above 1023"
    else:
        why, fix = str(exc), f"check {key}"
    return CannotListen(f"{what} cannot listen on {host}:{port}: {why}; {fix}")


def socket_family(host: str) -> socket.AddressFamily:
    """IPv6 for a host with a colon ("::1", "[::1]"), else IPv4."""
    return socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET


def check_port_free(what: str, host: str, port: int, key: str) -> None:
    """Raise CannotListen when `host:port` cannot be bound now (for servers, such as gRPC's, that report
    a failed bind without its cause). Port 0 is always free."""
    if port == 0:
        return
    with socket.socket(socket_family(host), socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: TIME_WAIT is no owner
        try:
            probe.bind((host.strip("[]"), port))
        except OSError as exc:
            raise cannot_listen(exc, what, host, port, key) from None


async def listen(site: web.TCPSite, what: str, host: str, port: int, key: str) -> None:
    """`await site.start()`, with a bind failure as CannotListen (module docstring)."""
    try:
        await site.start()
    except OSError as exc:
        raise cannot_listen(exc, what, host, port, key) from None


class BadBody(ValueError):
    """A request body that cannot be used; `status` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and "localhost"; an empty host or 0.0.0.0 means every interface."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def require_key_off_loopback(what: str, host: str, api_key: str | None, key_source: str) -> None:
    """Raise ExposedWithoutKey when `host` is not loopback and there is no key (`key_source` names the
    setting the operator should use)."""
    if not is_loopback(host) and not api_key:
        raise ExposedWithoutKey(
            f"{what} would listen on {host!r}, which is not a loopback address, without an API key: anyone "
            f"who can reach the port could use it. Set {key_source}, or bind 127.0.0.1"
        )


def bind_notice(what: str, host: str, port: int, api_key: str | None, open_paths: frozenset[str]) -> str:
    """The line a server logs at start about who may call it (never the key itself)."""
    where = f"{what} on {host}:{port}"
    if api_key:
        opened = f" except {', '.join(sorted(open_paths))}" if open_paths else ""
        return f"{where}: every route{opened} requires Authorization: Bearer <API key>"
    return f"{where}: loopback only, no API key"


def api_key_middleware(api_key: str, open_paths: frozenset[str]) -> Any:
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path not in open_paths:
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                return web.json_response(
                    {"error": {"message": "missing or wrong API key (Authorization: Bearer <key>)"}},
                    status=401,
                )
        return await handler(request)

    return check


INLINE_PARSE_BYTES = 256 * 1024  # parsed on the event loop below this size (a few milliseconds)


def _int_hook(text: str) -> int:
    return int(text)


def _float_hook(text: str) -> float:
    return float(text)


def _object_hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    return dict(pairs)


def loads_yielding(raw: bytes) -> Any:
    """json.loads that lets other threads run while it parses (module docstring); about 2x slower."""
    return json.loads(raw, parse_int=_int_hook, parse_float=_float_hook, object_pairs_hook=_object_hook)


async def read_json(request: web.Request, limits: DoorLimits) -> Any:
    """The body parsed as JSON (None when empty); BadBody with the status and the defect otherwise."""
    try:
        async with asyncio.timeout(limits.body_timeout_s):
            raw = await request.read()
    except TimeoutError:
        raise BadBody(f"request body not received within {limits.body_timeout_s:g} s", status=408) from None
    except web.HTTPRequestEntityTooLarge:
        raise BadBody(f"request body larger than {limits.max_body_bytes} bytes", status=413) from None
    if not raw or raw.isspace():
        return None
    try:
        if len(raw) <= INLINE_PARSE_BYTES:
            return json.loads(raw)
        return await asyncio.to_thread(loads_yielding, raw)
    except UnicodeDecodeError as exc:
        raise BadBody(f"request body is not UTF-8 JSON: {exc.reason} at byte {exc.start}") from None
    except RecursionError:
        raise BadBody("request body is JSON nested too deeply") from None
    except ValueError as exc:
        raise BadBody(f"malformed JSON body: {exc}") from None


def runner_options(limits: DoorLimits) -> dict[str, Any]:
    """Keyword arguments for web.AppRunner that bound idle and slow-loris connections."""
    return {"keepalive_timeout": limits.idle_timeout_s}
