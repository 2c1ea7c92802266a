"""Two ways the learner's step does less work for the same numbers: the first update's training forward is
its proximal forward (learner.trainer, `proximal_from_first_forward`), and frozen linear weights are cast
to the autocast dtype once (learner.model.frozen_casts, also where the fused head reads them). Each is
compared bit for bit with the work it saves."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from learner.model.frozen_casts import cache_frozen_casts, weight_in
from learner.model.lora import apply_lora
from learner.model.model_io import load_policy
from learner.trainer import Trainer
from pipeline.contracts.learner_config import LoraConfig
from pipeline.contracts.schema import segments_to_batch
from tests.helpers.configs import learner_cfg
from tests.helpers.train_groups import groups_of, one_turn_row

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _batch(groups: int = 2, members: int = 4) -> Any:
    rows = []
    for g in range(groups):
        for i in range(members):
            row = one_turn_row(f"g{g}", i, version=0, outcome=float(i % 2))
            rows.append(row)
    return segments_to_batch(rows)


def _trainer(model_dir: Path, *, reuse: bool, **cfg: Any) -> Trainer:
    torch.manual_seed(0)
    model, _ = load_policy(model_dir)
    options: dict[str, Any] = {"lr": 1e-2, "device": "cpu", "warmup_steps": 0, "mini_batches": 2}
    options.update(cfg)
    trainer = Trainer(model, learner_cfg(**options), temperature=1.0, seed=3)
    trainer.proximal_from_first_forward = reuse and trainer.proximal_from_first_forward
    return trainer


def _state(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


@pytest.mark.parametrize(
    "options",
    [
        {"mini_batches": 2},
        {"mini_batches": 4, "grad_accum": 2},
        {"mini_batches": 2, "precision": "bf16-mixed"},
        {"mini_batches": 2, "mismatch": {"proximal": "learner", "is_weights": "sequence"}},
    ],
    ids=["two-updates", "accumulated-window", "bf16-mixed", "sequence-weights"],
)
def test_the_first_windows_proximal_from_its_training_forward_changes_no_number(
    tiny_model_dir: Path, options: dict[str, Any]
) -> None:
    batch = _batch()
    reused, separate = (
        _trainer(tiny_model_dir, reuse=True, **options),
        _trainer(tiny_model_dir, reuse=False, **options),
    )
    assert reused.proximal_from_first_forward and not separate.proximal_from_first_forward
    for _ in range(2):
        a = reused.step(groups_of(batch))
        b = separate.step(groups_of(batch))
        assert {k: v for k, v in a.items() if k not in ("tokens_per_s", "step_time_s")} == {
            k: v for k, v in b.items() if k not in ("tokens_per_s", "step_time_s")
        }
    first, second = _state(reused), _state(separate)
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_rejection_keeps_the_separate_proximal_pass(tiny_model_dir: Path) -> None:
    # The window's token counts normalise its loss and must be known before its first forward; a rejection
    # mask changes them, so the proximal pass stays ahead of training.
    trainer = _trainer(
        tiny_model_dir,
        reuse=True,
        mismatch={"proximal": "learner", "reject": "token", "reject_band": (0.5, 2.0)},
    )
    assert not trainer.proximal_from_first_forward
    engine = _trainer(tiny_model_dir, reuse=True, mismatch={"proximal": "engine", "is_weights": "none"})
    assert not engine.proximal_from_first_forward


def test_a_frozen_linear_under_autocast_computes_what_autocast_computes(tiny_model_dir: Path) -> None:
    torch.manual_seed(0)
    plain, _ = load_policy(tiny_model_dir)
    cached, _ = load_policy(tiny_model_dir)
    policy = apply_lora(cached, LoraConfig(enabled=True), seed=0)
    reference = apply_lora(plain, LoraConfig(enabled=True), seed=0)
    frozen = [m for m in policy.model.modules() if type(m) is torch.nn.Linear and not m.weight.requires_grad]
    assert cache_frozen_casts(policy.model, torch.bfloat16) == len(frozen) > 0
    ids = torch.randint(1, 100, (2, 12))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = policy.model(input_ids=ids).logits
        want = reference.model(input_ids=ids).logits
    assert torch.equal(got, want)
    # Outside autocast the layers run on their own fp32 weights, as before.
    assert torch.equal(policy.model(input_ids=ids).logits, reference.model(input_ids=ids).logits)


def test_a_cached_cast_follows_a_changed_weight(tiny_model_dir: Path) -> None:
    layer = torch.nn.Linear(8, 4).requires_grad_(False)
    cache_frozen_casts(layer, torch.bfloat16)
    x = torch.randn(3, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        before = layer(x)
        with torch.no_grad():
            layer.weight.mul_(2.0)  # a load into the parameter (a restored checkpoint) bumps its version
        after = layer(x)
        expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
    assert not torch.equal(before, after)
    assert torch.equal(after, expected)


def test_trainable_layers_and_layers_already_in_the_compute_dtype_are_left_alone() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4).requires_grad_(False))
    model.append(torch.nn.Linear(4, 4).to(torch.bfloat16).requires_grad_(False))
    assert cache_frozen_casts(model, torch.bfloat16) == 1
    assert "forward" not in vars(model[0]) and "forward" in vars(model[1]) and "forward" not in vars(model[2])


def test_the_fused_head_reads_a_frozen_heads_cached_cast_and_a_trainable_heads_parameter() -> None:
    frozen = torch.nn.Linear(4, 6, bias=False).requires_grad_(False)
    trainable = torch.nn.Linear(4, 6, bias=False)
    assert weight_in(frozen, torch.bfloat16) is frozen.weight  # no cache installed: the parameter
    cache_frozen_casts(frozen, torch.bfloat16)
    cast = weight_in(frozen, torch.bfloat16)
    assert cast.dtype == torch.bfloat16 and torch.equal(cast, frozen.weight.to(torch.bfloat16))
    assert weight_in(frozen, torch.bfloat16) is cast  # made once
    assert weight_in(frozen, torch.float16) is frozen.weight  # another dtype: not this cache's
    cache_frozen_casts(trainable, torch.bfloat16)
    assert weight_in(trainable, torch.bfloat16) is trainable.weight
