"""Environment calls under a deadline: `within(call, timeout_s)` awaits `call` as
`asyncio.timeout(timeout_s)` around it would, raising `DeadlinePassed` when the bound (not the call
itself) timed out; `close_env` awaits env.close() under the step timeout and reports a failure instead of
raising it.

Most environment calls never suspend, and a call that returns before yielding to the event loop cannot
be timed out by asyncio anyway (the timer only fires from the loop). So a coroutine is first run up to
its first suspension by hand (`call.send(None)`); only one that suspends gets a timer, with the deadline
taken before it started, and is finished by `_Started`, which forwards what the task sends or throws
exactly as `await` would. Why not plain `asyncio.timeout` around every call: arming and cancelling its
timer costs several times what an environment that answers at once costs, and that is the usual step."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Coroutine, Generator
from types import CoroutineType
from typing import Any

from envs.api import Environment
from pipeline.supervisor.observability import metrics


class _Started:
    """Awaiting this finishes a coroutine that was already advanced to its first suspension, where it
    handed `pending` to the event loop: the same as awaiting the coroutine from there (`yield from`)."""

    __slots__ = ("_coro", "_pending")

    def __init__(self, coro: Coroutine[Any, Any, Any], pending: Any) -> None:
        self._coro = coro
        self._pending = pending

    def __await__(self) -> Generator[Any, Any, Any]:
        coro, value = self._coro, self._pending
        while True:
            try:
                sent = yield value
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:  # a cancellation (the timeout) or anything thrown into the task
                try:
                    value = coro.throw(exc)
                except StopIteration as done:
                    return done.value
            else:
                try:
                    value = coro.send(sent)
                except StopIteration as done:
                    return done.value


class DeadlinePassed(TimeoutError):
    """`within`'s bound was exceeded (unlike a TimeoutError the awaited call raised itself)."""


async def within(call: Awaitable[Any], timeout_s: float) -> Any:
    """`await call` bounded by `timeout_s` seconds from now; DeadlinePassed when exceeded."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    if isinstance(call, CoroutineType):
        try:
            pending = call.send(None)
        except StopIteration as done:
            return done.value
        call = _Started(call, pending)
    bound = asyncio.timeout_at(deadline)
    try:
        async with bound:
            return await call
    except TimeoutError as exc:
        if bound.expired():
            raise DeadlinePassed(f"not done within {timeout_s} s") from exc
        raise


async def close_env(env: Environment, env_name: str) -> str | None:
    """Await env.close() (bounded by the step timeout); a failure is counted and reported, not raised."""
    try:
        await within(env.close(), env.spec.step_timeout_s)
    except Exception as exc:
        metrics.ENV_ERRORS.labels(env=env_name, kind="close").inc()
        return f"env.close raised {exc!r}"
    return None
