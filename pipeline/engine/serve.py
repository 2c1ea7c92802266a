"""`rollwise engine serve` (and `python -m pipeline.engine`): start the engine server, run it until
SIGINT/SIGTERM.

`start_server` binds the port first (so /health answers 503 while the model loads), then loads and warms
the model; `serve` wraps it with signal handling and the process exit code; `main` is the entry point.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import sys
import time
from dataclasses import dataclass

import torch
from aiohttp import web

from pipeline.contracts import memory_trace
from pipeline.contracts.cpu_features import usable_cores
from pipeline.contracts.http_guard import (
    ENGINE_API_KEY_ENV,
    CannotListen,
    ExposedWithoutKey,
    bind_notice,
    listen,
    require_key_off_loopback,
    runner_options,
)
from pipeline.contracts.kernel_caches import bound_kernel_caches
from pipeline.contracts.tls import (
    PlaintextRefused,
    TlsFileError,
    check_files,
    require_tls_off_loopback,
    server_context,
)
from pipeline.engine.engine_state import STATE, EngineState
from pipeline.engine.routes import OPEN_PATHS, build_app
from pipeline.engine.serve_flags import ServerConfig, parse_args

log = logging.getLogger(__name__)


@dataclass
class RunningServer:
    """A started server (see `start_server`): `port` is the bound port (useful with port 0)."""

    app: web.Application
    runner: web.AppRunner
    port: int

    @property
    def state(self) -> EngineState:
        return self.app[STATE]

    @property
    def url(self) -> str:
        config = self.state.config
        return f"{'https' if config.tls.serves else 'http'}://{config.host}:{self.port}"

    async def close(self) -> None:
        await self.state.stop()
        await self.runner.cleanup()


async def start_server(config: ServerConfig) -> RunningServer:
    """Bind the HTTP port (so /health answers 503 at once), then load and warm the model. Raises
    ExposedWithoutKey for a non-loopback host without an API key (before binding anything)."""
    require_key_off_loopback("the engine", config.host, config.api_key, f"--api-key or {ENGINE_API_KEY_ENV}")
    how = "--ssl-certfile, --ssl-keyfile"
    require_tls_off_loopback("the engine", config.host, config.tls.serves, config.allow_plaintext, how)
    check_files(config.tls, "engine")
    app = build_app(config)
    runner = web.AppRunner(app, access_log=None, **runner_options(config.limits))
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port, ssl_context=server_context(config.tls))
    try:
        await listen(site, "the engine", config.host, config.port, "--port")
    except CannotListen:
        await runner.cleanup()
        raise
    port = int(runner.addresses[0][1]) if runner.addresses else config.port
    log.info("%s", bind_notice("engine", config.host, port, config.api_key, OPEN_PATHS))
    app[STATE].config = dataclasses.replace(config, port=port)  # /server_info tells the bound port
    running = RunningServer(app=app, runner=runner, port=port)
    try:
        await running.state.start()
    except BaseException:
        await running.close()
        raise
    return running


async def serve(config: ServerConfig) -> int:
    """Run until SIGINT/SIGTERM. Returns the process exit code (1 if the model could not be loaded)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = (signal.SIGINT, signal.SIGTERM)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    started = time.monotonic()
    try:
        try:
            running = await start_server(config)
        except (ExposedWithoutKey, PlaintextRefused, TlsFileError) as exc:
            log.error("%s", exc)
            return 2
        except CannotListen as exc:
            log.error("%s", exc)
            print(f"rollwise engine: {exc}", file=sys.stderr, flush=True)
            return 1
        except Exception:
            log.exception("engine failed to start with model %s", config.model)
            return 1
        log.info("serving %s on %s (ready in %.1f s)", config.model, running.url, time.monotonic() - started)
        print(f"rollwise engine listening on {running.url}", flush=True)
        try:
            await stop.wait()
        finally:
            await running.close()
        return 0
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)


def main(argv: list[str]) -> int:
    """`rollwise engine serve ...` entry point."""
    config = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(config.threads or usable_cores())
    bound_kernel_caches()  # before the first matmul: prefills come in ever new token counts
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one bar per weight update would flood the engine's log
    memory_trace.start_from_env("engine")
    return asyncio.run(serve(config))
