"""`rollwise eval`: score a published version of a run on its held-out tasks, outside the daemon.

    rollwise eval --run-dir D [--version V] [--env NAME] [--tasks N] [--greedy | --samples K]
                  [--engine-url U] [--seed S] [--concurrency C] [--json]

The tasks, env options and modes come from the run's resolved config (`[eval]`, else its training env),
so the numbers are those the daemon logged in `logs/eval.jsonl`, now for any version still on disk.
Without `--engine-url` an embedded engine starts in this process on `weights/v<V>` (version 0: the initial
model; a LoRA adapter version is served over the initial model, as the daemon serves it); with it, the
server there is used as it is and must serve V (its `/model_info` weight_version), so a live daemon's
engine can be evaluated but never has its weights changed. `evaluate_weights` scores any HF model
directory (or adapter over one) the same way: `rollwise bench learn --offline-eval` and `rollwise bench
trl` score their snapshots with it.

Exit codes: 0 evaluated, 1 the evaluation could not run (engine down, version mismatch), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

from pipeline.contracts.config import Config, ConfigError, EmbeddedEngine, load_config, reveal
from pipeline.contracts.run_dir import RunDir, is_model_dir, is_published_dir
from pipeline.supervisor.actors.heldout import Mode, ModeResult, run_evaluation
from pipeline.supervisor.eval_schedule import EvalSetup, eval_row, resolve_eval

_VERSION_DIR = re.compile(r"^v(\d+)$")


class EvalCommandError(RuntimeError):
    """The evaluation could not run; the message says why."""


def published_versions(run: RunDir) -> list[int]:
    """Versions whose weights are on disk, oldest first (0, the initial model, when it exists)."""
    found = [0] if is_model_dir(run.initial_model) else []
    if run.weights.is_dir():
        for child in run.weights.iterdir():
            match = _VERSION_DIR.match(child.name)
            if match and is_published_dir(child):
                found.append(int(match.group(1)))
    return sorted(found)


def choose_version(run: RunDir, wanted: int | None) -> int:
    versions = published_versions(run)
    if not versions:
        raise EvalCommandError(f"{run.root} holds no model weights (no model/ and no weights/v<n>/)")
    if wanted is None:
        return versions[-1]
    if wanted not in versions:
        raise EvalCommandError(
            f"--version {wanted}: no weights for it in {run.root} (on disk: {', '.join(map(str, versions))}; "
            "the daemon keeps the newest few)"
        )
    return wanted


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="rollwise eval", description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", required=True, type=Path, help="run directory (its config.toml and weights)")
    p.add_argument("--version", type=int, help="policy version to evaluate (default: the newest on disk)")
    p.add_argument("--env", help="environment to evaluate (default: eval.env, else the training env)")
    p.add_argument("--tasks", type=int, help="tasks to evaluate (default: eval.tasks)")
    modes = p.add_mutually_exclusive_group()
    modes.add_argument("--greedy", action="store_true", help="greedy episodes only")
    modes.add_argument("--samples", type=int, metavar="K", help="K sampled episodes per task only (pass@K)")
    p.add_argument("--engine-url", help="evaluate on this running server instead of an embedded engine")
    p.add_argument("--seed", type=int, help="eval task stream seed (default: eval.seed)")
    p.add_argument(
        "--concurrency", type=int, help="episodes in flight (default: eval.max_concurrent_episodes)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = p.parse_args(argv)
    if args.tasks is not None and args.tasks < 1:
        p.error("--tasks must be >= 1")
    if args.samples is not None and args.samples < 1:
        p.error("--samples must be >= 1")
    if args.concurrency is not None and args.concurrency < 1:
        p.error("--concurrency must be >= 1")
    return args


def load_run_config(run_dir: Path, args: argparse.Namespace) -> Config:
    config_file = RunDir.at(run_dir).config_file
    if not config_file.is_file():
        raise ConfigError(f"{config_file} does not exist: --run-dir must name a run directory")
    overrides = [f"run.run_dir={json.dumps(str(run_dir))}"]
    if args.seed is not None:
        overrides.append(f"eval.seed={args.seed}")
    if args.concurrency is not None:
        overrides.append(f"eval.max_concurrent_episodes={args.concurrency}")
    return load_config(config_file, overrides)


def served_model(run: RunDir, version: int) -> tuple[Path, Path | None]:
    """(HF model directory, PEFT adapter directory or None) that serve `version` of `run`: a published
    HF directory alone, or an adapter over the run's initial model."""
    weights = run.weights_of(version)
    return (weights, None) if is_model_dir(weights) else (run.initial_model, weights)


async def evaluate_version(
    cfg: Config, run: RunDir, setup: EvalSetup, version: int, engine_url: str | None
) -> tuple[dict[Mode, ModeResult], float]:
    """Run the evaluation of `version`; returns its results and wall time in seconds."""
    model, adapter = served_model(run, version)
    if adapter is not None and engine_url is not None:
        raise EvalCommandError(
            f"version {version} is a LoRA adapter ({adapter}): evaluate it on an embedded engine (no "
            "--engine-url), which serves it over the initial model"
        )
    return await evaluate_weights(cfg, setup, model, adapter=adapter, version=version, engine_url=engine_url)


async def evaluate_weights(
    cfg: Config,
    setup: EvalSetup,
    model: Path,
    *,
    adapter: Path | None = None,
    version: int = 0,
    engine_url: str | None = None,
    threads: int | None = None,
) -> tuple[dict[Mode, ModeResult], float]:
    """Evaluate the HF model directory `model` (with the PEFT `adapter` directory over it, when given) on
    `setup`'s tasks; returns the results and the evaluation's wall time in seconds (engine start left
    out). Without `engine_url` an embedded engine starts on it in this process with `[engine]`'s settings
    (`threads` overrides engine.threads); with it, that server must report `version` as its weight_version.
    `version` labels the episodes' tokens."""
    from pipeline.supervisor.engines.adapters import AdapterRegistry, AdapterRouting, adapter_name
    from pipeline.supervisor.engines.client import EngineClient
    from pipeline.supervisor.engines.pool import EnginePool
    from pipeline.supervisor.engines.protocol import EngineError
    from pipeline.supervisor.wiring import load_tokenizer, rollout_settings

    if adapter is not None and (engine_url is not None or version < 1):
        raise ValueError("an adapter is served by an embedded engine, under a version >= 1")
    tokenizer = await asyncio.to_thread(load_tokenizer, model)
    name = adapter_name(version) if adapter is not None else None
    server = None
    try:
        if engine_url is None:
            from pipeline.engine.serve import start_server
            from pipeline.engine.serve_flags import ServerConfig

            e = cfg.engine if isinstance(cfg.engine, EmbeddedEngine) else EmbeddedEngine()  # its defaults
            lora = cfg.learner.lora
            server = await start_server(
                ServerConfig(
                    model=str(model),
                    port=0,
                    weight_version=str(version) if adapter is None else "0",
                    max_batch=e.max_batch,
                    batch_wait_ms=e.batch_wait_ms,
                    dtype=cfg.engine.dtype or "auto",
                    threads=e.threads if threads is None else threads,
                    seed=cfg.run.seed,
                    enable_lora=adapter is not None,
                    max_lora_rank=lora.rank if adapter is not None else None,
                    lora_target_modules=tuple(lora.target_modules) if adapter is not None else None,
                    lora_paths=((str(name), str(adapter)),) if adapter is not None else (),
                )
            )
            engine_url = server.url
        client = EngineClient(
            engine_url, api_key=reveal(cfg.engine.api_key), request_timeout_s=cfg.engine.request_timeout_s
        )
        pool = EnginePool([client])

        async def no_unload(_: str) -> None:  # one adapter, served until the engine stops
            return None

        engine = AdapterRouting(pool, AdapterRegistry(version, no_unload)) if adapter is not None else pool
        try:
            if server is None:
                served = str((await client.model_info()).get("weight_version"))
                if served != str(version):
                    raise EvalCommandError(
                        f"{engine_url} serves weight_version {served!r}, not {version}: load that version "
                        "there or pass --version " + served
                    )
            started = time.monotonic()
            results = await run_evaluation(
                engine,
                tokenizer,
                setup.factory,
                setup.plan,
                rollout_settings(cfg, model),
                env_name=setup.env_name,
                env_options=setup.options,
                max_concurrent=setup.max_concurrent,
                priority=setup.priority,
                rid_prefix=f"offline-eval-v{version}-{time.time_ns()}",
            )
            return results, time.monotonic() - started
        except EngineError as exc:
            raise EvalCommandError(f"engine {engine_url}: {exc}") from exc
        finally:
            await pool.close()
    finally:
        if server is not None:
            await server.close()


def format_table(row: dict[str, Any]) -> str:
    """The evaluation as a small fixed-width table, one line per mode."""
    head = (
        f"{row['env']} v{row['version']}: {row['tasks']} held-out tasks (seed {row['seed']}, "
        f"holdout {row['holdout_fraction']}), {row['duration_s']:.1f} s"
    )
    lines = [
        head,
        f"{'mode':<8} {'k':>3} {'episodes':>8} {'success':>8} {'pass@k':>7} {'reward':>8} {'turns':>6}",
    ]
    for mode in ("greedy", "sampled"):
        r = row.get(mode)
        if isinstance(r, dict):
            lines.append(
                f"{mode:<8} {r['k']:>3} {r['episodes']:>8} {r['success']:>8.3f} {r['pass_at_k']:>7.3f} "
                f"{r['reward_mean']:>8.3f} {r['turns_mean']:>6.2f}"
            )
            reasons = ", ".join(f"{k} {v}" for k, v in r["finish_reasons"].items())
            lines.append(f"{'':<8} finish reasons: {reasons}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        cfg = load_run_config(args.run_dir, args)
        run = RunDir.at(args.run_dir, cfg.model.path)
        # --greedy or --samples K picks that one mode; neither keeps the run's [eval] modes.
        greedy, samples = (None, None)
        if args.greedy or args.samples:
            greedy, samples = (True, 0) if args.greedy else (False, args.samples)
        setup = resolve_eval(cfg, env_name=args.env, tasks=args.tasks, greedy=greedy, samples=samples)
        version = choose_version(run, args.version)
    except (ConfigError, EvalCommandError) as exc:
        print(f"rollwise eval: {exc}", file=sys.stderr)
        return 2
    try:
        results, seconds = asyncio.run(evaluate_version(cfg, run, setup, version, args.engine_url))
    except EvalCommandError as exc:
        print(f"rollwise eval: {exc}", file=sys.stderr)
        return 1
    row = eval_row(setup, results, version=version, step=None, elapsed_s=None, duration_s=seconds)
    print(json.dumps(row) if args.json else format_table(row))
    return 0
