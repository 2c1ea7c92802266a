"""Which engine processes a config asks for, and the command line of each.

- `embedded`: `python -m pipeline.engine --model DIR --weight-version V ...` per engine;
- `sglang`: `python -m sglang.launch_server ...` (`build_sglang_command`);
- `external`: nothing to start, only URLs to talk to.

Ports are fixed when the slots are planned (port 0 picks free ones once), so a restarted engine comes
back on the URL its EngineClient already uses. The argv is rebuilt on every start: a restarted engine
loads the latest published weights and announces their version.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.contracts.config import Config, EmbeddedEngine, ManagedEngine, reveal
from pipeline.contracts.cpu_features import usable_cores
from pipeline.contracts.http_guard import ENGINE_API_KEY_ENV
from pipeline.contracts.run_dir import RunDir
from pipeline.contracts.tls import scheme_of
from pipeline.supervisor.engines.adapters import lora_launch_flags
from pipeline.supervisor.fleet.children import ChildSpec


@dataclass(frozen=True)
class EngineSlot:
    """One engine the daemon talks to. `managed` = the daemon starts and restarts it."""

    name: str
    host: str
    port: int
    managed: bool
    external_url: str | None = None
    scheme: str = "http"  # https: a managed engine beyond loopback with [tls] (pipeline.contracts.tls)

    @property
    def url(self) -> str:
        return self.external_url or f"{self.scheme}://{self.host}:{self.port}"


@dataclass
class SGLangLaunchSpec:
    """How to launch one SGLang server. `python_executable` and `module` exist so tests can substitute
    a stub; `extra_args` are appended verbatim (any `launch_server` flag)."""

    model_path: str
    host: str = "127.0.0.1"
    port: int = 30000
    mem_fraction_static: float = 0.8
    tp: int = 1
    dp: int = 1
    api_key: str | None = field(default=None, repr=False)
    weight_version: str = "0"
    extra_args: tuple[str, ...] = ()
    python_executable: str = sys.executable
    module: str = "sglang.launch_server"

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"


def build_sglang_command(spec: SGLangLaunchSpec) -> list[str]:
    """The argv that launches `spec`. `--weight-version` labels the initial weights (rollwise's policy
    version 0) so that every response carries a parseable version from the first token on."""
    cmd = [
        spec.python_executable,
        "-m",
        spec.module,
        "--model-path",
        spec.model_path,
        "--host",
        spec.host,
        "--port",
        str(spec.port),
        "--mem-fraction-static",
        str(spec.mem_fraction_static),
        "--tp-size",
        str(spec.tp),
        "--dp-size",
        str(spec.dp),
        "--enable-metrics",
        "--weight-version",
        spec.weight_version,
    ]
    if spec.api_key:
        cmd += ["--api-key", spec.api_key]
    cmd += list(spec.extra_args)
    return cmd


SGLANG_DEFAULT_DTYPE = "bfloat16"


def free_port(host: str) -> int:
    """A port free at this moment only: a daemon's own children take theirs from PortReservations."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def plan_engines(cfg: Config, pick_port: Callable[[str], int] = free_port) -> list[EngineSlot]:
    """The engine slots of `cfg`: the external URLs, or num_engines local ports from engine.port on
    (engine.port = 0: each from `pick_port(host)`)."""
    e = cfg.engine
    if e.kind == "external":
        return [
            EngineSlot(name=f"engine{i}", host="", port=0, managed=False, external_url=url.rstrip("/"))
            for i, url in enumerate(e.urls)
        ]
    ports = [pick_port(e.host) if e.port == 0 else e.port + i for i in range(e.num_engines)]
    scheme = scheme_of(e.host, cfg.tls.files())
    return [
        EngineSlot(name=f"engine{i}", host=e.host, port=p, managed=True, scheme=scheme)
        for i, p in enumerate(ports)
    ]


def tls_flags(cfg: Config, slot: EngineSlot) -> list[str]:
    """The TLS flags of a managed engine (SGLang's names; the embedded engine takes the same): its
    certificate beyond loopback, and the CA an embedded engine's fetches check the admin endpoint with."""
    tls = cfg.tls
    flags: list[str] = []
    if slot.scheme == "https":
        flags += ["--ssl-certfile", str(tls.cert_file), "--ssl-keyfile", str(tls.key_file)]
    embedded = cfg.engine.kind == "embedded"
    if tls.ca_file is not None and embedded:
        flags += ["--ssl-ca-certs", tls.ca_file]
    if tls.allow_plaintext and embedded:
        flags.append("--allow-plaintext")
    return flags


def priority_scheduling_args(cfg: Config) -> list[str]:
    """SGLang flags that make `eval.priority` count: priority scheduling on, and requests without a
    priority (every training request) at 0 instead of SGLang's default, the lowest priority of all.
    None when eval sends no priority, runs on a dedicated engine (training's engines never see it, and
    that one serves nothing else), or the user's extra_args already configure it."""
    if not cfg.eval.enabled or cfg.eval.priority == "off" or cfg.eval.engine == "dedicated":
        return []
    e = cfg.engine
    assert isinstance(e, ManagedEngine), "only engines rollwise launches take launch flags"
    if "--enable-priority-scheduling" in e.extra_args:
        return []
    return ["--enable-priority-scheduling", "--default-priority-value", "0"]


def engine_seed(cfg: Config, slot: EngineSlot) -> int:
    """run.seed + the engine's index (engine0, engine1, ...); an engine named otherwise (the evaluation
    engine, pipeline.supervisor.fleet.eval_engine) takes the index after the planned ones."""
    assert isinstance(cfg.engine, ManagedEngine), "only engines rollwise launches are seeded"
    index = slot.name.removeprefix("engine")
    return cfg.run.seed + (int(index) if index.isdigit() else cfg.engine.num_engines)


def engine_argv(
    cfg: Config,
    slot: EngineSlot,
    *,
    model_dir: Path,
    version: int,
    weights_dir: Path | None = None,
    adapter: Path | None = None,
) -> list[str]:
    """Command line that starts `slot` serving `model_dir` labelled as policy version `version`.
    `weights_dir`: an embedded engine also downloads published versions over HTTP into it.

    With `learner.lora.serving = "adapter"`, `model_dir` is the base model, the engine is launched with
    SGLang's LoRA flags, and `adapter` (the PEFT directory of `version`, if > 0) is loaded at start under
    its versioned name."""
    e = cfg.engine
    lora_flags = lora_launch_flags(cfg.learner.lora, version=version, adapter=adapter)
    # SGLang's flag for routed experts in replies (MoE; learner.moe.record_routing / routing_replay).
    routing_flags = ["--enable-return-routed-experts"] if cfg.learner.moe.records_routing else []
    if e.kind == "embedded":
        fetch = ["--weights-dir", str(weights_dir)] if weights_dir is not None else []
        run = RunDir.at(cfg.run.run_dir, cfg.model.path)
        return [
            sys.executable,
            "-m",
            "pipeline.engine",
            "--model",
            str(model_dir),
            "--host",
            slot.host,
            "--port",
            str(slot.port),
            "--weight-version",
            str(version),
            "--max-batch",
            str(e.max_batch),
            "--batch-wait-ms",
            str(e.batch_wait_ms),
            *(["--threads", str(e.threads)] if e.threads is not None else []),
            "--seed",
            str(engine_seed(cfg, slot)),
            *(["--dtype", e.dtype] if e.dtype is not None else []),
            # /update_weights_from_disk loads published versions and the initial model, nothing else.
            "--allowed-weights-dir",
            str(run.weights),
            "--allowed-weights-dir",
            str(run.initial_model),
            "--enable-metrics",
            *(["--yield-to", str(run.core_lease)] if e.share_cores == "time" else []),
            *fetch,
            *tls_flags(cfg, slot),
            *lora_flags,
            *routing_flags,
            *e.extra_args,
        ]
    if e.kind == "sglang":
        spec = SGLangLaunchSpec(
            model_path=str(model_dir),
            host=slot.host,
            port=slot.port,
            mem_fraction_static=e.mem_fraction_static,
            tp=e.tp,
            dp=e.dp,
            api_key=reveal(e.api_key),
            weight_version=str(version),
            extra_args=(
                # Stated, not SGLang's auto: auto picks float16 for a float32 checkpoint on its CPU backend,
                # 0.149 nats per token from the learner (observed), and that backend has no float32 rmsnorm.
                "--dtype",
                e.dtype or SGLANG_DEFAULT_DTYPE,
                *priority_scheduling_args(cfg),
                *tls_flags(cfg, slot),
                *lora_flags,
                *routing_flags,
                *e.extra_args,
            ),
        )
        return build_sglang_command(spec)
    raise ValueError(f"engine.kind = {e.kind!r} starts no process")


def engine_child_spec(
    cfg: Config,
    slot: EngineSlot,
    *,
    model_dir: Path,
    version: int,
    log_dir: Path,
    weights_dir: Path | None = None,
    adapter: Path | None = None,
) -> ChildSpec:
    e, env = cfg.engine, {}
    if isinstance(e, EmbeddedEngine):
        threads = str(e.threads or usable_cores())
        env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
        key = reveal(e.api_key)
        if key:  # the environment, not argv: /proc/<pid>/cmdline and the log show argv
            env[ENGINE_API_KEY_ENV] = key
    return ChildSpec(
        name=slot.name,
        argv=engine_argv(
            cfg, slot, model_dir=model_dir, version=version, weights_dir=weights_dir, adapter=adapter
        ),
        log_path=log_dir / f"{slot.name}.log",
        env=env,
    )
