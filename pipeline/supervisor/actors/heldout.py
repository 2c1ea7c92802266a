"""Held-out evaluation episodes: the same runner as training, never written to the spool.

`run_evaluation` plays every task of a fixed list in each mode: `greedy` (one episode at temperature 0)
and/or `sampled` (k episodes at the training temperature). At most `max_concurrent` episodes are in
flight, and every request carries `priority` when given (SGLang's `priority` field: the engine serves
training requests first), so on the training engines an evaluation takes a bounded share of them and
training never waits for it (how often one runs, its budget, and the dedicated evaluation engine that
needs no priority: pipeline.supervisor.eval_schedule). The episodes stay out of the training
episodes' metrics (`run_episode(record_metrics=False)`); `summarise` turns them into the numbers the
daemon, `rollwise eval` and `rollwise bench learn` report.

Numbers of one mode (pure, from the episodes):
- success = solved episodes / episodes (solved: outcome >= 1.0, as in training);
- pass@k = tasks with at least one solved episode among their k / tasks (greedy: k = 1, = success);
- reward_mean = mean episode return, turn rewards plus outcome (the learner's `reward_mean`);
- turns_mean = mean turns per episode; finish_reasons = episodes by finish reason;
- versions = (lowest, highest) policy version that generated a token of the evaluation: weights synced
  while it runs (in place) reach its later turns, so a daemon evaluation can span versions.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from envs.api import EnvFactory, Task
from pipeline.supervisor.actors.chat import ChatTokenizer
from pipeline.supervisor.actors.outcomes import EpisodeOutcome
from pipeline.supervisor.actors.rollout import RolloutSettings, run_episode
from pipeline.supervisor.engines.protocol import GenerateResult, SamplingParams

Mode = Literal["greedy", "sampled"]
MODES: tuple[Mode, ...] = ("greedy", "sampled")


class PriorityEngine(Protocol):
    """What evaluation needs from an engine (pipeline.supervisor.engines.pool.EnginePool): generate with a
    priority."""

    async def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        rid: str,
        *,
        affinity_key: str,
        priority: int | None = None,
    ) -> GenerateResult: ...


@dataclass(frozen=True)
class _AtPriority:
    """The runner's GenerateEngine over a PriorityEngine: every request at `priority`."""

    engine: PriorityEngine
    priority: int | None

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, rid: str, *, affinity_key: str
    ) -> GenerateResult:
        return await self.engine.generate(
            input_ids, sampling, rid, affinity_key=affinity_key, priority=self.priority
        )


@dataclass(frozen=True)
class EvalPlan:
    """What one evaluation runs: the tasks, the modes (`samples` = k of the sampled mode, 0 = off)."""

    tasks: tuple[Task, ...]
    greedy: bool = True
    samples: int = 0

    def __post_init__(self) -> None:
        if not self.tasks:
            raise ValueError("EvalPlan needs at least one task")
        if self.samples < 0 or (not self.greedy and self.samples == 0):
            raise ValueError(f"EvalPlan needs greedy or samples >= 1, got {self.greedy}, {self.samples}")

    @property
    def modes(self) -> tuple[Mode, ...]:
        return tuple(m for m in MODES if (m == "greedy" and self.greedy) or (m == "sampled" and self.samples))

    def episodes_per_task(self, mode: Mode) -> int:
        return 1 if mode == "greedy" else self.samples


@dataclass(frozen=True)
class ModeResult:
    """One mode of one evaluation (module docstring for each number)."""

    mode: Mode
    k: int
    tasks: int
    episodes: int
    successes: int
    success: float
    pass_at_k: float
    reward_mean: float
    turns_mean: float
    finish_reasons: dict[str, int]
    versions: tuple[int, int] | None

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["versions"] = list(self.versions) if self.versions is not None else None
        return out


def episode_return(episode: EpisodeOutcome) -> float:
    """Turn rewards plus outcome (0 without one): what the learner logs as `reward_mean`."""
    return sum(episode.turn_rewards) + (episode.outcome if episode.outcome is not None else 0.0)


def token_versions(episode: EpisodeOutcome) -> list[int]:
    return [v for row in episode.rows for v, m in zip(row.versions, row.loss_mask, strict=True) if m]


def summarise(mode: Mode, per_task: Sequence[Sequence[EpisodeOutcome]]) -> ModeResult:
    """The numbers of one mode from its episodes, grouped by task (k per task)."""
    episodes = [ep for task_episodes in per_task for ep in task_episodes]
    if not episodes:
        raise ValueError("summarise needs at least one episode")
    solved = sum(ep.success for ep in episodes)
    versions = [v for ep in episodes for v in token_versions(ep)]
    return ModeResult(
        mode=mode,
        k=max(len(task_episodes) for task_episodes in per_task),
        tasks=len(per_task),
        episodes=len(episodes),
        successes=solved,
        success=solved / len(episodes),
        pass_at_k=sum(any(ep.success for ep in task_eps) for task_eps in per_task) / len(per_task),
        reward_mean=sum(episode_return(ep) for ep in episodes) / len(episodes),
        turns_mean=sum(ep.num_turns for ep in episodes) / len(episodes),
        finish_reasons=dict(sorted(collections.Counter(ep.finish_reason for ep in episodes).items())),
        versions=(min(versions), max(versions)) if versions else None,
    )


def mode_settings(settings: RolloutSettings, mode: Mode) -> RolloutSettings:
    """The training rollout settings with the mode's sampling: temperature 0 (greedy) or as trained.
    Held-out episodes are never trained on, so they record no routed experts."""
    settings = dataclasses.replace(settings, routed_experts=None)
    if mode == "sampled":
        return settings
    return dataclasses.replace(settings, sampling=dataclasses.replace(settings.sampling, temperature=0.0))


async def run_evaluation(
    engine: PriorityEngine,
    tokenizer: ChatTokenizer,
    factory: EnvFactory,
    plan: EvalPlan,
    settings: RolloutSettings,
    *,
    env_name: str,
    env_options: Mapping[str, Any] | None = None,
    max_concurrent: int = 8,
    priority: int | None = None,
    rid_prefix: str = "eval",
) -> dict[Mode, ModeResult]:
    """Play `plan` (module docstring); episode ids are `{rid_prefix}-{mode}-t{task}-{sample}`.

    Never raises for env or engine failures (they are episodes with that finish reason); a cancelled
    evaluation cancels its episodes."""
    if max_concurrent < 1:
        raise ValueError(f"max_concurrent must be >= 1, got {max_concurrent}")
    gate = asyncio.Semaphore(max_concurrent)
    options = dict(env_options or {})
    prioritised = _AtPriority(engine, priority)

    async def one(mode: Mode, index: int, task: Task, sample: int) -> EpisodeOutcome:
        episode_id = f"{rid_prefix}-{mode}-t{index}-{sample}"
        async with gate:
            try:
                env = factory(**options)
            except Exception as exc:
                return EpisodeOutcome(
                    episode_id, rid_prefix, task.id, env_name, "env_error", [], [], None, 0, 0.0,
                    error=f"env factory raised {exc!r}",
                )  # fmt: skip
            return await run_episode(
                prioritised,
                tokenizer,
                env,
                task,
                mode_settings(settings, mode),
                episode_id=episode_id,
                group_id=rid_prefix,
                env_name=env_name,
                record_metrics=False,
            )

    jobs: dict[Mode, list[list[asyncio.Task[EpisodeOutcome]]]] = {
        mode: [
            [asyncio.create_task(one(mode, i, task, s)) for s in range(plan.episodes_per_task(mode))]
            for i, task in enumerate(plan.tasks)
        ]
        for mode in plan.modes
    }
    everything = [job for per_task in jobs.values() for task_jobs in per_task for job in task_jobs]
    try:
        await asyncio.gather(*everything)
    except BaseException:
        for job in everything:
            job.cancel()
        await asyncio.gather(*everything, return_exceptions=True)
        raise
    return {
        mode: summarise(mode, [[job.result() for job in task_jobs] for task_jobs in per_task])
        for mode, per_task in jobs.items()
    }
