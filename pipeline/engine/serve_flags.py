"""The command line of `rollwise engine serve`: `ServerConfig` and `parse_args`, which builds it.

`rollwise engine serve --model DIR --host 127.0.0.1 --port N [--weight-version 0] [--max-batch 64]
[--batch-wait-ms 3] [--context-length L] [--enable-metrics] [--threads T] [--seed S] [--device cpu]
[--enable-return-routed-experts] [--dtype auto|float32|bfloat16|float16]
[--prefix-cache-mb 1024 | --disable-radix-cache]`;
what the served API does with these settings is in pipeline.engine.routes.

Defaults that depend on the machine: `--dtype auto` is bfloat16 on a CPU with native bf16 matmuls (AMX or
AVX512-BF16 in /proc/cpuinfo) or a CUDA device that supports it, float32 otherwise; `--threads` unset is
every core the process may run on. /server_info reports both, with the reason for the dtype.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.contracts.http_guard import ENGINE_API_KEY_ENV, DoorLimits
from pipeline.contracts.tls import TlsFiles
from pipeline.engine.model_loading import DTYPES

DEFAULT_PREFIX_CACHE_MB = 1024.0
DESCRIPTION = "The embedded SGLang-compatible engine: an aiohttp server over `batcher.ContinuousBatcher`."


@dataclass(frozen=True)
class ServerConfig:
    """Command-line settings of one engine server."""

    model: str
    host: str = "127.0.0.1"
    port: int = 30000
    weight_version: str = "default"
    max_batch: int = 64
    batch_wait_ms: float = 3.0
    context_length: int | None = None
    enable_metrics: bool = False
    device: str = "cpu"
    dtype: str = "auto"  # "auto" or a key of DTYPES (model_loading.resolve_dtype)
    threads: int | None = None  # None: every usable core (set by `serve.main`, not by in-process servers)
    seed: int | None = None
    served_model_name: str | None = None
    api_key: str | None = field(default=None, repr=False)
    max_prefill_tokens: int = 16384
    weights_dir: str | None = None  # serve POST /fetch_weights into this directory (weights over HTTP)
    limits: DoorLimits = field(default_factory=DoorLimits)
    max_new_tokens_cap: int | None = None  # None: the context length
    allowed_weights_dirs: tuple[str, ...] = ()  # empty: the directory holding `model`
    enable_lora: bool = False
    max_lora_rank: int | None = None
    lora_target_modules: tuple[str, ...] | None = None
    lora_paths: tuple[tuple[str, str], ...] = ()
    fault_stale_weights: bool = False
    enable_return_routed_experts: bool = False  # MoE: record routed experts for requests that ask
    ssl_certfile: str | None = None  # SGLang's flag names: TLS, needed beyond loopback
    ssl_keyfile: str | None = None
    ssl_ca_certs: str | None = None  # what an https weight source (its fetch route) is checked against
    allow_plaintext: bool = False
    prefix_cache_mb: float = DEFAULT_PREFIX_CACHE_MB  # 0 = no prefix cache
    yield_to: str | None = None  # a core lease file: decode only while the learner does not hold it

    @property
    def tls(self) -> TlsFiles:
        return TlsFiles(self.ssl_certfile, self.ssl_keyfile, self.ssl_ca_certs)

    def weights_roots(self) -> list[Path]:
        dirs = self.allowed_weights_dirs or (str(Path(self.model).resolve().parent),)
        # Versions this engine downloaded itself (weights over HTTP) are loaded from its weights_dir.
        fetched = (self.weights_dir,) if self.weights_dir is not None else ()
        return [Path(d).resolve() for d in (*dirs, *fetched)]


def parse_args(argv: list[str]) -> ServerConfig:
    p = argparse.ArgumentParser(prog="rollwise engine serve", description=DESCRIPTION)
    p.add_argument("--model", "--model-path", required=True, help="HF model directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000, help="0 picks a free port (logged)")
    p.add_argument("--weight-version", default="default", help="initial meta_info.weight_version")
    p.add_argument("--max-batch", type=int, default=64, help="most requests decoded together")
    p.add_argument("--batch-wait-ms", type=float, default=3.0, help="collect requests this long when idle")
    p.add_argument("--context-length", type=int, help="default: config.max_position_embeddings")
    p.add_argument("--enable-metrics", action="store_true", help="serve Prometheus /metrics")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", *sorted(DTYPES)],
        help="weights and compute; auto = bfloat16 where bf16 matmuls are native, else float32",
    )
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: every usable core)")
    p.add_argument(
        "--prefix-cache-mb",
        type=float,
        default=DEFAULT_PREFIX_CACHE_MB,
        help="KV bytes the prefix cache may hold (MiB; 0 turns it off)",
    )
    p.add_argument(
        "--disable-radix-cache",
        action="store_true",
        help="no prefix cache (SGLang's flag; = --prefix-cache-mb 0)",
    )
    p.add_argument("--seed", type=int, help="seed of unseeded requests' generators")
    p.add_argument(
        "--yield-to",
        help="a core lease file (pipeline/contracts/core_lease.py): hold decoding while the learner "
        "computes on the same cores",
    )
    p.add_argument("--served-model-name", help="model_name label of the metrics")
    p.add_argument(
        "--api-key",
        help="require Authorization: Bearer <key> on every route but /health "
        f"(default: ${ENGINE_API_KEY_ENV}); needed to bind anything but loopback",
    )
    p.add_argument("--max-prefill-tokens", type=int, default=16384, help="padded tokens per prefill batch")
    p.add_argument(
        "--weights-dir", help="serve POST /fetch_weights: download published versions over HTTP into it"
    )
    limits = DoorLimits()
    p.add_argument("--max-body-bytes", type=int, default=limits.max_body_bytes, help="larger bodies: 413")
    p.add_argument("--body-timeout-s", type=float, default=limits.body_timeout_s, help="slower bodies: 408")
    p.add_argument(
        "--idle-timeout-s", type=float, default=limits.idle_timeout_s, help="close connections idle this long"
    )
    p.add_argument("--max-new-tokens-cap", type=int, help="largest max_new_tokens (default: context length)")
    p.add_argument(
        "--allowed-weights-dir",
        action="append",
        default=[],
        help="a directory /update_weights_from_disk may load from (repeatable; default: the one holding "
        "--model)",
    )
    p.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (SGLang's flag)")
    p.add_argument("--max-lora-rank", type=int, help="largest adapter rank accepted")
    p.add_argument("--lora-target-modules", nargs="+", help="module names adapters may target")
    p.add_argument(
        "--lora-paths", nargs="+", default=[], metavar="NAME=PATH", help="adapters loaded at start"
    )
    p.add_argument(
        "--enable-return-routed-experts",
        action="store_true",
        help="record each layer's routed experts for requests with return_routed_experts (MoE models; "
        "SGLang's flag)",
    )
    p.add_argument(
        "--ssl-certfile", help="PEM certificate: serve https (SGLang's flag; needed beyond loopback)"
    )
    p.add_argument("--ssl-keyfile", help="PEM private key of --ssl-certfile")
    p.add_argument(
        "--ssl-ca-certs", help="PEM CA bundle an https weight source (--weights-dir) is checked against"
    )
    p.add_argument(
        "--allow-plaintext",
        action="store_true",
        help="serve plain HTTP beyond loopback (keys and data in clear), fetch weights from http://",
    )
    p.add_argument(
        "--fault-stale-weights",
        action="store_true",
        help="TESTS ONLY: acknowledge weight updates and adapter loads but keep serving the start weights",
    )
    a = p.parse_args(argv)
    if a.max_batch < 1:
        p.error("--max-batch must be >= 1")
    if a.threads is not None and a.threads < 1:
        p.error("--threads must be >= 1")
    if a.prefix_cache_mb < 0:
        p.error("--prefix-cache-mb must be >= 0")
    if a.max_body_bytes < 1024 or a.body_timeout_s <= 0 or a.idle_timeout_s <= 0:
        p.error("--max-body-bytes must be >= 1024, --body-timeout-s and --idle-timeout-s > 0")
    lora_paths = []
    for item in a.lora_paths:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            p.error(f"--lora-paths takes NAME=PATH items, got {item!r}")
        lora_paths.append((name, path))
    if (a.ssl_certfile is None) != (a.ssl_keyfile is None):
        p.error("--ssl-certfile and --ssl-keyfile are given together")
    if (lora_paths or a.max_lora_rank or a.lora_target_modules) and not a.enable_lora:
        a.enable_lora = True  # SGLang turns LoRA on when adapters are given at launch
    return ServerConfig(
        model=a.model,
        host=a.host,
        port=a.port,
        weight_version=a.weight_version,
        max_batch=a.max_batch,
        batch_wait_ms=a.batch_wait_ms,
        context_length=a.context_length,
        enable_metrics=a.enable_metrics,
        device=a.device,
        dtype=a.dtype,
        threads=a.threads,
        seed=a.seed,
        served_model_name=a.served_model_name,
        api_key=a.api_key or os.environ.get(ENGINE_API_KEY_ENV) or None,
        max_prefill_tokens=a.max_prefill_tokens,
        weights_dir=a.weights_dir,
        limits=DoorLimits(a.max_body_bytes, a.body_timeout_s, a.idle_timeout_s),
        max_new_tokens_cap=a.max_new_tokens_cap,
        allowed_weights_dirs=tuple(a.allowed_weights_dir),
        enable_lora=a.enable_lora,
        max_lora_rank=a.max_lora_rank,
        lora_target_modules=tuple(a.lora_target_modules) if a.lora_target_modules else None,
        lora_paths=tuple(lora_paths),
        fault_stale_weights=a.fault_stale_weights,
        enable_return_routed_experts=a.enable_return_routed_experts,
        ssl_certfile=a.ssl_certfile,
        ssl_keyfile=a.ssl_keyfile,
        ssl_ca_certs=a.ssl_ca_certs,
        allow_plaintext=a.allow_plaintext,
        prefix_cache_mb=0.0 if a.disable_radix_cache else a.prefix_cache_mb,
        yield_to=a.yield_to,
    )
