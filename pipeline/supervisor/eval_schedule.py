"""Evaluation during training: the `[eval]` section -> a fixed held-out task set scored as versions go by.

`resolve_eval` checks the section before anything starts (env, options, a usable held-out split) and
fixes the task list once, so every evaluation of a run, and every run of a config with the same
`eval.seed`, scores the same tasks. `Evaluator.on_version(v)` is called by the supervisor after each
weight sync: an evaluation starts when v is `every_versions` past the last evaluated one (and once at
start when `at_start`) and none is running, so evaluations never pile up; a version published while
one runs is simply not evaluated. Each finished evaluation becomes

- one JSON line in `logs/eval.jsonl` (`eval_row`: version, learner step, elapsed seconds, a block per
  mode with success, pass@k, reward, turns, finish reasons and the token versions seen),
- the `rollwise_eval_*` metrics, labelled by eval env and mode; when eval plays the training env with its
  options (`training_env`), also the gap between the training episodes' success since the previous
  evaluation and this evaluation's (`rollwise_eval_success_gap_ratio`): training reward that stops carrying
  to held-out tasks shows there first,
- an `eval` line in the progress view.

With `eval.pause_training` the evaluator holds training admission while it runs (`AdmissionHold`, the
group scheduler): running groups finish and no new one starts, so the evaluation is not starved by
training on an engine training keeps full. The seconds held are `rollwise_eval_training_paused_seconds`.

A failed evaluation is logged and counted (`rollwise_eval_runs_total{status="failed"}`), writes no row
and never stops the daemon; the next version served is evaluated instead. It fails on a bug, and when
any of its episodes ended `engine_error`: an engine that died or stopped answering (a restart, a
machine out of memory) is no verdict on the policy, and 64 such episodes in a row scored 0.0 where
the evaluations around it scored 0.56-0.67. Env failures (`env_error`, `timeout`) are the policy's
episodes like any other and count.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from envs.api import EnvFactory, Environment
from envs.task_split import TaskSplitError, eval_tasks
from pipeline.contracts.config import Config, ConfigError
from pipeline.contracts.run_dir import log_lines
from pipeline.supervisor.actors.chat import ChatTokenizer
from pipeline.supervisor.actors.heldout import EvalPlan, Mode, ModeResult, PriorityEngine, run_evaluation
from pipeline.supervisor.actors.rollout import RolloutSettings
from pipeline.supervisor.observability import metrics
from pipeline.supervisor.progress import Progress

log = logging.getLogger("rollwise.evaluation")


class AdmissionHold(Protocol):
    """What `eval.pause_training` needs from the training side (the group scheduler)."""

    def pause(self, by: str) -> None: ...

    def resume(self, by: str) -> None: ...


@dataclass(frozen=True)
class EvalSetup:
    """A checked `[eval]` section: the env to evaluate, its options and the fixed plan."""

    env_name: str
    factory: EnvFactory
    options: dict[str, Any]
    plan: EvalPlan
    seed: int
    holdout_fraction: float
    max_concurrent: int
    priority: int | None


def evaluates_training_env(cfg: Config) -> bool:
    """True when eval plays the training env with the training options (then a holdout binds training)."""
    same_env = cfg.eval.env in (None, cfg.env.name)
    return same_env and cfg.eval.options in (None, cfg.env.options)


def training_holdout(cfg: Config) -> float:
    """The share of the training env's task space training must skip: eval's held-out share when eval
    plays the training env, else 0."""
    return cfg.eval.holdout_fraction if evaluates_training_env(cfg) else 0.0


def resolve_eval(
    cfg: Config,
    *,
    training_factory: EnvFactory | None = None,
    env_name: str | None = None,
    tasks: int | None = None,
    greedy: bool | None = None,
    samples: int | None = None,
) -> EvalSetup:
    """The `[eval]` section (and `rollwise eval`'s overrides) as an EvalSetup. Raises ConfigError naming
    the key: an unknown env, options it rejects, a holdout that leaves too few tasks."""
    from envs.discovery import EnvDiscoveryError, resolve_env

    name = env_name or cfg.eval.env or cfg.env.name
    training = name == cfg.env.name
    options = cfg.eval.options if cfg.eval.options is not None else (cfg.env.options if training else {})
    key = "eval.env" if cfg.eval.env is not None or env_name is not None else "env.name"
    if training and training_factory is not None:
        factory = training_factory
    else:
        try:
            factory = resolve_env(name)
        except EnvDiscoveryError as exc:
            raise ConfigError(f"{key}: {exc}") from None
    try:
        probe: Environment = factory(**options)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"eval.options: {name} rejects {options!r}: {exc}") from None
    count = tasks if tasks is not None else cfg.eval.tasks
    try:
        chosen = eval_tasks(probe, cfg.eval.seed, count, cfg.eval.holdout_fraction)
    except TaskSplitError as exc:
        raise ConfigError(f"eval.holdout_fraction: {exc}") from None
    use_greedy = cfg.eval.greedy if greedy is None else greedy
    k = cfg.eval.samples if samples is None else samples
    try:
        plan = EvalPlan(tuple(chosen), greedy=use_greedy, samples=k)
    except ValueError as exc:
        raise ConfigError(f"eval: {exc}") from None
    return EvalSetup(
        env_name=name,
        factory=factory,
        options=dict(options),
        plan=plan,
        seed=cfg.eval.seed,
        holdout_fraction=cfg.eval.holdout_fraction,
        max_concurrent=cfg.eval.max_concurrent_episodes,
        priority=None if cfg.eval.priority == "off" else cfg.eval.priority,
    )


def eval_row(
    setup: EvalSetup,
    results: dict[Mode, ModeResult],
    *,
    version: int,
    step: int | None,
    elapsed_s: float | None,
    duration_s: float,
) -> dict[str, Any]:
    """The `logs/eval.jsonl` line of one evaluation (also `rollwise eval --json`'s object)."""
    row: dict[str, Any] = {
        "event": "eval",
        "time": round(time.time(), 3),
        "elapsed_s": None if elapsed_s is None else round(elapsed_s, 3),
        "version": version,
        "step": step,
        "env": setup.env_name,
        "tasks": len(setup.plan.tasks),
        "seed": setup.seed,
        "holdout_fraction": setup.holdout_fraction,
        "duration_s": round(duration_s, 3),
    }
    for mode, result in results.items():
        row[mode] = result.to_json()
    return row


def record_metrics(row: dict[str, Any], results: dict[Mode, ModeResult]) -> None:
    env = str(row["env"])
    metrics.EVAL_VERSION.labels(env=env).set(int(row["version"]))
    metrics.EVAL_DURATION.labels(env=env).observe(float(row["duration_s"]))
    metrics.EVAL_RUNS.labels(env=env, status="ok").inc()
    for mode, result in results.items():
        metrics.EVAL_SUCCESS.labels(env=env, mode=mode).set(result.success)
        metrics.EVAL_PASS_AT_K.labels(env=env, mode=mode).set(result.pass_at_k)
        metrics.EVAL_REWARD.labels(env=env, mode=mode).set(result.reward_mean)
        metrics.EVAL_TURNS.labels(env=env, mode=mode).set(result.turns_mean)
        metrics.EVAL_SUCCESSES.labels(env=env, mode=mode).inc(result.successes)
        for reason, count in result.finish_reasons.items():
            metrics.EVAL_EPISODES.labels(env=env, mode=mode, reason=reason).inc(count)


class Evaluator:
    """Starts evaluations as versions are served (module docstring); one at a time, in the background."""

    def __init__(
        self,
        setup: EvalSetup,
        *,
        engine: PriorityEngine,
        tokenizer: ChatTokenizer,
        settings: RolloutSettings,
        every_versions: int,
        log_path: Path,
        progress: Progress,
        started_at: float,
        training_env: str | None = None,
        on_result: Callable[[dict[str, Any]], None] | None = None,
        training: AdmissionHold | None = None,
    ) -> None:
        self.setup = setup
        self.engine = engine
        self.tokenizer = tokenizer
        self.settings = settings
        self.every_versions = every_versions
        self.log_path = log_path
        self.progress = progress
        self.started_at = started_at
        self.last_version: int | None = None  # the version the latest evaluation started on
        self.running: asyncio.Task[None] | None = None
        self.completed = 0
        self.training_env = training_env  # the gap is computed only when eval plays the training env
        self.on_result = on_result  # each eval row, after the metrics (the experiment trackers)
        self.training = training  # held while an evaluation runs (eval.pause_training); None = never
        metrics.init_eval_label_values(
            setup.env_name, setup.plan.modes, every_versions=every_versions, gap=training_env is not None
        )
        self.training_seen = training_counts(training_env) if training_env is not None else (0.0, 0.0)

    def skip_start(self, version: int) -> None:
        """No evaluation at start (`at_start = false`): the first one comes every_versions later."""
        self.last_version = version

    def due(self, version: int) -> bool:
        if self.running is not None and not self.running.done():
            return False
        return self.last_version is None or version - self.last_version >= self.every_versions

    def on_version(self, version: int, step: int) -> None:
        """The engines now serve `version` (at start: the version they start on)."""
        if not self.due(version):
            return
        previous, self.last_version = self.last_version, version
        self.running = asyncio.create_task(self._evaluate(version, step, previous), name=f"eval v{version}")

    def _failed(self, version: int, previous: int | None, why: str) -> None:
        """Count and report a failed evaluation; the next version served is due again."""
        self.last_version = previous
        metrics.EVAL_RUNS.labels(env=self.setup.env_name, status="failed").inc()
        self.progress.message(f"evaluation of version {version} failed: {why}")

    async def _evaluate(self, version: int, step: int, previous: int | None = None) -> None:
        started = time.monotonic()
        holder = f"eval v{version}"
        if self.training is not None:
            self.training.pause(holder)
        try:
            results = await run_evaluation(
                self.engine,
                self.tokenizer,
                self.setup.factory,
                self.setup.plan,
                self.settings,
                env_name=self.setup.env_name,
                env_options=self.setup.options,
                max_concurrent=self.setup.max_concurrent,
                priority=self.setup.priority,
                rid_prefix=f"eval-v{version}",
            )
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("evaluation of version %d failed", version)
            self._failed(version, previous, repr(exc))
            return
        finally:
            if self.training is not None:
                self.training.resume(holder)
                metrics.EVAL_TRAINING_PAUSED.labels(env=self.setup.env_name).inc(time.monotonic() - started)
        engine_errors = sum(result.finish_reasons.get("engine_error", 0) for result in results.values())
        if engine_errors:
            episodes = sum(result.episodes for result in results.values())
            why = (
                f"{engine_errors} of {episodes} episodes ended engine_error (an engine failed, not the "
                "policy); no score recorded, the next version is evaluated instead"
            )
            log.warning("evaluation of version %d failed: %s", version, why)
            self._failed(version, previous, why)
            return
        row = eval_row(
            self.setup,
            results,
            version=version,
            step=step,
            elapsed_s=started - self.started_at,
            duration_s=time.monotonic() - started,
        )
        await asyncio.to_thread(append_line, self.log_path, row)
        record_metrics(row, results)
        self.record_gap(results)
        self.completed += 1
        self.progress.on_eval(row)
        if self.on_result is not None:
            self.on_result(row)

    def record_gap(self, results: dict[Mode, ModeResult]) -> None:
        """Training success of the episodes finished since the previous evaluation, minus this one's."""
        if self.training_env is None:
            return
        episodes, successes = training_counts(self.training_env)
        new_episodes = episodes - self.training_seen[0]
        new_successes = successes - self.training_seen[1]
        self.training_seen = (episodes, successes)
        if new_episodes <= 0:
            return  # no training episode finished meanwhile: the last gap stands
        training = new_successes / new_episodes
        for mode, result in results.items():
            metrics.EVAL_SUCCESS_GAP.labels(env=self.setup.env_name, mode=mode).set(training - result.success)

    async def finish(self, grace_s: float) -> None:
        """At shutdown: let a running evaluation end within `grace_s` seconds (the engines are still up
        while the learner checkpoints), so the last version served is scored; then cancel what is left."""
        if self.running is not None and not self.running.done():
            await asyncio.wait({self.running}, timeout=grace_s)
        await self.stop()

    async def stop(self) -> None:
        """Cancel a running evaluation (its episodes are never trained on, so nothing is lost)."""
        if self.running is not None and not self.running.done():
            self.running.cancel()
            await asyncio.gather(self.running, return_exceptions=True)


def training_counts(env: str) -> tuple[float, float]:
    """Training episodes finished so far in `env`, and those that succeeded (the exported counters)."""
    episodes = successes = 0.0
    for family in (*metrics.EPISODES.collect(), *metrics.EPISODE_SUCCESSES.collect()):
        for sample in family.samples:
            if sample.name.endswith("_total") and sample.labels.get("env") == env:
                if family.name == "rollwise_episodes":
                    episodes += sample.value
                else:
                    successes += sample.value
    return episodes, successes


def append_line(path: Path, row: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(row, separators=(",", ":")) + "\n")


def read_eval_log(path: Path) -> list[dict[str, Any]]:
    """The evaluation rows of a run, oldest first (lines cut by a crash are skipped)."""
    rows = []
    for line in log_lines(path):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and row.get("event") == "eval":
            rows.append(row)
    return rows
