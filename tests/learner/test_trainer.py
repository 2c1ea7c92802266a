"""Batching (the next-token shift) and the training step on the tiny preset."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import torch

import learner.loss.terms as terms_module
from learner.batching import TrainSequence, pack_sequences
from learner.model.model_io import load_policy
from learner.step_input import build_step_input
from learner.trainer import Trainer
from pipeline.contracts.learner_config import LearnerConfig
from pipeline.contracts.schema import TRAJECTORY_SCHEMA, EpisodeSegment, segments_to_batch
from tests.helpers.configs import learner_cfg
from tests.helpers.train_groups import groups_of

PAD = 0


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Path) -> Path:
    return tiny_model_dir


@pytest.fixture
def policy(model_dir: Path) -> tuple[Any, Any]:
    torch.manual_seed(0)
    return load_policy(model_dir)


def _cfg(**overrides: Any) -> LearnerConfig:
    # The trainer's mechanics on the toy: no warm-up, the engine's log-probs as the old policy (the real-model
    # defaults' mismatch correction has tests of its own, tests/learner/test_learner_options.py).
    base: dict[str, Any] = {
        "lr": 1e-2,
        "mini_batches": 2,
        "device": "cpu",
        "warmup_steps": 0,
        "mismatch": {"proximal": "engine", "is_weights": "none"},
    }
    base.update(overrides)
    return learner_cfg(**base)


def _prompt_ids(tokenizer: Any) -> list[int]:
    messages = [{"role": "user", "content": "Guess my number from 1 to 16."}]
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@torch.no_grad()
def _logprobs_of(
    model: Any, token_ids: list[int], *, temperature: float = 1.0, start: int = 1
) -> list[float]:
    """log p(token_t | tokens_<t) under `model` for t >= start (0.0 before), one prefix forward per token."""
    out = [0.0] * start
    for t in range(start, len(token_ids)):
        logits = model(input_ids=torch.tensor([token_ids[:t]])).logits[0, -1].double() / temperature
        out.append(float(torch.log_softmax(logits, dim=-1)[token_ids[t]]))
    return out


def _episode(
    model: Any,
    prompt: list[int],
    action: list[int],
    *,
    group: str,
    index: int,
    outcome: float | None,
    turn_rewards: list[float] | None = None,
    finish_reason: str = "stop",
    temperature: float = 1.0,
) -> EpisodeSegment:
    """A one-turn episode whose engine log-probs come from `model` itself (behaviour = current policy)."""
    tokens = prompt + action
    n_prompt, n_action = len(prompt), len(action)
    full = _logprobs_of(model, tokens, temperature=temperature, start=n_prompt)
    return EpisodeSegment(
        episode_id=f"{group}-e{index}",
        group_id=group,
        task_id=f"task-{group}",
        env="guess-number",
        token_ids=tokens,
        prompt_len=n_prompt,
        loss_mask=[0] * n_prompt + [1] * n_action,
        logprobs=[0.0] * n_prompt + full[n_prompt:],
        turn_index=[-1] * n_prompt + [0] * n_action,
        versions=[-1] * n_prompt + [0] * n_action,
        turn_rewards=turn_rewards if turn_rewards is not None else [0.0],
        outcome=outcome,
        num_turns=1,
        finish_reason=finish_reason,
    )


def _ids(tokenizer: Any, text: str) -> int:
    ids = tokenizer.encode(text)
    assert len(ids) == 1, text
    return int(ids[0])


def _contrast_group(model: Any, tokenizer: Any, group: str, x: int, y: int) -> list[EpisodeSegment]:
    """Two episodes answering X (outcome 1) and two answering Y (outcome 0), each ending with <|im_end|>."""
    prompt, end = _prompt_ids(tokenizer), tokenizer.eos_token_id
    actions = [([x, end], 1.0), ([y, end], 0.0), ([x, end], 1.0), ([y, end], 0.0)]
    return [
        _episode(model, prompt, action, group=group, index=i, outcome=outcome)
        for i, (action, outcome) in enumerate(actions)
    ]


@torch.no_grad()
def _next_token_logprob(model: Any, prompt: list[int], token: int) -> float:
    logits = model(input_ids=torch.tensor([prompt])).logits[0, -1]
    return float(torch.log_softmax(logits.double(), dim=-1)[token])


def _weights(model: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --- batching -------------------------------------------------------------------------------------------


def test_pack_shifts_targets_and_per_token_fields_by_one() -> None:
    seq = TrainSequence(
        token_ids=[5, 6, 7, 8],
        loss_mask=[0, 0, 1, 1],
        old_logprobs=[0.0, 0.0, -1.0, -2.0],
        advantages=[0, 0, 0.5, 0.5],
    )
    short = TrainSequence(
        token_ids=[9, 10], loss_mask=[0, 1], old_logprobs=[0.0, -3.0], advantages=[0.0, -1.0]
    )
    batch = pack_sequences([seq, short], pad_id=PAD)
    assert batch.input_ids.tolist() == [[5, 6, 7], [9, PAD, PAD]]
    assert batch.targets.tolist() == [[6, 7, 8], [10, PAD, PAD]]
    assert batch.attention_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch.loss_mask.tolist() == [[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]]
    assert batch.old_logprobs.tolist() == [[0.0, -1.0, -2.0], [-3.0, 0.0, 0.0]]
    assert batch.advantages.tolist() == [[0.0, 0.5, 0.5], [-1.0, 0.0, 0.0]]
    assert batch.num_tokens == 4 and batch.num_loss_tokens == 3


def test_pack_zeroes_values_outside_the_loss_mask_even_nan() -> None:
    seq = TrainSequence(
        token_ids=[1, 2, 3],
        loss_mask=[1, 0, 1],
        old_logprobs=[-5.0, math.nan, -1.0],
        advantages=[9.0, math.nan, 2.0],
    )
    batch = pack_sequences([seq], pad_id=PAD)
    # Token 0 has no context, so its mask bit is dropped; the NaNs sit on a masked token.
    assert batch.loss_mask.tolist() == [[0.0, 1.0]]
    assert batch.old_logprobs.tolist() == [[0.0, -1.0]]
    assert batch.advantages.tolist() == [[0.0, 2.0]]


def test_train_sequence_rejects_mismatched_lengths() -> None:
    with pytest.raises(ValueError, match="advantages has 2 entries, expected 3"):
        TrainSequence(token_ids=[1, 2, 3], loss_mask=[0, 1, 1], old_logprobs=[0, 0, 0], advantages=[0, 0])


def test_packed_logits_score_the_next_token_exactly_as_one_position_at_a_time(
    policy: tuple[Any, Any],
) -> None:
    model, tokenizer = policy
    prompt = _prompt_ids(tokenizer)
    long_tokens = [*prompt, _ids(tokenizer, "12"), _ids(tokenizer, "higher"), tokenizer.eos_token_id]
    short_tokens = [*prompt[:5], _ids(tokenizer, "3")]
    seqs = [
        TrainSequence(t, [0] * (len(t) - 1) + [1], [0.0] * len(t), [0.0] * len(t))
        for t in (long_tokens, short_tokens)
    ]
    batch = pack_sequences(seqs, pad_id=tokenizer.pad_token_id)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        packed = (
            torch.log_softmax(logits.double(), dim=-1).gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1)
        )
    for row, tokens in enumerate((long_tokens, short_tokens)):
        expected = _logprobs_of(model, tokens)[1:]
        got = packed[row, : len(tokens) - 1].tolist()
        assert got == pytest.approx(expected, abs=1e-5)


# --- the training step ----------------------------------------------------------------------------------


def test_twenty_steps_raise_the_rewarded_token_and_lower_the_punished_one(policy: tuple[Any, Any]) -> None:
    model, tokenizer = policy
    # proximal = learner: the mismatch is measured at the start of the step, before either update.
    trainer = Trainer(model, _cfg(lr=3e-3, mini_batches=2, mismatch={"proximal": "learner"}), temperature=1.0)
    prompt = _prompt_ids(tokenizer)
    x, y = _ids(tokenizer, "12"), _ids(tokenizer, "3")
    before_x, before_y = _next_token_logprob(model, prompt, x), _next_token_logprob(model, prompt, y)
    for step in range(20):
        groups = [_contrast_group(model, tokenizer, f"s{step}g{g}", x, y) for g in range(2)]
        metrics = trainer.step(groups_of([ep for group in groups for ep in group]))
        assert metrics["num_sequences"] == 8.0
        assert metrics["optimizer_updates"] == 2.0
        # Behaviour log-probs came from this very model: the first mini-batch is exactly on-policy.
        assert metrics["mismatch_abs_mean"] < 1e-5
    after_x, after_y = _next_token_logprob(model, prompt, x), _next_token_logprob(model, prompt, y)
    # Measured (seed-0 tiny preset, lr 3e-3): log p(X) -6.86 -> -0.04, log p(Y) -6.50 -> -17.1.
    # The thresholds keep a wide margin for other torch builds.
    assert after_x - before_x > 4.0 and after_x > -1.0
    assert after_y - before_y < -5.0
    assert trainer.policy_version == 20
    assert trainer.optimizer_updates == 40


def test_metrics_report_the_step(policy: tuple[Any, Any]) -> None:
    model, tokenizer = policy
    trainer = Trainer(model, _cfg(mini_batches=2), temperature=1.0)
    episodes = _contrast_group(model, tokenizer, "g", _ids(tokenizer, "12"), _ids(tokenizer, "3"))
    metrics = trainer.step(groups_of(episodes))
    prompt_len = len(_prompt_ids(tokenizer))
    assert metrics["num_sequences"] == 4.0 and metrics["num_groups"] == 1.0
    assert metrics["tokens"] == 4 * (prompt_len + 1)  # every token but the last of each row is read
    assert metrics["loss_tokens"] == 8.0
    assert metrics["success_rate"] == 0.5
    assert metrics["reward_mean"] == 0.5
    # The first mini-batch is trained on the weights that sampled it (lag 0: numerics only, none here);
    # the second after the first update, on newer weights (lag >= 1).
    assert metrics["mismatch_abs_mean_lag0"] == pytest.approx(0.0, abs=1e-5)
    assert metrics["mismatch_abs_mean_lag1plus"] > 0.01
    assert metrics["mismatch_abs_mean"] == pytest.approx(metrics["mismatch_abs_mean_lag1plus"] / 2, rel=1e-5)
    assert metrics["mismatch_k3"] > 0.0
    assert metrics["ratio_min"] <= metrics["ratio_mean"] <= metrics["ratio_max"]
    assert metrics["lr"] == pytest.approx(1e-2)
    assert metrics["grad_norm"] > 0 and math.isfinite(metrics["loss"])
    assert 0.0 < metrics["entropy"] <= math.log(len(tokenizer)) + 1e-4
    assert metrics["tokens_per_s"] > 0 and metrics["step_time_s"] > 0
    assert metrics["policy_version"] == 1.0


def test_mismatch_reveals_a_temperature_different_from_the_sampling_one(policy: tuple[Any, Any]) -> None:
    model, tokenizer = policy
    prompt, end = _prompt_ids(tokenizer), tokenizer.eos_token_id
    episodes = [
        _episode(
            model,
            prompt,
            [_ids(tokenizer, t), end],
            group="g",
            index=i,
            outcome=float(i % 2),
            temperature=0.25,
        )
        for i, t in enumerate(["12", "3", "5", "8"])
    ]
    batch = segments_to_batch(episodes)
    same = Trainer(model, _cfg(lr=1e-9), temperature=0.25).step(groups_of(batch))
    other = Trainer(model, _cfg(lr=1e-9), temperature=1.0).step(groups_of(batch))
    assert same["mismatch_abs_mean"] < 1e-5
    assert other["mismatch_abs_mean"] > 0.1


def test_nan_logprob_on_a_model_token_rejects_the_row_and_trains_the_rest(policy: tuple[Any, Any]) -> None:
    model, tokenizer = policy
    episodes = _contrast_group(model, tokenizer, "g", _ids(tokenizer, "12"), _ids(tokenizer, "3"))
    episodes.append(
        _episode(model, _prompt_ids(tokenizer), [_ids(tokenizer, "7")], group="g", index=9, outcome=0.0)
    )
    columns = segments_to_batch(episodes).to_pydict()
    columns["logprobs"][-1][-1] = math.nan
    batch = pa.RecordBatch.from_pydict(columns, schema=TRAJECTORY_SCHEMA)
    trainer = Trainer(model, _cfg(), temperature=1.0)
    metrics = trainer.step(groups_of(batch))
    assert metrics["rejected_rows"] == 1.0
    assert metrics["num_sequences"] == 4.0
    assert [r.episode_id for r in trainer.last_rejected] == ["g-e9"]
    assert "logprobs" in trainer.last_rejected[0].reason


def test_all_zero_advantage_group_is_skipped_and_counted(policy: tuple[Any, Any]) -> None:
    model, tokenizer = policy
    prompt, end = _prompt_ids(tokenizer), tokenizer.eos_token_id
    solved = [
        _episode(model, prompt, [_ids(tokenizer, "12"), end], group="same", index=i, outcome=1.0)
        for i in range(3)
    ]
    trainer = Trainer(model, _cfg(), temperature=1.0)
    before = _weights(model)
    metrics = trainer.step(groups_of(solved))
    assert metrics["skipped_zero_adv_groups"] == 1.0
    assert metrics["num_sequences"] == 0.0 and metrics["optimizer_updates"] == 0.0
    assert _same_weights(before, _weights(model))
    assert trainer.policy_version == 0
    assert metrics["success_rate"] == 1.0  # accounting still sees the episodes


def test_entropy_bonus_still_reaches_a_group_whose_episodes_all_scored_the_same(
    policy: tuple[Any, Any],
) -> None:
    model, tokenizer = policy
    prompt, end = _prompt_ids(tokenizer), tokenizer.eos_token_id
    solved = [
        _episode(model, prompt, [_ids(tokenizer, "12"), end], group="same", index=i, outcome=1.0)
        for i in range(3)
    ]
    data = build_step_input(groups_of(solved), estimator="turn", gamma=1.0, lam=1.0, keep_zero_advantage=True)
    assert (data.skipped_zero_adv_groups, data.trained_groups, len(data.sequences)) == (1, 0, 3)
    assert all(a == 0.0 for seq in data.sequences for a in seq.advantages)

    trainer = Trainer(model, _cfg(entropy_coef=0.1, mini_batches=1), temperature=1.0)
    before = _weights(model)
    metrics = trainer.step(groups_of(solved))
    assert metrics["skipped_zero_adv_groups"] == 1.0 and metrics["optimizer_updates"] == 1.0
    assert not _same_weights(before, _weights(model))  # the entropy gradient alone moved the policy
    assert trainer.policy_version == 1


def test_advantage_norm_none_passes_reward_units_to_the_tokens(policy: tuple[Any, Any]) -> None:
    model, tokenizer = policy
    prompt, end = _prompt_ids(tokenizer), tokenizer.eos_token_id
    rows = [
        _episode(model, prompt, [_ids(tokenizer, "12"), end], group="g", index=i, outcome=outcome)
        for i, outcome in enumerate((1.0, 0.0, 0.0, 0.0))
    ]
    data = build_step_input(groups_of(rows), estimator="outcome", gamma=1.0, lam=1.0, norm="none")
    # Group mean 0.25: the winner gets 0.75, each loser -0.25, on every generated token, and 0 elsewhere.
    for seq, want in zip(data.sequences, (0.75, -0.25, -0.25, -0.25), strict=True):
        assert {a for a, m in zip(seq.advantages, seq.loss_mask, strict=True) if m} == {want}
        assert {a for a, m in zip(seq.advantages, seq.loss_mask, strict=True) if not m} == {0.0}


def test_untrainable_rows_are_counted_and_left_out(policy: tuple[Any, Any]) -> None:
    model, tokenizer = policy
    prompt, end = _prompt_ids(tokenizer), tokenizer.eos_token_id
    x, y = _ids(tokenizer, "12"), _ids(tokenizer, "3")
    rows = [
        _episode(model, prompt, [x, end], group="a", index=0, outcome=1.0),
        _episode(model, prompt, [y, end], group="a", index=1, outcome=None, finish_reason="env_error"),
        *_contrast_group(model, tokenizer, "b", x, y),
        _episode(model, prompt, [y, end], group="b", index=7, outcome=None, finish_reason="timeout"),
    ]
    groups = groups_of(rows)
    assert [g.group_id for g in groups] == ["b"]  # group "a" keeps one member: too_few_members
    data = build_step_input(groups, estimator="turn", gamma=1.0, lam=1.0)
    assert data.untrainable_rows == 1
    assert len(data.sequences) == 4 and data.trained_groups == 1


def test_segments_of_one_episode_share_its_turn_advantages(policy: tuple[Any, Any]) -> None:
    model, tokenizer = policy
    prompt, end = _prompt_ids(tokenizer), tokenizer.eos_token_id
    x, y = _ids(tokenizer, "12"), _ids(tokenizer, "3")
    rows = _contrast_group(model, tokenizer, "g", x, y)
    second = _episode(model, prompt, [y, end], group="g", index=0, outcome=1.0)
    second.segment = 1
    data = build_step_input(groups_of([*rows, second]), estimator="outcome", gamma=1.0, lam=1.0)
    # Sequences come per episode in first-appearance order, an episode's segments together.
    advantages = [seq.advantages for seq in data.sequences]
    assert len(advantages) == 5
    assert advantages[0][-1] > 0 and advantages[1][-1] == advantages[0][-1]  # both segments of g-e0
    assert advantages[2][-1] == advantages[2][-2] < 0  # g-e1: every token of its turn
    prompt_len = len(_prompt_ids(tokenizer))
    assert all(a == 0.0 for a in advantages[0][:prompt_len])


def test_non_finite_loss_skips_the_update_and_keeps_the_weights(
    policy: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    model, tokenizer = policy
    real_loss = terms_module.gspo_token_loss

    def poisoned(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss, stats = real_loss(*args, **kwargs)
        return loss * math.inf, stats

    monkeypatch.setattr(terms_module, "gspo_token_loss", poisoned)
    episodes = _contrast_group(model, tokenizer, "g", _ids(tokenizer, "12"), _ids(tokenizer, "3"))
    trainer = Trainer(model, _cfg(mini_batches=2), temperature=1.0)
    before = _weights(model)
    metrics = trainer.step(groups_of(episodes))
    assert metrics["skipped_steps_nonfinite"] == 2.0
    assert metrics["optimizer_updates"] == 0.0
    assert _same_weights(before, _weights(model))
    assert trainer.policy_version == 0
    assert trainer.optimizer.state_dict()["state"] == {}


def test_non_finite_gradient_skips_the_update_and_keeps_the_weights(policy: tuple[Any, Any]) -> None:
    model, tokenizer = policy
    episodes = _contrast_group(model, tokenizer, "g", _ids(tokenizer, "12"), _ids(tokenizer, "3"))
    trainer = Trainer(model, _cfg(mini_batches=1), temperature=1.0)
    handle = model.model.norm.weight.register_hook(lambda grad: grad * math.nan)
    before = _weights(model)
    try:
        metrics = trainer.step(groups_of(episodes))
    finally:
        handle.remove()
    assert metrics["skipped_steps_nonfinite"] == 1.0
    assert _same_weights(before, _weights(model))
    # The next clean step trains normally: no NaN was left behind in gradients or optimizer state.
    metrics = trainer.step(groups_of(episodes))
    assert metrics["optimizer_updates"] == 1.0 and metrics["skipped_steps_nonfinite"] == 0.0
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_grad_accumulation_merges_mini_batches_into_one_update(policy: tuple[Any, Any]) -> None:
    model, tokenizer = policy
    x, y = _ids(tokenizer, "12"), _ids(tokenizer, "3")
    episodes = [ep for g in range(2) for ep in _contrast_group(model, tokenizer, f"g{g}", x, y)]
    trainer = Trainer(model, _cfg(mini_batches=4, grad_accum=2), temperature=1.0)
    metrics = trainer.step(groups_of(episodes))
    assert metrics["optimizer_updates"] == 2.0
    assert metrics["num_sequences"] == 8.0


def test_accumulated_mini_batches_give_the_whole_batch_loss_and_gradient(model_dir: Path) -> None:
    first, tokenizer = load_policy(model_dir)
    second, _ = load_policy(model_dir)
    x, y = _ids(tokenizer, "12"), _ids(tokenizer, "3")
    batch = segments_to_batch(_contrast_group(first, tokenizer, "g", x, y))
    whole = Trainer(first, _cfg(mini_batches=1), temperature=1.0).step(groups_of(batch))
    accumulated = Trainer(second, _cfg(mini_batches=4, grad_accum=4), temperature=1.0).step(groups_of(batch))
    assert accumulated["optimizer_updates"] == whole["optimizer_updates"] == 1.0
    # The contrast group's loss terms (~1 each) cancel to ~0: fp32 rounding of other batch shapes is ~1e-7.
    assert accumulated["loss"] == pytest.approx(whole["loss"], rel=1e-5, abs=1e-6)
    assert accumulated["grad_norm"] == pytest.approx(whole["grad_norm"], rel=1e-5)


def test_same_seed_same_updates(model_dir: Path) -> None:
    first, tokenizer = load_policy(model_dir)
    second, _ = load_policy(model_dir)
    x, y = _ids(tokenizer, "12"), _ids(tokenizer, "3")
    batch = segments_to_batch(
        [ep for g in range(2) for ep in _contrast_group(first, tokenizer, f"g{g}", x, y)]
    )
    initial = _weights(first)
    trainers = [Trainer(m, _cfg(mini_batches=4), temperature=1.0) for m in (first, second)]
    for trainer in trainers:
        for _ in range(2):
            trainer.step(groups_of(batch))
    assert not _same_weights(initial, _weights(first))  # the updates did change the weights
    assert _same_weights(_weights(first), _weights(second))


def test_warmup_scales_the_learning_rate(policy: tuple[Any, Any]) -> None:
    model, tokenizer = policy
    episodes = _contrast_group(model, tokenizer, "g", _ids(tokenizer, "12"), _ids(tokenizer, "3"))
    trainer = Trainer(model, _cfg(lr=1e-2, mini_batches=1, warmup_steps=4), temperature=1.0)
    rates = [trainer.step(groups_of(episodes))["lr"] for _ in range(5)]
    assert rates == pytest.approx([2.5e-3, 5e-3, 7.5e-3, 1e-2, 1e-2])


def test_temperature_must_be_positive(policy: tuple[Any, Any]) -> None:
    with pytest.raises(ValueError, match="temperature"):
        Trainer(policy[0], _cfg(), temperature=0.0)


def test_shuffle_seed_sets_the_mini_batch_generator(policy: tuple[Any, Any]) -> None:
    model = policy[0]
    cfg = _cfg()
    five = Trainer(model, cfg, temperature=1.0, seed=5).generator.get_state()
    again = Trainer(model, cfg, temperature=1.0, seed=5).generator.get_state()
    default = Trainer(model, cfg, temperature=1.0).generator.get_state()
    assert torch.equal(five, again)
    assert torch.equal(default, torch.Generator().manual_seed(0).get_state())
    assert not torch.equal(five, default)


def test_generated_tokens_of_a_turn_without_a_reward_reject_the_row(policy: tuple[Any, Any]) -> None:
    model, tokenizer = policy
    prompt, end = _prompt_ids(tokenizer), tokenizer.eos_token_id
    x, y = _ids(tokenizer, "12"), _ids(tokenizer, "3")
    # The schema allows turn 0 on an episode that reports no turns; no advantage exists for its tokens.
    orphan = _episode(model, prompt, [x, end], group="g", index=0, outcome=1.0, turn_rewards=[])
    orphan.num_turns = 0
    rows = [orphan, *(_episode(model, prompt, [y, end], group="g", index=i, outcome=0.0) for i in (1, 2))]
    data = build_step_input(groups_of(rows), estimator="turn", gamma=1.0, lam=1.0)
    assert [r.episode_id for r in data.rejected] == ["g-e0"]
    assert "turn index 0" in data.rejected[0].reason
    assert len(data.sequences) == 2


def test_generated_token_entropy_is_exact_and_ignores_masked_positions() -> None:
    from learner.loss.terms import generated_token_entropy

    vocab = 8
    logits = torch.zeros(2, 3, vocab)  # uniform: entropy log(8) at temperature 1
    logits[1, 2] = torch.tensor([50.0] + [0.0] * (vocab - 1))  # near one-hot, but masked out below
    logits.requires_grad_(True)
    mask = torch.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    ent = generated_token_entropy(logits[mask > 0], temperature=1.0)
    assert float(ent.detach()) == pytest.approx(math.log(vocab), abs=1e-6)
    ent.backward()
    assert logits.grad is not None and torch.all(logits.grad[1, 2] == 0) and torch.all(logits.grad[0, 0] == 0)
    none = generated_token_entropy(logits[torch.zeros(2, 3) > 0], temperature=1.0)
    assert float(none.detach()) == 0.0


def _two_turn(
    first: int, second: int, *, index: int, outcome: float, rewards: tuple[float, float]
) -> EpisodeSegment:
    """A two-turn guess-number row from token ids alone (the anchor estimator needs no log-probs)."""
    prompt, context = [1, 2, 3], [7, 8]
    tokens = [*prompt, first, *context, second]
    return EpisodeSegment(
        episode_id=f"g-e{index}",
        group_id="g",
        task_id="task-g",
        env="guess-number",
        token_ids=tokens,
        prompt_len=3,
        loss_mask=[0, 0, 0, 1, 0, 0, 1],
        logprobs=[0.0, 0.0, 0.0, -1.0, 0.0, 0.0, -1.0],
        turn_index=[-1, -1, -1, 0, 0, 0, 1],
        versions=[-1, -1, -1, 0, -1, -1, 0],
        turn_rewards=list(rewards),
        outcome=outcome,
        num_turns=2,
        finish_reason="stop",
    )


def test_anchor_estimator_compares_second_turns_only_with_rows_of_the_same_history() -> None:
    # e0/e1 opened with token 40, e2/e3 with 50; only the second turn's reward differs within each pair.
    rows = [
        _two_turn(40, 60, index=0, outcome=0.0, rewards=(0.0, 0.2)),
        _two_turn(40, 61, index=1, outcome=0.0, rewards=(0.0, 0.0)),
        _two_turn(50, 60, index=2, outcome=0.0, rewards=(0.0, 0.9)),
        _two_turn(50, 61, index=3, outcome=0.0, rewards=(0.0, 0.7)),
    ]
    data = build_step_input(groups_of(rows), estimator="anchor", gamma=0.0, lam=1.0)
    second_turn = [seq.advantages[-1] for seq in data.sequences]
    # Same-history pairs: +0.2 / -0.2 and +0.2 / -0.2 (a batch-wide baseline would make e0, e1 negative).
    assert second_turn[0] == pytest.approx(second_turn[2]) and second_turn[0] > 0
    assert second_turn[1] == pytest.approx(second_turn[3]) == pytest.approx(-second_turn[0])
    assert all(seq.advantages[3] == 0.0 for seq in data.sequences)  # first turns: nothing to tell apart


def test_entropy_coef_falls_linearly_over_decay_steps_and_follows_restored_counters(
    policy: tuple[Any, Any],
) -> None:
    model, _ = policy
    trainer = Trainer(model, _cfg(entropy_coef=0.08, entropy_decay_steps=4), temperature=1.0)
    coefs = []
    for updates in range(6):
        trainer.optimizer_updates = updates
        coefs.append(trainer.entropy_coef)
    assert coefs == pytest.approx([0.08, 0.06, 0.04, 0.02, 0.0, 0.0])
    resumed = Trainer(model, _cfg(entropy_coef=0.08, entropy_decay_steps=4), temperature=1.0)
    resumed.load_counters({"steps": 3, "optimizer_updates": 3, "policy_version": 3})
    assert resumed.entropy_coef == pytest.approx(0.02)
    constant = Trainer(model, _cfg(entropy_coef=0.08), temperature=1.0)
    constant.optimizer_updates = 10_000
    assert constant.entropy_coef == 0.08


def test_action_prior_needs_action_tokens_and_decays_like_the_entropy_bonus(policy: tuple[Any, Any]) -> None:
    model, _ = policy
    with pytest.raises(ValueError, match="action_prior_coef"):
        Trainer(model, _cfg(action_prior_coef=0.2), temperature=1.0)
    trainer = Trainer(
        model, _cfg(action_prior_coef=0.2, action_prior_decay_steps=4), temperature=1.0, action_token_ids=[5]
    )
    coefs = []
    for updates in range(6):
        trainer.optimizer_updates = updates
        coefs.append(trainer.action_prior_coef)
    assert coefs == pytest.approx([0.2, 0.15, 0.1, 0.05, 0.0, 0.0])
    off = Trainer(model, _cfg(), temperature=1.0)
    assert off.action_prior_coef == 0.0 and off.step([])["action_prior_coef"] == 0.0


def test_action_prior_raises_every_answer_in_a_group_without_signal(policy: tuple[Any, Any]) -> None:
    from learner.loss.action_prior import action_token_ids

    model, tokenizer = policy
    prompt, end = _prompt_ids(tokenizer), tokenizer.eos_token_id
    answers = action_token_ids(tokenizer, [str(n) for n in range(1, 17)])
    failed = [
        _episode(model, prompt, [_ids(tokenizer, "12"), end], group="same", index=i, outcome=0.0)
        for i in range(4)
    ]

    @torch.no_grad()
    def answer_logprobs() -> torch.Tensor:
        logits = model(input_ids=torch.tensor([prompt])).logits[0, -1].float()
        return torch.log_softmax(logits, dim=-1)[answers]

    before = answer_logprobs()
    cfg = _cfg(action_prior_coef=1.0, mini_batches=1, lr=1e-3)
    trainer = Trainer(model, cfg, temperature=1.0, action_token_ids=answers)
    metrics = trainer.step(groups_of(failed))
    # All four failed alike: no policy-gradient signal, yet the group stays for the prior and moves it.
    assert metrics["skipped_zero_adv_groups"] == 1.0 and metrics["optimizer_updates"] == 1.0
    after = answer_logprobs()
    assert float(after.mean()) > float(before.mean())
    assert float(after.exp().sum()) > float(before.exp().sum())  # mass moved onto the answers


def test_embedding_weight_decay_gets_its_own_group_and_only_then(policy: tuple[Any, Any]) -> None:
    model, _ = policy
    embedding = model.get_input_embeddings().weight
    assert model.get_output_embeddings().weight is embedding  # the tiny preset ties them
    trainer = Trainer(model, _cfg(weight_decay=0.01, embedding_weight_decay=1.0), temperature=1.0)
    first, rest = trainer.optimizer.param_groups
    assert [p is embedding for p in first["params"]] == [True] and first["weight_decay"] == 1.0
    assert rest["weight_decay"] == 0.01 and all(p is not embedding for p in rest["params"])
    assert len(first["params"]) + len(rest["params"]) == len(list(model.parameters()))
    # Unset or equal: one group, the layout of checkpoints written before the option existed.
    for value in (None, 0.01):
        (group,) = Trainer(
            model, _cfg(weight_decay=0.01, embedding_weight_decay=value), temperature=1.0
        ).optimizer.param_groups
        assert group["weight_decay"] == 0.01


def test_embedding_weight_decay_shrinks_only_the_embeddings(policy: tuple[Any, Any]) -> None:
    model, _ = policy
    trainer = Trainer(model, _cfg(lr=0.1, embedding_weight_decay=0.5), temperature=1.0)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # no gradient: whatever moves is the decay
    trainer.optimizer.step()
    for name, p in model.named_parameters():
        if p is model.get_input_embeddings().weight:
            torch.testing.assert_close(p.detach(), before[name] * (1 - 0.1 * 0.5))
        else:
            assert torch.equal(p.detach(), before[name]), name


def test_one_process_updates_with_the_fused_adamw_kernel_and_it_is_adamw(policy: tuple[Any, Any]) -> None:
    """Fused in one process (learner.trainer: 7x faster on a CPU thread), and the same three updates as
    torch's reference AdamW on the trainer's parameter groups (the embeddings' decay apart), to rounding."""
    import copy

    model, _ = policy
    trainer = Trainer(model, _cfg(weight_decay=0.1, embedding_weight_decay=0.0), temperature=1.0)
    assert trainer.optimizer.defaults["fused"] is True
    assert [g["weight_decay"] for g in trainer.optimizer.param_groups] == [0.0, 0.1]
    initial, twin = copy.deepcopy(model), copy.deepcopy(model)
    name_of = {id(p): name for name, p in model.named_parameters()}
    defaults = trainer.optimizer.defaults
    reference = torch.optim.AdamW(
        [
            {
                "params": [twin.get_parameter(name_of[id(p)]) for p in g["params"]],
                "weight_decay": g["weight_decay"],
            }
            for g in trainer.optimizer.param_groups
        ],
        lr=defaults["lr"],
        betas=defaults["betas"],
        eps=defaults["eps"],
        foreach=False,
    )
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        for name, p in model.named_parameters():
            grad = torch.randn(p.shape, generator=generator)
            p.grad, twin.get_parameter(name).grad = grad.clone(), grad.clone()
        trainer.optimizer.step()
        reference.step()

    def max_diff(a: Any, b: Any) -> float:
        return max(
            float((p - q).detach().abs().max()) for p, q in zip(a.parameters(), b.parameters(), strict=True)
        )

    assert max_diff(model, initial) > 1e-2  # three updates of lr 1e-2 moved the weights
    assert max_diff(model, twin) < 1e-6
