"""`[engine]` and `[transport]`: each a union chosen by its `kind`, one model per kind with only that kind's
keys (learner.schedule's pattern).

    [engine]          kind = "embedded" | "sglang" | "external"; what every kind shares (timeouts, weight
                      transport, API key, dtype) and its own keys
    [engine.router]   kind = "none" | "sglang-router": the router in front of the engines
    [transport]       kind = "spool" | "flight": the flight_* keys and the token only with "flight"

A table without `kind` is the default kind. A key of another kind, or a key from before the router's
table (`engine.router_host`, ...), is refused naming the key and where it belongs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, SecretStr, model_validator

from pipeline.contracts.config_base import Section, secret_from_env

KIND_DOC = (
    "embedded = rollwise's torch engine; sglang = SGLang servers rollwise launches; external = servers "
    "started elsewhere, at urls. Each kind takes only its own keys."
)
TRANSPORT_DOC = (
    "spool = the learner reads run_dir/spool; flight = the supervisor also serves the spool as an Arrow "
    "Flight service, for a learner that reads it over the network (learner.remote.spool_url)."
)


class RouterConfig(Section):
    """SGLang's router in front of the engines (docs/scale_out.md, "A fleet across machines")."""

    kind: Literal["none", "sglang-router"] = Field(
        "none",
        description=(
            "sglang-router = start SGLang's router in front of the engines and send every /generate "
            "through it; control calls (pause, weights, continue, health) still go to each engine."
        ),
    )
    host: str = Field("127.0.0.1", description="Bind address of the router rollwise starts.")
    port: int = Field(0, ge=0, le=65535, description="Port of the router (0 = pick a free one).")
    policy: Literal["manual", "cache_aware", "round_robin", "power_of_two"] = Field(
        "manual",
        description=(
            "Router policy. manual = session affinity: the episode id is the X-SMG-Routing-Key, so every "
            "turn of an episode reaches the same worker (cache_aware matches request *text*, and rollwise "
            "sends token ids only, so it cannot see an episode's prefix)."
        ),
    )
    args: list[str] = Field(default_factory=list, description="Extra sglang_router.launch_router flags.")


class EngineBase(Section):
    """What every engine kind shares."""

    kind: str = Field(description=KIND_DOC)
    api_key: SecretStr | None = Field(
        default_factory=lambda: secret_from_env("ROLLWISE_ENGINE_API_KEY"),
        description=(
            "Bearer token for the engines' HTTP API (default: $ROLLWISE_ENGINE_API_KEY); required when "
            "engine.host is not loopback. Never written to the run directory or logged."
        ),
    )
    request_timeout_s: float = Field(120.0, gt=0, description="Timeout of one /generate call.")
    startup_timeout_s: float = Field(600.0, gt=0, description="Time an engine gets to answer /health.")
    health_check_interval_s: float = Field(
        5.0,
        gt=0,
        description=(
            "How often the daemon asks every engine in service for /health, so that a dead or frozen "
            "engine is ejected (after 3 failures in a row) even when it gets no request."
        ),
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
    weight_transport: Literal["shared_fs", "http"] = Field(
        "shared_fs",
        description=(
            "shared_fs = engines read weights/v<n> from the run directory; http = before each sync the "
            "supervisor asks each engine's fetcher to download the version from its weight endpoint "
            "(admin.host:admin.port) into the engine's own disk, then loads that local copy."
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
    router: RouterConfig = Field(default_factory=RouterConfig)


class ManagedEngine(EngineBase):
    """Engines rollwise starts (embedded, sglang)."""

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
    num_engines: int = Field(1, ge=1, le=64, description="Engines to start.")
    extra_args: list[str] = Field(
        default_factory=list,
        description=(
            "Extra flags appended to each engine's command line: SGLang launch_server flags, or the "
            "embedded engine's (e.g. its fault-injection switch --fault-stale-weights)."
        ),
    )


class EmbeddedEngine(ManagedEngine):
    kind: Literal["embedded"] = Field("embedded", description=KIND_DOC)
    max_batch: int = Field(64, ge=1, description="Most requests decoded together.")
    batch_wait_ms: float = Field(3.0, ge=0, description="How long to collect a batch.")
    threads: int | None = Field(
        None, ge=1, description="Torch intra-op threads of each engine (None = every core it may use)."
    )
    share_cores: Literal["split", "time"] = Field(
        "split",
        description=(
            "How the engines and a learner on this machine's CPU share its cores: split = disjoint "
            "shares, both run at once; time = every core for each in turn, the engines holding their "
            "decoding while the learner computes a step (pipeline/contracts/core_lease.py). Ignored "
            "when the learner is not on this CPU."
        ),
    )


class SglangEngine(ManagedEngine):
    kind: Literal["sglang"] = Field(description=KIND_DOC)
    mem_fraction_static: float = Field(0.8, gt=0, le=1, description="SGLang --mem-fraction-static.")
    tp: int = Field(1, ge=1, description="SGLang tensor parallel size.")
    dp: int = Field(1, ge=1, description="SGLang data parallel size.")

    @model_validator(mode="after")
    def _no_fetcher(self) -> SglangEngine:
        if self.weight_transport == "http":
            raise ValueError(
                "engine.weight_transport = 'http' needs engines with a fetcher: kind = 'embedded', or "
                "'external' with engine.fetch_urls (SGLang engines rollwise starts share its disk)"
            )
        return self


class ExternalEngine(EngineBase):
    kind: Literal["external"] = Field(description=KIND_DOC)
    urls: list[str] = Field(default_factory=list, description="The servers' URLs.")
    fetch_urls: list[str] = Field(
        default_factory=list,
        description=(
            "With weight_transport = http: the fetcher of each engine in urls, in order ('rollwise "
            "engine fetch-agent' beside SGLang; an embedded engine's own URL)."
        ),
    )

    @model_validator(mode="after")
    def _urls(self) -> ExternalEngine:
        if not self.urls:
            raise ValueError("engine.urls must list at least one server when engine.kind = 'external'")
        if self.fetch_urls and self.weight_transport != "http":
            raise ValueError("engine.fetch_urls needs engine.weight_transport = 'http'")
        if self.fetch_urls and len(self.fetch_urls) != len(self.urls):
            raise ValueError("engine.fetch_urls must name one fetcher per entry of engine.urls")
        return self


class SpoolTransport(Section):
    kind: Literal["spool"] = Field("spool", description=TRANSPORT_DOC)


class FlightTransport(Section):
    kind: Literal["flight"] = Field(description=TRANSPORT_DOC)
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


ENGINE_KINDS: dict[str, type[EngineBase]] = {
    "embedded": EmbeddedEngine,
    "sglang": SglangEngine,
    "external": ExternalEngine,
}
TRANSPORT_KINDS: dict[str, type[Section]] = {"spool": SpoolTransport, "flight": FlightTransport}
# engine keys from before [engine.router] -> their key in it
ROUTER_KEYS = {"router_host": "host", "router_port": "port", "router_policy": "policy", "router_args": "args"}


def _of_kind(table: str, kinds: Mapping[str, type[Section]], default: str) -> Callable[[Any], Any]:
    """A before-validator for the union at `table`: the default kind when none is given, and a key of
    another kind refused naming the kinds it belongs to."""

    def check(data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = {"kind": default, **data}
        kind = data["kind"]
        own = kinds.get(kind) if isinstance(kind, str) else None
        if own is None:
            return data  # the union names the kinds it knows
        for key in data:
            owners = [kind for kind, model in kinds.items() if key in model.model_fields]
            if key not in own.model_fields and owners:
                raise ValueError(
                    f"{table}.{key} is a setting of {table}.kind = {' or '.join(map(repr, owners))}, not "
                    f"{data['kind']!r}"
                )
        return data

    return check


_engine_keys = _of_kind("engine", ENGINE_KINDS, "embedded")


def _engine_table(data: Any) -> Any:
    if isinstance(data, dict):
        for old, new in ROUTER_KEYS.items():
            if old in data:
                raise ValueError(f"engine.{old} is engine.router.{new} now (the [engine.router] table)")
        if isinstance(data.get("router"), str):
            raise ValueError(
                f"engine.router is a table now: set engine.router.kind = {data['router']!r} ([engine.router])"
            )
    return _engine_keys(data)


EngineConfig = Annotated[
    EmbeddedEngine | SglangEngine | ExternalEngine,
    Field(discriminator="kind"),
    BeforeValidator(_engine_table),
]
TransportConfig = Annotated[
    SpoolTransport | FlightTransport,
    Field(discriminator="kind"),
    BeforeValidator(_of_kind("transport", TRANSPORT_KINDS, "spool")),
]
