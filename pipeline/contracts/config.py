"""Configuration: one pydantic model per component, loaded from one TOML file plus `--set a.b=c` overrides.

Imports nothing heavy (no torch) so `rollwise config show` is instant. Validation happens before
anything starts; an unknown key or a bad value raises ConfigError naming the dotted key. The tables live
in config_sections.py, config_engine.py ([engine], [transport]), config_eval.py and learner_config.py;
this module holds the whole config, the rules across tables, and loading and writing it.
"""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator

from pipeline.contracts.config_base import Section, is_loopback, reveal
from pipeline.contracts.config_engine import (
    ENGINE_KINDS,
    TRANSPORT_KINDS,
    EmbeddedEngine,
    EngineConfig,
    ExternalEngine,
    FlightTransport,
    ManagedEngine,
    SglangEngine,
    SpoolTransport,
    TransportConfig,
)
from pipeline.contracts.config_eval import EvalConfig
from pipeline.contracts.config_sections import (
    AdminConfig,
    AsyncConfig,
    EnvConfig,
    LogsConfig,
    MetricsConfig,
    ModelConfig,
    RolloutConfig,
    RunConfig,
    SamplingConfig,
    TlsConfig,
    TraceConfig,
    TracingConfig,
    TrackersConfig,
)
from pipeline.contracts.learner_config import SCHEDULE_KINDS, LearnerConfig
from pipeline.contracts.tls import (
    PlaintextRefused,
    TlsFileError,
    TlsFiles,
    check_files,
    check_url,
    require_tls_off_loopback,
)

__all__ = [
    "Config",
    "ConfigError",
    "EmbeddedEngine",
    "EngineConfig",
    "EvalConfig",
    "ExternalEngine",
    "FlightTransport",
    "LearnerConfig",
    "ManagedEngine",
    "SglangEngine",
    "SpoolTransport",
    "TracingConfig",
    "TransportConfig",
    "load_config",
    "reveal",
]


class Config(Section):
    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    engine: EngineConfig = Field(default_factory=EmbeddedEngine)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    async_: AsyncConfig = Field(default_factory=AsyncConfig, alias="async")
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    transport: TransportConfig = Field(default_factory=SpoolTransport)
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
        if self.learner.mini_batches > self.learner.batch_groups * self.env.group_size:
            raise ValueError("learner.mini_batches exceeds the episodes in one rollout batch")
        if self.env.group_size < 2 and self.learner.advantages.estimator == "turn":
            raise ValueError("env.group_size must be >= 2: leave-one-out advantages need peers")
        if self.async_.max_staleness < self.async_.sync_every_steps - 1:
            # Admission counts versions the engines serve; they lag the learner by up to k-1 versions.
            raise ValueError("async.max_staleness must be >= async.sync_every_steps - 1 (actors would wait)")
        lora = self.learner.lora
        if (
            lora.enabled
            and lora.serving == "adapter"
            and isinstance(self.engine, SglangEngine)
            and self.engine.dp > 1
        ):
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
        """Weight transport and Flight settings that only make sense together."""
        lora, remote = self.learner.lora, self.learner.remote
        if lora.enabled and lora.serving == "adapter" and self.engine.weight_transport == "http":
            raise ValueError(
                "learner.lora.serving = 'adapter' reads each adapter from the run directory: with "
                "engine.weight_transport = 'http' use learner.lora.serving = 'merged'"
            )
        if remote.spool_url is not None and self.transport.kind != "flight":
            raise ValueError(
                "learner.remote.spool_url reads the spool over Arrow Flight: set transport.kind = 'flight' "
                "(its token and poll_wait_s are there)"
            )
        own = remote.run_dir
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
    if isinstance(engine, ManagedEngine) and not is_loopback(engine.host) and engine.api_key is None:
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
    if isinstance(t, FlightTransport) and not is_loopback(t.flight_host) and t.token is None:
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
    e, t = cfg.engine, cfg.transport
    if isinstance(e, ManagedEngine):
        require_tls_off_loopback("an engine rollwise starts (engine.host)", e.host, serves, allow, how)
    if e.router.kind != "none":
        require_tls_off_loopback("the router (engine.router.host)", e.router.host, serves, allow, how)
    require_tls_off_loopback("the metrics endpoint (metrics.host)", cfg.metrics.host, serves, allow, how)
    require_tls_off_loopback("the admin endpoint (admin.host)", cfg.admin.host, serves, allow, how)
    if isinstance(t, FlightTransport):
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
    named: list[tuple[str, str | None]] = []
    if isinstance(e, ExternalEngine):
        named += [(f"engine.urls[{i}]", u) for i, u in enumerate(e.urls)]
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
    """The table holding the secret at `dotted` (e.g. learner.remote.weights_token) and its key; a key of
    a kind the config does not choose (transport.token with transport.kind = "spool") is no setting."""
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


# The tagged unions: their table's path -> their kinds.
UNION_KINDS: dict[tuple[str, ...], tuple[str, ...]] = {
    ("learner", "schedule"): SCHEDULE_KINDS,
    ("engine",): tuple(ENGINE_KINDS),
    ("transport",): tuple(TRANSPORT_KINDS),
}


def _format_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        parts, kind = [str(p) for p in e["loc"]], ""
        for i in range(1, len(parts)):
            # A tagged union puts the tag into the location: learner.schedule.cosine.decay_steps.
            if parts[i] in UNION_KINDS.get(tuple(parts[:i]), ()):
                tag = parts.pop(i)
                # The kind's own rule (the tag ends the location) names its keys itself.
                kind = f" ({'.'.join(parts[:i])}.kind = {tag!r})" if i < len(parts) else ""
                break
        if e["type"] == "union_tag_invalid":
            parts.append("kind")  # the tag's own key: engine.kind
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
