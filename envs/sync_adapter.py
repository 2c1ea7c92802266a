"""Run a synchronous environment as an asynchronous one, in a bounded shared thread pool.

A blocking ``step`` must never run on the event loop (it would stall every other episode), so the
adapter hands ``reset``/``step``/``close`` to a ``ThreadPoolExecutor``. Pools are shared per size:
all adapters asking for 8 workers share one pool, so 1,000 concurrent episodes still use 8 threads.

A step that exceeds the runner's timeout is abandoned, not killed: Python cannot stop a thread,
so the worker stays busy until the call returns.
"""

from __future__ import annotations

import asyncio
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from envs.api import Action, EnvFactory, Environment, EnvSpec, Message, StepResult, Task

DEFAULT_MAX_WORKERS = 8
THREAD_NAME_PREFIX = "rollwise-env"

_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


class SyncEnvironment(ABC):
    """The synchronous twin of ``envs.api.Environment`` (same contract, blocking methods)."""

    spec: EnvSpec

    @abstractmethod
    def tasks(self, seed: int) -> Iterator[Task]:
        """An infinite stream of tasks; the same seed yields the same stream."""

    @abstractmethod
    def reset(self, task: Task) -> list[Message]:
        """Start the episode; the initial messages are a pure function of ``task``."""

    @abstractmethod
    def step(self, action: Action) -> StepResult:
        """Apply one assistant turn and return the environment's answer."""

    def close(self) -> None:  # noqa: B027 - optional hook, a no-op unless overridden
        """Release resources. Safe to call more than once."""

    def gold_action(self) -> str | None:
        """The text an ideal agent would send next, given the hidden state; None if not provided."""
        return None

    def gold_unavailable(self) -> str | None:
        """Why `gold_action()` gives None, for `env check`; optional."""
        return None


def shared_executor(max_workers: int = DEFAULT_MAX_WORKERS) -> ThreadPoolExecutor:
    """The process-wide pool with ``max_workers`` threads (created on first use, then reused)."""
    if max_workers < 1:
        raise ValueError(f"max_workers must be >= 1, got {max_workers}")
    with _pools_lock:
        pool = _pools.get(max_workers)
        if pool is None:
            pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=THREAD_NAME_PREFIX)
            _pools[max_workers] = pool
        return pool


def is_pool_thread(thread: threading.Thread) -> bool:
    """Whether ``thread`` belongs to one of the shared adapter pools (they live for the process)."""
    return thread.name.startswith(THREAD_NAME_PREFIX)


class AsyncAdapter(Environment):
    """Wraps a ``SyncEnvironment`` as an ``Environment``; blocking calls run in ``executor``."""

    def __init__(self, sync_env: SyncEnvironment, executor: ThreadPoolExecutor | None = None) -> None:
        self.sync_env = sync_env
        self.spec = sync_env.spec
        self._executor = executor if executor is not None else shared_executor()
        self._closed = False

    async def _call(self, method: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, method, *args)

    # tasks() and gold_action() are expected to be cheap and run inline; reset/step/close may block.
    def tasks(self, seed: int) -> Iterator[Task]:
        return self.sync_env.tasks(seed)

    async def reset(self, task: Task) -> list[Message]:
        messages: list[Message] = await self._call(self.sync_env.reset, task)
        return messages

    async def step(self, action: Action) -> StepResult:
        result: StepResult = await self._call(self.sync_env.step, action)
        return result

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._call(self.sync_env.close)

    def gold_action(self) -> str | None:
        return self.sync_env.gold_action()

    def gold_unavailable(self) -> str | None:
        return self.sync_env.gold_unavailable()


def as_async_factory(
    sync_factory: Callable[..., SyncEnvironment], max_workers: int = DEFAULT_MAX_WORKERS
) -> EnvFactory:
    """An ``EnvFactory`` whose instances run ``sync_factory(**options)`` in the shared pool."""
    if max_workers < 1:
        raise ValueError(f"max_workers must be >= 1, got {max_workers}")

    def factory(**options: Any) -> Environment:
        return AsyncAdapter(sync_factory(**options), shared_executor(max_workers))

    factory.__name__ = f"async_{getattr(sync_factory, '__name__', 'factory')}"
    factory.__doc__ = f"Async adapter around {sync_factory!r} ({max_workers} shared worker threads)."
    return factory
