"""Tree rollouts: a group whose G episodes share their first turns (`rollout.branch_turn = b`).

One episode, the trunk (`{group_id}-0`), plays turns 0 .. b-1. At the end of turn b-1 its environment is
forked G-1 times (`Environment.fork`: a sandbox session's snapshot and fork, envs.sandbox.sessions) and
its token buffer copied; each fork continues as episode `{group_id}-i` from turn b, as does the trunk.
The shared turns are generated once; every episode's rows still hold them, with the trunk's log-probs and
versions, so the learner sees G whole episodes (a group's advantages centre on its mean, so the shared
tokens' net gradient is what their branches' outcomes say about them, as in tree-search RL).

Rules:
- the branches take their turns after the fork, never before: forks and the buffer's copy are made
  before the trunk steps again;
- every branch keeps the trunk's deadline (`episode_timeout_s` counts from the trunk's start) and the
  group's cut;
- a fork that fails costs its branch only (env_error, counted like a factory failure);
- a trunk that ends before turn b (done, failed, cut) leaves nothing to branch from: the other G-1
  episodes are played from the start, as in an ordinary group (`rollwise_tree_groups_total{shape}` says
  which happened).
Token-in/token-out environments only: an agent function holds its own conversation, so it cannot be
forked between turns; the config refuses the combination before anything starts (wiring).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Mapping
from typing import Any

from envs.api import EnvFactory, Environment, Task
from pipeline.supervisor.actors.chat import ChatTokenizer
from pipeline.supervisor.actors.env_calls import within
from pipeline.supervisor.actors.episode_drive import drive_episode
from pipeline.supervisor.actors.episode_metrics import EpisodeMetrics
from pipeline.supervisor.actors.episode_trace import UNTRACED, Spans
from pipeline.supervisor.actors.late_cut import GroupCut
from pipeline.supervisor.actors.outcomes import EpisodeOutcome, GroupOutcome
from pipeline.supervisor.actors.rollout import (
    GenerateEngine,
    RolloutSettings,
    _EpisodeRun,
    failed_to_start,
    run_group,
)
from pipeline.supervisor.observability import metrics


class _Tree:
    """One tree group in flight: the trunk's body spawns the branches at the branch turn."""

    def __init__(
        self,
        engine: GenerateEngine,
        tokenizer: ChatTokenizer,
        factory: EnvFactory,
        task: Task,
        settings: RolloutSettings,
        *,
        group_size: int,
        group_id: str,
        env_name: str,
        env_options: Mapping[str, Any],
        branch_turn: int,
        cut: GroupCut | None,
    ) -> None:
        self.engine, self.tokenizer, self.factory = engine, tokenizer, factory
        self.task, self.settings, self.options = task, settings, dict(env_options)
        self.group_size, self.group_id, self.env_name = group_size, group_id, env_name
        self.branch_turn, self.cut = branch_turn, cut
        self.others: list[asyncio.Task[EpisodeOutcome]] = []
        self.branched = False  # the trunk reached the branch turn and was forked
        self.deadline: float | None = None

    def _counted(self, episode: Awaitable[EpisodeOutcome]) -> asyncio.Task[EpisodeOutcome]:
        async def run() -> EpisodeOutcome:
            try:
                return await episode
            finally:
                if self.cut is not None:
                    self.cut.finished += 1

        return asyncio.create_task(run())

    async def play(self) -> GroupOutcome:
        try:
            env = self.factory(**self.options)
        except Exception as exc:
            message = f"env factory raised {exc!r}"
            first = failed_to_start(f"{self.group_id}-0", self.group_id, self.task, self.env_name, message)
            if self.cut is not None:
                self.cut.finished += 1
            return await self._the_rest_whole(first)
        spec = env.spec
        if spec.episode_timeout_s is not None:
            self.deadline = asyncio.get_running_loop().time() + spec.episode_timeout_s
        trunk = self._counted(
            drive_episode(
                self._trunk_run(env),
                self._trunk_body,
                env,
                self.task,
                episode_id=f"{self.group_id}-0",
                group_id=self.group_id,
                env_name=self.env_name,
                cut=self.cut,
                deadline=self.deadline,
            )
        )
        try:
            first = await trunk
        except BaseException:
            trunk.cancel()
            await self._cancel_others()
            raise
        metrics.TREE_GROUPS.labels(env=self.env_name, shape="branched" if self.branched else "whole").inc()
        if not self.branched:  # the trunk ended before the branch turn
            return await self._the_rest_whole(first)
        return await self._gather(first)

    async def _the_rest_whole(self, first: EpisodeOutcome) -> GroupOutcome:
        """Episodes 1 .. G-1 played from the start, as an ordinary group (rollout.run_group)."""
        rest: list[EpisodeOutcome] = []
        if self.group_size > 1:
            played = await run_group(
                self.engine,
                self.tokenizer,
                self.factory,
                self.task,
                self.settings,
                group_size=self.group_size - 1,
                group_id=self.group_id,
                env_name=self.env_name,
                env_options=self.options,
                cut=self.cut,
                first_index=1,
            )
            rest = played.episodes
        return self._outcome([first, *rest])

    def _outcome(self, episodes: list[EpisodeOutcome]) -> GroupOutcome:
        task_id, env = self.task.id, self.env_name
        return GroupOutcome(group_id=self.group_id, task_id=task_id, env=env, episodes=episodes)

    async def _gather(self, first: EpisodeOutcome) -> GroupOutcome:
        """The trunk's outcome and its branches', in episode order."""
        try:
            rest = list(await asyncio.gather(*self.others))
        except BaseException:
            await self._cancel_others()
            raise
        return self._outcome([first, *rest])

    async def _cancel_others(self) -> None:
        for other in self.others:
            other.cancel()
        await asyncio.gather(*self.others, return_exceptions=True)

    def _trunk_run(self, env: Environment) -> Any:
        def new_run(recorded: EpisodeMetrics, trace: Spans) -> _EpisodeRun:
            return _EpisodeRun(
                self.engine,
                self.tokenizer,
                env,
                self.settings,
                f"{self.group_id}-0",
                metrics=recorded,
                trace=trace,
                affinity_key=self.group_id,
                group=self.cut,
            )

        return new_run

    async def _trunk_body(self, trunk: _EpisodeRun) -> str:
        await trunk.start(self.task)
        finish = await trunk.play_turns(0, self.branch_turn)
        if finish is not None:
            return finish
        if self.branch_turn < trunk.env.spec.max_turns:
            await self._branch(trunk)
        finish = await trunk.play_turns(self.branch_turn, trunk.env.spec.max_turns)
        return "truncated" if finish is None else finish

    async def _branch(self, trunk: _EpisodeRun) -> None:
        """Fork the trunk's environment G-1 times and start a branch on each, before the trunk goes on."""
        self.branched = True
        point = trunk.branch(trunk.episode_id, trunk.env, trunk.metrics, UNTRACED)  # frozen from here
        shared = sum(segment.num_generated for segment in point.chat.segments) if point.chat else 0
        for index in range(1, self.group_size):
            episode_id = f"{self.group_id}-{index}"
            try:
                child = await within(trunk.env.fork(), trunk.step_timeout_s)
            except Exception as exc:  # failed_to_start counts it under rollwise_env_errors_total
                message = f"env.fork raised {exc!r}"
                self.others.append(self._counted(self._failed(episode_id, message)))
                continue
            metrics.TREE_SHARED_TOKENS.labels(env=self.env_name).inc(shared)
            self.others.append(self._counted(self._continue(point, episode_id, child)))

    async def _failed(self, episode_id: str, message: str) -> EpisodeOutcome:
        return failed_to_start(episode_id, self.group_id, self.task, self.env_name, message)

    def _continue(self, point: _EpisodeRun, episode_id: str, env: Environment) -> Any:
        def new_run(recorded: EpisodeMetrics, trace: Spans) -> _EpisodeRun:
            return point.branch(episode_id, env, recorded, trace)

        async def body(branch: _EpisodeRun) -> str:
            finish = await branch.play_turns(self.branch_turn, env.spec.max_turns)
            return "truncated" if finish is None else finish

        return drive_episode(
            new_run,
            body,
            env,
            self.task,
            episode_id=episode_id,
            group_id=self.group_id,
            env_name=self.env_name,
            cut=self.cut,
            deadline=self.deadline,
        )


async def run_tree_group(
    engine: GenerateEngine,
    tokenizer: ChatTokenizer,
    factory: EnvFactory,
    task: Task,
    settings: RolloutSettings,
    *,
    group_size: int,
    group_id: str,
    env_name: str,
    branch_turn: int,
    env_options: Mapping[str, Any] | None = None,
    cut: GroupCut | None = None,
) -> GroupOutcome:
    """Run `group_size` episodes of `task` as a tree that branches after `branch_turn` turns (module
    docstring); never raises for env or engine failures. Episode ids are `"{group_id}-{i}"`, the trunk 0."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if branch_turn < 1:
        raise ValueError(f"branch_turn must be >= 1, got {branch_turn}")
    tree = _Tree(
        engine,
        tokenizer,
        factory,
        task,
        settings,
        group_size=group_size,
        group_id=group_id,
        env_name=env_name,
        env_options=env_options or {},
        branch_turn=branch_turn,
        cut=cut,
    )
    return await tree.play()
