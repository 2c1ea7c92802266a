"""A group's shared prompt run once (learner.shared_prefix): the same hidden states and gradients where
anything is scored, the plain forward where nothing is shared, and the same training step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from learner.model.model_io import load_policy
from learner.policy_forward import final_hidden_states
from learner.shared_prefix import shared_prefix_hidden_states, split_columns
from learner.trainer import Trainer
from tests.helpers.configs import learner_cfg
from tests.helpers.train_groups import groups_of

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _batch(rows: list[tuple[list[int], list[int], list[int]]]) -> tuple[torch.Tensor, ...]:
    """(input_ids, attention_mask, scored) of (prompt, generated, mask over generated) rows, right-padded
    and shifted as learner.batching packs them."""
    width = max(len(p) + len(g) for p, g, _ in rows) - 1
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    attention = torch.zeros_like(ids)
    scored = torch.zeros(len(rows), width, dtype=torch.bool)
    for r, (prompt, generated, mask) in enumerate(rows):
        tokens = prompt + generated
        ids[r, : len(tokens) - 1] = torch.tensor(tokens[:-1])
        attention[r, : len(tokens) - 1] = 1
        for j, m in enumerate(mask):
            scored[r, len(prompt) - 1 + j] = bool(m)
    return ids, attention, scored


def _rows(vocab: int) -> list[tuple[list[int], list[int], list[int]]]:
    g = torch.Generator().manual_seed(0)

    def draw(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=g).tolist()

    rows = []
    for prompt_len in (7, 11, 4):  # three groups with prompts of different lengths
        prompt = draw(prompt_len)
        for k in range(3):
            generated = draw(2 + 2 * k)
            # the third member is two turns: generated, an env reply (not scored), generated again
            mask = [1] * len(generated) if k < 2 else [1, 1, 0, 0, 1, 1]
            rows.append((prompt, generated, mask))
    return rows


def test_shared_prefixes_give_the_plain_hidden_states_and_gradients(tiny_model_dir: Path) -> None:
    model, _ = load_policy(tiny_model_dir)
    ids, attention, scored = _batch(_rows(model.config.vocab_size))
    plain = final_hidden_states(model, ids, attention)
    (plain[scored].sum()).backward()
    plain_grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    shared = shared_prefix_hidden_states(model.base_model, ids, attention, scored)
    assert shared is not None
    (shared[scored].sum()).backward()
    shared_grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert torch.allclose(shared[scored], plain[scored], atol=1e-5)
    split = split_columns(attention, scored)
    before = torch.arange(ids.shape[1]).unsqueeze(0) < split.unsqueeze(1)
    assert (shared[before] == 0.0).all()  # the prefix's own columns are never read
    for mine, theirs in zip(shared_grads, plain_grads, strict=True):
        # fp32 sums in other orders: relative to the gradient's own scale
        assert (mine - theirs).abs().max() <= 1e-5 * theirs.abs().max()


def test_nothing_shared_or_a_checkpointed_model_takes_the_plain_forward(tiny_model_dir: Path) -> None:
    model, _ = load_policy(tiny_model_dir)
    rows = _rows(model.config.vocab_size)
    distinct = [rows[0], rows[3], rows[6]]  # one member of each group: no prefix in common
    assert shared_prefix_hidden_states(model.base_model, *_batch(distinct)) is None
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert shared_prefix_hidden_states(model.base_model, *_batch(rows)) is None


def _group(tokenizer: Any, name: str) -> list[Any]:
    from pipeline.contracts.schema import EpisodeSegment

    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Guess my number from 1 to 16."}],
        tokenize=True,
        add_generation_prompt=True,
    )
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    episodes = []
    for i, answer in enumerate(("8", "12", "3", "16")):
        generated = [*tokenizer.encode(answer, add_special_tokens=False), tokenizer.eos_token_id]
        n, k = len(prompt), len(generated)
        episodes.append(
            EpisodeSegment(
                episode_id=f"{name}-{i}",
                group_id=name,
                task_id=name,
                env="guess-number",
                token_ids=prompt + generated,
                prompt_len=n,
                loss_mask=[0] * n + [1] * k,
                logprobs=[0.0] * n + [-3.0] * k,
                turn_index=[-1] * n + [0] * k,
                versions=[-1] * n + [0] * k,
                turn_rewards=[0.0],
                outcome=float(i % 2),
                num_turns=1,
                finish_reason="stop",
            )
        )
    return episodes


def test_a_step_with_shared_prefixes_is_the_plain_step(tiny_model_dir: Path) -> None:
    results, weights = [], []
    for shared in (False, True):
        model, tokenizer = load_policy(tiny_model_dir)
        cfg = learner_cfg(lr=1e-3, warmup_steps=0, mini_batches=1, shared_prefix=shared, entropy_coef=0.1)
        groups = groups_of([*_group(tokenizer, "a"), *_group(tokenizer, "b")])
        results.append(Trainer(model, cfg, temperature=1.0).step(groups))
        weights.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    for key in ("loss", "entropy", "grad_norm", "mismatch_abs_mean"):
        assert results[1][key] == pytest.approx(results[0][key], rel=1e-5, abs=1e-6), key
    assert (weights[1] - weights[0]).abs().max() < 1e-4  # AdamW's first step: ~lr x rounding at most
