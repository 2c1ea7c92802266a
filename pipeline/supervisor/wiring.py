"""Config -> the daemon's components. Everything a bad config can break is checked in `resolve_config`,
before anything starts; the rest builds what the schedule in daemon.py asks for.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import itertools
import json
import logging
import sys
from asyncio.subprocess import PIPE
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from envs.agent import AgentEnvironment
from envs.api import EnvFactory, Environment, can_fork
from envs.task_split import training_tasks
from pipeline.contracts import events
from pipeline.contracts.config import (
    Config,
    ConfigError,
    ManagedEngine,
    check_exposed_ports,
    check_tls_files,
    load_config,
)
from pipeline.contracts.run_dir import PRESET_CONTEXT_TOKENS, RunDir, is_model_dir, model_context_length
from pipeline.supervisor.actors.admission import AdmissionController
from pipeline.supervisor.actors.chat import ChatTokenizer
from pipeline.supervisor.actors.rollout import GenerateEngine, RolloutSettings
from pipeline.supervisor.actors.scheduler import GroupRecipe, GroupScheduler, Pacing, ResumePoint, TreeRecipe
from pipeline.supervisor.engines.protocol import SamplingParams
from pipeline.supervisor.engines.served_check import ServedPolicyCheck, tolerance_for
from pipeline.supervisor.eval_cadence import describe_cadence
from pipeline.supervisor.eval_schedule import (
    AdmissionHold,
    EvalSetup,
    Evaluator,
    evaluates_training_env,
    resolve_eval,
    training_holdout,
)
from pipeline.supervisor.fleet.core_split import CoreSplit, apply_split
from pipeline.supervisor.progress import Progress
from pipeline.transport.spool import SpoolWriter, spool_depth

if TYPE_CHECKING:
    from pipeline.supervisor.actors.agent_api.openai_endpoint import OpenAIEndpoint
    from pipeline.supervisor.actors.concurrency import ConcurrencyLimit
    from pipeline.supervisor.fleet.engine_fleet import EngineFleet

log = logging.getLogger("rollwise.supervisor")


@dataclass(frozen=True)
class RunSetup:
    """A validated run: the config, its directory, and the environment built once from `env.options`
    (its spec was checked against the config; its task stream feeds the scheduler)."""

    cfg: Config
    run: RunDir
    env_factory: EnvFactory
    env: Environment
    evaluation: EvalSetup | None = None  # the checked [eval] section when evaluation is on
    cores: CoreSplit | None = None  # the engines' and the learner's threads, printed at start


# `rollwise run` with neither --config nor --set. The built-in defaults are a pretrained model's on a GPU
# (lr 1e-6, 1024 new tokens, GSPO's 3e-4 band), while the default model is the tiny random preset: with
# them it made no learner step in minutes and would learn nothing if it did. The bare command runs what
# `make run` runs instead, the CPU recipe that learns in minutes on any machine.
BARE_RUN_RECIPE = Path(__file__).resolve().parents[2] / "examples" / "guess_number.toml"


def bare_run_config(ns: argparse.Namespace, recipe: Path = BARE_RUN_RECIPE) -> str | None:
    """The config the bare `rollwise run` uses and a line saying so (None when --config or --set was
    given: those mean the built-in defaults). ConfigError when the recipe is not on disk (an install
    without the repository's examples/), naming what to pass instead."""
    if ns.config is not None or ns.set:
        return None
    if not recipe.is_file():
        raise ConfigError(
            f"no --config given, and the CPU recipe it would run ({recipe}) is not installed: pass "
            "--config FILE, or --set KEY=VALUE to run on the built-in defaults (`rollwise config show`)"
        )
    ns.config = str(recipe)
    return (
        f"no --config: running the CPU recipe {recipe.parent.name}/{recipe.name} (what `make run` runs: a "
        "tiny model learns guess-the-number in minutes). The built-in defaults (`rollwise config show`) "
        "are for a pretrained model on a GPU; a real model on the CPU: examples/smollm2_arithmetic.toml "
        "(`make run-real`)"
    )


def resolve_config(ns: argparse.Namespace) -> RunSetup:
    """Config file + --set + the run flags (as overrides, so errors name the key); checks the env name,
    its options and the model path before anything starts. Raises ConfigError."""
    overrides = list(ns.set or [])
    if ns.run_dir is not None:
        overrides.append(f"run.run_dir={json.dumps(ns.run_dir)}")
    if ns.max_steps is not None:
        overrides.append(f"run.max_steps={ns.max_steps}")
    if ns.log_format is not None:
        overrides.append(f"run.log_format={json.dumps(ns.log_format)}")
    cfg, cores = apply_split(load_config(ns.config, overrides))
    check_exposed_ports(cfg)
    check_tls_files(cfg)
    check_observer_libraries(cfg)
    from envs.discovery import EnvDiscoveryError, resolve_env

    try:
        factory = resolve_env(cfg.env.name)
    except EnvDiscoveryError as exc:
        raise ConfigError(f"env.name: {exc}") from None
    try:
        env = factory(**cfg.env.options)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"env.options: {cfg.env.name} rejects {cfg.env.options!r}: {exc}") from None
    if cfg.env.agent_workers > 0 and (
        not isinstance(env, AgentEnvironment) or type(env).play is not AgentEnvironment.play
    ):
        raise ConfigError(
            f"env.agent_workers: {cfg.env.name} is not an agent-function environment; only those run in "
            "worker processes (set env.agent_workers = 0)"
        )
    if cfg.env.agent_workers > 0 and isinstance(env, AgentEnvironment) and env.agent_ref is None:
        raise ConfigError(
            "env.agent_workers: the agent function cannot be imported by a worker process; name it as "
            "'module:attr' or 'file.py:attr' in env.options.agent"
        )
    if cfg.rollout.branch_turn and (isinstance(env, AgentEnvironment) or not can_fork(env)):
        what = (
            "an agent environment (its agent holds the conversation)"
            if isinstance(env, AgentEnvironment)
            else "an environment without fork()"
        )
        raise ConfigError(
            f"rollout.branch_turn: a tree rollout forks the environment between turns, and {cfg.env.name} "
            f"is {what}; set rollout.branch_turn = 0"
        )
    runs_a_function = isinstance(env, AgentEnvironment) and type(env).play is AgentEnvironment.play
    if runs_a_function and importlib.util.find_spec("openai") is None:
        raise ConfigError(
            f"env.name: {cfg.env.name} is an agent environment, whose agent gets an openai.AsyncOpenAI "
            "client; install the openai package (pip install 'rollwise[agents]')"
        )
    if cfg.learner.regularizers.action_prior_coef > 0.0 and not env.spec.action_hints:
        raise ConfigError(
            f"learner.regularizers.action_prior_coef: {cfg.learner.regularizers.action_prior_coef} needs an "
            f"env that declares action_hints, and {cfg.env.name} declares none (set it to 0)"
        )
    run = RunDir.at(cfg.run.run_dir, cfg.model.path)
    if cfg.model.path is not None and not is_model_dir(run.initial_model):
        raise ConfigError(f"model.path: {cfg.model.path} is not an HF model directory (no config.json)")
    check_moe(cfg, run.initial_model)
    check_context_fits(cfg, run)
    evaluation = resolve_eval(cfg, training_factory=factory) if cfg.eval.enabled else None
    return RunSetup(cfg, run, factory, env, evaluation, cores)


# The experts of an MoE model are no linear modules LoRA could adapt (learner.lora.apply_lora refuses them).
_EXPERT_MODULES = ("gate_proj", "up_proj", "down_proj")


def moe_routing_shape(model_dir: Path) -> tuple[int, int, int] | None:
    """(layers, topk, num_experts) of the MoE model in `model_dir` (its config.json), None when dense."""
    config = json.loads((model_dir / "config.json").read_text())
    experts = next(
        (config[k] for k in ("num_experts", "num_local_experts", "n_routed_experts") if config.get(k)), None
    )
    topk, layers = config.get("num_experts_per_tok"), config.get("num_hidden_layers")
    if not isinstance(experts, int) or not isinstance(topk, int) or not isinstance(layers, int):
        return None
    return layers, topk, experts


def check_moe(cfg: Config, model_dir: Path) -> None:
    """The [learner.moe] keys and LoRA against the model, before anything starts (ConfigError naming the
    key): routing records need an MoE model; LoRA cannot adapt an MoE model's experts. A preset not yet
    built is judged by its name (the moe-* presets are Qwen3-MoE, every layer routed)."""
    if cfg.model.path is not None or is_model_dir(model_dir):
        is_moe = moe_routing_shape(model_dir) is not None
        described = f"the model in {model_dir}"
    else:
        is_moe = cfg.model.preset.startswith("moe-")
        described = f"model.preset = {cfg.model.preset!r}"
    moe = cfg.learner.moe
    for key, wanted in (
        ("routing_replay", moe.routing_replay),
        ("record_routing", moe.record_routing),
        ("load_balance_coef", moe.load_balance_coef > 0.0),
    ):
        if wanted and not is_moe:
            raise ConfigError(
                f"learner.moe.{key} needs a Mixture-of-Experts model, and {described} is dense (no "
                "num_experts / num_experts_per_tok in its config): use model.preset = 'moe-tiny' or an MoE "
                f"checkpoint, or unset learner.moe.{key}"
            )
    wanted_experts = sorted(set(cfg.learner.lora.target_modules) & set(_EXPERT_MODULES))
    if wanted_experts and cfg.learner.lora.enabled and is_moe:
        raise ConfigError(
            f"learner.lora.target_modules: {wanted_experts} are expert weights in {described}, an MoE "
            "model whose experts are 3D parameters, not linear layers LoRA can adapt: set "
            "learner.lora.target_modules to the attention projections, e.g. "
            '["q_proj", "k_proj", "v_proj", "o_proj"]'
        )


def model_context(cfg: Config, run: RunDir) -> tuple[int, str] | None:
    """The context length the engines will serve and where that is known from; None when unknown."""
    args = cfg.engine.extra_args if isinstance(cfg.engine, ManagedEngine) else []
    if "--context-length" in args[:-1]:
        try:
            return int(args[args.index("--context-length") + 1]), "engine.extra_args --context-length"
        except ValueError:
            return None
    if cfg.model.path is None:
        return PRESET_CONTEXT_TOKENS, f"the {cfg.model.preset!r} preset"
    length = model_context_length(run.initial_model)
    return (length, f"{cfg.model.path}/config.json") if length is not None else None


def check_context_fits(cfg: Config, run: RunDir) -> None:
    """Where the model's context is known: refuse a reply longer than the whole context (every engine
    refuses such a request), and cut the episode budget to the context. The runner asks each turn for
    at most `env.max_context_tokens - prompt` tokens, so with the budget cut prompt + reply always fit;
    with a budget beyond the context a turn overflowed it (SGLang refuses the request; the embedded
    engine cut the reply, and the next turn's prompt no longer fitted): an engine_error per episode
    instead of a truncated one. Raises ConfigError; the cut is logged and written to the run's
    config.toml."""
    known = model_context(cfg, run)
    if known is None:
        return
    context, source = known
    new = cfg.sampling.max_new_tokens
    if new > context:
        raise ConfigError(
            f"sampling.max_new_tokens: {new} is longer than the model's whole context of {context} tokens "
            f"({source}): no engine accepts such a request. Set it below {context} minus the prompts' length"
        )
    if cfg.env.max_context_tokens > context:
        log.warning(
            "env.max_context_tokens = %d exceeds the model's context of %d tokens (%s): episodes are cut "
            "(finish reason truncated) at %d",
            cfg.env.max_context_tokens,
            context,
            source,
            context,
        )
        cfg.env.max_context_tokens = context


def check_observer_libraries(cfg: Config) -> None:
    """[tracing] and [trackers] name libraries that are optional extras: a missing one is a ConfigError
    naming the key before anything starts (found without importing them)."""
    wanted = {
        "tracing.enabled": (cfg.tracing.enabled, "opentelemetry.sdk", "tracing"),
        "tracing.protocol": (
            cfg.tracing.enabled,
            "opentelemetry.exporter.otlp.proto." + ("grpc" if cfg.tracing.protocol == "grpc" else "http"),
            "tracing",
        ),
        "trackers.wandb": (cfg.trackers.wandb, "wandb", "trackers"),
        "trackers.mlflow": (cfg.trackers.mlflow, "mlflow", "trackers"),
        "trackers.tensorboard": (cfg.trackers.tensorboard, "tensorboard", "trackers"),
    }
    for key, (on, module, extra) in wanted.items():
        if not on:
            continue
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            raise ConfigError(f"{key}: needs the {module} package (pip install 'rollwise[{extra}]')")


async def ensure_initial_model(setup: RunSetup) -> Path:
    """The initial model directory; creates the preset in run_dir/model (atomically) when needed, in a
    process of its own (`python -m learner.model.model_init`): building weights takes torch, which the daemon
    never imports."""
    target = setup.run.initial_model
    if setup.cfg.model.path is not None or is_model_dir(target):
        return target
    preset, seed = setup.cfg.model.preset, setup.cfg.run.seed
    argv = ["--out", str(target), "--preset", preset, "--seed", str(seed), "--keep-existing"]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "learner.model.model_init", *argv, stdout=PIPE, stderr=PIPE
    )
    _, err = await proc.communicate()
    if proc.returncode != 0:
        tail = err.decode(errors="replace").strip().splitlines()[-20:]
        raise RuntimeError(
            f"building the initial model (preset {preset!r}, seed {seed}) in {target} failed with exit "
            f"code {proc.returncode}:\n" + "\n".join(tail)
        )
    return target


# tokenizer_config.json classes for which AutoTokenizer builds the plain fast tokenizer itself.
PLAIN_TOKENIZERS = frozenset({"PreTrainedTokenizerFast", "TokenizersBackend"})


def named_tokenizer_class(model_dir: Path) -> str | None:
    """The `tokenizer_class` of `model_dir`'s tokenizer_config.json (None when it names none)."""
    try:
        named = json.loads((model_dir / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None
    return named if isinstance(named, str) else None


def load_tokenizer(model_dir: Path) -> Any:
    """The tokenizer AutoTokenizer gives for `model_dir`. When the directory names the plain fast
    tokenizer, that class is loaded directly: the same object, without transformers' auto module, whose
    import pulls in torch (seconds and hundreds of MB the daemon otherwise never needs)."""
    if named_tokenizer_class(model_dir) in PLAIN_TOKENIZERS:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def initial_accepted(version: int, batch_groups: int, unconsumed_groups: int) -> int:
    """Groups the staleness control counts as accepted on resume.

    Each learner version consumed exactly B accepted groups, so v·B groups are behind the learner;
    the groups fsync'd to the spool but not yet consumed are accepted too (they will be trained).
    Groups lost with a killed supervisor were never fsync'd, never counted, and are simply redone.
    """
    return version * batch_groups + unconsumed_groups


def rollout_settings(cfg: Config, model_dir: Path | None = None) -> RolloutSettings:
    """The episode runner's settings; with `model_dir` (the initial model, built) and learner.moe asking
    for routing records, the runner asks the engines for each turn's routed experts."""
    routing = (
        moe_routing_shape(model_dir) if model_dir is not None and cfg.learner.moe.records_routing else None
    )
    return RolloutSettings(
        # [sampling] names exactly SamplingParams' fields (stop ids come from the tokenizer, the seed
        # is per request).
        sampling=SamplingParams(**cfg.sampling.model_dump() | {"stop": tuple(cfg.sampling.stop)}),
        max_context_tokens=cfg.env.max_context_tokens,
        tool_parser=cfg.env.tool_parser,
        system_prompt=cfg.env.system_prompt,
        # abort-and-retry: an aborted turn is resubmitted with its partial output (AReaL-style), so the
        # tokens already generated keep their old version and the rest comes from the new weights.
        retry_aborted=cfg.async_.weight_sync_mode == "abort",
        routed_experts=routing,
    )


def build_served_check(
    cfg: Config, fleet: EngineFleet, fail: Callable[[str], None]
) -> ServedPolicyCheck | None:
    """The served-policy check of each synced version (`async.served_check`), None when it is off."""
    check = cfg.async_.served_check
    if not check.enabled:
        return None
    return ServedPolicyCheck(
        fleet.pool,
        tolerance=tolerance_for(cfg),
        max_failures=check.max_failures,
        fail=fail,
        names={slot.url: slot.name for slot in fleet.slots},
    )


def build_concurrency(cfg: Config, fleet: EngineFleet, scheduler: GroupScheduler) -> ConcurrencyLimit:
    """The limit on groups in flight `rollout.concurrency` chooses, over the fleet's engines, applied to
    `scheduler` (pipeline.supervisor.actors.concurrency)."""
    from pipeline.supervisor.actors.concurrency import concurrency_limit

    rollout, apply = cfg.rollout, scheduler.set_max_concurrent
    return concurrency_limit(rollout, cfg.learner.batch_groups, fleet.pool, fleet.capacity, apply)


def build_scheduler(
    setup: RunSetup,
    *,
    engine: GenerateEngine,
    tokenizer: ChatTokenizer,
    agent_endpoint: OpenAIEndpoint,
    ready: events.Ready,
    served_version: int,
    dropped_already: int,
    notify: Callable[[str], None] | None = None,
    engines_up: Callable[[], bool] | None = None,
) -> GroupScheduler:
    """The actor side: spool writer and staleness control around the engine pool.

    The learner may already have trained the unconsumed groups, published newer versions and dropped
    some groups while the engines were starting: admission starts from the version the engines serve
    now, and does not count as accepted what the learner already announced it will never train
    (`dropped_already`). Synchronous on purpose: the caller reads `served_version` and
    `dropped_already` and installs the result with no await in between, so no learner event can land
    between the read and the scheduler that must see it."""
    cfg, run = setup.cfg, setup.run
    unconsumed, _ = spool_depth(run.spool, ready.consumed_seq, consumed=set(ready.consumed_after))
    spool = SpoolWriter(run.spool)
    # A resumed run continues the task stream after the groups already produced instead of replaying it.
    # Tasks held out for evaluation (eval.holdout_fraction) are never trained on.
    stream = training_tasks(setup.env.tasks(cfg.run.seed), training_holdout(cfg))
    tasks = itertools.islice(stream, spool.next_seq - 1, None)
    return GroupScheduler(
        recipe=(TreeRecipe if cfg.rollout.branch_turn else GroupRecipe)(
            engine=engine,
            tokenizer=tokenizer,
            factory=setup.env_factory,
            env_name=cfg.env.name,
            settings=agent_endpoint.settings,
            group_size=cfg.env.group_size,
            env_options=cfg.env.options,
            agent_endpoint=agent_endpoint,
            branch_turn=cfg.rollout.branch_turn,
        ),
        admission=AdmissionController(
            cfg.learner.batch_groups,
            cfg.async_.max_staleness,
            cfg.rollout.max_concurrent_groups,
            max_groups=None if cfg.run.max_steps is None else cfg.run.max_steps * cfg.learner.batch_groups,
        ),
        spool=spool,
        tasks=tasks,
        resume=ResumePoint(
            version=served_version,
            accepted=initial_accepted(ready.version, cfg.learner.batch_groups, unconsumed) - dropped_already,
        ),
        pacing=Pacing(
            straggler_patience=cfg.async_.straggler_patience, cut_late_groups=cfg.async_.cut_late_groups
        ),
        notify=notify,
        engines_up=engines_up,
    )


async def start_openai_endpoint(
    engine: GenerateEngine, tokenizer: Any, cfg: Config, model_dir: Path | None = None
) -> OpenAIEndpoint:
    """The run's OpenAI endpoint on 127.0.0.1 (agent-function episodes; judges on the run's own engines,
    which find it through `envs.judge.set_run_endpoint`). The scheduler owns it from here on; its
    settings are the training rollouts' (`rollout_settings(cfg, model_dir)`)."""
    from envs.judge import set_run_endpoint
    from pipeline.supervisor.actors.agent_api.openai_endpoint import OpenAIEndpoint
    from pipeline.supervisor.observability import judge_metrics

    pool = None
    if cfg.env.agent_workers > 0:
        from pipeline.supervisor.actors.agent_api.agent_workers import AgentWorkerPool

        pool = AgentWorkerPool(cfg.env.agent_workers)
        await pool.start()
        log.info("agent functions run in %d worker processes", cfg.env.agent_workers)
    endpoint = OpenAIEndpoint(
        engine=engine, tokenizer=tokenizer, settings=rollout_settings(cfg, model_dir), agent_pool=pool
    )
    await endpoint.start()
    log.info("OpenAI endpoint (agent episodes, judges) on %s", endpoint.base_url)
    set_run_endpoint(endpoint.base_url, endpoint.service_key)
    judge_metrics.install()
    return endpoint


def build_evaluator(
    setup: RunSetup,
    *,
    engine: Any,
    tokenizer: Any,
    progress: Progress,
    started_at: float,
    on_result: Callable[[dict[str, Any]], None] | None = None,
    training: AdmissionHold | None = None,
    newest_published: Callable[[], int] | None = None,
) -> Evaluator | None:
    """The evaluation side (pipeline.supervisor.eval_schedule): on the training engines (`engine`) within
    eval.max_engine_share, or on a dedicated engine process it creates (pipeline.supervisor.fleet.eval_engine;
    the Evaluator launches and stops it); None when eval is off. `on_result` receives each evaluation's
    row (the experiment trackers); `training` is held while an evaluation runs when `eval.pause_training`
    is set; `newest_published()` is the learner's newest published version (versions_behind)."""
    if setup.evaluation is None:
        return None
    cfg = setup.cfg
    dedicated = None
    if cfg.eval.engine == "dedicated":
        from pipeline.supervisor.fleet.eval_engine import DedicatedEvalEngine

        dedicated = DedicatedEvalEngine(cfg, setup.run, grace_s=cfg.run.shutdown_grace_s)
    evaluator = Evaluator(
        setup.evaluation,
        engine=engine,
        tokenizer=tokenizer,
        settings=rollout_settings(cfg),
        every_versions=cfg.eval.every_versions,
        every_minutes=cfg.eval.every_minutes,
        max_engine_share=cfg.eval.max_engine_share,
        dedicated=dedicated,
        newest_published=newest_published,
        log_path=setup.run.eval_log,
        progress=progress,
        started_at=started_at,
        training_env=cfg.env.name if evaluates_training_env(cfg) else None,
        on_result=on_result,
        training=training if cfg.eval.pause_training else None,
    )
    start = describe_cadence(evaluator.cadence, dedicated=dedicated is not None)
    where = f" ({dedicated.slot.url}, logs/{dedicated.log_path.name})" if dedicated is not None else ""
    progress.message(f"{start}{where}; {len(setup.evaluation.plan.tasks)} held-out tasks")
    return evaluator


async def close_env(env: Environment) -> None:
    try:
        await asyncio.wait_for(env.close(), 10.0)
    except Exception as exc:  # a plugin's close must not hide the daemon's exit code
        log.warning("closing the task environment failed: %r", exc)
