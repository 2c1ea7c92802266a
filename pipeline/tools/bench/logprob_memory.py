"""`rollwise bench logprobs`: chunked vs naive sampled-token log-probs, peak memory and time.

Both variants get the same logits (seq_len x vocab, as a model's lm head hands them over: fp32 on CPU by
default, bf16 with --dtype bfloat16) and tokens sampled from those logits. Measured per variant, in one
process, for the forward alone and for forward + backward:

- time: median wall-clock seconds over ``repeats`` runs, after one unmeasured warm-up run; the measured
  runs of the two variants alternate, so background load on a shared machine hits both alike;
- peak extra memory: the highest memory in use during a run minus what was in use just before it (the
  logits and tokens are already allocated, so this is what the log-prob computation itself costs).
  CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``. CPU: the kernel's peak
  resident set size (VmHWM in /proc/self/status), reset before each run by writing "5" to
  /proc/self/clear_refs (Linux >= 4.0). glibc serves tensors above its mmap threshold (at most 32 MiB)
  with mmap and unmaps them on free, so the resident set follows the live tensors and the reading is a
  true high-water mark, not a sample. With small sizes (tensors under 32 MiB) freed memory stays in the
  heap and is reused, so the CPU reading is only meaningful at realistic sizes such as the defaults.

The goal: the chunked forward needs <= 0.35x the naive peak at <= 1.2x its time, with results equal to
1e-6.

`--hidden H` measures the learner's real input instead: final hidden states (seq_len x H) and an output
layer (vocab x H). "naive" materialises the logits and takes the full log-softmax, "chunked" materialises
the logits and takes the chunked log-softmax (the logits and their gradient still exist), "fused"
(learner.fused_logprobs) never holds a (seq_len, vocab) tensor. Forward + backward returns the gradients
of the hidden states and of the output layer; the output layer's gradient (vocab x H) is part of every
variant's peak. Goal for fused, forward + backward: <= 0.1x the naive peak at <= 1.2x its time.
"""

from __future__ import annotations

import argparse
import functools
import gc
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from learner.fused_logprobs import linear_sampled_token_logprobs
from learner.logprobs import DEFAULT_CHUNK_SIZE, naive_sampled_token_logprobs, sampled_token_logprobs

MEMORY_GOAL = 0.35
FUSED_MEMORY_GOAL = 0.1
TIME_GOAL = 1.2
EQUALITY_TOLERANCE = 1e-6
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class PeakMemory:
    """Peak bytes in use during a `with` block, above the level at its start."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak_extra_bytes = 0
        self._baseline = 0

    def __enter__(self) -> PeakMemory:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._baseline = torch.cuda.memory_allocated(self.device)
        else:
            Path("/proc/self/clear_refs").write_text("5")
            self._baseline = _proc_status_bytes("VmHWM")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            peak = _proc_status_bytes("VmHWM")
        self.peak_extra_bytes = peak - self._baseline


def _proc_status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            value, unit = line.split()[1:3]
            if unit != "kB":
                raise RuntimeError(f"unexpected unit {unit!r} for {field} in /proc/self/status")
            return int(value) * 1024
    raise RuntimeError(f"{field} not found in /proc/self/status; peak-RSS measurement needs Linux")


def _sampled_tokens(logits: torch.Tensor, temperature: float, seed: int) -> torch.Tensor:
    """Tokens drawn from softmax(logits / T), a few rows at a time to keep this setup cheap."""
    gen = torch.Generator(device=logits.device).manual_seed(seed)
    rows = []
    for start in range(0, logits.shape[0], 64):
        probs = torch.softmax(logits[start : start + 64].float() / temperature, dim=-1)
        rows.append(torch.multinomial(probs, 1, generator=gen).squeeze(-1))
    return torch.cat(rows)


def _measure(
    calls: dict[str, Callable[[], torch.Tensor]], device: torch.device, repeats: int
) -> dict[str, tuple[torch.Tensor, float, int]]:
    """Per variant: (last result, median seconds, max peak extra bytes) over ``repeats`` runs.

    Each variant runs once unmeasured to warm up; the measured runs then alternate between variants, so
    that load from other processes on a shared machine hits both alike.
    """
    for call in calls.values():
        call()
    seconds: dict[str, list[float]] = {name: [] for name in calls}
    peaks: dict[str, list[int]] = {name: [] for name in calls}
    results: dict[str, torch.Tensor] = {}
    for _ in range(repeats):
        for name, call in calls.items():
            results.pop(name, None)
            with PeakMemory(device) as memory:
                start = time.perf_counter()
                result = call()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                seconds[name].append(time.perf_counter() - start)
            peaks[name].append(memory.peak_extra_bytes)
            results[name] = result.float()
            del result
    return {name: (results[name], statistics.median(seconds[name]), max(peaks[name])) for name in calls}


def _forward_backward(
    compute: Callable[[torch.Tensor], torch.Tensor], logits: torch.Tensor, upstream: torch.Tensor
) -> torch.Tensor:
    leaf = logits.detach().requires_grad_(True)
    compute(leaf).backward(upstream)
    assert leaf.grad is not None
    return leaf.grad


def run(
    vocab: int = 151936,
    seq_len: int = 2048,
    repeats: int = 3,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    device: str = "cpu",
    dtype: str = "float32",
    temperature: float = 1.0,
    backward: bool = True,
    seed: int = 0,
) -> dict[str, Any]:
    """Measures both variants; returns {"config": ..., "forward": {...}, "forward_backward": {...}}.

    Each mode maps "naive" and "chunked" to {"seconds", "peak_extra_bytes"} and adds "memory_ratio" and
    "time_ratio" (chunked / naive) and "max_abs_diff" (of the log-probs, or of the logits' gradients for
    forward_backward). Raises AssertionError when the two variants differ by more than 1e-6.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    torch_device = torch.device(device)
    gen = torch.Generator(device=torch_device).manual_seed(seed)
    # Logit scale ~3 gives log-probs of sampled tokens in the range a trained LM produces (mostly > -10).
    logits = (torch.randn(seq_len, vocab, generator=gen, device=torch_device) * 3.0).to(_DTYPES[dtype])
    tokens = _sampled_tokens(logits, temperature, seed)
    variants: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "naive": lambda x: naive_sampled_token_logprobs(x, tokens, temperature=temperature),
        "chunked": lambda x: sampled_token_logprobs(
            x, tokens, temperature=temperature, chunk_size=chunk_size
        ),
    }
    report: dict[str, Any] = {
        "config": {
            "vocab": vocab,
            "seq_len": seq_len,
            "repeats": repeats,
            "chunk_size": chunk_size,
            "device": str(torch_device),
            "dtype": dtype,
            "temperature": temperature,
            "torch_threads": torch.get_num_threads(),
        }
    }

    modes: dict[str, Callable[[Callable[[torch.Tensor], torch.Tensor]], torch.Tensor]] = {
        "forward": lambda compute: _no_grad_call(compute, logits)
    }
    if backward:
        upstream = torch.randn(seq_len, generator=gen, device=torch_device)
        modes["forward_backward"] = lambda compute: _forward_backward(compute, logits, upstream)

    for mode, call in modes.items():
        measured = _measure(
            {name: functools.partial(call, compute) for name, compute in variants.items()},
            torch_device,
            repeats,
        )
        entry: dict[str, Any] = {
            name: {"seconds": seconds, "peak_extra_bytes": peak}
            for name, (_, seconds, peak) in measured.items()
        }
        diff = (measured["naive"][0] - measured["chunked"][0]).abs().max().item()
        del measured
        entry["max_abs_diff"] = diff
        naive_peak = max(entry["naive"]["peak_extra_bytes"], 1)
        entry["memory_ratio"] = entry["chunked"]["peak_extra_bytes"] / naive_peak
        entry["time_ratio"] = entry["chunked"]["seconds"] / entry["naive"]["seconds"]
        report[mode] = entry
        assert diff <= EQUALITY_TOLERANCE, f"{mode}: chunked and naive differ by {diff:.3g} > 1e-6"
    forward = report["forward"]
    report["meets_goal"] = forward["memory_ratio"] <= MEMORY_GOAL and forward["time_ratio"] <= TIME_GOAL
    return report


def run_from_hidden(
    vocab: int = 151936,
    seq_len: int = 2048,
    hidden_size: int = 1024,
    repeats: int = 3,
    *,
    chunk_size: int = 128,
    device: str = "cpu",
    temperature: float = 1.0,
    seed: int = 0,
) -> dict[str, Any]:
    """naive vs chunked vs fused from hidden states (see the module docstring), forward + backward.

    Returns {"config", "variants": {name: {"seconds", "peak_extra_bytes", "memory_ratio", "time_ratio",
    "max_abs_diff"}}, "meets_goal"}; ratios and differences against naive (the diff is over the
    hidden-state and output-layer gradients; the latter sum over every position, so fp32 summation order
    alone moves them by ~1e-5). Raises AssertionError when a variant differs by > 1e-4.

    The output layer's gradient, (V, H) fp32, is in every variant's peak and bounds the ratio from below
    by about H / (3 T + H): the naive variant holds about three (T, V) tensors besides it.
    """
    torch_device = torch.device(device)
    gen = torch.Generator(device=torch_device).manual_seed(seed)
    hidden = torch.randn(seq_len, hidden_size, generator=gen, device=torch_device)
    # Scaled so the logits have std ~3, as in the logits-only benchmark.
    weight = torch.randn(vocab, hidden_size, generator=gen, device=torch_device) * (3.0 / hidden_size**0.5)
    with torch.no_grad():
        tokens = torch.cat(
            [
                _sampled_tokens(hidden[s : s + 256] @ weight.t(), temperature, seed + s)
                for s in range(0, seq_len, 256)
            ]
        )
    upstream = torch.randn(seq_len, generator=gen, device=torch_device)
    hidden_grads: dict[str, torch.Tensor] = {}  # (T, H): small; kept aside so no copy joins the two

    def grads(compute: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], name: str) -> torch.Tensor:
        h, w = hidden.detach().requires_grad_(True), weight.detach().requires_grad_(True)
        compute(h, w).backward(upstream)
        assert h.grad is not None and w.grad is not None
        hidden_grads[name] = h.grad
        return w.grad

    variants: dict[str, Callable[[], torch.Tensor]] = {
        "naive": lambda: grads(
            lambda h, w: naive_sampled_token_logprobs(h @ w.t(), tokens, temperature=temperature), "naive"
        ),
        "chunked": lambda: grads(
            lambda h, w: sampled_token_logprobs(h @ w.t(), tokens, temperature=temperature), "chunked"
        ),
        "fused": lambda: grads(
            lambda h, w: linear_sampled_token_logprobs(
                h, w, tokens, temperature=temperature, chunk_size=chunk_size
            ),
            "fused",
        ),
    }
    measured = _measure(variants, torch_device, repeats)
    naive_grads, naive_seconds, naive_peak = measured["naive"]
    entries: dict[str, Any] = {}
    for name, (result, seconds, peak) in measured.items():
        diff = max(
            (result - naive_grads).abs().max().item(),
            (hidden_grads[name] - hidden_grads["naive"]).abs().max().item(),
        )
        entries[name] = {
            "seconds": seconds,
            "peak_extra_bytes": peak,
            "memory_ratio": peak / max(naive_peak, 1),
            "time_ratio": seconds / naive_seconds,
            "max_abs_diff": diff,
        }
        assert diff <= 1e-4, f"{name} differs from naive by {diff:.3g}"
    fused = entries["fused"]
    return {
        "config": {
            "vocab": vocab,
            "seq_len": seq_len,
            "hidden": hidden_size,
            "repeats": repeats,
            "chunk_size": chunk_size,
            "device": str(torch_device),
            "temperature": temperature,
            "torch_threads": torch.get_num_threads(),
        },
        "variants": entries,
        "meets_goal": fused["memory_ratio"] <= FUSED_MEMORY_GOAL and fused["time_ratio"] <= TIME_GOAL,
    }


def format_hidden_report(report: dict[str, Any]) -> str:
    c = report["config"]
    lines = [
        f"from hidden states: T={c['seq_len']}, H={c['hidden']}, V={c['vocab']}, forward + backward",
        f"{'variant':<10}{'time (s)':>10}{'peak extra (MiB)':>18}{'time x':>9}{'memory x':>10}"
        f"{'max diff':>11}",
    ]
    for name, e in report["variants"].items():
        lines.append(
            f"{name:<10}{e['seconds']:>10.3f}{e['peak_extra_bytes'] / 2**20:>18.1f}"
            f"{e['time_ratio']:>9.2f}{e['memory_ratio']:>10.3f}{e['max_abs_diff']:>11.2e}"
        )
    verdict = "met" if report["meets_goal"] else "MISSED"
    lines.append(f"goal (fused: memory <= {FUSED_MEMORY_GOAL}x, time <= {TIME_GOAL}x naive): {verdict}")
    return "\n".join(lines)


def _no_grad_call(compute: Callable[[torch.Tensor], torch.Tensor], logits: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return compute(logits)


def format_report(report: dict[str, Any]) -> str:
    config = report["config"]
    lines = [
        "sampled-token log-probs: " + ", ".join(f"{key}={value}" for key, value in config.items()),
        f"{'mode':<18}{'variant':<10}{'time (s)':>10}{'peak extra (MiB)':>18}",
    ]
    for mode in ("forward", "forward_backward"):
        if mode not in report:
            continue
        entry = report[mode]
        for variant in ("naive", "chunked"):
            numbers = entry[variant]
            lines.append(
                f"{mode:<18}{variant:<10}{numbers['seconds']:>10.3f}"
                f"{numbers['peak_extra_bytes'] / 2**20:>18.1f}"
            )
        lines.append(
            f"{'':<18}{'ratio':<10}{entry['time_ratio']:>9.2f}x{entry['memory_ratio']:>17.3f}x"
            f"   max |diff| {entry['max_abs_diff']:.2e}"
        )
    verdict = "met" if report["meets_goal"] else "NOT met"
    lines.append(f"goal (forward: memory <= {MEMORY_GOAL}x, time <= {TIME_GOAL}x naive): {verdict}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """CLI entry for `rollwise bench logprobs`. Exit 0 on success; 1 if the goal is required and missed."""
    parser = argparse.ArgumentParser(prog="rollwise bench logprobs", description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=151936, help="vocabulary size (Qwen3: 151936)")
    parser.add_argument("--seq-len", type=int, default=2048, help="positions per call")
    parser.add_argument("--repeats", type=int, default=3, help="measured runs per variant (median time)")
    parser.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE, help="rows per chunk")
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda:0")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="float32", help="logits dtype")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    parser.add_argument("--no-backward", action="store_true", help="measure the forward only")
    parser.add_argument("--require-goal", action="store_true", help="exit 1 when the goal is missed")
    parser.add_argument(
        "--hidden", type=int, help="measure from hidden states of this width (naive / chunked / fused)"
    )
    args = parser.parse_args(argv)
    if args.hidden is not None:
        hidden_report = run_from_hidden(
            args.vocab,
            args.seq_len,
            args.hidden,
            args.repeats,
            chunk_size=args.chunk_size if args.chunk_size != DEFAULT_CHUNK_SIZE else 128,
            device=args.device,
            temperature=args.temperature,
        )
        print(format_hidden_report(hidden_report))
        return 1 if args.require_goal and not hidden_report["meets_goal"] else 0
    report = run(
        args.vocab,
        args.seq_len,
        args.repeats,
        chunk_size=args.chunk_size,
        device=args.device,
        dtype=args.dtype,
        temperature=args.temperature,
        backward=not args.no_backward,
    )
    print(format_report(report))
    return 1 if args.require_goal and not report["meets_goal"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
