"""The lifecycle every token-in/token-out episode shares, whatever plays its turns (a whole episode,
rollout.run_episode; a tree rollout's trunk or branch, tree_rollout): its metrics and span, the episode
timeout, the group's cut, `env.close()` always awaited, and the EpisodeOutcome with its rows."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

from envs.api import Environment, Task
from pipeline.contracts import tracing
from pipeline.contracts.schema import EpisodeSegment
from pipeline.supervisor.actors.env_calls import close_env
from pipeline.supervisor.actors.episode_end import EpisodeEnded
from pipeline.supervisor.actors.episode_metrics import EpisodeMetrics, episode_metrics
from pipeline.supervisor.actors.episode_trace import Spans, episode_attributes, episode_trace
from pipeline.supervisor.actors.late_cut import GroupCut
from pipeline.supervisor.actors.outcomes import EpisodeOutcome


class PlayedEpisode(Protocol):
    """What the lifecycle reads of the object that played the turns (rollout._EpisodeRun)."""

    turn_rewards: list[float]
    outcome: float | None
    generated_tokens: int
    tool_calls: int
    turn_seconds: list[float]
    engine_seconds: list[float]

    def rows(self, task: Task, group_id: str, env_name: str, finish_reason: str) -> list[EpisodeSegment]: ...


Run = TypeVar("Run", bound=PlayedEpisode)


async def drive_episode(
    new_run: Callable[[EpisodeMetrics, Spans], Run],
    body: Callable[[Run], Awaitable[str]],
    env: Environment,
    task: Task,
    *,
    episode_id: str,
    group_id: str,
    env_name: str,
    record_metrics: bool = True,
    cut: GroupCut | None = None,
    deadline: float | None = None,
) -> EpisodeOutcome:
    """What every token-in/token-out episode shares, around `body(new_run(metrics, trace))`, which returns
    the finish reason: its metrics and span, the episode timeout (`env.spec.episode_timeout_s` from now,
    or the event loop's time `deadline`), the group's cut, `env.close()` and the outcome (run_episode)."""
    started = time.perf_counter()
    recorded = episode_metrics(env_name, record_metrics)
    recorded.started()
    error: str | None = None
    aborted = False
    span = tracing.root_span(
        "episode", {"rollwise.episode_id": episode_id, "rollwise.env": env_name, "rollwise.task_id": task.id}
    )
    if deadline is None and env.spec.episode_timeout_s is not None:
        deadline = asyncio.get_running_loop().time() + env.spec.episode_timeout_s
    try:
        with span as current:
            episode = new_run(recorded, episode_trace(current))
            try:
                async with asyncio.timeout_at(deadline) as scope:
                    with cut.watching(scope) if cut is not None else contextlib.nullcontext():
                        finish_reason = await body(episode)
            except EpisodeEnded as ended:
                finish_reason, error, aborted = ended.finish_reason, ended.message, ended.aborted
            except TimeoutError:
                if cut is not None and cut.fired:
                    finish_reason, error = "cut", cut.reason
                else:
                    finish_reason = "timeout"
                    error = f"episode exceeded episode_timeout_s={env.spec.episode_timeout_s}"
            if current.is_recording():
                current.set_attributes(
                    episode_attributes(
                        finish_reason,
                        len(episode.turn_rewards),
                        episode.tool_calls,
                        episode.generated_tokens,
                        episode.outcome,
                    )
                )
    finally:
        close_error = await close_env(env, env_name)
        recorded.stopped()
    outcome = EpisodeOutcome(
        episode_id=episode_id,
        group_id=group_id,
        task_id=task.id,
        env=env_name,
        finish_reason=finish_reason,
        rows=episode.rows(task, group_id, env_name, finish_reason),
        turn_rewards=list(episode.turn_rewards),
        outcome=episode.outcome,
        generated_tokens=episode.generated_tokens,
        duration_s=time.perf_counter() - started,
        turn_seconds=episode.turn_seconds,
        engine_seconds=episode.engine_seconds,
        error=error or close_error,
        aborted=aborted,
    )
    recorded.ended(outcome, episode.tool_calls, bool(env.spec.tools))
    return outcome
