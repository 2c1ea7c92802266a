"""The supervisor's admin endpoint (`admin.host:admin.port`, 127.0.0.1:9401 by default) and its client,
`rollwise engines list|add URL|drain URL`.

    GET  /fleet                   {"router", "router_metrics", "engines": [...]}
    GET  /engines                 [{"url", "managed", "draining", "capacity", "weight_version", ...}]
    POST /engines                 {"url", "fetch_url"?} -> the engine joins on the served version
    POST /engines/drain           {"url"} -> returns once the engine has left (fleet_membership.py)
    GET  /weights/v<n>/manifest   published weights for fetchers (pipeline.transport.weights_http)
    GET  /weights/v<n>/files/<f>

Security: with `admin.token` ($ROLLWISE_ADMIN_TOKEN) set, every route needs `Authorization: Bearer
<token>` (pipeline.contracts.http_guard: constant-time compare, body and idle limits); `rollwise run`
refuses a
non-loopback `admin.host` without one, because these routes change the fleet and hand out the policy's
weights. Errors are JSON with 400 (bad request), 401 (token), 404 (unknown engine), 409 (conflicting
state), 413 (body too large) or 502 (engine unreachable).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import ssl
import sys
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from pipeline.contracts.http_guard import (
    BadBody,
    DoorLimits,
    api_key_middleware,
    listen,
    read_json,
    runner_options,
)
from pipeline.contracts.run_endpoints import running_endpoints
from pipeline.contracts.tls import PlaintextRefused, TlsFiles, check_url, client_context
from pipeline.supervisor.fleet.fleet_membership import FleetMembership, MembershipError
from pipeline.transport.weights_http import WeightServer

TOKEN_ENV = "ROLLWISE_ADMIN_TOKEN"
CA_ENV = "ROLLWISE_CA_FILE"
# Bodies are a URL or two; the limits of every rollwise door (pipeline.contracts.http_guard) otherwise.
ADMIN_LIMITS = DoorLimits(max_body_bytes=64 * 1024)


def _error(message: str, status: int) -> web.Response:
    return web.json_response({"error": message}, status=status)


async def _body(request: web.Request, *keys: str) -> dict[str, Any]:
    try:
        body = await read_json(request, ADMIN_LIMITS)
    except BadBody as exc:
        raise MembershipError(str(exc), exc.status) from None
    if not isinstance(body, dict) or any(not isinstance(body.get(k), str) for k in keys):
        raise MembershipError(f"body must be a JSON object with string field(s) {list(keys)}", 400)
    return body


def make_admin_app(membership: FleetMembership, weights: WeightServer, token: str | None) -> web.Application:
    app = web.Application(
        middlewares=[api_key_middleware(token, frozenset())] if token else [],
        client_max_size=ADMIN_LIMITS.max_body_bytes,
    )

    async def list_engines(request: web.Request) -> web.Response:
        return web.json_response(await membership.describe())

    async def add_engine(request: web.Request) -> web.Response:
        try:
            body = await _body(request, "url")
            fetch_url = body.get("fetch_url")
            return web.json_response(
                await membership.add(body["url"], fetch_url if isinstance(fetch_url, str) else None)
            )
        except MembershipError as exc:
            return _error(str(exc), exc.status)

    async def drain_engine(request: web.Request) -> web.Response:
        try:
            body = await _body(request, "url")
            return web.json_response(await membership.drain(body["url"]))
        except MembershipError as exc:
            return _error(str(exc), exc.status)

    async def fleet(request: web.Request) -> web.Response:
        f = membership.fleet
        return web.json_response(
            {
                "router": f.router_url,
                "router_metrics": f.router_metrics_url,
                "engines": await membership.describe(),
            }
        )

    app.router.add_get("/fleet", fleet)
    app.router.add_get("/engines", list_engines)
    app.router.add_post("/engines", add_engine)
    app.router.add_post("/engines/drain", drain_engine)
    weights.add_routes(app)
    return app


class AdminEndpoint:
    """Serve `make_admin_app` on host:port (port 0 = any free port; `port` tells which after start)."""

    def __init__(
        self, host: str, port: int, app: web.Application, ssl_context: ssl.SSLContext | None = None
    ) -> None:
        self.host = host
        self.port = port
        self.ssl_context = ssl_context  # TLS beyond loopback (pipeline.contracts.tls), None = plain
        self._runner = web.AppRunner(app, access_log=None, **runner_options(ADMIN_LIMITS))

    async def start(self) -> None:
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, ssl_context=self.ssl_context)
        await listen(site, "the admin endpoint", self.host, self.port, "admin.port")
        if self._runner.addresses:
            self.port = int(self._runner.addresses[0][1])

    async def stop(self) -> None:
        await self._runner.cleanup()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.ssl_context else 'http'}://{host}:{self.port}"


# --- `rollwise engines ...` ------------------------------------------------------------------------------
async def admin_call(
    base: str,
    method: str,
    path: str,
    body: dict[str, Any] | None,
    token: str | None,
    timeout_s: float,
    ca_file: str | None = None,
) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=5.0)
    connector = aiohttp.TCPConnector(ssl=client_context(TlsFiles(ca_file=ca_file)))
    async with (
        aiohttp.ClientSession(timeout=timeout, headers=headers, connector=connector) as http,
        http.request(method, base.rstrip("/") + path, json=body) as resp,
    ):
        text = await resp.text()
    try:
        return resp.status, json.loads(text)
    except ValueError:
        return resp.status, text


def main(argv: list[str]) -> int:
    """`rollwise engines list|add URL|drain URL`: change the fleet of a running daemon."""
    p = argparse.ArgumentParser(prog="rollwise engines", description=main.__doc__)
    door = p.add_mutually_exclusive_group()
    door.add_argument("--admin", help="the daemon's admin endpoint (default: http://127.0.0.1:9401)")
    door.add_argument("--run-dir", help="the running daemon's run directory: its admin endpoint as bound")
    p.add_argument("--token", help=f"admin token (default: ${TOKEN_ENV})")
    p.add_argument(
        "--ca-file", help=f"CA bundle that signed an https admin endpoint's certificate (default: ${CA_ENV})"
    )
    p.add_argument(
        "--allow-plaintext",
        action="store_true",
        help="send the token to an http:// endpoint on another host (in clear)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the daemon's answer")
    sub = p.add_subparsers(dest="action", required=True)
    sub.add_parser("list", help="engines, their state and weight version")
    add = sub.add_parser("add", help="join an engine: it loads the served weights before it gets work")
    add.add_argument("url")
    add.add_argument("--fetch-url", help="its weight fetcher (engine.weight_transport = http, SGLang)")
    drain = sub.add_parser("drain", help="take an engine out without losing its in-flight turns")
    drain.add_argument("url")
    args = p.parse_args(argv)
    if args.run_dir is not None:
        running = running_endpoints(Path(args.run_dir))
        if running is None or "admin" not in running:
            print(f"rollwise engines: no daemon runs on {args.run_dir}", file=sys.stderr)
            return 2
        args.admin = running["admin"]
    args.admin = args.admin or "http://127.0.0.1:9401"
    token = args.token or os.environ.get(TOKEN_ENV)
    try:
        check_url(args.admin, "--admin", args.allow_plaintext)
    except PlaintextRefused as exc:
        print(f"rollwise engines: {exc} (--allow-plaintext)", file=sys.stderr)
        return 2
    ca_file = args.ca_file or os.environ.get(CA_ENV)
    call: tuple[str, str, dict[str, Any] | None]
    if args.action == "list":
        call = ("GET", "/engines", None)
    elif args.action == "add":
        fetch = {"fetch_url": args.fetch_url} if args.fetch_url else {}
        call = ("POST", "/engines", {"url": args.url, **fetch})
    else:
        call = ("POST", "/engines/drain", {"url": args.url})
    try:
        method, path, body = call
        status, reply = asyncio.run(admin_call(args.admin, method, path, body, token, args.timeout, ca_file))
    except (aiohttp.ClientError, TimeoutError, ssl.SSLError) as exc:
        print(f"rollwise engines: cannot reach {args.admin}: {exc}", file=sys.stderr)
        return 1
    if status != 200:
        message = reply.get("error") if isinstance(reply, dict) else reply
        print(f"rollwise engines {args.action}: HTTP {status}: {message}", file=sys.stderr)
        return 1
    print(json.dumps(reply, indent=2))
    return 0
