"""The control routes: weight updates, LoRA adapters, pause / continue, abort and cache flush, with
SGLang's request and reply shapes."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from aiohttp import web

from pipeline.engine.batcher import PAUSE_MODES
from pipeline.engine.engine_state import state_of
from pipeline.engine.http_json import bad_reply, error_reply, json_body, json_reply
from pipeline.engine.lora_slots import lora_reply
from pipeline.engine.model_loading import load_model

log = logging.getLogger(__name__)

FLUSH_MESSAGE = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)


def inside_any(path: str, roots: list[Path]) -> bool:
    """True when `path`, with its symbolic links resolved, is one of `roots` or below one."""
    resolved = Path(path).resolve()
    return any(resolved == root or resolved.is_relative_to(root) for root in roots)


async def update_weights_from_disk(request: web.Request) -> web.Response:
    state = state_of(request)
    scheduler = state.require_scheduler()

    def failure(message: str) -> web.Response:
        return json_reply({"success": False, "message": message, "num_paused_requests": 0}, status=400)

    try:
        body = await json_body(request, required=True)
    except ValueError as exc:
        return failure(str(exc))
    path = body.get("model_path")
    version = body.get("weight_version")
    if not isinstance(path, str) or not path or "\0" in path:
        return failure("model_path must be a non-empty string")
    if version is not None and not isinstance(version, (str, int)):
        return failure(f"weight_version must be a string, got {version!r}")
    if not isinstance(body.get("abort_all_requests", False), bool):
        return failure("abort_all_requests must be a boolean")
    roots = await asyncio.to_thread(state.config.weights_roots)
    if not await asyncio.to_thread(inside_any, path, roots):
        log.warning("refused update_weights_from_disk outside the allowed directories: %s", path)
        return failure(
            f"model_path {path!r} is outside the directories this engine may load weights from "
            f"({', '.join(map(str, roots))}; --allowed-weights-dir)"
        )
    if state.adapters.loaded:
        return failure(
            "cannot update the base weights while LoRA adapters are loaded "
            f"({sorted(state.adapters.loaded)}); unload them first"
        )
    async with state.update_lock:
        loop = asyncio.get_running_loop()
        cfg = state.config
        if cfg.fault_stale_weights:
            # Fault injection: acknowledge and relabel, keep the old weights (the served-policy check's test).
            log.warning("fault injection: update to %s acknowledged but not loaded", path)
            model = scheduler.model
        else:
            try:
                model = await loop.run_in_executor(state.loader, load_model, path, cfg.device, state.dtype)
            except Exception as exc:
                return failure(f"Failed to load weights from {path}: {type(exc).__name__}: {exc}")
        try:
            paused = await asyncio.wrap_future(
                scheduler.swap_weights(
                    model,
                    None if version is None else str(version),
                    bool(body.get("abort_all_requests", False)),
                )
            )
        except ValueError as exc:
            return failure(str(exc))
        state.model_path = path
    return json_reply(
        {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": paused}
    )


async def load_lora_adapter(request: web.Request) -> web.Response:
    state = state_of(request)
    scheduler = state.require_scheduler()
    try:
        body = await json_body(request, required=True)
    except ValueError as exc:
        return json_reply(lora_reply(False, str(exc), state.adapters.paths), status=400)
    status, reply = await state.adapters.load(
        body.get("lora_name"), body.get("lora_path"), scheduler, state.loader, state.config.device
    )
    return json_reply(reply, status=status)


async def unload_lora_adapter(request: web.Request) -> web.Response:
    state = state_of(request)
    scheduler = state.require_scheduler()
    try:
        body = await json_body(request, required=True)
    except ValueError as exc:
        return json_reply(lora_reply(False, str(exc), state.adapters.paths), status=400)
    status, reply = await state.adapters.unload(body.get("lora_name"), scheduler)
    return json_reply(reply, status=status)


async def update_weight_version(request: web.Request) -> web.Response:
    state = state_of(request)
    scheduler = state.require_scheduler()
    try:
        body = await json_body(request, required=True)
    except ValueError as exc:
        return json_reply({"success": False, "message": str(exc)}, status=400)
    new_version = body.get("new_version")
    if not isinstance(new_version, (str, int)):
        return json_reply({"success": False, "message": "new_version must be a string"}, status=400)
    async with state.update_lock:
        await asyncio.wrap_future(
            scheduler.swap_weights(
                scheduler.model, str(new_version), bool(body.get("abort_all_requests", True))
            )
        )
    return json_reply(
        {"success": True, "message": "Weight version updated.", "new_version": str(new_version)}
    )


async def pause_generation(request: web.Request) -> web.Response:
    state = state_of(request)
    try:
        body = await json_body(request, required=False)
    except ValueError as exc:
        return bad_reply(exc)
    mode = body.get("mode", "abort")
    if mode not in PAUSE_MODES:
        return error_reply(f"mode must be one of {list(PAUSE_MODES)}, got {mode!r}")
    await asyncio.wrap_future(state.require_scheduler().pause(mode))
    return json_reply({"message": "Generation paused successfully.", "status": "ok"})


async def continue_generation(request: web.Request) -> web.Response:
    state = state_of(request)
    try:
        await json_body(request, required=False)
    except ValueError as exc:
        return bad_reply(exc)
    await asyncio.wrap_future(state.require_scheduler().resume())
    return json_reply({"message": "Generation continued successfully.", "status": "ok"})


async def abort_request(request: web.Request) -> web.Response:
    state = state_of(request)
    try:
        body = await json_body(request, required=True)
    except ValueError as exc:
        return bad_reply(exc)
    scheduler = state.require_scheduler()
    if not isinstance(body.get("abort_all", False), bool):
        return error_reply("abort_all must be a boolean")
    if body.get("abort_all", False) is True:
        scheduler.abort(None, "Aborted by /abort_request (abort_all)")
    elif isinstance(body.get("rid"), str):
        scheduler.abort(body["rid"])
    else:
        return error_reply("abort_request needs 'rid' (a string) or 'abort_all': true")
    return web.Response(status=200)


async def flush_cache(request: web.Request) -> web.Response:
    idle = await asyncio.wrap_future(state_of(request).require_scheduler().flush_cache())
    return web.Response(text=FLUSH_MESSAGE, status=200 if idle else 400, content_type="text/plain")
