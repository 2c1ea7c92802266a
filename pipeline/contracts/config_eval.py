"""`[eval]`: held-out evaluation during training (pipeline.supervisor.eval_schedule)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from pipeline.contracts.config_base import Section


class EvalConfig(Section):
    """Held-out evaluation during training (docs/run.md, "Evaluation during training"). By default
    eval episodes run on the training engines at a lower priority and take at most `max_engine_share` of
    their time; `engine = "dedicated"` gives them an engine process of their own. They are never written
    to the spool and never trained on."""

    every_versions: int = Field(
        0,
        ge=0,
        description=(
            "Evaluate when the served version is n published versions past the last one evaluated (0 = no "
            "version trigger; with every_minutes also 0, no evaluation during training)."
        ),
    )
    every_minutes: float = Field(
        0.0,
        ge=0.0,
        le=10_000.0,
        description=(
            "Evaluate when a newly served version comes this many minutes after the last evaluation "
            "started (0 = no minute trigger). With every_versions too, whichever comes first."
        ),
    )
    max_engine_share: float = Field(
        0.10,
        gt=0.0,
        le=1.0,
        description=(
            "Budget of an evaluation on the training engines: after one that ran D seconds, the next starts "
            "no sooner than D / max_engine_share seconds after it started, so evaluation holds at most this "
            "share of the engines' wall time (1.0 = no budget: back to back at most). Not used with "
            'engine = "dedicated".'
        ),
    )
    at_start: bool = Field(
        True, description="Also evaluate the version the run starts (or resumes) from: the curve's baseline."
    )
    engine: Literal["training", "dedicated"] = Field(
        "training",
        description=(
            '"training": eval requests share the training engines at `priority`, within max_engine_share. '
            '"dedicated": one more engine process of engine.kind (its own port on 127.0.0.1, logs/eval-'
            "engine.log) serves only evaluation and loads the served version before each one; never in "
            "the training pool, restarted when it dies (that evaluation fails). Not with engine.kind = "
            '"external".'
        ),
    )
    engine_threads: int = Field(
        1,
        ge=1,
        le=1024,
        description=(
            'Torch threads of the dedicated engine (eval.engine = "dedicated") when engine.kind = "embedded".'
        ),
    )
    engine_args: list[str] = Field(
        default_factory=list,
        description=(
            "Arguments appended to the dedicated engine's command line (after engine.extra_args), e.g. "
            '["--base-gpu-id", "1"] to put an SGLang evaluation engine on its own GPU.'
        ),
    )
    env: str | None = Field(None, description="Environment to evaluate (None = env.name, the training env).")
    options: dict[str, Any] | None = Field(
        None,
        description="Its factory options (None = env.options for the training env, {} for another env).",
    )
    seed: int = Field(
        1_000_003,
        description=(
            "Seed of the eval task stream, fixed across training seeds so that every run of a config is "
            "scored on the same tasks; must differ from run.seed unless holdout_fraction > 0."
        ),
    )
    holdout_fraction: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description=(
            "0: eval tasks are fresh draws from the eval seed's stream (stream-disjoint: no task id in "
            "common, same distribution). > 0: this share of the task space, chosen by a hash of each "
            "task's content, is held out: training never sees it and eval draws only from it "
            "(content-disjoint; envs.task_split)."
        ),
    )
    tasks: int = Field(32, ge=1, le=100_000, description="Tasks per evaluation.")
    greedy: bool = Field(True, description="Evaluate one greedy episode per task (temperature 0).")
    samples: int = Field(
        0,
        ge=0,
        le=1024,
        description="k episodes per task at sampling.temperature: pass@k and mean success (0 = off).",
    )
    max_concurrent_episodes: int = Field(
        32, ge=1, le=4096, description="Eval episodes in flight at once: the bound on eval's engine share."
    )
    pause_training: bool = Field(
        False,
        description=(
            "While an evaluation runs on the training engines, start no new training group (running ones "
            "finish): the evaluation then has the engines to itself instead of queueing behind training at "
            "its lower priority, where its episodes can run into the env's episode timeout on an engine "
            "training keeps full (a small CPU engine). Costs training the evaluation's whole duration "
            "(rollwise_eval_training_paused_seconds_total); off by default: training admission is never "
            'held for evaluation unless this is set. Not with engine = "dedicated".'
        ),
    )
    priority: int | Literal["off"] = Field(
        -100,
        description=(
            'SGLang request priority of eval requests on the training engines ("off" = not sent). Training '
            "requests carry none, i.e. the server's default 0 (rollwise launches SGLang with "
            "--enable-priority-scheduling --default-priority-value 0 when this is set); higher values are "
            "scheduled first, and a difference above SGLang's preemption threshold (10) lets training "
            "preempt eval."
        ),
    )

    @property
    def enabled(self) -> bool:
        """Evaluation during training is on: a version or a minute trigger is set."""
        return self.every_versions > 0 or self.every_minutes > 0

    @model_validator(mode="after")
    def _rules(self) -> EvalConfig:
        if not self.greedy and self.samples == 0:
            raise ValueError("eval needs greedy = true or samples >= 1 (nothing to evaluate otherwise)")
        if self.pause_training and self.engine == "dedicated":
            raise ValueError(
                "eval.pause_training holds training for evaluations on the training engines; with "
                'eval.engine = "dedicated" they take nothing from training: unset eval.pause_training'
            )
        return self
