"""`rollwise bench engine`: embedded-engine tokens/s under concurrency versus sequential generation.

Baseline: the same model in the same process generating one request at a time with a plain HF
KV-cache loop (prefill, then one token per forward; same sampling code, no batching, no HTTP).
Engine: the embedded server started in-process on 127.0.0.1 (port 0); C requests are sent at once
over real HTTP and tokens/s = generated tokens / wall seconds from first send to last reply.
Every request generates exactly `--max-new-tokens` tokens (ignore_eos), prompts have random ids.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import torch

from pipeline.engine.batcher import cache_kwarg
from pipeline.engine.model_loading import load_model
from pipeline.engine.sampling import RequestSampling, batch_sampling, sample_next_tokens
from pipeline.engine.serve import start_server
from pipeline.engine.serve_flags import ServerConfig


@dataclass(frozen=True)
class BenchRow:
    concurrency: int
    tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def _prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(count)]


@torch.inference_mode()
def sequential_generate(model: Any, prompts: list[list[int]], max_new_tokens: int) -> BenchRow:
    """One request at a time: prefill, then one forward per token with HF's own KV cache."""
    from transformers import DynamicCache

    sampling = RequestSampling(max_new_tokens=max_new_tokens, temperature=1.0, ignore_eos=True)
    settings = batch_sampling([sampling], int(model.config.vocab_size))
    generator = torch.Generator().manual_seed(0)
    tokens = 0
    start = time.perf_counter()
    kwarg = cache_kwarg(model)
    for prompt in prompts:
        cache = DynamicCache()
        ids = torch.tensor([prompt])
        for _ in range(max_new_tokens):
            logits = model(input_ids=ids, use_cache=True, logits_to_keep=1, **{kwarg: cache}).logits
            uniform = torch.rand(1, generator=generator, dtype=torch.float64)
            next_id, _ = sample_next_tokens(logits[:, -1, :], settings, uniform)
            ids = next_id.unsqueeze(0)
            tokens += 1
    return BenchRow(concurrency=1, tokens=tokens, seconds=time.perf_counter() - start)


async def engine_generate(url: str, prompts: list[list[int]], max_new_tokens: int) -> BenchRow:
    """All prompts sent at once; wall time until the last response."""
    params = {"max_new_tokens": max_new_tokens, "temperature": 1.0, "ignore_eos": True}
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:

        async def one(prompt: list[int]) -> int:
            body = {"input_ids": prompt, "sampling_params": params, "return_logprob": True}
            async with session.post(f"{url}/generate", json=body) as response:
                response.raise_for_status()
                return len((await response.json())["output_ids"])

        start = time.perf_counter()
        counts = await asyncio.gather(*(one(p) for p in prompts))
        seconds = time.perf_counter() - start
    return BenchRow(concurrency=len(prompts), tokens=sum(counts), seconds=seconds)


def format_table(baseline: BenchRow, rows: list[BenchRow]) -> str:
    lines = [
        f"{'mode':<22}{'requests':>9}{'tokens':>9}{'seconds':>10}{'tok/s':>10}{'vs seq':>9}",
        f"{'sequential (HF loop)':<22}{'-':>9}{baseline.tokens:>9}{baseline.seconds:>10.2f}"
        f"{baseline.tokens_per_s:>10.0f}{1.0:>8.2f}x",
    ]
    for row in rows:
        ratio = row.tokens_per_s / baseline.tokens_per_s
        lines.append(
            f"{'engine, concurrent':<22}{row.concurrency:>9}{row.tokens:>9}{row.seconds:>10.2f}"
            f"{row.tokens_per_s:>10.0f}{ratio:>8.2f}x"
        )
    return "\n".join(lines)


async def run_bench(args: argparse.Namespace, model_dir: Path) -> tuple[BenchRow, list[BenchRow]]:
    model = load_model(str(model_dir), "cpu", "float32")
    vocab = int(model.config.vocab_size)
    baseline = sequential_generate(
        model, _prompts(args.sequential_requests, args.prompt_len, vocab, 0), args.max_new_tokens
    )
    del model
    config = ServerConfig(
        model=str(model_dir), port=0, max_batch=args.max_batch, batch_wait_ms=args.batch_wait_ms, seed=0
    )
    server = await start_server(config)
    try:
        rows = []
        for concurrency in args.concurrency:
            prompts = _prompts(concurrency, args.prompt_len, vocab, concurrency)
            rows.append(await engine_generate(server.url, prompts, args.max_new_tokens))
    finally:
        await server.close()
    return baseline, rows


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="rollwise bench engine", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="HF model dir (default: a fresh tiny preset in a temp dir)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 128])
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--sequential-requests", type=int, default=8, help="requests in the baseline run")
    p.add_argument("--max-batch", type=int, default=128)
    p.add_argument("--batch-wait-ms", type=float, default=3.0)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (both modes)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="rollwise-bench-engine-") as tmp:
        model_dir = Path(args.model) if args.model else _tiny_model(Path(tmp))
        baseline, rows = asyncio.run(run_bench(args, model_dir))
    print(
        f"model: {model_dir if args.model else 'tiny preset (fresh)'}; torch threads: {args.threads}; "
        f"{args.max_new_tokens} new tokens per request, prompt {args.prompt_len} tokens"
    )
    print(format_table(baseline, rows))
    return 0


def _tiny_model(tmp: Path) -> Path:
    from learner.model_init import init_model

    return init_model(tmp / "tiny", preset="tiny", seed=0)
