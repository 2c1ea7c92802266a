"""Sampled-token log-probs from hidden states through the output layer, fused per chunk."""

from __future__ import annotations

import pytest
import torch

from learner.fused_logprobs import linear_sampled_token_logprobs


def _inputs(shape: tuple[int, ...], hidden: int, vocab: int, dtype: torch.dtype, seed: int):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(*shape, hidden, generator=gen, dtype=dtype)
    w = torch.randn(vocab, hidden, generator=gen, dtype=dtype) * 0.3
    ids = torch.randint(0, vocab, shape, generator=gen)
    return h, w, ids


def _naive(h: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    logits = (h @ w.t()) / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("chunk", [1, 3, 4, 64])
def test_values_and_gradients_equal_the_materialised_version_in_fp64(chunk: int) -> None:
    h, w, ids = _inputs((2, 5), hidden=6, vocab=11, dtype=torch.float64, seed=chunk)
    weights = torch.randn(2, 5, dtype=torch.float64)  # any upstream gradient
    h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
    h2, w2 = h.clone().requires_grad_(), w.clone().requires_grad_()
    fused = linear_sampled_token_logprobs(h1, w1, ids, temperature=0.7, chunk_size=chunk)
    naive = _naive(h2, w2, ids, 0.7)
    torch.testing.assert_close(fused, naive, atol=1e-12, rtol=0)
    (fused * weights).sum().backward()
    (naive * weights).sum().backward()
    assert h1.grad is not None and w1.grad is not None and h2.grad is not None and w2.grad is not None
    torch.testing.assert_close(h1.grad, h2.grad, atol=1e-12, rtol=0)
    torch.testing.assert_close(w1.grad, w2.grad, atol=1e-12, rtol=0)


def test_gradcheck() -> None:
    h, w, ids = _inputs((7,), hidden=3, vocab=5, dtype=torch.float64, seed=1)
    assert torch.autograd.gradcheck(
        lambda a, b: linear_sampled_token_logprobs(a, b, ids, temperature=1.3, chunk_size=2),
        (h.requires_grad_(), w.requires_grad_()),
    )


def test_fp32_matches_within_float_rounding_and_keeps_dtypes() -> None:
    h, w, ids = _inputs((64,), hidden=32, vocab=1000, dtype=torch.float32, seed=3)
    h.requires_grad_()
    w.requires_grad_()
    out = linear_sampled_token_logprobs(h, w, ids, chunk_size=16)
    assert out.dtype == torch.float32
    assert (out.detach() - _naive(h.detach(), w.detach(), ids, 1.0)).abs().max() < 1e-5
    out.sum().backward()
    assert h.grad is not None and h.grad.dtype == torch.float32
    assert w.grad is not None and w.grad.dtype == torch.float32


def test_bf16_compute_stays_close_and_the_weight_gradient_keeps_the_weight_dtype() -> None:
    h, w, ids = _inputs((32,), hidden=16, vocab=200, dtype=torch.float32, seed=4)
    w.requires_grad_()
    out = linear_sampled_token_logprobs(h, w, ids, chunk_size=8, compute_dtype=torch.bfloat16)
    assert out.dtype == torch.float32
    assert (out.detach() - _naive(h, w.detach(), ids, 1.0)).abs().max() < 0.1  # bf16 matmul spacing
    out.sum().backward()
    assert w.grad is not None and w.grad.dtype == torch.float32


def test_bad_shapes_and_settings_name_what_is_wrong() -> None:
    h, w, ids = _inputs((4,), hidden=3, vocab=5, dtype=torch.float32, seed=0)
    with pytest.raises(ValueError, match="agree on H"):
        linear_sampled_token_logprobs(h, w[:, :2], ids)
    with pytest.raises(ValueError, match="token_ids"):
        linear_sampled_token_logprobs(h, w, ids[:3])
    with pytest.raises(ValueError, match="temperature"):
        linear_sampled_token_logprobs(h, w, ids, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        linear_sampled_token_logprobs(h, w, ids, chunk_size=0)


def test_bench_from_hidden_states_compares_all_three_and_they_agree(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from pipeline.tools.bench.logprob_memory import format_hidden_report, main, run_from_hidden

    report = run_from_hidden(vocab=300, seq_len=40, hidden_size=8, repeats=1, chunk_size=16)
    assert list(report["variants"]) == ["naive", "chunked", "fused"]
    # (at this size the CPU peak reading is meaningless: freed heap memory is reused; see the bench)
    assert report["variants"]["naive"]["time_ratio"] == 1.0
    assert all(v["max_abs_diff"] <= 1e-5 for v in report["variants"].values())
    assert report["config"]["hidden"] == 8 and report["config"]["chunk_size"] == 16
    lines = format_hidden_report(report).splitlines()
    assert lines[0] == "from hidden states: T=40, H=8, V=300, forward + backward"
    assert [line.split()[0] for line in lines[2:5]] == ["naive", "chunked", "fused"]
    assert main(["--hidden", "8", "--vocab", "300", "--seq-len", "40", "--repeats", "1"]) == 0
    assert "from hidden states: T=40, H=8" in capsys.readouterr().out
