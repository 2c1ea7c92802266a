"""sglang-router in front of the engines: its command line, and its worker list as rollwise keeps it.

The router is SGLang's own (`pip install sglang-router`, a Rust extension module; version 0.3.2's
flags and worker API, checked against `--help` and a running router):

- started as `python -m sglang_router.launch_router --host H --port P --worker-urls U... --policy manual
  --assignment-mode min_load ...`; it forwards `/generate` to one worker and answers `/readiness`
  (200 once a worker is healthy) and `GET /workers` (`{"workers": [{"id", "url", "is_healthy", ...}],
  "total"}`);
- workers join with `POST /workers {"url"}` (202: queued; the router registers it in the background
  after reading its /server_info) and leave with `DELETE /workers/{id}` (the router's UUID, not the URL).

Policy: `manual` with the episode id as `X-SMG-Routing-Key` pins every turn of an episode to one worker
(new keys go to the worker with the fewest requests, `--assignment-mode min_load`; a key moves only
when its worker leaves or turns unhealthy), so the episode's growing prompt stays in that worker's
radix cache. `cache_aware` matches request text; rollwise sends token ids only, and measured on
0.3.2 it then sends every new episode to the same worker.
"""

from __future__ import annotations

import asyncio
import ssl
import sys
import time
from typing import Any
from urllib.parse import quote

import aiohttp

from pipeline.contracts.tls import TlsFiles

ROUTER_MODULE = "sglang_router.launch_router"


def router_argv(
    *,
    host: str,
    port: int,
    worker_urls: list[str],
    policy: str,
    request_timeout_s: float,
    prometheus_port: int,
    api_key: str | None = None,
    extra_args: list[str] | tuple[str, ...] = (),
    tls: TlsFiles | None = None,
) -> list[str]:
    """Command line of a router on host:port in front of `worker_urls` (possibly none yet). `tls`: its
    certificate (served beyond loopback) and the CA it checks https workers against (sglang-router
    0.3.2's --tls-cert-path, --tls-key-path, --ca-cert-paths)."""
    argv = [
        sys.executable,
        "-m",
        ROUTER_MODULE,
        "--host",
        host,
        "--port",
        str(port),
        "--policy",
        policy,
        "--request-timeout-secs",
        str(max(1, int(request_timeout_s))),
        # A dead worker must leave the routing table in seconds, not the default minutes; the supervisor
        # also removes the engines it sees die at once.
        "--health-check-interval-secs",
        "5",
        "--health-failure-threshold",
        "2",
        "--prometheus-host",
        host,
        "--prometheus-port",
        str(prometheus_port),
        "--log-level",
        "warn",
    ]
    if policy == "manual":
        argv += ["--assignment-mode", "min_load"]
    if api_key is not None:
        argv += ["--api-key", api_key]
    if tls is not None and tls.serves:
        argv += ["--tls-cert-path", str(tls.cert_file), "--tls-key-path", str(tls.key_file)]
    if tls is not None and tls.ca_file is not None:
        argv += ["--ca-cert-paths", tls.ca_file]
    if worker_urls:
        argv += ["--worker-urls", *worker_urls]
    return [*argv, *extra_args]


class RouterError(Exception):
    """The router refused a worker-list change or did not answer as 0.3.2 does."""


class RouterAdmin:
    """The router's worker list over its HTTP API. Every call has a timeout."""

    def __init__(
        self, base_url: str, *, timeout_s: float = 10.0, ssl_context: ssl.SSLContext | None = None
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.ssl_context = ssl_context
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(ssl=self.ssl_context or True)
            self._session = aiohttp.ClientSession(timeout=self.timeout, connector=connector)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def workers(self) -> dict[str, dict[str, Any]]:
        """Registered workers by URL: each one's router record (`id`, `is_healthy`, `load`...)."""
        async with self._http().get(self.base_url + "/workers") as resp:
            if resp.status != 200:
                raise RouterError(f"GET {self.base_url}/workers answered {resp.status}: {await resp.text()}")
            body = await resp.json()
        try:
            return {str(w["url"]).rstrip("/"): w for w in body["workers"]}
        except (KeyError, TypeError) as exc:
            raise RouterError(f"GET {self.base_url}/workers: unexpected body {body!r}") from exc

    async def add_worker(self, url: str) -> None:
        """Ask the router to register `url` (it does so in the background; see `wait_workers`)."""
        async with self._http().post(self.base_url + "/workers", json={"url": url}) as resp:
            if resp.status not in (200, 201, 202):
                raise RouterError(f"router refused worker {url}: {resp.status} {await resp.text()}")

    async def remove_worker(self, url: str) -> bool:
        """Deregister `url`; False when the router did not list it."""
        record = (await self.workers()).get(url.rstrip("/"))
        if record is None:
            return False
        path = f"{self.base_url}/workers/{quote(str(record['id']), safe='')}"
        async with self._http().delete(path) as resp:
            if resp.status not in (200, 202, 204):
                raise RouterError(f"router refused to remove worker {url}: {resp.status} {await resp.text()}")
        return True

    async def wait_workers(
        self, expected: set[str], timeout_s: float, *, poll_s: float = 0.1, healthy: bool = True
    ) -> None:
        """Until the router lists exactly `expected` (healthy ones, by default); RouterError after
        `timeout_s` naming what it lists instead."""
        expected = {u.rstrip("/") for u in expected}
        deadline = time.monotonic() + timeout_s
        listed: dict[str, dict[str, Any]] = {}
        while time.monotonic() < deadline:
            try:
                listed = await self.workers()
            except (aiohttp.ClientError, TimeoutError, RouterError):
                listed = {}
            ready = {u for u, w in listed.items() if w.get("is_healthy", True) or not healthy}
            if set(listed) == expected and ready == expected:
                return
            await asyncio.sleep(poll_s)
        raise RouterError(
            f"router {self.base_url} lists {sorted(listed)} after {timeout_s} s, expected {sorted(expected)}"
        )

    async def wait_worker(self, url: str, timeout_s: float, *, poll_s: float = 0.1) -> None:
        """Until the router lists `url` as healthy; RouterError after `timeout_s`."""
        url = url.rstrip("/")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                record = (await self.workers()).get(url)
            except (aiohttp.ClientError, TimeoutError, RouterError):
                record = None
            if record is not None and record.get("is_healthy", True):
                return
            await asyncio.sleep(poll_s)
        raise RouterError(f"router {self.base_url} does not list {url} as healthy after {timeout_s} s")
