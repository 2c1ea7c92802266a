"""Published weights over HTTP, for engines (and a supervisor) that do not share the disk they are on.

Supervisor side (routes on the admin endpoint, pipeline/supervisor/fleet/admin.py; the same routes on the
weight server of a learner with its own run directory, `WeightServerThread`, from which the supervisor copies
each version into its run directory with `fetch_version` before the engines load it):

    GET /weights/v<n>/manifest        {"version": n, "files": [{"path", "size", "sha256"}, ...]}
    GET /weights/v<n>/files/<path>    the file's bytes (sendfile)

Engine side: a *fetcher* answers `POST /fetch_weights {"source": BASE, "version": n, "token": T|null}`
by downloading version n from BASE into its own directory (staged as `v<n>.tmp`, every file checked
against the manifest's size and sha256, then renamed to `v<n>`, the manifest kept beside it as
`v<n>.manifest.json`), keeping the `KEEP_VERSIONS` most recently installed, and replies
`{"success": true, "model_path": "<dir>/v<n>"}`. The supervisor then calls SGLang's
`update_weights_from_disk` on that engine with that local path. The embedded engine serves the route
itself (`--weights-dir`); beside an SGLang server runs `rollwise engine fetch-agent --dir D --port P`.
The download happens while the engines keep generating; only the load runs inside the pause.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import ssl
import sys
import threading
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from pipeline.contracts.http_guard import (
    ENGINE_API_KEY_ENV,
    CannotListen,
    DoorLimits,
    ExposedWithoutKey,
    api_key_middleware,
    bind_notice,
    check_port_free,
    listen,
    require_key_off_loopback,
    runner_options,
)
from pipeline.contracts.tls import (
    PlaintextRefused,
    TlsFiles,
    check_url,
    client_context,
    require_tls_off_loopback,
    server_context,
)

log = logging.getLogger(__name__)

KEEP_VERSIONS = 3
MANIFEST_CACHE = 8  # manifests a WeightServer keeps (hashing a large model's files takes a while)
CHUNK = 1 << 20
STALL_S = 20.0  # seconds a download may go without a byte before it is given up and retried
# A fetcher (engine side) keeps resuming a broken download this long before it answers the failure: the
# supervisor's request crosses the network too, and each of its retries would start from the manifest.
FETCHER_RETRY_S = 60.0
RETRY_FIRST_S, RETRY_MAX_S = 0.25, 2.0
_VERSION_DIR = re.compile(r"^v(\d+)$")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def build_manifest(weights_dir: Path, version: int) -> dict[str, Any]:
    """Every regular file under `weights_dir` (relative POSIX paths, sorted) with size and sha256."""
    files = []
    for path in sorted(p for p in weights_dir.rglob("*") if p.is_file()):
        rel = path.relative_to(weights_dir).as_posix()
        files.append({"path": rel, "size": path.stat().st_size, "sha256": _sha256(path)})
    if not files:
        raise FileNotFoundError(f"no files under {weights_dir}")
    return {"version": version, "files": files}


class WeightServer:
    """The two GET routes over a `weights_of(version) -> Path` function
    (pipeline.contracts.run_dir.RunDir's)."""

    def __init__(self, weights_of: Any) -> None:
        self.weights_of = weights_of
        # A version's directory never changes once renamed into place, but a learner that restarted from
        # an older checkpoint publishes the same version number again as a new directory: the cache is
        # keyed by the directory's identity too.
        self._manifests: dict[tuple[int, int, int], dict[str, Any]] = {}

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get(r"/weights/v{version:\d+}/manifest", self.manifest)
        app.router.add_get(r"/weights/v{version:\d+}/files/{path:.+}", self.file)

    async def manifest(self, request: web.Request) -> web.Response:
        version = int(request.match_info["version"])
        directory = Path(self.weights_of(version))
        identity = await asyncio.to_thread(_published_identity, directory)
        if identity is None:
            return web.json_response({"error": f"version {version} is not published"}, status=404)
        key = (version, *identity)
        manifest = self._manifests.get(key)
        if manifest is None:
            manifest = await asyncio.to_thread(build_manifest, directory, version)
            # One entry per version, the newest few: a long run publishes thousands.
            kept = sorted(k for k in self._manifests if k[0] != version)[-(MANIFEST_CACHE - 1) :]
            self._manifests = {k: self._manifests[k] for k in kept}
            self._manifests[key] = manifest
        return web.json_response(manifest)

    async def file(self, request: web.Request) -> web.StreamResponse:
        version = int(request.match_info["version"])
        name = request.match_info["path"]
        target = await asyncio.to_thread(_inside, Path(self.weights_of(version)), name)
        if target is None:
            return web.json_response({"error": f"no file {name!r} in v{version}"}, status=404)
        return web.FileResponse(target)


def _published_identity(directory: Path) -> tuple[int, int] | None:
    """(inode, mtime) of a complete version directory, None when there is none."""
    try:
        if not (directory / "config.json").is_file():
            return None
        stat = directory.stat()
    except OSError:
        return None
    return stat.st_ino, stat.st_mtime_ns


def _inside(root: Path, name: str) -> Path | None:
    """`root/name` when it is a file under `root` (no escape through `..` or links), else None."""
    root = root.resolve()
    target = (root / name).resolve()
    return target if target.is_relative_to(root) and target.is_file() else None


class WeightServerThread:
    """A WeightServer with its own thread and event loop, for a process that is not asyncio: the learner
    with its own run directory serves its published versions to the supervisor this way. The door
    is pipeline.contracts.http_guard's: a bearer token (required off loopback), small bodies, idle
    connections cut."""

    LIMITS = DoorLimits(max_body_bytes=64 * 1024)

    def __init__(
        self,
        weights_of: Any,
        host: str,
        port: int,
        token: str | None,
        *,
        what: str,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.server = WeightServer(weights_of)
        self.host, self.port, self.token, self.what = host, port, token, what
        self.ssl_context = ssl_context  # TLS (pipeline.contracts.tls.context_for); None = plain
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> int:
        """Bind and serve; returns the bound port. ExposedWithoutKey off loopback without a token;
        OSError when the port cannot be bound."""
        require_key_off_loopback(self.what, self.host, self.token, "learner.remote.weights_token")
        loop = self._loop = asyncio.new_event_loop()
        bound: list[int] = []
        failed: list[BaseException] = []
        ready = threading.Event()

        def serve() -> None:
            asyncio.set_event_loop(loop)
            try:
                bound.append(loop.run_until_complete(self._open()))
            except BaseException as exc:  # handed to start(), which raises it in the caller's thread
                failed.append(exc)
                return
            finally:
                ready.set()
            loop.run_forever()

        self._thread = threading.Thread(target=serve, name="weight-server", daemon=True)
        self._thread.start()
        ready.wait()
        if failed:
            self._thread.join()
            loop.run_until_complete(self._close_runner())
            loop.close()
            raise failed[0]
        self.port = bound[0]
        log.info("%s", bind_notice(self.what, self.host, self.port, self.token, frozenset()))
        return self.port

    async def _open(self) -> int:
        app = web.Application(
            middlewares=[api_key_middleware(self.token, frozenset())] if self.token else [],
            client_max_size=self.LIMITS.max_body_bytes,
        )
        self.server.add_routes(app)
        self._runner = web.AppRunner(app, access_log=None, **runner_options(self.LIMITS))
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, ssl_context=self.ssl_context)
        await listen(site, self.what, self.host, self.port, "learner.remote.weights_port")
        return int(self._runner.addresses[0][1])

    async def _close_runner(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def stop(self) -> None:
        """Close the server and its loop. Idempotent."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or not thread.is_alive():
            return

        async def close() -> None:
            await self._close_runner()
            loop.stop()

        asyncio.run_coroutine_threadsafe(close(), loop)
        thread.join(timeout=10)
        if not thread.is_alive():
            loop.close()


def advertised_url(host: str, port: int, scheme: str = "http") -> str:
    """scheme://host:port as another machine reaches it: a wildcard bind names this machine instead."""
    if host in ("", "0.0.0.0", "::", "[::]"):
        host = socket.getfqdn()
    elif ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{scheme}://{host}:{port}"


class FetchError(Exception):
    """A download that could not complete or did not match its manifest. `transient`: the network's
    doing (a short read, a 5xx answer), so another attempt, resuming what is staged, may succeed."""

    def __init__(self, message: str, *, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient


# What a network that drops and resets connections raises; each is worth another attempt.
_NETWORK_FAILURES = (aiohttp.ClientError, TimeoutError, ConnectionError)
_RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})


async def fetch_version(
    source: str,
    version: int,
    dest_root: Path,
    *,
    token: str | None = None,
    timeout_s: float = 3600.0,
    ssl_context: ssl.SSLContext | None = None,
    retry_s: float = 0.0,
) -> Path:
    """Download version `version` from the weight server at `source` into `dest_root/v<version>`.

    Idempotent: a complete copy whose manifest (kept beside it as `v<n>.manifest.json`) is the one the
    source serves now is returned as is; a copy of another manifest (the same version number published
    again by a learner that restarted from an older checkpoint) is replaced. A network failure (reset,
    refused, stalled, a 5xx) is tried again, resuming the staged files, for up to `retry_s` seconds
    (0: the first failure is raised); a certificate the source fails is not. Raises FetchError naming the
    file, or the network's error."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + retry_s
    delay, attempt = RETRY_FIRST_S, 0
    while True:
        attempt += 1
        try:
            return await _fetch_once(source, version, dest_root, token, timeout_s, ssl_context)
        except (*_NETWORK_FAILURES, FetchError) as exc:
            permanent = isinstance(exc, aiohttp.ClientConnectorCertificateError) or (
                isinstance(exc, FetchError) and not exc.transient
            )
            if permanent or loop.time() + delay > deadline:
                raise
            log.warning(
                "fetching version %d from %s: attempt %d failed (%s: %s); resuming in %.2f s",
                version,
                source,
                attempt,
                type(exc).__name__,
                str(exc)[:200],
                delay,
            )
            await asyncio.sleep(delay)
            delay = min(2 * delay, RETRY_MAX_S)


async def _fetch_once(
    source: str,
    version: int,
    dest_root: Path,
    token: str | None,
    timeout_s: float,
    ssl_context: ssl.SSLContext | None,
) -> Path:
    final = dest_root / f"v{version}"
    staged = dest_root / f"v{version}.tmp"
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    base = f"{source.rstrip('/')}/weights/v{version}"
    # A transfer that stalls (a server whose handler died mid-file without closing the connection, seen
    # under bench hosts' resets) fails after STALL_S without a byte, and the next attempt resumes it.
    timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=10.0, sock_read=STALL_S)
    connector = aiohttp.TCPConnector(ssl=ssl_context) if ssl_context is not None else None
    async with aiohttp.ClientSession(timeout=timeout, headers=headers, connector=connector) as http:
        async with http.get(base + "/manifest") as resp:
            raw = await resp.read()
            if resp.status != 200:
                raise FetchError(
                    f"{base}/manifest answered {resp.status}: {raw[:200].decode('utf-8', 'replace')}",
                    transient=resp.status in _RETRYABLE_STATUS,
                )
        try:
            manifest = json.loads(raw)
        except ValueError:
            manifest = None
        if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), list):
            raise FetchError(f"{base}/manifest is not a manifest: {raw[:200]!r}")
        if await asyncio.to_thread(_have_copy, final, manifest):
            return final
        await asyncio.to_thread(_stage_for, staged, manifest)
        for entry in manifest["files"]:
            await _download(http, f"{base}/files/{entry['path']}", staged, entry)
    await asyncio.to_thread(_install, staged, final, dest_root, manifest)
    return final


def _manifest_file(final: Path) -> Path:
    return final.parent / f"{final.name}.manifest.json"


def _have_copy(final: Path, manifest: dict[str, Any]) -> bool:
    try:
        kept = json.loads(_manifest_file(final).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return bool(kept.get("files") == manifest["files"] and (final / "config.json").is_file())


_STAGED_MANIFEST = ".manifest.json"


def _stage_for(staged: Path, manifest: dict[str, Any]) -> None:
    """Keep what an earlier, broken fetch of the same manifest staged (its files resume where they
    stopped); start over for any other manifest."""
    mark = staged / _STAGED_MANIFEST
    try:
        if json.loads(mark.read_text(encoding="utf-8")) == manifest:
            return
    except (OSError, ValueError):
        pass
    shutil.rmtree(staged, ignore_errors=True)
    staged.mkdir(parents=True)
    mark.write_text(json.dumps(manifest), encoding="utf-8")


def staged_bytes(dest_root: Path, version: int) -> int:
    """Bytes a broken fetch of `version` into `dest_root` left staged for the next attempt to resume
    (0: none). A caller that retries compares it across an attempt to tell a link that breaks but
    delivers from one that delivers nothing."""
    staged = dest_root / f"v{version}.tmp"
    try:
        files = [p for p in staged.rglob("*") if p.name != _STAGED_MANIFEST]
        return sum(p.stat().st_size for p in files if p.is_file())
    except OSError:  # removed or replaced by the attempt that finished it
        return 0


def _partial(target: Path) -> tuple[int, Any]:
    """Bytes already staged at `target` and their running sha256 (0 and a fresh one when none)."""
    digest = hashlib.sha256()
    try:
        with open(target, "rb") as handle:
            for block in iter(lambda: handle.read(CHUNK), b""):
                digest.update(block)
            return handle.tell(), digest
    except FileNotFoundError:
        return 0, digest


async def _download(http: aiohttp.ClientSession, url: str, staged: Path, entry: dict[str, Any]) -> None:
    """One file of the manifest, checked against its size and sha256. A file that an earlier attempt
    left partly staged continues with an HTTP range request (the weight server's FileResponse answers
    206), so a link that resets connections still makes progress; a server that answers 200 instead
    sends it whole again."""
    rel = Path(entry["path"])
    if rel.is_absolute() or ".." in rel.parts:
        raise FetchError(f"manifest names an unsafe path {entry['path']!r}")
    target = staged / rel
    target.parent.mkdir(parents=True, exist_ok=True)
    size, digest = await asyncio.to_thread(_partial, target)
    if size > entry["size"]:
        size, digest = 0, hashlib.sha256()
    if size == entry["size"] and digest.hexdigest() == entry["sha256"]:
        return
    headers = {"Range": f"bytes={size}-"} if 0 < size < entry["size"] else None
    async with http.get(url, headers=headers) as resp:
        if resp.status == 200:
            size, digest = 0, hashlib.sha256()
        elif not (resp.status == 206 and headers is not None):
            raise FetchError(f"{url} answered {resp.status}", transient=resp.status in _RETRYABLE_STATUS)
        # Chunked writes on the loop: a thread hop per MiB costs more.
        with open(target, "ab" if size else "wb") as handle:  # noqa: ASYNC230
            async for block in resp.content.iter_chunked(CHUNK):
                handle.write(block)
                digest.update(block)
                size += len(block)
    if size != entry["size"] or digest.hexdigest() != entry["sha256"]:
        target.unlink(missing_ok=True)  # the next attempt starts this file over
        raise FetchError(
            f"{url}: got {size} bytes sha256 {digest.hexdigest()[:12]}, manifest says {entry['size']} "
            f"bytes sha256 {entry['sha256'][:12]}"
        )


def _install(staged: Path, final: Path, dest_root: Path, manifest: dict[str, Any]) -> None:
    (staged / _STAGED_MANIFEST).unlink(missing_ok=True)
    for path in staged.rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    copies = _copies(dest_root)
    kept = _manifest_file(final)
    kept.unlink(missing_ok=True)  # no moment where an old manifest vouches for the new directory
    shutil.rmtree(final, ignore_errors=True)
    os.rename(staged, final)
    staged_manifest = kept.with_suffix(".tmp")
    install_seq = 1 + max((seq for seq, _ in copies), default=0)
    staged_manifest.write_text(json.dumps({**manifest, "install_seq": install_seq}), encoding="utf-8")
    os.replace(staged_manifest, kept)
    # Keep KEEP_VERSIONS copies: this one and the most recently installed others. By install order, not
    # version number: a learner that restarted from an older checkpoint has the engines go back to that
    # version, which must survive beside the higher numbers of the lineage it lost.
    others = [path for _, path in copies if path != final]
    for old in others[: max(0, len(others) - (KEEP_VERSIONS - 1))]:
        shutil.rmtree(old, ignore_errors=True)
        _manifest_file(old).unlink(missing_ok=True)


def _copies(dest_root: Path) -> list[tuple[int, Path]]:
    """(install sequence, directory) of every v<n> copy, oldest install first (0: no manifest kept)."""
    found = []
    for path in dest_root.iterdir():
        match = _VERSION_DIR.match(path.name)
        if not (match and path.is_dir()):
            continue
        try:
            seq = int(json.loads(_manifest_file(path).read_text(encoding="utf-8"))["install_seq"])
        except (OSError, ValueError, KeyError, TypeError):
            seq = 0
        found.append((seq, int(match.group(1)), path))
    return [(seq, path) for seq, _, path in sorted(found)]


def add_fetch_route(
    app: web.Application,
    dest_root: Path,
    *,
    ssl_context: ssl.SSLContext | None = None,
    allow_plaintext: bool = False,
    retry_s: float = FETCHER_RETRY_S,
) -> None:
    """`POST /fetch_weights` (module docstring) storing versions under `dest_root`. `ssl_context`: what
    an https source is checked against; a plain http source on another host is refused unless
    `allow_plaintext` (the request hands the source its token). A broken download is resumed for up to
    `retry_s` seconds before the request is answered with the failure."""
    lock = asyncio.Lock()  # one download at a time: two syncs never race on the same staging dir

    async def fetch(request: web.Request) -> web.Response:
        try:
            body = await request.json()
            source, version = str(body["source"]), int(body["version"])
            token = body.get("token")
            check_url(source, "fetch_weights source", allow_plaintext)
        except (ValueError, KeyError, TypeError) as exc:
            return _failed(f"bad fetch_weights body: {exc}")
        async with lock:
            try:
                path = await fetch_version(
                    source, version, dest_root, token=token, ssl_context=ssl_context, retry_s=retry_s
                )
            except (FetchError, aiohttp.ClientError, TimeoutError, OSError, KeyError) as exc:
                log.error("fetching version %d from %s failed: %r", version, source, exc)
                return _failed(f"{type(exc).__name__}: {exc}")
        return web.json_response({"success": True, "model_path": str(path)})

    app.router.add_post("/fetch_weights", fetch)


def _failed(message: str) -> web.Response:
    return web.json_response({"success": False, "message": message}, status=400)


async def request_fetch(
    fetcher_url: str,
    *,
    source: str,
    version: int,
    token: str | None,
    timeout_s: float = 3600.0,
    ssl_context: ssl.SSLContext | None = None,
    api_key: str | None = None,
) -> str:
    """Ask the fetcher at `fetcher_url` to download `version`; returns its local model path. `api_key`:
    the fetcher's (the engine's) key; `ssl_context`: what an https fetcher is checked against."""
    body = {"source": source, "version": version, "token": token}
    timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=10.0)
    url = fetcher_url.rstrip("/") + "/fetch_weights"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    connector = aiohttp.TCPConnector(ssl=ssl_context) if ssl_context is not None else None
    async with (
        aiohttp.ClientSession(timeout=timeout, headers=headers, connector=connector) as http,
        http.post(url, json=body) as resp,
    ):
        text = await resp.text()
    try:
        reply = json.loads(text)
    except ValueError:
        reply = {}
    if resp.status != 200 or reply.get("success") is not True:
        raise FetchError(f"{fetcher_url} could not fetch version {version}: {resp.status} {text[:300]}")
    return str(reply["model_path"])


def main(argv: list[str]) -> int:
    """`rollwise engine fetch-agent`: the fetcher beside an SGLang server that does not share the disk."""
    p = argparse.ArgumentParser(prog="rollwise engine fetch-agent", description=main.__doc__)
    p.add_argument("--dir", required=True, help="where versions are stored (v<n>/, newest 3 kept)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30100)
    p.add_argument(
        "--api-key",
        help=f"require Authorization: Bearer <key> (default: ${ENGINE_API_KEY_ENV}, the engine's key, which "
        "the supervisor sends); needed beyond loopback",
    )
    p.add_argument("--ssl-certfile", help="PEM certificate: serve https (needed beyond loopback)")
    p.add_argument("--ssl-keyfile", help="PEM private key of --ssl-certfile")
    p.add_argument("--ssl-ca-certs", help="PEM CA bundle an https weight source is checked against")
    p.add_argument(
        "--allow-plaintext", action="store_true", help="serve plain HTTP beyond loopback, fetch from http://"
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s fetch-agent %(levelname)s %(message)s")
    files = TlsFiles(args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs)
    api_key = args.api_key or os.environ.get(ENGINE_API_KEY_ENV) or None
    try:
        require_key_off_loopback("the fetch agent", args.host, api_key, f"--api-key or {ENGINE_API_KEY_ENV}")
        require_tls_off_loopback(
            "the fetch agent", args.host, files.serves, args.allow_plaintext, "--ssl-certfile, --ssl-keyfile"
        )
        check_port_free("the fetch agent", args.host, args.port, "--port")
    except (ExposedWithoutKey, PlaintextRefused, CannotListen) as exc:
        print(f"rollwise engine fetch-agent: {exc}", file=sys.stderr)
        return 2 if not isinstance(exc, CannotListen) else 1
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    app = web.Application(middlewares=[api_key_middleware(api_key, frozenset())] if api_key else [])
    add_fetch_route(app, root, ssl_context=client_context(files), allow_plaintext=args.allow_plaintext)
    log.info("%s", bind_notice("fetch agent", args.host, args.port, api_key, frozenset()))
    web.run_app(app, host=args.host, port=args.port, print=None, ssl_context=server_context(files))
    return 0
