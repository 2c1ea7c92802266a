"""Agent functions off the supervisor's core: a pool of worker processes, each running many episodes'
agent functions on its own event loop with its own HTTP client (`[env] agent_workers`, default 0 = off).

An agent function's own client (the openai SDK builds and parses every request in Python) costs more CPU
per turn than the endpoint's work for that turn (docs/benchmarks.md, `bench actors --agent`): in the
supervisor's loop it bounds the whole run's agent turns/s to one core. In a worker the agent runs as it
would anywhere: `agent(openai.AsyncOpenAI(base_url=<the episode's base URL>, api_key=<its key>), task)`,
and its requests are recorded as always. The client the worker gives it sends the requests to the
endpoint's own address over the worker's pipe (the parent answers them with `OpenAIEndpoint.handle`, the
in-process route: no HTTP to build or parse on either side, and a real HTTP transport would cost the
worker more CPU than the SDK itself); any client the agent builds from the base URL (`str(client.base_url)`,
a framework's own) reaches the same endpoint over HTTP on 127.0.0.1.

Protocol (one JSON object per line; the worker's stdout is the protocol, its fd 1 is pointed at stderr so
an agent's prints cannot break it): parent -> worker `{"op": "run", "id", "agent": "module:attr" or
"file.py:attr", "task": {"id", "seed", "data"}, "base_url", "api_key", "timeout_s"}` and `{"op": "cancel",
"id"}`; worker -> parent `{"id", "ok": true, "value": <a number or {"outcome", "turn_rewards", "info"}>}`
or `{"id", "ok": false, "error": "<repr of what the agent raised>"}`; a request of the worker's client:
worker -> parent `{"op": "http", "id", "method", "path", "headers", "body"}`, parent -> worker `{"op":
"reply", "id", "status", "headers", "body"}` (bodies as latin-1 text: bytes kept exactly). Closing the
worker's stdin ends it.

A worker that dies fails its episodes (AgentFailure reason "worker", counted) and is started again for
the next ones. Episodes go to the worker with the fewest in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import json
import logging
import os
import sys
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from envs.agent import AgentEnvironment, AgentEpisode, AgentFailure, AgentResult
from envs.api import Task

log = logging.getLogger(__name__)
STOP_WAIT_S = 10.0


class HTTPReply(Protocol):
    """What the endpoint answers a request with (reply.Reply, frozen: read-only here too)."""

    @property
    def status(self) -> int: ...
    @property
    def body(self) -> bytes: ...
    @property
    def content_type(self) -> str: ...
    @property
    def headers(self) -> dict[str, str]: ...


# (method, path, lower-case headers, body) -> the reply: OpenAIEndpoint.handle.
RequestHandler = Callable[[str, str, Mapping[str, str], bytes], Awaitable[HTTPReply]]


class RemoteAgentError(Exception):
    """What an agent function raised in a worker process (its repr there)."""

    def __repr__(self) -> str:
        return f"{self.args[0]} (in an agent worker)"


@dataclass
class _Worker:
    index: int
    proc: asyncio.subprocess.Process
    pending: dict[int, asyncio.Future[Any]] = field(default_factory=dict)
    reader: asyncio.Task[None] | None = None


class AgentWorkerPool:
    """`workers` processes running agent functions (module docstring). `await start()`, `await close()`."""

    def __init__(self, workers: int, *, cpus: set[int] | None = None) -> None:
        if workers < 1:
            raise ValueError(f"agent workers must be >= 1, got {workers}")
        self.size = workers
        self.cpus = cpus  # the workers' CPU affinity (None: inherited)
        self._workers: list[_Worker] = []
        self._ids = itertools.count()
        self._closing = False
        self._handler: RequestHandler | None = None
        self._answering: set[asyncio.Future[None]] = set()

    def bind(self, handler: RequestHandler) -> None:
        """Answer the workers' client requests with `handler` (the endpoint's, set when it is made)."""
        self._handler = handler

    async def start(self) -> None:
        self._workers = [await self._spawn(i) for i in range(self.size)]

    async def _spawn(self, index: int) -> _Worker:
        argv = [sys.executable, "-m", "pipeline.supervisor.actors.agent_api.agent_workers"]
        if self.cpus is not None:
            argv.append(",".join(str(c) for c in sorted(self.cpus)))
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, limit=1 << 26
        )
        worker = _Worker(index, proc)
        worker.reader = asyncio.ensure_future(self._read(worker))
        return worker

    @property
    def pids(self) -> list[int]:
        """The workers' process ids (for CPU accounting)."""
        return [worker.proc.pid for worker in self._workers]

    def accepts(self, env: AgentEnvironment) -> bool:
        """An agent function the workers can import (not a subclass that runs something else)."""
        return type(env).play is AgentEnvironment.play and env.agent_ref is not None

    async def run(self, env: AgentEnvironment, episode: AgentEpisode, task: Task) -> object:
        """Run `env`'s agent for `task` in a worker against `episode`'s endpoint; its return value."""
        if self._closing or not self._workers:
            raise AgentFailure("the agent worker pool is closed", reason="worker")
        worker = min(self._workers, key=lambda w: len(w.pending))
        if worker.proc.returncode is not None:  # died since: its reader starts a new one
            raise AgentFailure(f"agent worker {worker.index} is restarting", reason="worker")
        request_id = next(self._ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        worker.pending[request_id] = future
        message = {
            "op": "run",
            "id": request_id,
            "agent": env.agent_ref,
            "task": {"id": task.id, "seed": task.seed, "data": task.data},
            "base_url": episode.openai_base_url,
            "api_key": episode.api_key,
            "timeout_s": env.spec.episode_timeout_s,
        }
        try:
            self._send(worker, message)
            reply = await future
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                self._send(worker, {"op": "cancel", "id": request_id})
            raise
        finally:
            worker.pending.pop(request_id, None)
        if not reply["ok"]:
            raise RemoteAgentError(reply["error"])
        return _as_result(reply["value"])

    @staticmethod
    def _send(worker: _Worker, message: dict[str, Any]) -> None:
        assert worker.proc.stdin is not None
        worker.proc.stdin.write((json.dumps(message, ensure_ascii=False) + "\n").encode())

    async def _read(self, worker: _Worker) -> None:
        assert worker.proc.stdout is not None
        while True:
            line = await worker.proc.stdout.readline()
            if not line:
                break
            try:
                reply = json.loads(line)
                if reply.get("op") == "http":
                    answering = asyncio.ensure_future(self._answer(worker, reply))
                    self._answering.add(answering)
                    answering.add_done_callback(self._answering.discard)
                    continue
                future = worker.pending.get(reply["id"])
            except (ValueError, KeyError, TypeError, AttributeError):
                log.warning("agent worker %d wrote a line outside the protocol: %.200r", worker.index, line)
                continue
            if future is not None and not future.done():
                future.set_result(reply)
        code = await worker.proc.wait()
        for future in worker.pending.values():
            if not future.done():
                future.set_exception(
                    AgentFailure(f"agent worker {worker.index} died (exit {code})", reason="worker")
                )
        if not self._closing:
            log.warning("agent worker %d died (exit %s); starting another", worker.index, code)
            replacement = await self._spawn(worker.index)
            self._workers[self._workers.index(worker)] = replacement

    async def _answer(self, worker: _Worker, request: dict[str, Any]) -> None:
        """A request of a worker's client, answered by the endpoint; the reply goes back over the pipe."""
        try:
            if self._handler is None:
                raise RuntimeError("the worker pool is not bound to an endpoint")
            headers = {str(k).lower(): str(v) for k, v in dict(request["headers"]).items()}
            body = str(request["body"]).encode("latin-1")
            answer = await self._handler(str(request["method"]), str(request["path"]), headers, body)
            message = {
                "op": "reply",
                "id": request["id"],
                "status": answer.status,
                "headers": {"content-type": answer.content_type, **answer.headers},
                "body": answer.body.decode("latin-1"),
            }
        except Exception as exc:  # never leave the agent's request without an answer
            log.warning("agent worker %d: a request failed in the parent: %r", worker.index, exc)
            error = {"error": {"message": f"rollwise: {exc!r}", "type": "server_error"}}
            message = {
                "op": "reply",
                "id": request.get("id"),
                "status": 500,
                "headers": {"content-type": "application/json"},
                "body": json.dumps(error),
            }
        if worker.proc.returncode is None:
            with contextlib.suppress(Exception):  # the worker died meanwhile: its episodes already failed
                self._send(worker, message)

    async def close(self) -> None:
        """End every worker (closing its stdin ends it; killed after STOP_WAIT_S)."""
        self._closing = True
        for worker in self._workers:
            if worker.proc.stdin is not None:
                worker.proc.stdin.close()
        for worker in self._workers:
            try:
                await asyncio.wait_for(worker.proc.wait(), STOP_WAIT_S)
            except TimeoutError:
                worker.proc.kill()
                await worker.proc.wait()
            if worker.reader is not None:
                await asyncio.gather(worker.reader, return_exceptions=True)
        for answering in list(self._answering):
            answering.cancel()
        self._workers = []


def _as_result(value: Any) -> object:
    if isinstance(value, dict):
        return AgentResult(
            outcome=value.get("outcome"),
            turn_rewards=tuple(value.get("turn_rewards", ())),
            info=value.get("info", {}),
        )
    return value


# ------------------------------------------------------------------------------------- the worker side
def _encode(value: object) -> object:
    if isinstance(value, AgentResult):
        return {"outcome": value.outcome, "turn_rewards": list(value.turn_rewards), "info": value.info}
    return value


async def _serve(protocol_fd: int) -> None:
    import httpx2
    import openai

    from envs.agent import _load

    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 26)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    # A non-blocking pipe transport: a blocking write would stall every episode of this worker whenever
    # the parent is slow to read (a full pipe buffer is ~30 requests).
    out, _ = await loop.connect_write_pipe(asyncio.Protocol, os.fdopen(protocol_fd, "wb", buffering=0))
    agents: dict[str, Any] = {}
    running: dict[int, asyncio.Task[None]] = {}
    waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}  # this worker's requests, by id
    request_ids = itertools.count()

    def reply(message: dict[str, Any]) -> None:
        out.write((json.dumps(message, ensure_ascii=False, default=str) + "\n").encode())

    class ViaParent(httpx2.AsyncBaseTransport):
        """Requests to the endpoint's address: over the pipe, answered by the parent's endpoint."""

        async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
            request_id = next(request_ids)
            waiting[request_id] = future = loop.create_future()
            headers = {k: request.headers[k] for k in ("authorization", "x-api-key") if k in request.headers}
            try:
                reply(
                    {
                        "op": "http",
                        "id": request_id,
                        "method": request.method,
                        "path": request.url.path,
                        "headers": headers,
                        "body": (await request.aread()).decode("latin-1"),
                    }
                )
                answer = await future
            finally:
                waiting.pop(request_id, None)
            return httpx2.Response(
                answer["status"],
                headers=answer["headers"],
                content=answer["body"].encode("latin-1"),
                request=request,
            )

    https: dict[str, Any] = {}  # the endpoint's origin -> one client for every episode of this worker

    def http_for(base_url: str) -> Any:
        origin = str(httpx2.URL(base_url).copy_with(path="/", query=None)).rstrip("/")
        if origin not in https:
            https[origin] = openai.DefaultAsyncHttpxClient(mounts={origin: ViaParent()})
        return https[origin]

    class Shared(openai.AsyncOpenAI):
        async def close(self) -> None:  # an agent closing its client must not close the pool
            return None

    async def run(message: dict[str, Any]) -> None:
        request_id = message["id"]
        try:
            agent = agents.get(message["agent"])
            if agent is None:
                agent = agents[message["agent"]] = _load(message["agent"], "agent")
                # What the agent's module imported lives as long as the worker: out of full collections,
                # as the supervisor does with its own start-up heap (pipeline/supervisor/heap.py).
                gc.collect()
                gc.freeze()
            client = Shared(
                base_url=message["base_url"],
                api_key=message["api_key"],
                max_retries=0,
                timeout=message["timeout_s"],
                http_client=http_for(message["base_url"]),
            )
            data = message["task"]
            value = await agent(client, Task(id=data["id"], seed=data["seed"], data=data["data"]))
            reply({"id": request_id, "ok": True, "value": _encode(value)})
        except asyncio.CancelledError:
            pass
        except Exception as exc:
            reply({"id": request_id, "ok": False, "error": repr(exc)[:2000]})
        finally:
            running.pop(request_id, None)

    while line := await reader.readline():
        message = json.loads(line)
        if message["op"] == "reply":
            future = waiting.get(message["id"])
            if future is not None and not future.done():
                future.set_result(message)
        elif message["op"] == "run":
            running[message["id"]] = asyncio.ensure_future(run(message))
        elif message["op"] == "cancel" and message["id"] in running:
            running[message["id"]].cancel()
    for task in list(running.values()):
        task.cancel()
    await asyncio.gather(*running.values(), return_exceptions=True)
    for http in https.values():
        await http.aclose()


def main(argv: list[str]) -> None:
    """Worker process: `python -m pipeline.supervisor.actors.agent_api.agent_workers [cpu,cpu,...]`."""
    if argv:
        os.sched_setaffinity(0, {int(c) for c in argv[0].split(",")})
    protocol_fd = os.dup(1)
    os.dup2(2, 1)  # print() from an agent goes to stderr, never into the protocol
    sys.stdout = sys.stderr
    logging.basicConfig(level=logging.WARNING)
    for name in ("httpx", "httpx2"):
        logging.getLogger(name).setLevel(logging.WARNING)
    asyncio.run(_serve(protocol_fd))


if __name__ == "__main__":
    main(sys.argv[1:])
