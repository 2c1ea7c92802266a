"""`rollwise bench engine`: the embedded engine on a model, against plain transformers, in one process.

Three measurements, each against its own baseline in the same run:

1. Throughput. Baseline: the same model generating one request at a time with `model.generate` (plain
   transformers: sampling at T = 1, no top-k, every token up to `--max-new-tokens`). Engine: the
   embedded server started in-process on 127.0.0.1 (port 0); C requests are sent at once over real
   HTTP and tokens/s = generated tokens / wall seconds from first send to last reply. Prompts are random
   ids; every request generates exactly `--max-new-tokens` tokens (ignore_eos). Both sides run in the
   same dtype (`--dtype`, default the engine's auto choice) on the same torch threads. On a shared
   machine the load drifts, so each concurrency level alternates baseline and engine `--repeats` times
   and keeps the best of each: its ratio compares measurements seconds apart, not minutes.
2. Multi-turn with the prefix cache: `--episodes` episodes in groups of `--group` (a group shares its
   first prompt) play `--turns` turns each: generate, append an environment reply of `--reply-len`
   random ids, send the whole conversation again. Run once with the prefix cache and once without
   (`--prefix-cache-mb 0`); reports the cache's hit rate, the prefill tokens it saved and both wall times.
3. Log-prob agreement: sequences the engine samples in bfloat16 and in float32, scored by the learner's
   fp32 forward (`learner.model.model_io.load_policy` + `learner.logprobs.sampled_token_logprobs`, the
   learner's own path): mean and max per-token |engine - learner| over the generated tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import torch

from pipeline.contracts.cpu_features import usable_cores
from pipeline.contracts.kernel_caches import bound_kernel_caches
from pipeline.engine.model_loading import load_model, resolve_dtype
from pipeline.engine.serve import RunningServer, start_server
from pipeline.engine.serve_flags import ServerConfig

REQUEST_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class BenchRow:
    concurrency: int
    tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def best(rows: list[BenchRow]) -> BenchRow:
    return max(rows, key=lambda row: row.tokens_per_s)


@dataclass(frozen=True)
class MultiTurnRun:
    """One pass of the multi-turn workload on one engine."""

    prefix_cache: bool
    seconds: float
    requests: int
    prompt_tokens: int  # tokens prefilled (every turn's whole conversation)
    cached_tokens: int  # of those, taken from the prefix cache (meta_info.cached_tokens summed)
    hits: int  # requests that reused at least one cached token
    outputs: list[list[int]]  # every turn's output ids, episode-major

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(frozen=True)
class Agreement:
    """Engine log-probs of its own samples against the learner's fp32 recomputation."""

    dtype: str
    tokens: int
    mean_abs: float
    max_abs: float


def _prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(count)]


@torch.inference_mode()
def sequential_generate(model: Any, prompts: list[list[int]], max_new_tokens: int) -> BenchRow:
    """One request at a time through plain `model.generate` (its own KV cache, no batching, no HTTP)."""
    torch.manual_seed(0)
    tokens = 0
    start = time.perf_counter()
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,  # as ignore_eos: every request generates them all
            do_sample=True,
            temperature=1.0,
            top_k=None,
            top_p=1.0,
            pad_token_id=0,
        )
        tokens += out.shape[1] - ids.shape[1]
    return BenchRow(concurrency=1, tokens=tokens, seconds=time.perf_counter() - start)


def _session() -> aiohttp.ClientSession:
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    return aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0))


async def _generate(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Any:
    async with session.post(f"{url}/generate", json=body) as response:
        text = await response.text()
        if response.status != 200:
            raise RuntimeError(f"/generate answered {response.status}: {text[:300]}")
        return json.loads(text)


async def engine_generate(url: str, prompts: list[list[int]], max_new_tokens: int) -> BenchRow:
    """All prompts sent at once; wall time until the last response."""
    params = {"max_new_tokens": max_new_tokens, "temperature": 1.0, "ignore_eos": True}
    async with _session() as session:
        start = time.perf_counter()
        replies = await asyncio.gather(
            *(
                _generate(session, url, {"input_ids": p, "sampling_params": params, "return_logprob": True})
                for p in prompts
            )
        )
        seconds = time.perf_counter() - start
    return BenchRow(
        concurrency=len(prompts), tokens=sum(len(r["output_ids"]) for r in replies), seconds=seconds
    )


async def multi_turn(url: str, args: argparse.Namespace, vocab: int, *, prefix_cache: bool) -> MultiTurnRun:
    """The multi-turn workload (module docstring); every request seeded, so both passes sample alike."""
    groups = _prompts(-(-args.episodes // args.group), args.mt_prompt_len, vocab, 7)
    outputs: list[list[list[int]]] = [[] for _ in range(args.episodes)]
    stats = {"prompt": 0, "cached": 0, "hits": 0}

    async def episode(session: aiohttp.ClientSession, index: int) -> None:
        rng = random.Random(1000 + index)
        history = list(groups[index // args.group])
        for turn in range(args.turns):
            params = {
                "max_new_tokens": args.mt_new_tokens,
                "temperature": 1.0,
                "ignore_eos": True,
                "sampling_seed": 100 * index + turn,
            }
            reply = await _generate(session, url, {"input_ids": history, "sampling_params": params})
            meta = reply["meta_info"]
            stats["prompt"] += meta["prompt_tokens"]
            stats["cached"] += meta["cached_tokens"]
            stats["hits"] += meta["cached_tokens"] > 0
            outputs[index].append(reply["output_ids"])
            history += reply["output_ids"] + [rng.randrange(vocab) for _ in range(args.reply_len)]

    async with _session() as session:
        start = time.perf_counter()
        await asyncio.gather(*(episode(session, i) for i in range(args.episodes)))
        seconds = time.perf_counter() - start
    return MultiTurnRun(
        prefix_cache=prefix_cache,
        seconds=seconds,
        requests=args.episodes * args.turns,
        prompt_tokens=stats["prompt"],
        cached_tokens=stats["cached"],
        hits=stats["hits"],
        outputs=[out for per_episode in outputs for out in per_episode],
    )


async def engine_samples(
    url: str, prompts: list[list[int]], max_new_tokens: int
) -> list[tuple[list[int], list[float]]]:
    """(output ids, the engine's log-probs of them) for each prompt; seeded, T = 1."""
    async with _session() as session:
        replies = await asyncio.gather(
            *(
                _generate(
                    session,
                    url,
                    {
                        "input_ids": p,
                        "sampling_params": {
                            "max_new_tokens": max_new_tokens,
                            "temperature": 1.0,
                            "ignore_eos": True,
                            "sampling_seed": i,
                        },
                        "return_logprob": True,
                    },
                )
                for i, p in enumerate(prompts)
            )
        )
    return [(r["output_ids"], [e[0] for e in r["meta_info"]["output_token_logprobs"]]) for r in replies]


@torch.inference_mode()
def learner_agreement(
    learner: Any, dtype: str, prompts: list[list[int]], samples: list[tuple[list[int], list[float]]]
) -> Agreement:
    """Per-token |engine - learner| of the engine's samples, the learner's fp32 forward as reference."""
    from learner.logprobs import sampled_token_logprobs

    diffs: list[float] = []
    for prompt, (output, engine_lps) in zip(prompts, samples, strict=True):
        logits = learner(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1]
        reference = sampled_token_logprobs(logits.float(), torch.tensor(output), temperature=1.0)
        diffs += [abs(a - b) for a, b in zip(engine_lps, reference.tolist(), strict=True)]
    return Agreement(dtype=dtype, tokens=len(diffs), mean_abs=sum(diffs) / len(diffs), max_abs=max(diffs))


def _server_config(args: argparse.Namespace, model_dir: Path, dtype: str, **overrides: Any) -> ServerConfig:
    settings: dict[str, Any] = {
        "model": str(model_dir),
        "port": 0,
        "max_batch": args.max_batch,
        "batch_wait_ms": args.batch_wait_ms,
        "seed": 0,
        "dtype": dtype,
        **overrides,
    }
    return ServerConfig(**settings)


async def _served(config: ServerConfig) -> RunningServer:
    return await start_server(config)


async def run_bench(args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    """Every measurement the flags ask for, as a dict (what --json prints)."""
    dtype, reason = resolve_dtype(args.dtype, "cpu")
    started = time.perf_counter()
    model = load_model(str(model_dir), "cpu", dtype)
    load_s = time.perf_counter() - started
    vocab = int(model.config.vocab_size)
    result: dict[str, Any] = {
        "model": str(model_dir),
        "parameters": sum(p.numel() for p in model.parameters()),
        "dtype": dtype,
        "dtype_reason": reason,
        "threads": torch.get_num_threads(),
        "model_load_s": round(load_s, 3),
        "max_new_tokens": args.max_new_tokens,
        "prompt_len": args.prompt_len,
        "repeats": args.repeats,
    }
    server = await _served(_server_config(args, model_dir, dtype))
    try:
        result["engine"] = await _throughput(args, model, server.url, vocab)
        del model
        if args.turns > 0:
            plain = await _served(_server_config(args, model_dir, dtype, prefix_cache_mb=0))
            try:
                result["multi_turn"] = await _multi_turn_pair(args, server.url, plain.url, vocab)
            finally:
                await plain.close()
    finally:
        await server.close()
    if args.agreement > 0:
        result["agreement"] = [asdict(a) for a in await _agreements(args, model_dir, vocab)]
    return result


async def _throughput(args: argparse.Namespace, model: Any, url: str, vocab: int) -> list[dict[str, Any]]:
    """Per concurrency level: the best of `repeats` alternating baseline and engine measurements."""
    rows = []
    sequential = _prompts(args.sequential_requests, args.prompt_len, vocab, 0)
    for concurrency in args.concurrency:
        prompts = _prompts(concurrency, args.prompt_len, vocab, concurrency)
        base_runs, engine_runs = [], []
        for _ in range(args.repeats):
            base_runs.append(
                await asyncio.to_thread(sequential_generate, model, sequential, args.max_new_tokens)
            )
            engine_runs.append(await engine_generate(url, prompts, args.max_new_tokens))
        base, row = best(base_runs), best(engine_runs)
        rows.append(
            asdict(row)
            | {
                "tokens_per_s": row.tokens_per_s,
                "baseline_tokens_per_s": base.tokens_per_s,
                "ratio": row.tokens_per_s / base.tokens_per_s,
            }
        )
    return rows


async def _multi_turn_pair(
    args: argparse.Namespace, cached_url: str, plain_url: str, vocab: int
) -> dict[str, Any]:
    """The workload on the engine with the prefix cache and on the one without, alternating `repeats`
    times (the cache flushed before each pass, so every pass starts cold); the fastest of each."""
    cached_runs, plain_runs = [], []
    for _ in range(args.repeats):
        await _flush(cached_url)
        cached_runs.append(await multi_turn(cached_url, args, vocab, prefix_cache=True))
        plain_runs.append(await multi_turn(plain_url, args, vocab, prefix_cache=False))
    cached = min(cached_runs, key=lambda run: run.seconds)
    plain = min(plain_runs, key=lambda run: run.seconds)
    return _multi_turn_summary(args, cached, plain)


async def _flush(url: str) -> None:
    async with _session() as session, session.post(f"{url}/flush_cache") as response:
        await response.read()


def _multi_turn_summary(
    args: argparse.Namespace, cached: MultiTurnRun, plain: MultiTurnRun
) -> dict[str, Any]:
    same = sum(a == b for a, b in zip(cached.outputs, plain.outputs, strict=True))
    return {
        "episodes": args.episodes,
        "group": args.group,
        "turns": args.turns,
        "requests": cached.requests,
        "prompt_tokens": cached.prompt_tokens,
        "cached_tokens": cached.cached_tokens,
        "hits": cached.hits,
        "hit_rate": cached.hit_rate,
        "seconds_with_cache": cached.seconds,
        "seconds_without": plain.seconds,
        "speedup": plain.seconds / cached.seconds,
        "identical_outputs": f"{same}/{len(cached.outputs)}",
    }


async def _agreements(args: argparse.Namespace, model_dir: Path, vocab: int) -> list[Agreement]:
    from learner.model.model_io import load_policy

    learner, _ = load_policy(model_dir)  # fp32, as the learner trains
    learner.eval()
    prompts = _prompts(args.agreement, args.prompt_len, vocab, 99)
    found = []
    for dtype in ("bfloat16", "float32"):
        server = await _served(_server_config(args, model_dir, dtype))
        try:
            samples = await engine_samples(server.url, prompts, args.max_new_tokens)
        finally:
            await server.close()
        found.append(learner_agreement(learner, dtype, prompts, samples))
    return found


def format_report(result: dict[str, Any]) -> str:
    lines = [
        f"model: {result['model']} ({result['parameters']:,} parameters); dtype {result['dtype']} "
        f"({result['dtype_reason']}); torch threads {result['threads']}; load {result['model_load_s']:.2f} s",
        f"{result['max_new_tokens']} new tokens per request, prompt {result['prompt_len']} tokens; best of "
        f"{result['repeats']} alternating rounds per level against transformers generate, one at a time",
        f"{'concurrent':>10}{'tokens':>9}{'seconds':>10}{'engine tok/s':>14}{'generate tok/s':>16}"
        f"{'ratio':>9}",
    ]
    for row in result.get("engine", []):
        lines.append(
            f"{row['concurrency']:>10}{row['tokens']:>9}{row['seconds']:>10.2f}{row['tokens_per_s']:>14.1f}"
            f"{row['baseline_tokens_per_s']:>16.1f}{row['ratio']:>8.2f}x"
        )
    if "multi_turn" in result:
        m = result["multi_turn"]
        lines += [
            f"multi-turn: {m['episodes']} episodes (groups of {m['group']}) x {m['turns']} turns = "
            f"{m['requests']} requests; {m['prompt_tokens']} prompt tokens, {m['cached_tokens']} from the "
            "prefix cache "
            f"(hit rate {m['hit_rate']:.3f}, {m['hits']} requests hit); {m['seconds_with_cache']:.2f} s with "
            f"the cache, {m['seconds_without']:.2f} s without ({m['speedup']:.2f}x); identical outputs "
            f"{m['identical_outputs']}"
        ]
    for a in result.get("agreement", []):
        lines.append(
            f"log-prob agreement, engine {a['dtype']} vs learner fp32 on {a['tokens']} sampled tokens: "
            f"mean |diff| {a['mean_abs']:.3g}, max {a['max_abs']:.3g}"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="rollwise bench engine", description=__doc__.splitlines()[0])
    source = p.add_mutually_exclusive_group()
    source.add_argument("--model", help="HF model dir")
    source.add_argument(
        "--preset", default="tiny", help="model preset when --model is not given (default tiny)"
    )
    p.add_argument("--dtype", default="auto", help="auto (the engine's choice), float32 or bfloat16")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--sequential-requests", type=int, default=2, help="requests per baseline measurement")
    p.add_argument("--repeats", type=int, default=2, help="alternating rounds per measurement")
    p.add_argument("--max-batch", type=int, default=128)
    p.add_argument("--batch-wait-ms", type=float, default=3.0)
    p.add_argument(
        "--threads", type=int, help="torch intra-op threads, both sides (default: every usable core)"
    )
    p.add_argument("--episodes", type=int, default=8, help="multi-turn episodes")
    p.add_argument("--group", type=int, default=4, help="episodes sharing a first prompt")
    p.add_argument("--turns", type=int, default=4, help="turns per episode (0: no multi-turn run)")
    p.add_argument("--mt-prompt-len", type=int, default=256, help="first prompt of a multi-turn group")
    p.add_argument("--mt-new-tokens", type=int, default=32, help="tokens per multi-turn turn")
    p.add_argument("--reply-len", type=int, default=32, help="environment reply tokens per turn")
    p.add_argument(
        "--agreement", type=int, default=8, help="sequences per dtype scored by the learner (0: skip)"
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads or usable_cores())
    bound_kernel_caches()  # as the engine process does
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    with tempfile.TemporaryDirectory(prefix="rollwise-bench-engine-") as tmp:
        model_dir = Path(args.model) if args.model else _preset_model(args.preset, Path(tmp))
        result = asyncio.run(run_bench(args, model_dir))
    result["load_average"] = _load_average()
    print(
        json.dumps(result, indent=2)
        if args.json
        else format_report(result) + f"\nload average {result['load_average']}"
    )
    return 0


def _load_average() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def _preset_model(preset: str, tmp: Path) -> Path:
    """The preset in `tmp` (a pretrained one is linked from its cached conversion, made first if need be)."""
    from learner.model.model_init import init_model

    return init_model(tmp / preset, preset=preset, seed=0)
