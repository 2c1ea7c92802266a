"""The learner's token trace (learner.trace): what the loss saw, per token, on the traced groups."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import torch

from learner.loss.gspo import gspo_token_loss
from learner.model.model_io import load_policy
from learner.trace import (
    CLIPPED,
    NOT_SCORED,
    REJECTED,
    TRAINED,
    StepTracer,
    token_clip_active,
    trace_batch,
    trace_files,
    write_trace,
)
from learner.trainer import Trainer
from tests.helpers.configs import learner_cfg
from tests.helpers.train_groups import groups_of, one_turn_row

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("level", ["sequence_token", "sequence", "token"])
def test_token_clip_state_is_the_losses_clip_fraction_token_per_token(level: str) -> None:
    gen = torch.Generator().manual_seed(3)
    lp = -torch.rand(6, 9, generator=gen) * 3
    old = lp + torch.randn(6, 9, generator=gen) * 0.3
    adv = torch.randn(6, 9, generator=gen)
    mask = (torch.rand(6, 9, generator=gen) > 0.3).float()
    _, stats = gspo_token_loss(lp, old, adv, mask, clip_low=0.1, clip_high=0.15, level=level)  # type: ignore[arg-type]
    active = token_clip_active(lp, old, adv, mask, level=level, clip_low=0.1, clip_high=0.15)  # type: ignore[arg-type]
    assert active.any() and not active[mask == 0].any()
    assert float(active.float().sum() / mask.sum()) == pytest.approx(
        float(stats["clip_fraction_token"]), abs=1e-6
    )


def _trainer(model_dir: Path, tracer: StepTracer, **cfg: Any) -> Trainer:
    torch.manual_seed(0)
    model, _ = load_policy(model_dir)
    base: dict[str, Any] = {"lr": 1e-2, "mini_batches": 2, "device": "cpu", "warmup_steps": 0}
    base.update(cfg)
    return Trainer(model, learner_cfg(**base), temperature=1.0, tracer=tracer)


def _groups(n: int) -> list[Any]:
    return groups_of([one_turn_row(f"g{g}", i, 0) for g in range(n) for i in range(4)])


@torch.no_grad()
def _on_policy_groups(model_dir: Path, n: int, *, off_by: dict[str, float] | None = None) -> list[Any]:
    """Rows whose engine log-probs are the tiny model's own (what its engine would have returned), each
    shifted by off_by[group_id] nats when given."""
    torch.manual_seed(0)
    model, _ = load_policy(model_dir)
    rows = [one_turn_row(f"g{g}", i, 0) for g in range(n) for i in range(4)]
    for row in rows:
        ids = torch.tensor([row.token_ids])
        logp = torch.log_softmax(model(ids).logits.float(), dim=-1)[0, :-1]
        own = logp.gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1).tolist()
        shift = (off_by or {}).get(row.group_id, 0.0)
        row.logprobs = [0.0] * 4 + [v + shift for v in own[3:]]
    return groups_of(rows)


def test_a_traced_step_records_every_row_of_one_group_token_by_token(tiny_model_dir: Path) -> None:
    trainer = _trainer(
        tiny_model_dir,
        StepTracer(groups_per_step=1),
        mini_batches=1,
        mismatch={"proximal": "engine", "is_weights": "none"},
    )
    groups = _on_policy_groups(tiny_model_dir, 3)
    trainer.step(groups)
    rows = trainer.tracer.take()
    assert len(rows) == 4 and len({r.segment.group_id for r in rows}) == 1
    for row in rows:
        seg = row.segment
        assert len(row.learner_logprobs) == len(row.advantages) == len(row.clip) == len(seg.token_ids) == 7
        # One update on the engine's own log-probs: ratio 1, nothing clipped, learner = engine log-probs.
        assert row.clip == [NOT_SCORED] * 4 + [TRAINED] * 3
        assert row.learner_logprobs[:4] == [0.0] * 4
        assert row.learner_logprobs[4:] == pytest.approx(seg.logprobs[4:], abs=1e-5)
        # Each generated token carries its turn's advantage (outcome index % 2 against its peers).
        assert len(set(row.advantages[4:])) == 1 and row.advantages[4] != 0.0
        assert row.is_weights == [1.0] * 7
    assert sorted(r.advantages[4] > 0 for r in rows) == [False, False, True, True]
    assert trainer.tracer.take() == []  # handed over once


def test_rejected_tokens_and_importance_weights_are_traced(tiny_model_dir: Path) -> None:
    tracer = StepTracer(groups_per_step=2)
    trainer = _trainer(
        tiny_model_dir,
        tracer,
        mismatch={"proximal": "learner", "is_weights": "token", "reject": "token", "reject_band": [0.5, 2.0]},
    )
    # g0's engine log-probs are the learner's (weight 1, kept); g1's are 3 nats lower: ratio e^3, rejected.
    trainer.step(_on_policy_groups(tiny_model_dir, 2, off_by={"g1": -3.0}))
    rows = {r.segment.episode_id: r for r in tracer.take()}
    assert len(rows) == 8
    for i in range(4):
        kept, rejected = rows[f"g0-{i}"], rows[f"g1-{i}"]
        assert kept.clip[4:] == [TRAINED] * 3 and kept.is_weights[4:] == pytest.approx([1.0] * 3, abs=1e-4)
        assert rejected.clip[4:] == [REJECTED] * 3


def test_a_clipped_sequence_is_traced_as_clipped(tiny_model_dir: Path) -> None:
    tracer = StepTracer(groups_per_step=1)
    # Engine log-probs 1 nat below the policy's: every sequence ratio is e, so positive advantages clip.
    rows = [one_turn_row("g0", i, 0) for i in range(4)]
    for row in rows:
        row.logprobs = [0.0] * 4 + [-30.0] * 3
    trainer = _trainer(
        tiny_model_dir, tracer, mini_batches=1, mismatch={"proximal": "engine", "is_weights": "none"}
    )
    trainer.step(groups_of(rows))
    traced = tracer.take()
    clipped = {r.segment.episode_id: r.clip[4:] for r in traced}
    # outcome 1 (odd index) = positive advantage: ratio above the band clips; negative advantages do not.
    assert clipped == {
        "g0-0": [TRAINED] * 3,
        "g0-1": [CLIPPED] * 3,
        "g0-2": [TRAINED] * 3,
        "g0-3": [CLIPPED] * 3,
    }


def test_untraced_steps_and_an_off_tracer_record_nothing(tiny_model_dir: Path) -> None:
    tracer = StepTracer(groups_per_step=1, every_steps=2)
    trainer = _trainer(tiny_model_dir, tracer, mismatch={"proximal": "engine", "is_weights": "none"})
    trainer.step(_groups(1))  # step 0: traced
    assert len(tracer.take()) == 4
    trainer.step(_groups(1))  # step 1: not
    assert tracer.take() == []
    off = StepTracer()
    _trainer(tiny_model_dir, off, mismatch={"proximal": "engine", "is_weights": "none"}).step(_groups(1))
    assert off.take() == [] and not off.active
    with pytest.raises(ValueError, match="every >= 1"):
        StepTracer(1, every_steps=0)


def test_trace_files_hold_contract_one_columns_plus_the_trace_and_keep_the_newest(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    tracer = StepTracer(groups_per_step=1)
    trainer = _trainer(tiny_model_dir, tracer, mismatch={"proximal": "engine", "is_weights": "none"})
    trainer.step(_on_policy_groups(tiny_model_dir, 2))
    rows = tracer.take()
    for step in range(1, 6):
        write_trace(tmp_path, trace_batch(rows, step=step, learner_version=step - 1), step=step, keep=3)
    assert [s for s, _ in trace_files(tmp_path)] == [3, 4, 5]
    assert not list(tmp_path.glob("*.tmp"))
    table = pa.ipc.open_file(str(tmp_path / "s000000000005.arrow")).read_all()
    assert table.num_rows == 4 and table.column("step").to_pylist() == [5] * 4
    assert table.column("learner_version").to_pylist() == [4] * 4
    assert table.schema.names[:15] == [
        "episode_id", "group_id", "task_id", "env", "segment", "token_ids", "prompt_len", "loss_mask",
        "logprobs", "turn_index", "versions", "turn_rewards", "outcome", "num_turns", "finish_reason",
    ]  # fmt: skip
    assert table.column("clip").to_pylist()[0] == [-1, -1, -1, -1, 0, 0, 0]
