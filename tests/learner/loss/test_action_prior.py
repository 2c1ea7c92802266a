"""The action prior: which tokens it covers, where it applies, its exact value and its gradient."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from learner.loss.action_prior import action_prior_loss, action_token_ids, turn_start_mask
from learner.model.model_io import load_policy


class SplittingCodec:
    """A tokenizer that splits every character off, spaces included (digits as Qwen's tokenizer does)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, token_ids: list[int]) -> str:
        return "".join(chr(t) for t in token_ids)


def test_tiny_tokenizer_covers_each_number_with_and_without_a_space(tiny_model_dir: Path) -> None:
    _, tokenizer = load_policy(tiny_model_dir)
    ids = action_token_ids(tokenizer, [str(n) for n in range(1, 17)])
    assert len(ids) == 32 and ids == sorted(ids)
    words = sorted(tokenizer.decode([t]) for t in ids)
    assert words == sorted([str(n) for n in range(1, 17)] + [f" {n}" for n in range(1, 17)])


def test_a_split_off_space_is_skipped_for_the_first_visible_token() -> None:
    # "16" and " 16" both start with "1"; "7" and " 7" with "7": the bare space is never an action token.
    assert action_token_ids(SplittingCodec(), ["16", "7"]) == [ord("1"), ord("7")]


def test_hints_without_a_visible_token_are_an_error() -> None:
    with pytest.raises(ValueError, match="no visible token"):
        action_token_ids(SplittingCodec(), ["  "])


def test_turn_starts_are_the_first_generated_position_of_each_span() -> None:
    mask = torch.tensor([[0, 1, 1, 0, 1, 0], [1, 1, 0, 0, 1, 1]], dtype=torch.float32)
    assert turn_start_mask(mask).tolist() == [
        [False, True, False, False, True, False],
        [True, False, False, False, True, False],
    ]


def test_loss_is_the_cross_entropy_of_uniform_actions_at_turn_starts_only() -> None:
    logits = torch.zeros(1, 3, 4)
    logits[0, 0] = torch.tensor([0.0, math.log(2.0), 0.0, 0.0])  # p = (1, 2, 1, 1) / 5 at the turn start
    logits[0, 1] = torch.tensor([0.0, 50.0, -50.0, 0.0])  # inside the turn: must not count
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    got = action_prior_loss(logits, mask, torch.tensor([1, 3]), temperature=1.0)
    assert float(got.detach()) == pytest.approx(-(math.log(2 / 5) + math.log(1 / 5)) / 2, abs=1e-6)
    # Temperature divides the logits first: at T = 2 the start row is (0, ln2/2, 0, 0).
    scaled = torch.log_softmax(torch.tensor([0.0, math.log(2.0) / 2, 0.0, 0.0]), dim=-1)
    want = -(scaled[1] + scaled[3]) / 2
    got_t2 = action_prior_loss(logits, mask, torch.tensor([1, 3]), temperature=2.0)
    assert float(got_t2.detach()) == pytest.approx(float(want), abs=1e-6)


def test_gradient_on_an_unlikely_answer_does_not_vanish_unlike_the_entropy_bonus() -> None:
    # The answer token 2 sits 25 nats below the favourite: p ~ 1e-11.
    row = torch.tensor([[[25.0, 0.0, 0.0, 0.0]]], requires_grad=True)
    mask = torch.tensor([[1.0]])
    action_prior_loss(row, mask, torch.tensor([0, 2]), temperature=1.0).backward()
    assert row.grad is not None
    p = torch.softmax(row.detach()[0, 0], dim=-1)
    # d/dz_j of -(1/|A|) sum_A log p = p_j - [j in A] / |A|: the unlikely answer gets -1/2 + 1e-11.
    want = p - torch.tensor([0.5, 0.0, 0.5, 0.0])
    assert row.grad[0, 0].tolist() == pytest.approx(want.tolist(), abs=1e-6)
    assert float(row.grad[0, 0, 2]) == pytest.approx(-0.5, abs=1e-6)

    entropy_row = row.detach().clone().requires_grad_(True)
    logp = torch.log_softmax(entropy_row[0, 0], dim=-1)
    (logp.exp() * logp).sum().backward()  # minus the entropy, the bonus's loss term
    assert entropy_row.grad is not None and abs(float(entropy_row.grad[0, 0, 2])) < 1e-8


def test_a_batch_without_generated_tokens_gives_a_differentiable_zero() -> None:
    logits = torch.randn(2, 3, 5, requires_grad=True)
    got = action_prior_loss(logits, torch.zeros(2, 3), torch.tensor([1]), temperature=1.0)
    got.backward()
    assert float(got.detach()) == 0.0 and logits.grad is not None and float(logits.grad.abs().sum()) == 0.0
