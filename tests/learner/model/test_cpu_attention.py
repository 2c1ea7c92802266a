"""learner.model.cpu_attention: the written-out attention computes what SDPA computes (outputs and
gradients, grouped heads, masks, causal without a mask), long shapes go to SDPA, and a policy loaded
with it gives SDPA's hidden states on the plain and the shared-prefix path."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from learner.model import cpu_attention
from learner.model.cpu_attention import (
    ATTENTION,
    MATH_SCORES,
    attention_implementation,
    math_attention,
)
from learner.model.cpu_attention import cpu_attention as attend
from learner.model.model_io import load_policy
from learner.policy_forward import final_hidden_states
from learner.policy_setup import build_policy
from learner.shared_prefix import shared_prefix_hidden_states
from pipeline.contracts.config import load_config
from tests.learner.test_shared_prefix import _batch, _rows

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _qkv(heads: int = 4, kv_heads: int = 2, q_len: int = 5, k_len: int = 8) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    shapes = ((2, heads, q_len, 16), (2, kv_heads, k_len, 16), (2, kv_heads, k_len, 16))
    return tuple(torch.randn(s, generator=g, dtype=torch.float64, requires_grad=True) for s in shapes)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: object) -> torch.Tensor:
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, **kw)  # type: ignore[arg-type]


def _grads(out: torch.Tensor, *leaves: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad(out.square().sum(), leaves))


def test_a_boolean_mask_with_grouped_heads_gives_sdpas_output_and_gradients() -> None:
    q, k, v = _qkv()
    mask = torch.ones(5, 8, dtype=torch.bool).tril(3).expand(2, 1, 5, 8).clone()
    mask[1, :, :, :2] = False  # row 1's first two keys are padding
    got, want = math_attention(q, k, v, mask, 0.25), _sdpa(q, k, v, attn_mask=mask, scale=0.25)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    for a, b in zip(_grads(got, q, k, v), _grads(want, q, k, v), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_no_mask_is_causal_with_the_queries_at_the_last_keys() -> None:
    q, k, v = _qkv(q_len=3, k_len=7)
    explicit = torch.ones(3, 7, dtype=torch.bool).tril(4)
    torch.testing.assert_close(
        math_attention(q, k, v, None, 0.25), _sdpa(q, k, v, attn_mask=explicit, scale=0.25)
    )
    one = _qkv(q_len=1, k_len=7)  # a single query attends to every key
    torch.testing.assert_close(
        math_attention(*one, None, 0.25), _sdpa(*one, scale=0.25), rtol=1e-10, atol=1e-12
    )


def test_a_row_that_may_attend_to_nothing_stays_finite() -> None:
    q, k, v = _qkv(q_len=2, k_len=3)
    mask = torch.zeros(2, 1, 2, 3, dtype=torch.bool)
    assert torch.isfinite(math_attention(q, k, v, mask, 0.25)).all()


def test_the_dispatch_keeps_short_shapes_and_hands_long_ones_to_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    module = SimpleNamespace(training=True, is_causal=True, num_key_value_groups=2)
    q, k, v = (t.detach().float() for t in _qkv())
    out, weights = attend(module, q, k, v, None, scaling=0.25)
    assert weights is None and out.shape == (2, 5, 4, 16)  # transformers' (B, Tq, H, D)
    torch.testing.assert_close(out, math_attention(q, k, v, None, 0.25).transpose(1, 2))

    called = []
    monkeypatch.setattr(
        "transformers.integrations.sdpa_attention.sdpa_attention_forward",
        lambda *a, **kw: called.append(a[1].shape) or (a[1].transpose(1, 2), None),
    )
    monkeypatch.setattr(cpu_attention, "MATH_SCORES", 5 * 8 - 1)
    attend(module, q, k, v, None, scaling=0.25)
    assert called == [q.shape]
    called.clear()
    monkeypatch.setattr(cpu_attention, "MATH_SCORES", MATH_SCORES)
    attend(module, q, k, v, None, dropout=0.1, scaling=0.25)  # dropout: only SDPA applies it
    assert called == [q.shape]


def test_a_float_mask_is_refused_by_name() -> None:
    module = SimpleNamespace(training=False)
    q, k, v = (t.detach() for t in _qkv())
    with pytest.raises(TypeError, match=f"{ATTENTION} takes boolean masks"):
        attend(module, q, k, v, torch.zeros(2, 1, 5, 8, dtype=torch.float64))


def test_the_cpu_gets_it_and_other_devices_keep_sdpa() -> None:
    assert attention_implementation(torch.device("cpu")) == ATTENTION
    assert attention_implementation(torch.device("cuda")) == "sdpa"


def test_the_learner_builds_its_policy_with_it_on_the_cpu(tiny_model_dir: Path) -> None:
    cfg = load_config(None, ["learner.device=cpu", "learner.threads=1"])
    policy = build_policy(cfg, tiny_model_dir)
    assert policy.trainer.model.config._attn_implementation == ATTENTION


def test_it_gives_sdpas_hidden_states_plain_and_with_shared_prefixes(tiny_model_dir: Path) -> None:
    model, _ = load_policy(tiny_model_dir)
    model.set_attn_implementation(attention_implementation(torch.device("cpu")))
    reference, _ = load_policy(tiny_model_dir)
    assert reference.config._attn_implementation == "sdpa"
    ids, attention, scored = _batch(_rows(model.config.vocab_size))
    torch.testing.assert_close(
        final_hidden_states(model, ids, attention)[attention.bool()],
        final_hidden_states(reference, ids, attention)[attention.bool()],
        rtol=1e-5,
        atol=1e-5,
    )
    got = shared_prefix_hidden_states(model.base_model, ids, attention, scored)
    want = shared_prefix_hidden_states(reference.base_model, ids, attention, scored)
    assert got is not None and want is not None
    torch.testing.assert_close(got[scored], want[scored], rtol=1e-5, atol=1e-5)
