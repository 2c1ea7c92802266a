"""POST/PUT /generate: submit the validated requests, then answer with SGLang's object (or array), or
stream cumulative SSE chunks; a client that goes away has its requests aborted at once."""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from pipeline.engine.engine_state import EngineState, Tracked, state_of
from pipeline.engine.http_json import bad_reply, dumps, error_reply, json_body, json_reply
from pipeline.engine.request_parsing import build_requests

log = logging.getLogger(__name__)
DISCONNECT_POLL_S = 0.25


async def generate(request: web.Request) -> web.StreamResponse:
    state = state_of(request)
    try:
        body = await json_body(request, required=True)
        tracked, is_batch = build_requests(body, state)
    except ValueError as exc:
        return bad_reply(exc)
    except web.HTTPException:
        raise
    except Exception as exc:  # a defect, not the client's: still JSON, and nothing left registered
        log.exception("/generate failed before its requests were submitted")
        return error_reply(f"internal error: {type(exc).__name__}: {exc}", status=500)
    scheduler = state.require_scheduler()
    scheduler.submit([t.request for t in tracked])
    if body.get("stream", False):
        return await _stream(request, state, tracked)
    try:
        connected = await _wait_while_connected(request, [t.done for t in tracked])
    except asyncio.CancelledError:
        connected = False
    if not connected:  # free the batch slots at once; nobody will read the answer
        for t in tracked:
            scheduler.abort(t.request.rid, "client disconnected")
        raise web.HTTPBadRequest(text="client disconnected")
    objects = [state.response_object(t) for t in tracked]
    return json_reply(objects if is_batch else objects[0])


async def _wait_while_connected(request: web.Request, futures: list[asyncio.Future[None]]) -> bool:
    """Wait for every future; False as soon as the client's connection is gone (checked every
    DISCONNECT_POLL_S; aiohttp does not cancel handlers on disconnect)."""
    everything = asyncio.gather(*futures)
    while True:
        done, _ = await asyncio.wait({everything}, timeout=DISCONNECT_POLL_S)
        if done:
            return True
        transport = request.transport
        if transport is None or transport.is_closing():
            return False


async def _stream(request: web.Request, state: EngineState, tracked: list[Tracked]) -> web.StreamResponse:
    """Cumulative SSE chunks, interleaved across batch items, then `data: [DONE]`."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    scheduler = state.require_scheduler()
    pending: dict[asyncio.Future[int], Tracked] = {}

    def wait_next(item: Tracked) -> None:
        assert item.updates is not None
        pending[asyncio.ensure_future(item.updates.get())] = item

    for item in tracked:
        wait_next(item)
    try:
        while pending:
            ready, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in ready:
                item = pending.pop(future)
                assert item.updates is not None
                count = future.result()
                while not item.updates.empty():  # coalesce a backlog into its latest snapshot
                    count = item.updates.get_nowait()
                finished = item.done.done()
                obj = state.response_object(item, None if finished else count)
                await response.write(f"data: {dumps(obj)}\n\n".encode())
                if not finished:
                    wait_next(item)
        await response.write(b"data: [DONE]\n\n")
    except (ConnectionResetError, asyncio.CancelledError):
        for item in tracked:
            scheduler.abort(item.request.rid, "client disconnected")
        raise
    finally:
        for future in pending:
            future.cancel()
    return response
