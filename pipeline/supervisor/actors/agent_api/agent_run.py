"""How an agent run ends and what it is answered through: stopping it with a grace period, reading its
outcome, ranking the causes of an episode's end, and the in-process HTTP client its openai SDK uses.

Causes rank: an engine failure first (its root cause), then a timeout, then a refusal the endpoint made
(the agent's exception is usually its consequence), then the agent's own fault. A problem is
(finish reason, ENV_ERRORS kind, message)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from envs.agent import AgentFailure, AgentResult, as_agent_result
from pipeline.supervisor.actors.agent_api.agent_session import AgentSession
from pipeline.supervisor.actors.agent_api.reply import Reply
from pipeline.supervisor.observability import metrics

log = logging.getLogger(__name__)

STOP_GRACE_S = 5.0  # how long a stopped agent gets to finish its cleanup

Problem = tuple[str, str, str]  # (finish reason, ENV_ERRORS kind, message)
RequestHandler = Callable[[str, str, Mapping[str, str], bytes], Awaitable[Reply]]


async def stop_agent(agent: asyncio.Future[object]) -> None:
    """Cancel an agent run that is still going and give it STOP_GRACE_S to clean up (a process is killed
    and reaped within it); a run that ignores cancellation is left behind, logged."""
    if agent.done():
        return
    agent.cancel()
    _, pending = await asyncio.wait({agent}, timeout=STOP_GRACE_S)
    if pending:
        log.warning("an agent run ignored its cancellation for %.0f s; left behind", STOP_GRACE_S)
    elif not agent.cancelled():
        with contextlib.suppress(BaseException):
            agent.exception()  # retrieved: the episode already has its reason


def agent_outcome(agent: asyncio.Future[object], env_name: str) -> tuple[Problem | None, AgentResult | None]:
    """(problem, result) of a finished agent run."""
    if agent.cancelled():
        return ("env_error", "agent", "the agent was stopped"), None
    exc = agent.exception()
    if isinstance(exc, AgentFailure):
        metrics.AGENT_FAILURES.labels(env=env_name, reason=exc.reason).inc()
        return (exc.finish, exc.kind, str(exc)), None
    if exc is not None:
        return ("env_error", "agent", f"the agent raised {exc!r}"), None
    try:
        return None, as_agent_result(agent.result())
    except ValueError as err:
        return ("env_error", "invalid", str(err)), None


def episode_finish(
    session: AgentSession, problem: Problem | None, result: AgentResult | None
) -> tuple[str, str | None]:
    """(finish reason, error) of an agent episode, its causes ranked (module docstring)."""
    env_name = session.env_name
    if session.finish == "engine_error":
        return "engine_error", session.error
    if problem is not None and problem[0] == "timeout":
        metrics.ENV_ERRORS.labels(env=env_name, kind="timeout").inc()
        return "timeout", problem[2]
    if session.finish is not None:
        return session.finish, session.error if problem is None else f"{session.error}; then {problem[2]}"
    if problem is not None:
        metrics.ENV_ERRORS.labels(env=env_name, kind=problem[1]).inc()
        return problem[0], problem[2]
    assert result is not None
    invalid = None
    if session.num_turns == 0:
        invalid = "the agent returned without requesting a chat completion"
    elif len(result.turn_rewards) > session.num_turns:
        count = len(result.turn_rewards)
        invalid = f"AgentResult.turn_rewards has {count} entries for {session.num_turns} turns"
    if invalid is not None:
        metrics.ENV_ERRORS.labels(env=env_name, kind="invalid").inc()
        return "env_error", invalid
    return ("length" if session.last_engine_finish == "length" else "stop"), None


def shared_http_client(origin: str, handle: RequestHandler) -> Any:
    """The httpx client behind every episode's AsyncOpenAI: requests to `origin` (the endpoint's own
    address) are answered in-process by `handle` (no socket, no HTTP parsing); any other URL goes out over
    the network as usual. The base URL stays the real `http://127.0.0.1:<port>/e/<key>/v1`, so an agent
    may equally use it with another HTTP client."""
    import httpx2
    import openai

    class InProcess(httpx2.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
            reply = await handle(request.method, request.url.path, request.headers, await request.aread())
            headers = {"content-type": reply.content_type, **reply.headers}
            return httpx2.Response(reply.status, headers=headers, content=reply.body, request=request)

    class SharedHTTPClient(openai.DefaultAsyncHttpxClient):
        """One client for every episode's AsyncOpenAI; an agent closing its client must not close the
        others', so only the endpoint closes it."""

        async def aclose(self) -> None:
            return None

        async def close_shared(self) -> None:
            await super().aclose()

    return SharedHTTPClient(mounts={origin: InProcess()})
