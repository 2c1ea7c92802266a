"""`rollwise bench lora`: LoRA against full-weight training and serving, as ratios measured in one run.

1. Learner (each variant in a process of its own, glibc's mmap threshold fixed as in `bench learner`):
   peak memory of two learner steps above the loaded model (gradients, AdamW state, activations), the
   AdamW state bytes, trainable parameters and step time, for `full` and `lora` on the same synthetic
   batch (`--groups` x `--group-size` one-turn episodes of `--prompt` + `--generated` random tokens).
2. Publishing and serving, with the embedded engine as a child process launched as the daemon launches
   it: per version (after two warm-up versions), the bytes written (full HF weights vs the PEFT
   adapter), the time to write them, the sync (pause -> `update_weights_from_disk` or
   `/load_lora_adapter` -> continue), and publish -> served (from the start of the write until the
   engine answered a one-token request with the version; with LoRA the request names the adapter).
3. The embedded engine's mixed-adapter batch (one forward, peft's `adapter_names`) against one forward
   per adapter on the same rows, prefill and decode, and a decode step whose rows all name one adapter
   (peft's active adapter) against the same step of an engine without LoRA, in this process.

Prints a table (or `--json`). CPU numbers on a shared machine: compare the ratios, not the seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from pipeline.tools.bench.logprob_memory import PeakMemory


# ---- 1. learner --------------------------------------------------------------------------------------
def _learner_variant(model_dir: Path, variant: str, args: argparse.Namespace) -> dict[str, float]:
    from learner.model.lora import apply_lora
    from learner.model.model_io import load_policy
    from learner.trainer import Trainer
    from pipeline.contracts.learner_config import LearnerConfig, LoraConfig, OptimConfig
    from pipeline.tools.bench.learner_step import _groups

    lora = LoraConfig(enabled=variant == "lora", rank=args.rank, alpha=2 * args.rank)
    cfg = LearnerConfig(
        optim=OptimConfig(lr=1e-5), mini_batches=args.mini_batches, precision="fp32", lora=lora
    )
    model, _ = load_policy(model_dir)
    if lora.enabled:
        model = apply_lora(model, lora).model
    groups = _groups(model.config.vocab_size, args)
    seconds = []
    with PeakMemory(torch.device("cpu")) as memory:
        trainer = Trainer(model, cfg, temperature=1.0)
        for _ in range(2):
            started = time.perf_counter()
            trainer.step(groups)
            seconds.append(time.perf_counter() - started)
    state = trainer.optimizer.state_dict()["state"]
    optimizer_bytes = sum(
        t.numel() * t.element_size() for s in state.values() for t in s.values() if torch.is_tensor(t)
    )
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {
        "peak_extra_bytes": float(memory.peak_extra_bytes),
        "optimizer_state_bytes": float(optimizer_bytes),
        "trainable_parameters": float(trainable),
        "step_seconds": seconds[-1],
    }


def _in_own_process(model_dir: Path, variant: str, argv: list[str]) -> dict[str, float]:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    cmd = [
        sys.executable,
        "-m",
        "pipeline.tools.bench.lora_cost",
        *argv,
        "--variant",
        variant,
        "--model",
        str(model_dir),
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"variant {variant} failed (exit {done.returncode}): {done.stderr[-2000:]}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


# ---- 2. publishing and serving ----------------------------------------------------------------------
async def _serving(model_dir: Path, work: Path, args: argparse.Namespace, *, lora: bool) -> dict[str, float]:
    from learner.model.lora import apply_lora, directory_bytes
    from learner.model.model_io import export_weights, load_policy
    from pipeline.contracts.config import load_config
    from pipeline.contracts.run_dir import RunDir
    from pipeline.supervisor.engines.adapters import AdapterRegistry, AdapterRouting, unloader
    from pipeline.supervisor.engines.client import EngineClient
    from pipeline.supervisor.engines.pool import EnginePool
    from pipeline.supervisor.engines.protocol import SamplingParams
    from pipeline.supervisor.engines.weightsync import sync_weights
    from pipeline.supervisor.fleet.children import Child
    from pipeline.supervisor.fleet.engine_launch import engine_child_spec, plan_engines

    lora_flags = ["learner.lora.enabled=true", f"learner.lora.rank={args.rank}"] if lora else []
    root = work / ("lora" if lora else "full")  # the run directory the engine may load weights from
    overrides = ["engine.port=0", f"engine.threads={args.threads}", f"run.run_dir={json.dumps(str(root))}"]
    cfg = load_config(None, [*overrides, *lora_flags])
    slot = plan_engines(cfg)[0]
    run = RunDir.at(root, model_dir)
    child = Child(engine_child_spec(cfg, slot, model_dir=model_dir, version=0, log_dir=run.logs))
    await child.start()
    pool = EnginePool([EngineClient(slot.url)])
    model, tokenizer = await asyncio.to_thread(load_policy, model_dir)
    policy = apply_lora(model, cfg.learner.lora) if lora else None
    registry = AdapterRegistry(0, unloader(pool)) if lora else None
    engine = AdapterRouting(pool, registry) if registry is not None else pool
    written, write_s, sync_s, served_s = [], [], [], []
    warmup = 2  # the engine's first adapter loads inject slots; later ones refill them
    try:
        await pool.members[0].wait_ready(300)
        for version in range(1, warmup + args.repeats + 1):
            started = time.perf_counter()
            target = run.weights_of(version)
            if policy is not None:
                path = await asyncio.to_thread(policy.publish_adapter, target, version)
            else:
                path = await asyncio.to_thread(export_weights, model, tokenizer, target, version)
            wrote = time.perf_counter() - started
            timings = await sync_weights(
                pool, model_path=str(path), version=version, mode="in_place", adapter=registry
            )
            probe = await engine.generate(
                [1, 2, 3], SamplingParams(max_new_tokens=1), f"p{version}", affinity_key="p"
            )
            served = time.perf_counter() - started
            if not timings.ok or probe.weight_version != str(version):
                raise RuntimeError(f"version {version} not served: {timings.errors or probe.weight_version}")
            if args.verbose:
                print(
                    f"v{version} write {wrote:.3f} sync {timings.total_s:.3f} served {served:.3f}",
                    file=sys.stderr,
                )
            if version > warmup:
                written.append(directory_bytes(path))
                write_s.append(wrote)
                sync_s.append(timings.total_s)
                served_s.append(served)
        if registry is not None:
            await registry.drain()
    finally:
        await pool.close()
        await child.stop(10.0)
    return {
        "bytes_per_version": float(statistics.median(written)),
        "write_s": statistics.median(write_s),
        "sync_s": statistics.median(sync_s),
        "publish_to_served_s": statistics.median(served_s),
    }


# ---- 3. the engine's mixed-adapter batch --------------------------------------------------------------
@torch.inference_mode()
def _mixed_batch(model_dir: Path, args: argparse.Namespace) -> dict[str, float]:
    """Seconds of one forward over B rows naming two adapters (peft mixed batch) vs one forward per
    adapter on its rows, for a prefill (T = --prompt) and one decode step with a KV cache."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import PeftModel
    from transformers import DynamicCache

    from pipeline.engine.model_forward import cache_kwarg
    from pipeline.engine.model_loading import load_model

    plain = load_model(str(model_dir), "cpu", "float32")  # an engine without LoRA
    base = load_model(str(model_dir), "cpu", "float32")
    kwarg = cache_kwarg(base)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    config = PeftLoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=targets)
    model = PeftModel(base, config, adapter_name="a")
    model.add_adapter("b", config)
    model.eval()
    rows, length = args.batch, min(args.prompt, 256)
    ids = torch.randint(
        1, int(base.config.vocab_size), (rows, length), generator=torch.Generator().manual_seed(0)
    )
    names = ["a" if i % 2 == 0 else "b" for i in range(rows)]
    halves = {n: [i for i, m in enumerate(names) if m == n] for n in ("a", "b")}

    def prefill_mixed() -> Any:
        return model(input_ids=ids, adapter_names=names, use_cache=True, **{kwarg: DynamicCache()})

    def prefill_split() -> list[Any]:
        outs = []
        for name, index in halves.items():
            model.set_adapter(name)
            outs.append(model(input_ids=ids[index], use_cache=True, **{kwarg: DynamicCache()}))
        return outs

    mixed_cache = _cache_of(prefill_mixed())
    split_caches = [_cache_of(out) for out in prefill_split()]
    step = ids[:, -1:]

    def decode_mixed(cache: Any) -> Any:
        return model(input_ids=step, adapter_names=names, use_cache=True, **{kwarg: cache})

    def decode_split(caches: list[Any]) -> list[Any]:
        outs = []
        for (name, index), cache in zip(halves.items(), caches, strict=True):
            model.set_adapter(name)
            outs.append(model(input_ids=step[index], use_cache=True, **{kwarg: cache}))
        return outs

    def decode_one_adapter(cache: Any) -> Any:  # every row names "a": the engine's usual batch
        return model(input_ids=step, use_cache=True, **{kwarg: cache})

    def decode_plain(cache: Any) -> Any:
        return plain(input_ids=step, use_cache=True, **{kwarg: cache})

    def one_adapter(cache: Any) -> Any:
        model.set_adapter("a")  # once per batch in the engine; cheap next to a forward
        return decode_one_adapter(cache)

    # Variants run in turn within each repeat, so load that comes and goes hits them alike.
    variants: dict[str, tuple[Any, Any]] = {
        "prefill_mixed_s": (prefill_mixed, lambda: ()),
        "prefill_per_adapter_s": (prefill_split, lambda: ()),
        "decode_mixed_s": (decode_mixed, lambda: (_clone(mixed_cache),)),
        "decode_per_adapter_s": (decode_split, lambda: ([_clone(c) for c in split_caches],)),
        "decode_one_adapter_s": (one_adapter, lambda: (_clone(mixed_cache),)),
        "decode_base_only_s": (decode_plain, lambda: (_clone(mixed_cache),)),
    }
    samples: dict[str, list[float]] = {key: [] for key in variants}
    for repeat in range(args.repeats + 1):
        for key, (fn, fresh) in variants.items():
            inputs = fresh()
            started = time.perf_counter()
            fn(*inputs)
            if repeat > 0:  # the first round warms up
                samples[key].append(time.perf_counter() - started)
    result = {key: statistics.median(values) for key, values in samples.items()}
    return {"rows": float(rows), "prefill_tokens": float(length), **result}


def _cache_of(output: Any) -> Any:
    """The KV cache of a forward's output (transformers 5.24 renamed `past_key_values` to `cache`)."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


def _clone(cache: Any) -> Any:
    """A fresh copy of a DynamicCache (each timed decode step appends to the one it gets)."""
    import copy

    return copy.deepcopy(cache)


# ---- report ------------------------------------------------------------------------------------------
def run(argv: list[str]) -> dict[str, Any]:
    from learner.model.model_init import init_model

    args = _parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="rollwise-bench-lora-") as tmp:
        work = Path(tmp)
        model_dir = init_model(work / "model", preset=args.preset, seed=0)
        learner = {v: _in_own_process(model_dir, v, argv) for v in ("full", "lora")}
        serving = {
            "full": asyncio.run(_serving(model_dir, work, args, lora=False)),
            "lora": asyncio.run(_serving(model_dir, work, args, lora=True)),
        }
        mixed = _mixed_batch(model_dir, args)
    for part in serving.values():
        part["write_plus_sync_s"] = part["write_s"] + part["sync_s"]
    full, lora = learner["full"], learner["lora"]
    ratios = {
        "learner_peak_memory": lora["peak_extra_bytes"] / max(full["peak_extra_bytes"], 1.0),
        "optimizer_state_bytes": lora["optimizer_state_bytes"] / full["optimizer_state_bytes"],
        "trainable_parameters": lora["trainable_parameters"] / full["trainable_parameters"],
        "learner_step_time": lora["step_seconds"] / full["step_seconds"],
        "bytes_per_version": serving["lora"]["bytes_per_version"] / serving["full"]["bytes_per_version"],
        "publish_to_served": serving["lora"]["publish_to_served_s"] / serving["full"]["publish_to_served_s"],
        "write_plus_sync": (serving["lora"]["write_s"] + serving["lora"]["sync_s"])
        / (serving["full"]["write_s"] + serving["full"]["sync_s"]),
        "mixed_batch_prefill_vs_per_adapter": mixed["prefill_mixed_s"] / mixed["prefill_per_adapter_s"],
        "mixed_batch_decode_vs_per_adapter": mixed["decode_mixed_s"] / mixed["decode_per_adapter_s"],
        "mixed_batch_decode_vs_base_only": mixed["decode_mixed_s"] / mixed["decode_base_only_s"],
        "one_adapter_decode_vs_base_only": mixed["decode_one_adapter_s"] / mixed["decode_base_only_s"],
    }
    return {
        "preset": args.preset,
        "rank": args.rank,
        "tokens_per_step": args.groups * args.group_size * (args.prompt + args.generated),
        "learner": learner,
        "serving": serving,
        "mixed_batch": mixed,
        "ratios_lora_over_full": ratios,
    }


def format_report(r: dict[str, Any]) -> str:
    mib = 2.0**20
    lines = [
        f"LoRA (rank {r['rank']}) vs full weights, preset {r['preset']}, {r['tokens_per_step']} tokens/step"
    ]
    lines.append(f"{'':28}{'full':>14}{'lora':>14}{'lora/full':>11}")
    rows = [
        ("learner peak extra (MiB)", "learner", "peak_extra_bytes", mib, "learner_peak_memory"),
        ("AdamW state (MiB)", "learner", "optimizer_state_bytes", mib, "optimizer_state_bytes"),
        ("trainable parameters", "learner", "trainable_parameters", 1.0, "trainable_parameters"),
        ("learner step (s)", "learner", "step_seconds", 1.0, "learner_step_time"),
        ("bytes per version (MiB)", "serving", "bytes_per_version", mib, "bytes_per_version"),
        ("write + sync (s)", "serving", "write_plus_sync_s", 1.0, "write_plus_sync"),
        ("publish -> served (s)", "serving", "publish_to_served_s", 1.0, "publish_to_served"),
    ]
    for label, part, key, scale, ratio in rows:
        full, lora = r[part]["full"][key] / scale, r[part]["lora"][key] / scale
        lines.append(f"{label:<28}{full:>14.4g}{lora:>14.4g}{r['ratios_lora_over_full'][ratio]:>11.4f}")
    m, ratio = r["mixed_batch"], r["ratios_lora_over_full"]
    lines.append(
        f"engine, {int(m['rows'])} rows on 2 adapters: mixed-batch / per-adapter forwards = "
        f"{ratio['mixed_batch_prefill_vs_per_adapter']:.2f} (prefill of {int(m['prefill_tokens'])} tokens), "
        f"{ratio['mixed_batch_decode_vs_per_adapter']:.2f} (decode step); mixed decode / base-only decode = "
        f"{ratio['mixed_batch_decode_vs_base_only']:.2f}, one-adapter decode / base-only = "
        f"{ratio['one_adapter_decode_vs_base_only']:.2f}"
    )
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rollwise bench lora", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small", help="model preset (tiny, small)")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank (alpha = 2 x rank, all linear layers)")
    p.add_argument("--groups", type=int, default=2, help="groups per learner step")
    p.add_argument("--group-size", type=int, default=4, help="episodes per group")
    p.add_argument("--prompt", type=int, default=256, help="prompt tokens per episode")
    p.add_argument("--generated", type=int, default=256, help="generated tokens per episode")
    p.add_argument("--mini-batches", type=int, default=2, help="mini-batches per step")
    p.add_argument("--repeats", type=int, default=5, help="published versions / timed repeats")
    p.add_argument("--batch", type=int, default=16, help="rows of the mixed-adapter engine forward")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (learner and engine)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--verbose", action="store_true", help="print each version's sync timings to stderr")
    p.add_argument("--variant", help=argparse.SUPPRESS)  # one learner variant, in this process
    p.add_argument("--model", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(argv) if argv is not None else sys.argv[1:]
    args = _parser().parse_args(argv)
    if args.variant is not None:
        torch.set_num_threads(args.threads)
        print(json.dumps(_learner_variant(Path(args.model), args.variant, args)))
        return 0
    report = run([a for a in argv if a != "--json"])
    print(json.dumps(report) if args.json else format_report(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
