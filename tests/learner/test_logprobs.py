"""Chunked sampled-token log-probs and entropy versus the textbook full log_softmax."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from learner.logprobs import (
    DEFAULT_CHUNK_SIZE,
    entropy_from_logits,
    naive_sampled_token_logprobs,
    sampled_token_logprobs,
)


def _logits_and_tokens(
    shape: tuple[int, ...], vocab: int, seed: int = 0, scale: float = 4.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random logits and tokens *sampled from them*, so log-probs have realistic sizes (mostly > -10)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(*shape, vocab, generator=gen) * scale
    probs = torch.softmax(logits.reshape(-1, vocab), dim=-1)
    tokens = torch.multinomial(probs, 1, generator=gen).view(shape)
    return logits, tokens


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
@pytest.mark.parametrize("chunk_size", [1, 7, 64, 1000, DEFAULT_CHUNK_SIZE])
def test_matches_naive_in_fp32(temperature: float, chunk_size: int) -> None:
    logits, tokens = _logits_and_tokens((3, 41), vocab=301)  # 123 rows: no chunk size divides it
    chunked = sampled_token_logprobs(logits, tokens, temperature=temperature, chunk_size=chunk_size)
    naive = naive_sampled_token_logprobs(logits, tokens, temperature=temperature)
    assert chunked.shape == (3, 41)
    assert chunked.dtype == torch.float32
    torch.testing.assert_close(chunked, naive, atol=1e-6, rtol=0)


def test_improbable_tokens_stay_within_fp32_resolution_of_float64() -> None:
    """Uniformly drawn tokens have lp near -25, where one fp32 ulp is 1.9e-6: compare relatively."""
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(300, 1001, generator=gen) * 4.0
    tokens = torch.randint(0, 1001, (300,), generator=gen)
    exact = sampled_token_logprobs(logits.double(), tokens, temperature=0.7)
    chunked = sampled_token_logprobs(logits, tokens, temperature=0.7, chunk_size=64)
    assert exact.min().item() < -20.0
    torch.testing.assert_close(chunked.double(), exact, rtol=4e-7, atol=1e-6)


def test_matches_float64_reference_and_engine_semantics() -> None:
    """lp = x[y]/T - logsumexp(x/T), exactly what SGLang reports before top-p/top-k."""
    logits = torch.tensor([[2.0, 0.0, -1.0, 0.5]])
    tokens = torch.tensor([2])
    temperature = 0.7
    scaled = [v / temperature for v in (2.0, 0.0, -1.0, 0.5)]
    expected = scaled[2] - math.log(sum(math.exp(v) for v in scaled))
    got = sampled_token_logprobs(logits, tokens, temperature=temperature)
    assert got.item() == pytest.approx(expected, abs=1e-6)
    got64 = sampled_token_logprobs(logits.double(), tokens, temperature=temperature)
    assert got64.dtype == torch.float64
    assert got64.item() == pytest.approx(expected, abs=1e-14)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_bf16_logits_are_upcast_exactly(temperature: float) -> None:
    logits, tokens = _logits_and_tokens((2, 50), vocab=257, seed=1)
    bf16 = logits.bfloat16()
    chunked = sampled_token_logprobs(bf16, tokens, temperature=temperature, chunk_size=9)
    # The reference sees the same bf16-rounded logits in fp32: only the computation precision differs.
    naive = naive_sampled_token_logprobs(bf16.float(), tokens, temperature=temperature)
    assert chunked.dtype == torch.float32
    torch.testing.assert_close(chunked, naive, atol=1e-6, rtol=0)


@pytest.mark.parametrize("temperature", [1.0, 1.3])
@pytest.mark.parametrize("chunk_size", [5, 1000])
def test_gradient_matches_naive(temperature: float, chunk_size: int) -> None:
    logits, tokens = _logits_and_tokens((2, 17), vocab=53, seed=2)
    upstream = torch.randn(2, 17, generator=torch.Generator().manual_seed(3))
    chunked = logits.clone().requires_grad_(True)
    sampled_token_logprobs(chunked, tokens, temperature=temperature, chunk_size=chunk_size).backward(upstream)
    naive = logits.clone().requires_grad_(True)
    naive_sampled_token_logprobs(naive, tokens, temperature=temperature).backward(upstream)
    assert chunked.grad is not None and naive.grad is not None
    torch.testing.assert_close(chunked.grad, naive.grad, atol=1e-6, rtol=0)


def test_gradient_passes_torch_gradcheck_in_float64() -> None:
    logits, tokens = _logits_and_tokens((3, 4), vocab=6, seed=4, scale=1.0)
    leaf = logits.double().requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda x: sampled_token_logprobs(x, tokens, temperature=0.8, chunk_size=5), (leaf,)
    )


def test_bf16_logits_get_a_bf16_gradient_close_to_fp32() -> None:
    logits, tokens = _logits_and_tokens((1, 12), vocab=33, seed=5)
    leaf = logits.bfloat16().requires_grad_(True)
    sampled_token_logprobs(leaf, tokens, chunk_size=5).sum().backward()
    reference = logits.bfloat16().float().requires_grad_(True)
    naive_sampled_token_logprobs(reference, tokens).sum().backward()
    assert leaf.grad is not None and reference.grad is not None
    assert leaf.grad.dtype == torch.bfloat16
    torch.testing.assert_close(leaf.grad.float(), reference.grad, atol=8e-3, rtol=0)


def _largest_allocation(call: Callable[[], object]) -> int:
    """Bytes of the largest CPU allocation while `call` runs, as torch's profiler records them."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        call()
    return max((event.self_cpu_memory_usage for event in prof.events()), default=0)


def test_sliced_model_output_is_neither_copied_nor_mishandled() -> None:
    """logits[:, :-1] (drop the last position) is the usual way to align logits with next tokens."""
    full, _ = _logits_and_tokens((3, 10), vocab=29, seed=8)
    sliced_values = full[:, :-1]
    tokens = torch.multinomial(torch.softmax(sliced_values.reshape(-1, 29), -1), 1).view(3, 9)
    assert not sliced_values.is_contiguous()
    # Not copied: the largest tensor the chunked forward allocates is one (chunk, V) fp32 buffer, where a
    # copy of the slice would be 3 x 9 x 29 floats (the size of the naive version's logits / T).
    chunked_peak = _largest_allocation(
        lambda: sampled_token_logprobs(sliced_values, tokens, temperature=0.9, chunk_size=4)
    )
    naive_peak = _largest_allocation(
        lambda: naive_sampled_token_logprobs(sliced_values, tokens, temperature=0.9)
    )
    assert chunked_peak == 4 * 29 * 4
    assert naive_peak == 3 * 9 * 29 * 4

    leaf = full.clone().requires_grad_(True)
    chunked = sampled_token_logprobs(leaf[:, :-1], tokens, temperature=0.9, chunk_size=4)
    chunked.sum().backward()
    reference = full.clone().requires_grad_(True)
    naive = naive_sampled_token_logprobs(reference[:, :-1], tokens, temperature=0.9)
    naive.sum().backward()
    assert torch.equal(chunked, naive)
    assert leaf.grad is not None and reference.grad is not None
    torch.testing.assert_close(leaf.grad, reference.grad, atol=1e-6, rtol=0)
    assert torch.equal(leaf.grad[:, -1], torch.zeros(3, 29))


def test_bf16_autocast_region_does_not_downcast_the_log_softmax() -> None:
    logits, tokens = _logits_and_tokens((2, 30), vocab=301, seed=9)
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        inside = sampled_token_logprobs(logits, tokens, chunk_size=16)
    assert inside.dtype == torch.float32
    assert torch.equal(inside, naive_sampled_token_logprobs(logits, tokens))


def test_input_logits_are_not_modified_by_forward_or_backward() -> None:
    logits, tokens = _logits_and_tokens((2, 9), vocab=11, seed=6)
    leaf = logits.clone().requires_grad_(True)
    sampled_token_logprobs(leaf, tokens, chunk_size=4).sum().backward()
    assert torch.equal(leaf.detach(), logits)


def test_empty_sequence_gives_empty_result() -> None:
    result = sampled_token_logprobs(torch.zeros(2, 0, 5), torch.zeros(2, 0, dtype=torch.long))
    assert result.shape == (2, 0)


def test_rejects_bad_arguments_with_names() -> None:
    logits, tokens = _logits_and_tokens((4,), vocab=5)
    with pytest.raises(ValueError, match="token id 5 is outside the vocabulary"):
        sampled_token_logprobs(logits, torch.tensor([0, 1, 5, 2]))
    with pytest.raises(ValueError, match="token id -1"):
        sampled_token_logprobs(logits, torch.tensor([0, -1, 4, 2]))
    with pytest.raises(ValueError, match="token_ids shape"):
        sampled_token_logprobs(logits, tokens[:3])
    with pytest.raises(ValueError, match="temperature"):
        sampled_token_logprobs(logits, tokens, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        sampled_token_logprobs(logits, tokens, chunk_size=0)
    with pytest.raises(ValueError, match="integer"):
        sampled_token_logprobs(logits, tokens.float())


def _naive_entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    logp = torch.log_softmax(logits.double() / temperature, dim=-1)
    return -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_entropy_is_masked_mean_of_row_entropies(temperature: float) -> None:
    logits, _ = _logits_and_tokens((3, 10), vocab=40, seed=7, scale=2.0)
    mask = torch.zeros(3, 10, dtype=torch.bool)
    mask[0, :4] = True
    mask[2, 5:] = True
    rows = _naive_entropy(logits, temperature)
    expected = rows[mask].mean().item()
    got = entropy_from_logits(logits, mask, temperature=temperature, chunk_size=7)
    assert got.dtype == torch.float32
    assert got.item() == pytest.approx(expected, abs=1e-5)
    everything = entropy_from_logits(logits, temperature=temperature, chunk_size=7)
    assert everything.item() == pytest.approx(rows.mean().item(), abs=1e-5)


def test_entropy_of_uniform_and_of_empty_mask() -> None:
    uniform = torch.zeros(2, 3, 16, dtype=torch.bfloat16)
    assert entropy_from_logits(uniform).item() == pytest.approx(math.log(16), abs=1e-6)
    assert entropy_from_logits(uniform, torch.zeros(2, 3)).item() == 0.0
    with pytest.raises(ValueError, match="mask shape"):
        entropy_from_logits(uniform, torch.zeros(3, 2))


def test_entropy_needs_no_grad_and_keeps_none() -> None:
    logits = torch.randn(2, 5, 9, requires_grad=True)
    assert not entropy_from_logits(logits).requires_grad


def test_benchmark_measures_the_memory_each_variant_materialises() -> None:
    from pipeline.tools.bench.logprob_memory import MEMORY_GOAL

    # One (T, V) fp32 tensor is 39 MiB: above glibc's largest mmap threshold (32 MiB), so each one is
    # freshly mapped and shows in the peak RSS that the CPU measurement reads (see the bench's docstring).
    # The bench runs in a process of its own, as `rollwise bench logprobs` does: inside the test process,
    # after a full suite's earlier tests, its peak-RSS reading came out 0 (alone it passed).
    seq_len, vocab, chunk_size = 256, 40_000, 8
    full = seq_len * vocab * 4
    code = (
        "import json, torch\n"
        "from pipeline.tools.bench.logprob_memory import run\n"
        f"report = run(vocab={vocab}, seq_len={seq_len}, repeats=2, chunk_size={chunk_size}, "
        "temperature=0.7)\n"
        "print(json.dumps({'report': report, 'threads': torch.get_num_threads()}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.splitlines()[-1])
    report = result["report"]
    assert report["config"] == {
        "vocab": vocab,
        "seq_len": seq_len,
        "repeats": 2,
        "chunk_size": chunk_size,
        "device": "cpu",
        "dtype": "float32",
        "temperature": 0.7,
        "torch_threads": result["threads"],
    }
    forward, both = report["forward"], report["forward_backward"]
    assert forward["max_abs_diff"] <= 1e-6 and both["max_abs_diff"] <= 1e-6
    peak = {
        (mode, variant): report[mode][variant]["peak_extra_bytes"]
        for mode in ("forward", "forward_backward")
        for variant in ("naive", "chunked")
    }
    # Naive forward: logits / T and its log_softmax, two (T, V) tensors; backward adds the (T, V)
    # gradient. Chunked: two (chunk, V) buffers (2.5 MB here), plus the (T, V) gradient in backward.
    # A peak-RSS reading can miss one tensor's worth (seen on Linux 6.x), so the lower bounds allow that.
    assert 0.95 * full <= peak["forward", "naive"] <= 2.2 * full
    assert peak["forward", "chunked"] <= 0.25 * full
    assert 1.9 * full <= peak["forward_backward", "naive"] <= 3.2 * full
    assert peak["forward_backward", "chunked"] <= 1.25 * full
    for entry in (forward, both):
        ratio = entry["chunked"]["peak_extra_bytes"] / entry["naive"]["peak_extra_bytes"]
        assert entry["memory_ratio"] == pytest.approx(ratio, rel=1e-12)
        seconds = [entry[variant]["seconds"] for variant in ("naive", "chunked")]
        assert all(0.0 < s < 30.0 for s in seconds)
        assert entry["time_ratio"] == pytest.approx(seconds[1] / seconds[0], rel=1e-12)
    assert forward["memory_ratio"] <= MEMORY_GOAL and both["memory_ratio"] < 0.66


def test_benchmark_cli_prints_the_forward_only_report(capsys: pytest.CaptureFixture[str]) -> None:
    from pipeline.tools.bench.logprob_memory import main

    assert main(["--vocab", "97", "--seq-len", "40", "--repeats", "1", "--no-backward"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == (
        "sampled-token log-probs: vocab=97, seq_len=40, repeats=1, chunk_size=256, device=cpu, "
        f"dtype=float32, temperature=1.0, torch_threads={torch.get_num_threads()}"
    )
    assert lines[1].split() == ["mode", "variant", "time", "(s)", "peak", "extra", "(MiB)"]
    assert [line.split()[:2] for line in lines[2:4]] == [["forward", "naive"], ["forward", "chunked"]]
    assert lines[4].split()[0] == "ratio" and "max |diff| " in lines[4]
    assert lines[5].startswith("goal (forward: memory <= 0.35x, time <= 1.2x naive): ")
    assert len(lines) == 6  # no forward_backward rows with --no-backward
