"""`rollwise bench learner`: peak memory and time of one learner step per option (precision, gradient
checkpointing, LoRA, prefix sharing), as ratios against fp32 full weights without checkpointing in the same
process.

The model is a preset (default `small`, ~10M parameters; `--preset smollm2-135m-instruct` the pretrained
one) built from its config; the batch is synthetic: `--groups` groups of `--group-size` one-turn episodes
of `--prompt` prompt and `--generated` generated tokens with random ids (a group's episodes share their
prompt, as a task's do), outcomes alternating 0/1 (every group carries signal). Per variant, in a
process of its own (forked from a server that has imported torch and transformers once):
`--repeats` measured steps for the peak (after one warm-up step), then one more warm-up and `--repeats`
timed steps (median time, highest peak).

Peak memory: CUDA's max_memory_allocated, or on a CPU the process's high-water mark (VmHWM) above its
level before the step, measured with glibc's mmap threshold fixed at 128 KiB: otherwise memory one step
freed stays in the allocator's pool, the next step reuses it without raising the high-water mark, and its
peak reads as zero. That setting maps and unmaps every large temporary, which made CPU steps 3-5x slower
(bf16 casts allocate the most), so the timed steps run with the threshold raised to glibc's own
steady-state ceiling (32 MiB) instead. `auto` resolves as learner.precision does on this device
(the report's first line says to what).

`--nproc N` compares instead one rank against N ranks (torchrun, FSDP2; `--precision`, default fp32) on the
same step: its time and, per rank, the peak of the step above the level before it, the bytes of the
weights and AdamW state the rank holds (exact, from the tensors), and the process's resident high-water
mark. Sharding divides the held state by N; the step's peak falls with the rows each rank trains. On a
CPU with fewer cores than ranks the time says nothing about speed-up.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch

from pipeline.contracts.kernel_caches import bound_kernel_caches
from pipeline.tools.bench.logprob_memory import PeakMemory, _proc_status_bytes

# (precision, gradient checkpointing, LoRA, shared prefix); the first is the baseline of the ratios.
# Checkpointing turns prefix sharing off (learner.shared_prefix); "+unshared" shows what it saves.
VARIANTS: tuple[tuple[str, bool, bool, bool], ...] = (
    ("fp32", False, False, True),
    ("fp32", True, False, True),
    ("bf16-mixed", False, False, True),
    ("bf16-mixed", True, False, True),
    ("bf16", False, False, True),
    ("fp32", False, True, True),
    ("bf16-mixed", False, True, True),
    ("bf16-mixed", False, False, False),
)
# glibc's mallopt parameters and the values the two phases use (module docstring).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MEASURE_MMAP_BYTES = 128 * 1024
_TIMING_MMAP_BYTES = 32 * 2**20


def _groups(vocab: int, args: argparse.Namespace) -> list[Any]:
    from learner.groups import TrainGroup
    from pipeline.contracts.schema import EpisodeSegment

    rng = random.Random(0)
    groups = []
    for g in range(args.groups):
        episodes = []
        n, k = args.prompt, args.generated
        prompt = [rng.randrange(1, vocab) for _ in range(n)]  # a group's episodes share their task's prompt
        for i in range(args.group_size):
            episodes.append(
                [
                    EpisodeSegment(
                        episode_id=f"g{g}-{i}",
                        group_id=f"g{g}",
                        task_id="t",
                        env="bench",
                        token_ids=prompt + [rng.randrange(1, vocab) for _ in range(k)],
                        prompt_len=n,
                        loss_mask=[0] * n + [1] * k,
                        logprobs=[0.0] * n + [-5.0] * k,
                        turn_index=[-1] * n + [0] * k,
                        versions=[-1] * n + [0] * k,
                        turn_rewards=[0.0],
                        outcome=float(i % 2),
                        num_turns=1,
                        finish_reason="stop",
                    )
                ]
            )
        groups.append(TrainGroup(group_id=f"g{g}", episodes=episodes))
    return groups


def _mallopt(param: int, value: int) -> None:
    """glibc's mallopt (a no-op elsewhere: the peaks are then only as good as the allocator allows)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(param, value)


def _measure(
    model_dir: Path,
    precision: str,
    checkpointing: bool,
    args: argparse.Namespace,
    nproc: int = 1,
    lora: bool = False,
    shared: bool = True,
) -> dict[str, Any]:
    from learner.distributed import join, leave
    from learner.model.model_io import load_policy
    from learner.model.precision import resolve_precision
    from learner.trainer import Trainer
    from pipeline.contracts.learner_config import LearnerConfig, LoraConfig, OptimConfig

    ranks = join(nproc, args.device)
    device = ranks.device if ranks is not None else torch.device(args.device)
    weights = resolve_precision(precision, device).param_dtype_name
    if ranks is None:
        model, _ = load_policy(model_dir, device=device, dtype=weights)
    else:
        from learner.sharding import load_policy_for_ranks

        model, _ = load_policy_for_ranks(model_dir, ranks, dtype=weights)
    cfg = LearnerConfig(
        optim=OptimConfig(lr=1e-5),
        mini_batches=args.mini_batches,
        precision=precision,
        gradient_checkpointing=checkpointing,
        lora=LoraConfig(enabled=lora),
        shared_prefix=shared,
    )
    if lora:
        from learner.model.lora import apply_lora

        model = apply_lora(model, cfg.lora).model
    trainer = Trainer(model, cfg, temperature=1.0, device=device, ranks=ranks)
    groups = _groups(model.config.vocab_size, args)
    _mallopt(_M_MMAP_THRESHOLD, _MEASURE_MMAP_BYTES)
    trainer.step(groups)  # warm-up: optimizer state, allocator pools
    peaks = []
    for _ in range(args.repeats):
        with PeakMemory(device) as memory:
            trainer.step(groups)
        peaks.append(memory.peak_extra_bytes)
    _mallopt(_M_MMAP_THRESHOLD, _TIMING_MMAP_BYTES)
    _mallopt(_M_TRIM_THRESHOLD, 2 * _TIMING_MMAP_BYTES)
    trainer.step(groups)  # warm-up of the allocator's pool at the new threshold
    seconds = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        trainer.step(groups)
        seconds.append(time.perf_counter() - started)
    result: dict[str, Any] = {"seconds": statistics.median(seconds), "peak_extra_bytes": float(max(peaks))}
    if args.variant is not None and _RANKED.match(args.variant):
        mine = {
            "peak_extra_bytes": result["peak_extra_bytes"],
            "state_bytes": float(_held_state_bytes(trainer)),
            "rss_peak_bytes": float(_proc_status_bytes("VmHWM")),
        }
        result["ranks"] = ranks.gather(mine) if ranks is not None else [mine]
        result["peak_extra_bytes"] = max(r["peak_extra_bytes"] for r in result["ranks"])
    leave(ranks)
    return result


def _held_state_bytes(trainer: Any) -> int:
    """Bytes of the weights and optimizer state this rank holds (its shards when sharded)."""

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    held = sum(local(p).numel() * p.element_size() for p in trainer.model.parameters())
    for state in trainer.optimizer.state.values():
        held += sum(
            local(v).numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor)
        )
    return int(held)


def _variant_name(precision: str, checkpointing: bool, lora: bool = False, shared: bool = True) -> str:
    options = [("+ckpt", checkpointing), ("+lora", lora), ("+unshared", not shared)]
    return precision + "".join(name for name, on in options if on)


# What every variant's process imports before its step: the forkserver imports them once and forks a
# fresh process per variant from it, so a variant's peak and time are its own and the imports (most of a
# small preset's run) are paid once. The server never runs a torch op, so forking it is safe with OpenMP.
_FORKSERVER_PRELOAD = [
    "torch",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "transformers.models.qwen3.modeling_qwen3",
    "learner.trainer",
    "learner.model.model_io",
    "learner.model.lora",
    "pipeline.tools.bench.learner_step",
]


def _variant_in_child(model_dir: Path, name: str, argv: list[str]) -> dict[str, Any]:
    """One variant's measurement, in a process forked for it alone (see `_FORKSERVER_PRELOAD`)."""
    args = _parser().parse_args([*argv, "--variant", name, "--model", str(model_dir)])
    return _run_variant(args)


def _in_forked_processes(model_dir: Path, names: list[str], argv: list[str]) -> dict[str, dict[str, Any]]:
    """Each variant in a fresh process of its own, one after the other (`_FORKSERVER_PRELOAD`)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_FORKSERVER_PRELOAD)
    # By its module's name, so that it pickles the same when this module runs as __main__.
    from pipeline.tools.bench.learner_step import _variant_in_child as measure

    results: dict[str, dict[str, Any]] = {}
    with ProcessPoolExecutor(max_workers=1, mp_context=context, max_tasks_per_child=1) as pool:
        for name in names:
            try:
                results[name] = pool.submit(measure, model_dir, name, argv).result()
            except Exception as exc:  # its own error, or BrokenProcessPool when its process died
                raise RuntimeError(f"variant {name} failed: {exc!r}") from exc
    return results


def _in_ranks(model_dir: Path, name: str, argv: list[str], nproc: int) -> dict[str, Any]:
    """A ranked variant under torchrun, which starts its own processes."""
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS", "1")
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    cmd = [
        *launcher,
        "-m",
        "pipeline.tools.bench.learner_step",
        *argv,
        "--variant",
        name,
        "--model",
        str(model_dir),
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"variant {name} failed (exit {done.returncode}): {done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


_RANKED = re.compile(r"^(?P<precision>\S+) x(?P<nproc>\d+) ranks?$")


def _rank_variants(args: argparse.Namespace) -> list[tuple[str, int]]:
    return [(f"{args.precision} x{n} rank{'s' if n > 1 else ''}", n) for n in (1, args.nproc)]


def _without_nproc(argv: list[str]) -> list[str]:
    """The bench's flags for a variant's process: torchrun would take `--nproc` for its own
    `--nproc-per-node` (argparse prefix matching), and the variant's name carries it anyway."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            out.append(arg)
    return out


def run(argv: list[str]) -> dict[str, Any]:
    """Every variant, each in its own process, and their ratios against fp32 (`argv`: this bench's flags)."""
    from learner.model.model_init import init_model

    args = _parser().parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="rollwise-bench-learner-") as tmp:
        model_dir = init_model(Path(tmp) / "model", preset=args.preset, seed=0)
        if args.nproc > 1:
            child_argv = _without_nproc(argv)
            results = {name: _in_ranks(model_dir, name, child_argv, n) for name, n in _rank_variants(args)}
        else:
            results = _in_forked_processes(model_dir, [_variant_name(*v) for v in VARIANTS], argv)
    base = next(iter(results.values()))
    for entry in results.values():
        entry["time_ratio"] = entry["seconds"] / base["seconds"]
        entry["memory_ratio"] = entry["peak_extra_bytes"] / max(base["peak_extra_bytes"], 1.0)
        if "ranks" in entry:
            for key in ("state_bytes", "rss_peak_bytes"):
                worst = max(r[key] for r in entry["ranks"])
                entry[f"{key.removesuffix('_bytes')}_ratio"] = worst / max(r[key] for r in base["ranks"])
    return {
        "preset": args.preset,
        "device": args.device,
        "auto": _auto_precision(args.device),
        "threads": args.threads,
        "tokens_per_step": _tokens(args),
        "results": results,
    }


def _auto_precision(device: str) -> str:
    from learner.model.precision import resolve_precision

    return resolve_precision("auto", torch.device(device)).name


def _tokens(args: argparse.Namespace) -> int:
    return args.groups * args.group_size * (args.prompt + args.generated)


def format_report(report: dict[str, Any]) -> str:
    lines = [
        f"learner step, preset {report['preset']} on {report['device']} ({report['threads']} threads; "
        f"auto = {report['auto']}), {report['tokens_per_step']} tokens",
        f"{'variant':<18}{'time (s)':>10}{'peak (MiB)':>12}{'time x':>9}{'memory x':>10}",
    ]
    for name, r in report["results"].items():
        lines.append(
            f"{name:<18}{r['seconds']:>10.3f}{r['peak_extra_bytes'] / 2**20:>12.1f}"
            f"{r['time_ratio']:>9.2f}{r['memory_ratio']:>10.3f}"
        )
    ranked = {name: r for name, r in report["results"].items() if "ranks" in r}
    if ranked:
        lines.append("per rank (the largest of the ranks against one process): held = weights + AdamW state")
        lines.append(f"{'variant':<18}{'held (MiB)':>12}{'held x':>9}{'RSS peak (MiB)':>16}{'RSS x':>8}")
        for name, r in ranked.items():
            held = max(x["state_bytes"] for x in r["ranks"]) / 2**20
            rss = max(x["rss_peak_bytes"] for x in r["ranks"]) / 2**20
            lines.append(
                f"{name:<18}{held:>12.1f}{r['state_ratio']:>9.3f}{rss:>16.1f}{r['rss_peak_ratio']:>8.3f}"
            )
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rollwise bench learner", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small", help="model preset (rollwise model init's presets)")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    p.add_argument("--groups", type=int, default=2, help="groups per step")
    p.add_argument("--group-size", type=int, default=4, help="episodes per group")
    p.add_argument("--prompt", type=int, default=256, help="prompt tokens per episode")
    p.add_argument("--generated", type=int, default=256, help="generated tokens per episode")
    p.add_argument("--mini-batches", type=int, default=2, help="mini-batches per step")
    p.add_argument("--repeats", type=int, default=2, help="measured steps per variant")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (per rank)")
    p.add_argument(
        "--nproc", type=int, default=1, help="> 1: one rank against this many (torchrun, FSDP2) instead"
    )
    p.add_argument("--precision", default="fp32", help="precision of the --nproc comparison")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--variant", help=argparse.SUPPRESS)  # one variant, in this process (the runner's call)
    p.add_argument("--model", help=argparse.SUPPRESS)
    return p


def _run_variant(args: argparse.Namespace) -> dict[str, Any]:
    """The measurement of `args.variant` in this process (a ranked one: this rank's part of it)."""
    torch.set_num_threads(args.threads)
    bound_kernel_caches()  # as the learner process does
    ranked = _RANKED.match(args.variant)
    if ranked is not None:
        return _measure(Path(args.model), ranked["precision"], False, args, nproc=int(ranked["nproc"]))
    precision, *options = args.variant.split("+")
    return _measure(
        Path(args.model),
        precision,
        "ckpt" in options,
        args,
        lora="lora" in options,
        shared="unshared" not in options,
    )


def main(argv: list[str] | None = None) -> int:
    argv = list(argv) if argv is not None else sys.argv[1:]
    if any(arg == "--replay" or arg.startswith("--replay=") for arg in argv):
        from pipeline.tools.bench.learner_replay import main as replay_main

        return replay_main(argv)  # a run's own steps, not a synthetic batch (its module docstring)
    args = _parser().parse_args(argv)
    if args.variant is not None:
        result = _run_variant(args)
        if int(os.environ.get("RANK", "0")) == 0:
            print(json.dumps(result))
        return 0
    report = run([a for a in argv if a != "--json"])
    print(json.dumps(report) if args.json else format_report(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
