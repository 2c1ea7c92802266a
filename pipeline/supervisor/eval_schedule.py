"""Evaluation during training: the `[eval]` section -> a fixed held-out task set scored as versions go by.

`resolve_eval` checks the section before anything starts and fixes the task list once, so every
evaluation of a run, and every run of a config with the same `eval.seed`, scores the same tasks.

When (`decide`, pure, in pipeline.supervisor.eval_cadence), on each version served
(`Evaluator.on_version`), an evaluation starts if
- a trigger is due: `every_versions` past the last version evaluated, or a new version `every_minutes`
  after the last evaluation started; the first runs on the version the run starts from (`at_start`);
- none is running: evaluations never pile up, and a version served meanwhile is not evaluated;
- the budget allows (`max_engine_share`, training engines only): after an evaluation of D seconds, ok or
  failed, the next starts no sooner than D / max_engine_share seconds after it started, so evaluating
  takes at most that share of the engines' wall time (1.0: no budget).
A version made due that did not start counts in `rollwise_eval_deferred_total{reason}`.

Where: on the training engines at `eval.priority`, or on a dedicated engine (pipeline.supervisor.fleet.
eval_engine) that loads the version first and serves nothing else (no budget). With `eval.pause_training`
(never with a dedicated engine) training admission is held while an evaluation runs (`AdmissionHold`).

Each finished evaluation becomes a line of `logs/eval.jsonl` (`eval_row`), the `rollwise_eval_*` metrics
(with the training/held-out success gap when eval plays the training env) and an `eval` line in the
progress view. A failed one (a bug, the dedicated engine down, or any episode ended `engine_error`: an
engine failure is no verdict on the policy) is logged and counted, writes no row and never stops the
daemon; the next version served is evaluated instead, its seconds still counted in the budget.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from envs.api import EnvFactory, Environment
from envs.task_split import TaskSplitError, eval_tasks
from pipeline.contracts.config import Config, ConfigError
from pipeline.contracts.run_dir import log_events
from pipeline.supervisor.actors.chat import ChatTokenizer
from pipeline.supervisor.actors.heldout import EvalPlan, Mode, ModeResult, PriorityEngine, run_evaluation
from pipeline.supervisor.actors.rollout import RolloutSettings
from pipeline.supervisor.eval_cadence import Cadence, EvalClock, decide, effective_interval
from pipeline.supervisor.observability import metrics
from pipeline.supervisor.progress import Progress

log = logging.getLogger("rollwise.evaluation")

COUNT_EVERY_S = 2.0  # rollwise_eval_engine_seconds_total grows this often while an evaluation runs
PACE_VERSIONS = 5  # the versions' pace in the interval line: over the latest this many


class AdmissionHold(Protocol):
    """What `eval.pause_training` needs from the training side (the group scheduler)."""

    def pause(self, by: str) -> None: ...

    def resume(self, by: str) -> None: ...


class OwnEngine(PriorityEngine, Protocol):
    """A dedicated evaluation engine (pipeline.supervisor.fleet.eval_engine.DedicatedEvalEngine)."""

    def launch(self, version: int) -> None: ...

    async def load(self, version: int) -> float: ...

    async def stop(self) -> None: ...


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

    if cfg.eval.engine == "dedicated" and cfg.engine.kind == "external":
        raise ConfigError(
            'eval.engine: "dedicated" starts one more engine process of engine.kind, and engine.kind = '
            '"external" starts none: use eval.engine = "training" (eval requests at eval.priority on the '
            'external servers), or engine.kind = "embedded" or "sglang"'
        )
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
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The `logs/eval.jsonl` line of one evaluation (also `rollwise eval --json`'s object); `extra`: the
    daemon's fields (engine, versions_behind, eval_share, load_s)."""
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
        **(extra or {}),
    }
    for mode, result in results.items():
        row[mode] = result.to_json()
    return row


def record_metrics(row: dict[str, Any], results: dict[Mode, ModeResult]) -> None:
    env = str(row["env"])
    metrics.EVAL_VERSION.labels(env=env).set(int(row["version"]))
    metrics.EVAL_DURATION.labels(env=env).observe(float(row["duration_s"]))
    metrics.EVAL_RUNS.labels(env=env, status="ok").inc()
    if row.get("versions_behind") is not None:
        metrics.EVAL_LAG.labels(env=env).set(int(row["versions_behind"]))
    for mode, result in results.items():
        metrics.EVAL_SUCCESS.labels(env=env, mode=mode).set(result.success)
        metrics.EVAL_PASS_AT_K.labels(env=env, mode=mode).set(result.pass_at_k)
        metrics.EVAL_REWARD.labels(env=env, mode=mode).set(result.reward_mean)
        metrics.EVAL_TURNS.labels(env=env, mode=mode).set(result.turns_mean)
        metrics.EVAL_SUCCESSES.labels(env=env, mode=mode).inc(result.successes)
        for reason, count in result.finish_reasons.items():
            metrics.EVAL_EPISODES.labels(env=env, mode=mode, reason=reason).inc(count)


class ServedPace:
    """(version, when) of the latest versions served: how fast versions come, and the newest one.
    `newest_published()`: the learner's newest published version (default: the newest served)."""

    def __init__(self, newest_published: Callable[[], int] | None) -> None:
        self.served: collections.deque[tuple[int, float]] = collections.deque(maxlen=PACE_VERSIONS + 1)
        self.newest_published = newest_published

    def note(self, version: int, now: float) -> None:
        self.served.append((version, now))

    @property
    def measured(self) -> bool:
        """The pace is measured over PACE_VERSIONS versions."""
        return len(self.served) > PACE_VERSIONS

    def version_seconds(self) -> float | None:
        """Mean seconds between the latest PACE_VERSIONS + 1 served versions (None before two distinct
        versions)."""
        if len(self.served) < 2 or self.served[-1][0] <= self.served[0][0]:
            return None
        (v0, t0), (v1, t1) = self.served[0], self.served[-1]
        return (t1 - t0) / (v1 - v0)

    def newest(self) -> int:
        served = max(v for v, _ in self.served) if self.served else 0
        return max(served, self.newest_published()) if self.newest_published is not None else served


class TrainingGap:
    """Training success of the episodes finished since the previous evaluation minus an evaluation's,
    when eval plays the training env `training_env` (None: never computed)."""

    def __init__(self, env_name: str, training_env: str | None) -> None:
        self.env_name = env_name
        self.training_env = training_env
        self.seen = training_counts(training_env) if training_env is not None else (0.0, 0.0)

    def record(self, results: dict[Mode, ModeResult]) -> None:
        if self.training_env is None:
            return
        episodes, successes = training_counts(self.training_env)
        new_episodes = episodes - self.seen[0]
        new_successes = successes - self.seen[1]
        self.seen = (episodes, successes)
        if new_episodes <= 0:
            return  # no training episode finished meanwhile: the last gap stands
        training = new_successes / new_episodes
        for mode, result in results.items():
            metrics.EVAL_SUCCESS_GAP.labels(env=self.env_name, mode=mode).set(training - result.success)


def engine_failure(results: dict[Mode, ModeResult]) -> str | None:
    """Why an evaluation scores nothing when some of its episodes ended engine_error (None: none did)."""
    engine_errors = sum(result.finish_reasons.get("engine_error", 0) for result in results.values())
    if not engine_errors:
        return None
    episodes = sum(result.episodes for result in results.values())
    return (
        f"{engine_errors} of {episodes} episodes ended engine_error (an engine failed, not the "
        "policy); no score recorded, the next version is evaluated instead"
    )


class Evaluator:
    """Starts evaluations as versions are served (module docstring); one at a time, in the background.

    `every_versions`, `every_minutes`, `max_engine_share`: the Cadence (the defaults: no minute trigger,
    no budget). `dedicated`: the evaluation engine (then `engine` is ignored and no budget applies).
    `training_env`: the env whose training success the gap compares (None: no gap). `on_result`: called
    with each eval row after the metrics (the experiment trackers). `training`: held while an evaluation
    runs (eval.pause_training; None = never). `clock`: monotonic seconds."""

    def __init__(
        self,
        setup: EvalSetup,
        *,
        engine: PriorityEngine | None,
        tokenizer: ChatTokenizer,
        settings: RolloutSettings,
        every_versions: int,
        log_path: Path,
        progress: Progress,
        started_at: float,
        training_env: str | None = None,
        on_result: Callable[[dict[str, Any]], None] | None = None,
        training: AdmissionHold | None = None,
        every_minutes: float = 0.0,
        max_engine_share: float = 1.0,
        dedicated: OwnEngine | None = None,
        newest_published: Callable[[], int] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.setup = setup
        self.dedicated = dedicated
        self.engine: PriorityEngine | None = dedicated if dedicated is not None else engine
        self.kind = "dedicated" if dedicated is not None else "training"
        share = 1.0 if dedicated is not None else max_engine_share
        self.cadence = Cadence(every_versions, every_minutes, share)
        self.tokenizer, self.settings = tokenizer, settings
        self.log_path, self.progress, self.started_at = log_path, progress, started_at
        self.on_result, self.training = on_result, training
        self.clock_now = clock
        self.clock = EvalClock()
        self.pace = ServedPace(newest_published)
        self.running: asyncio.Task[None] | None = None
        self.completed = 0
        self.last_eval_s: float | None = None  # the latest successful evaluation's wall seconds
        self.eval_seconds = 0.0  # wall seconds evaluations ran (ok and failed)
        self.first_started: float | None = None
        self._counted = 0.0  # up to when the running evaluation's seconds are counted
        self.interval_told = False
        metrics.init_eval_label_values(
            setup.env_name,
            setup.plan.modes,
            every_versions=every_versions,
            gap=training_env is not None,
            kind=self.kind,
            budget=share if dedicated is None else None,
        )
        self.seconds_counter = metrics.EVAL_ENGINE_SECONDS.labels(env=setup.env_name, kind=self.kind)
        self.gap = TrainingGap(setup.env_name, training_env)

    @property
    def last_version(self) -> int | None:
        """The version the triggers count from (the latest evaluation started and not failed)."""
        return self.clock.version

    def skip_start(self, version: int) -> None:
        """No evaluation at start (`at_start = false`): the triggers count from the version served now."""
        self.pace.note(version, self.clock_now())
        self.clock = replace(self.clock, version=version, since=self.clock_now())
        if self.dedicated is not None:
            self.dedicated.launch(version)  # up by the time the first evaluation is due

    def due(self, version: int) -> bool:
        return decide(self.cadence, self.clock, version, self.clock_now()) == "start"

    def on_version(self, version: int, step: int) -> None:
        """The engines now serve `version` (at start: the version they start on)."""
        now = self.clock_now()
        self.pace.note(version, now)
        if not self.interval_told and self.last_eval_s is not None and self.pace.measured:
            self.tell_interval(self.last_eval_s)
        decision = decide(self.cadence, self.clock, version, now)
        if decision in ("running", "budget"):
            metrics.EVAL_DEFERRED.labels(env=self.setup.env_name, reason=decision).inc()
        if decision != "start":
            return
        previous = (self.clock.version, self.clock.since)
        self.clock = EvalClock(version=version, since=now, ran_at=now, ran_s=None)
        self.first_started = now if self.first_started is None else self.first_started
        self.running = asyncio.create_task(
            self._evaluate(version, step, previous, started=now), name=f"eval v{version}"
        )

    def _failed(self, version: int, previous: tuple[int | None, float | None], why: str) -> None:
        """Count and report a failed evaluation; the next version served is due again."""
        self.clock = replace(self.clock, version=previous[0], since=previous[1])
        metrics.EVAL_RUNS.labels(env=self.setup.env_name, status="failed").inc()
        self.progress.message(f"evaluation of version {version} failed: {why}")

    async def _count_seconds(self) -> None:
        """Add the running evaluation's seconds to the counter as they pass (its rate is then live)."""
        while True:
            await asyncio.sleep(COUNT_EVERY_S)
            now = self.clock_now()
            self.seconds_counter.inc(max(0.0, now - self._counted))
            self._counted = now

    async def _evaluate(
        self, version: int, step: int, previous: tuple[int | None, float | None], *, started: float
    ) -> None:
        self._counted = started
        counting = asyncio.create_task(self._count_seconds(), name=f"eval v{version} seconds")
        try:
            await self._run(version, step, previous, started)
        finally:
            counting.cancel()
            await asyncio.gather(counting, return_exceptions=True)
            now = self.clock_now()
            self.seconds_counter.inc(max(0.0, now - self._counted))
            self.eval_seconds += now - started
            self.clock = replace(self.clock, ran_s=now - started)

    async def _run(
        self, version: int, step: int, previous: tuple[int | None, float | None], started: float
    ) -> None:
        """One evaluation: its episodes, then its row and metrics, or a failure counted and reported."""
        extra: dict[str, Any] = {"engine": self.kind}
        try:
            results = await self._play(version, started, extra)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("evaluation of version %d failed", version)
            self._failed(version, previous, repr(exc))
            return
        why = engine_failure(results)
        if why is not None:
            log.warning("evaluation of version %d failed: %s", version, why)
            self._failed(version, previous, why)
            return
        await self._record(version, step, started, results, extra)

    async def _play(self, version: int, started: float, extra: dict[str, Any]) -> dict[Mode, ModeResult]:
        """The evaluation's episodes (on a dedicated engine: once it loaded `version`), training admission
        held meanwhile with eval.pause_training."""
        holder = f"eval v{version}"
        if self.training is not None:
            self.training.pause(holder)
        try:
            if self.dedicated is not None:
                extra["load_s"] = round(await self.dedicated.load(version), 3)
            assert self.engine is not None, "an Evaluator needs an engine or a dedicated one"
            return await run_evaluation(
                self.engine,
                self.tokenizer,
                self.setup.factory,
                self.setup.plan,
                self.settings,
                env_name=self.setup.env_name,
                env_options=self.setup.options,
                max_concurrent=self.setup.max_concurrent,
                priority=self.setup.priority if self.dedicated is None else None,
                rid_prefix=f"eval-v{version}",
            )
        finally:
            if self.training is not None:
                self.training.resume(holder)
                paused = self.clock_now() - started
                metrics.EVAL_TRAINING_PAUSED.labels(env=self.setup.env_name).inc(paused)

    async def _record(
        self,
        version: int,
        step: int,
        started: float,
        results: dict[Mode, ModeResult],
        extra: dict[str, Any],
    ) -> None:
        """A finished evaluation's row (logs/eval.jsonl), metrics, gap, progress line and interval."""
        now = self.clock_now()
        first = self.first_started if self.first_started is not None else started
        extra["versions_behind"] = max(0, self.pace.newest() - version)
        extra["eval_share"] = round((self.eval_seconds + now - started) / max(now - first, 1e-9), 4)
        row = eval_row(
            self.setup,
            results,
            version=version,
            step=step,
            elapsed_s=started - self.started_at,
            duration_s=now - started,
            extra=extra,
        )
        await asyncio.to_thread(append_line, self.log_path, row)
        record_metrics(row, results)
        self.record_gap(results)
        self.completed += 1
        self.progress.on_eval(row)
        self.last_eval_s = now - started
        self.tell_interval(self.last_eval_s)
        if self.on_result is not None:
            self.on_result(row)

    def tell_interval(self, eval_s: float) -> None:
        """The effective interval from an evaluation's cost and the versions' pace: logged after every
        evaluation, printed once, when the pace is measured over PACE_VERSIONS versions."""
        version_s = self.pace.version_seconds()
        if version_s is None or version_s <= 0:
            return
        versions, seconds = effective_interval(self.cadence, eval_s, version_s)
        where = (
            "a dedicated engine"
            if self.dedicated is not None
            else (f"the training engines, budget {self.cadence.max_engine_share:.0%}")
        )
        line = (
            f"evaluation every ~{versions} version{'s' if versions > 1 else ''} / ~{seconds / 60:.1f} min at "
            f"{eval_s:.0f} s per evaluation (on {where}; a version every {version_s:.0f} s)"
        )
        log.info("%s", line)
        if not self.interval_told and self.pace.measured:
            self.interval_told = True
            self.progress.message(line)

    def record_gap(self, results: dict[Mode, ModeResult]) -> None:
        """Training success of the episodes finished since the previous evaluation, minus this one's."""
        self.gap.record(results)

    async def finish(self, grace_s: float) -> None:
        """At shutdown: let a running evaluation end within `grace_s` seconds (the engines are still up
        while the learner checkpoints), so the last version served is scored; then cancel what is left."""
        if self.running is not None and not self.running.done():
            await asyncio.wait({self.running}, timeout=grace_s)
        await self.stop()

    async def stop(self) -> None:
        """Cancel a running evaluation (its episodes are never trained on, so nothing is lost) and stop
        the dedicated engine. Idempotent."""
        if self.running is not None and not self.running.done():
            self.running.cancel()
            await asyncio.gather(self.running, return_exceptions=True)
        if self.dedicated is not None:
            await self.dedicated.stop()


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
    return log_events(path, "eval")
