"""Checkpoints resume the exact next step; weight export and HF saves are atomic and loadable."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import torch
from transformers import AutoModelForCausalLM

from learner.model.model_init import PRESETS, build_model
from learner.model.model_io import VERSION_FILE, export_weights, load_policy, resolve_device, save_hf
from learner.process.checkpoint import restore, save_checkpoint
from learner.process.checkpoint_state import ConsumedState, load_latest_checkpoint
from learner.trainer import Trainer
from pipeline.contracts.learner_config import LearnerConfig
from pipeline.contracts.schema import segments_to_batch
from tests.helpers.configs import learner_cfg
from tests.helpers.train_groups import groups_of, one_turn_segment

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Path) -> Path:
    return tiny_model_dir


def _cfg() -> LearnerConfig:
    return learner_cfg(lr=1e-3, mini_batches=3, warmup_steps=2, device="cpu")


def _batches(tokenizer: Any) -> list[pa.RecordBatch]:
    """Four fixed rollout batches (two groups of three one-turn episodes each), distinct per step."""
    prompt = tokenizer.encode(
        "<|im_start|>user\nGuess my number from 1 to 16.<|im_end|>\n<|im_start|>assistant\n"
    )
    end = tokenizer.eos_token_id
    batches = []
    for step in range(4):
        episodes = []
        for group in range(2):
            for member in range(3):
                action = [*tokenizer.encode(str(1 + (step + group + member) % 16)), end]
                episodes.append(
                    one_turn_segment(
                        f"s{step}g{group}e{member}",
                        f"s{step}g{group}",
                        prompt,
                        action,
                        logprob=-6.5 - 0.1 * member,
                        outcome=float(member == 0),
                        env="guess-number",
                    )
                )
        batches.append(segments_to_batch(episodes))
    return batches


def _fresh_trainer(model_dir: Path) -> tuple[Trainer, Any]:
    model, tokenizer = load_policy(model_dir)
    return Trainer(model, _cfg(), temperature=1.0, seed=7), tokenizer


def _optimizer_tensors(trainer: Trainer) -> list[torch.Tensor]:
    state = trainer.optimizer.state_dict()["state"]
    return [value for key in sorted(state) for _, value in sorted(state[key].items())]


def test_resume_after_two_steps_matches_four_straight_steps(model_dir: Path, tmp_path: Path) -> None:
    straight, tokenizer = _fresh_trainer(model_dir)
    batches = _batches(tokenizer)
    for batch in batches:
        straight.step(groups_of(batch))

    first, _ = _fresh_trainer(model_dir)
    for batch in batches[:2]:
        first.step(groups_of(batch))
    consumed = ConsumedState(last_seq=11, group_ids=["s0g0", "s0g1", "s1g0", "s1g1"])
    save_checkpoint(tmp_path / "checkpoints", first, consumed=consumed, extra={"note": "half"})
    # Disturb every RNG the restore must put back.
    torch.manual_seed(1234)
    torch.randperm(5, generator=first.generator)

    ckpt = load_latest_checkpoint(tmp_path / "checkpoints")
    assert ckpt is not None
    resumed, _ = _fresh_trainer(model_dir)  # a new model object and a new trainer, as after a restart
    restore(resumed, ckpt)
    assert resumed.steps == 2 and resumed.policy_version == first.policy_version
    assert ckpt.consumed == consumed and ckpt.extra == {"note": "half"}
    for batch in batches[2:]:
        resumed.step(groups_of(batch))

    for (name, a), b in zip(straight.model.named_parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b), name
    expected, got = _optimizer_tensors(straight), _optimizer_tensors(resumed)
    assert len(expected) == len(got) > 0
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    assert straight.scheduler.state_dict() == resumed.scheduler.state_dict()
    assert straight.counters() == resumed.counters()


def test_latest_pointer_and_keep_last_k(model_dir: Path, tmp_path: Path) -> None:
    trainer, _ = _fresh_trainer(model_dir)
    root = tmp_path / "ckpt"
    for steps in (1, 2, 3):
        trainer.steps = steps
        save_checkpoint(root, trainer, consumed=ConsumedState(last_seq=steps), keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step2", "step3"]
    assert (root / "latest").read_text().strip() == "step3"
    ckpt = load_latest_checkpoint(root)
    assert ckpt is not None and ckpt.step == 3 and ckpt.consumed.last_seq == 3
    reloaded = AutoModelForCausalLM.from_pretrained(ckpt.model_dir)
    assert torch.equal(reloaded.model.embed_tokens.weight, trainer.model.model.embed_tokens.weight)


def test_no_checkpoint_gives_none(tmp_path: Path) -> None:
    assert load_latest_checkpoint(tmp_path / "missing") is None
    (tmp_path / "empty").mkdir()
    assert load_latest_checkpoint(tmp_path / "empty") is None


def test_crash_leftovers_are_ignored_and_a_stale_pointer_falls_back(model_dir: Path, tmp_path: Path) -> None:
    trainer, _ = _fresh_trainer(model_dir)
    root = tmp_path / "ckpt"
    trainer.steps = 4
    save_checkpoint(root, trainer, consumed=ConsumedState())
    (root / ".step5.tmp-abc").mkdir()  # a save interrupted before its rename
    (root / "step6").mkdir()  # a directory without state.json is not a checkpoint
    (root / "latest").write_text("step9\n")  # pointer to something that is gone
    ckpt = load_latest_checkpoint(root)
    assert ckpt is not None and ckpt.path.name == "step4"
    trainer.steps = 7
    save_checkpoint(root, trainer, consumed=ConsumedState())  # the next save clears the crash leftover
    assert not (root / ".step5.tmp-abc").exists()
    assert (root / "latest").read_text().strip() == "step7"


def test_restore_rejects_a_checkpoint_of_another_shape(model_dir: Path, tmp_path: Path) -> None:
    trainer, _ = _fresh_trainer(model_dir)
    save_checkpoint(tmp_path / "c", trainer, consumed=ConsumedState())
    ckpt = load_latest_checkpoint(tmp_path / "c")
    assert ckpt is not None
    other = build_model(PRESETS["small"], trainer.model.config.vocab_size, eos_id=2, pad_id=0, seed=0)
    with pytest.raises(RuntimeError, match="size mismatch"):
        restore(Trainer(other, _cfg(), temperature=1.0), ckpt)


def test_restore_names_the_key_when_the_embedding_decay_changed(model_dir: Path, tmp_path: Path) -> None:
    trainer, _ = _fresh_trainer(model_dir)  # one optimizer group: embedding_weight_decay unset
    save_checkpoint(tmp_path / "c", trainer, consumed=ConsumedState())
    ckpt = load_latest_checkpoint(tmp_path / "c")
    assert ckpt is not None
    model, _ = load_policy(model_dir)
    split = learner_cfg(lr=1e-3, mini_batches=3, warmup_steps=2, device="cpu", embedding_weight_decay=1.0)
    with pytest.raises(ValueError, match=r"sizes \[\d+\].*learner.optim.embedding_weight_decay"):
        restore(Trainer(model, split, temperature=1.0), ckpt)


def test_export_weights_writes_a_loadable_versioned_hf_dir(model_dir: Path, tmp_path: Path) -> None:
    trainer, tokenizer = _fresh_trainer(model_dir)
    with torch.no_grad():
        trainer.model.model.norm.weight.add_(0.5)
    out = export_weights(trainer, tokenizer, tmp_path / "weights" / "v3", version=3)
    assert json.loads((out / VERSION_FILE).read_text()) == {"policy_version": 3}
    loaded, loaded_tokenizer = load_policy(out)
    for (name, a), b in zip(trainer.model.named_parameters(), loaded.parameters(), strict=True):
        assert torch.equal(a, b), name
    assert loaded_tokenizer.encode("12") == tokenizer.encode("12")
    for name in ("tokenizer.json", "tokenizer_config.json"):  # what an engine reads stays byte-identical
        assert (out / name).read_bytes() == (model_dir / name).read_bytes()
    # Re-exporting the same version replaces the directory whole; no temp dirs are left behind.
    with torch.no_grad():
        trainer.model.model.norm.weight.add_(0.5)
    export_weights(trainer.model, None, out, version=3)
    again = AutoModelForCausalLM.from_pretrained(out)
    assert torch.equal(again.model.norm.weight, trainer.model.model.norm.weight)
    assert sorted(os.listdir(tmp_path / "weights")) == ["v3"]


def test_export_rejects_bad_inputs(model_dir: Path, tmp_path: Path) -> None:
    model, tokenizer = load_policy(model_dir)
    with pytest.raises(TypeError, match="PreTrainedModel"):
        export_weights(object(), tokenizer, tmp_path / "x", version=1)
    with pytest.raises(ValueError, match="version must be >= 0"):
        export_weights(model, tokenizer, tmp_path / "x", version=-1)


def test_failed_save_leaves_no_partial_directory(model_dir: Path, tmp_path: Path) -> None:
    model, _ = load_policy(model_dir)

    class Broken:
        def save_pretrained(self, path: Path) -> None:
            raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        save_hf(model, Broken(), tmp_path / "out")  # type: ignore[arg-type]
    assert os.listdir(tmp_path) == []


def test_load_policy_takes_the_weights_dtype_and_refuses_unknown_ones(model_dir: Path) -> None:
    model, _ = load_policy(model_dir, dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    with pytest.raises(ValueError, match="unknown dtype"):
        load_policy(model_dir, dtype="float16")
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        resolve_device("tpu")
    assert resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="cuda"):
            resolve_device("cuda")
        assert resolve_device("auto") == torch.device("cpu")


def test_a_tokenizer_without_a_source_directory_is_serialised(model_dir: Path, tmp_path: Path) -> None:
    model, tokenizer = load_policy(model_dir)
    tokenizer.name_or_path = ""
    out = save_hf(model, tokenizer, tmp_path / "out")
    _, reloaded = load_policy(out)
    text = "Guess my number from 1 to 16."
    assert reloaded.encode(text) == tokenizer.encode(text)
    assert reloaded.eos_token == tokenizer.eos_token
