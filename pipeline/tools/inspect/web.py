"""`rollwise inspect --run-dir D`: a local web page over a run's groups, token by token.

    rollwise inspect --run-dir D [--port 0] [--max-groups 500]

Serves on 127.0.0.1 (a free port unless `--port`; the URL is printed on start) until Ctrl-C, on the
aiohttp stack the daemon uses. The page is plain HTML/JS shipped in the package
(pipeline/tools/inspect/static,
no build step); it asks for JSON:

    GET /api/run                      run directory, newest version, colour channels
    GET /api/groups?env=&outcome=&finish_reason=&version_min=&version_max=&staleness_min=
                   &staleness_max=&traced=yes|no&limit=     newest groups first
                                      (pipeline.tools.inspect.trajectories)
    GET /api/groups/{group_id}        one group: its episodes as chat blocks of tokens with their values
    GET /api/quarantine               quarantined spool files with their reasons

A bad filter is a 400 naming the parameter; an unknown group a 404. Trajectories are untrusted text: the
page builds every element with createElement/textContent and never parses model output as HTML.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from pathlib import Path
from typing import Any

from aiohttp import web

from pipeline.tools.inspect.trajectories import RunView, parse_filter

STATIC = Path(__file__).parent / "static"
VIEW = web.AppKey("view", RunView)
_CSP = "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'"


@web.middleware
async def _headers(request: web.Request, handler: Any) -> web.StreamResponse:
    response: web.StreamResponse = await handler(request)
    # Defence in depth: even a bug that inserted model text as markup could not run a script.
    response.headers["Content-Security-Policy"] = _CSP
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Cache-Control"] = "no-store"
    return response


async def index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC / "index.html")


async def run_info(request: web.Request) -> web.Response:
    return web.json_response(await asyncio.to_thread(request.app[VIEW].run_info))


async def groups(request: web.Request) -> web.Response:
    query = dict(request.query)
    try:
        keep = parse_filter(query)
        limit = int(query.get("limit") or 200)
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
    except ValueError as exc:
        return web.json_response({"error": str(exc)}, status=400)
    return web.json_response(await asyncio.to_thread(request.app[VIEW].list_groups, keep, limit=limit))


async def group(request: web.Request) -> web.Response:
    group_id = request.match_info["group_id"]
    detail = await asyncio.to_thread(request.app[VIEW].group_detail, group_id)
    if detail is None:
        return web.json_response({"error": f"no group {group_id!r} in the spool or the trace"}, status=404)
    return web.json_response(detail)


async def quarantine(request: web.Request) -> web.Response:
    return web.json_response({"files": await asyncio.to_thread(request.app[VIEW].quarantine)})


def build_app(view: RunView) -> web.Application:
    app = web.Application(middlewares=[_headers])
    app[VIEW] = view
    app.router.add_get("/", index)
    app.router.add_get("/api/run", run_info)
    app.router.add_get("/api/groups", groups)
    app.router.add_get("/api/groups/{group_id}", group)
    app.router.add_get("/api/quarantine", quarantine)
    app.router.add_static("/static/", STATIC)
    return app


def load_tokenizer_of(run_dir: Path) -> Any:
    """The run's tokenizer: from `model.path` in its config, else its `model/` directory."""
    from pipeline.contracts.config import load_config
    from pipeline.contracts.run_dir import RunDir
    from pipeline.supervisor.wiring import load_tokenizer

    model_path = None
    config_file = RunDir.at(run_dir).config_file
    if config_file.is_file():
        model_path = load_config(config_file).model.path
    return load_tokenizer(RunDir.at(run_dir, model_path).initial_model)


async def start(view: RunView, host: str, port: int) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(build_app(view), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1] if runner.addresses else port
    return runner, f"http://{host}:{bound}/"


async def serve(view: RunView, host: str, port: int) -> None:
    runner, url = await start(view, host, port)
    print(f"rollwise inspect: {view.run.root} on {url} (Ctrl-C stops)", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="rollwise inspect", description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", required=True, type=Path, help="run directory (spool, trace, logs)")
    p.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (default: a free one)")
    p.add_argument("--max-groups", type=int, default=500, help="newest spool groups read (default 500)")
    args = p.parse_args(argv)
    if not (args.run_dir / "spool").is_dir() and not (args.run_dir / "trace").is_dir():
        print(f"rollwise inspect: {args.run_dir} has no spool/ or trace/: not a run dir", file=sys.stderr)
        return 2
    try:
        tokenizer = load_tokenizer_of(args.run_dir)
    except Exception as exc:
        print(f"rollwise inspect: cannot load the run's tokenizer: {exc}", file=sys.stderr)
        return 2
    view = RunView(args.run_dir, tokenizer, max_groups=args.max_groups)
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is how it stops
        asyncio.run(serve(view, "127.0.0.1", args.port))
    return 0
