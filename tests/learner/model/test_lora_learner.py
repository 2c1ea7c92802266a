"""LoRA on the learner: only adapter parameters train, checkpoints resume exactly, versions are published in
PEFT format (or merged) that load back to the learner's own policy, and the served-policy probe is the
learner's log-probs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from learner.model.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, LoraPolicy, apply_lora
from learner.model.model_io import VERSION_FILE, load_policy
from learner.process.checkpoint import restore, save_checkpoint
from learner.process.checkpoint_state import ConsumedState, load_latest_checkpoint
from learner.served_probe import probe_ids, probe_logprobs
from learner.trainer import Trainer
from pipeline.contracts.config import ConfigError, load_config
from pipeline.contracts.learner_config import LearnerConfig, LoraConfig
from tests.helpers.configs import learner_cfg
from tests.helpers.train_groups import groups_of
from tests.learner.process.test_checkpoint import _batches

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LORA = LoraConfig(enabled=True, rank=4, alpha=8, dropout=0.1, target_modules=["q_proj", "v_proj", "up_proj"])


def _cfg(lora: LoraConfig = LORA) -> LearnerConfig:
    return learner_cfg(lr=1e-2, mini_batches=3, warmup_steps=2, device="cpu", lora=lora)


def _lora_trainer(model_dir: Path, lora: LoraConfig = LORA) -> tuple[Trainer, LoraPolicy, Any]:
    model, tokenizer = load_policy(model_dir)
    policy = apply_lora(model, lora)
    return Trainer(policy.model, _cfg(lora), temperature=1.0, seed=7), policy, tokenizer


def _optimizer_tensors(trainer: Trainer) -> list[torch.Tensor]:
    state = trainer.optimizer.state_dict()["state"]
    return [value for key in sorted(state) for _, value in sorted(state[key].items())]


def _logits(model: Any, ids: list[int]) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids])).logits[0]
    return out


def test_only_adapter_parameters_reach_the_optimizer_and_change(tiny_model_dir: Path) -> None:
    trainer, policy, tokenizer = _lora_trainer(tiny_model_dir)
    frozen = {n: p.detach().clone() for n, p in policy.model.named_parameters() if not p.requires_grad}
    adapters = policy.adapter_parameters()
    assert adapters and all(".lora_A." in n or ".lora_B." in n for n in adapters)
    in_optimizer = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    assert {id(p) for p in in_optimizer} == {id(p) for p in adapters.values()}
    before = {n: p.detach().clone() for n, p in adapters.items()}
    for batch in _batches(tokenizer)[:2]:
        trainer.step(groups_of(batch))
    assert trainer.policy_version == 2
    for name, p in policy.model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, frozen[name]), name
    assert any(not torch.equal(p, before[n]) for n, p in adapters.items())
    # AdamW holds two moments per adapter parameter and nothing for the frozen base.
    state_numel = sum(t.numel() for t in _optimizer_tensors(trainer) if t.dim() > 0)
    assert state_numel == 2 * sum(p.numel() for p in adapters.values())


def test_resume_restores_adapter_and_optimizer_exactly(tiny_model_dir: Path, tmp_path: Path) -> None:
    straight, straight_policy, tokenizer = _lora_trainer(tiny_model_dir)
    batches = _batches(tokenizer)
    torch.manual_seed(0)  # adapter dropout draws from the global RNG: both runs start from the same state
    for batch in batches:
        straight.step(groups_of(batch))

    first, first_policy, _ = _lora_trainer(tiny_model_dir)
    torch.manual_seed(0)
    for batch in batches[:2]:
        first.step(groups_of(batch))
    save_checkpoint(tmp_path / "ck", first, consumed=ConsumedState(last_seq=3), adapter=first_policy)
    torch.manual_seed(99)  # disturb the RNG the adapter dropout draws from; restore must put it back
    ckpt = load_latest_checkpoint(tmp_path / "ck")
    assert ckpt is not None
    assert sorted(p.name for p in (ckpt.path / "adapter").iterdir()) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
    assert not (ckpt.path / "model").exists()  # the base is the run's initial model, never rewritten

    resumed, resumed_policy, _ = _lora_trainer(tiny_model_dir)
    restore(resumed, ckpt, adapter=resumed_policy)
    for (name, a), b in zip(
        first_policy.adapter_parameters().items(), resumed_policy.adapter_parameters().values(), strict=True
    ):
        assert torch.equal(a, b), name
    assert all(
        torch.equal(a, b) for a, b in zip(_optimizer_tensors(first), _optimizer_tensors(resumed), strict=True)
    )
    for batch in batches[2:]:
        resumed.step(groups_of(batch))
    for (name, a), b in zip(
        straight_policy.adapter_parameters().items(),
        resumed_policy.adapter_parameters().values(),
        strict=True,
    ):
        assert torch.equal(a, b), name
    expected, got = _optimizer_tensors(straight), _optimizer_tensors(resumed)
    assert len(expected) == len(got) > 0
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    assert straight.counters() == resumed.counters()


def test_restore_refuses_a_checkpoint_of_other_lora_settings(tiny_model_dir: Path, tmp_path: Path) -> None:
    trainer, policy, _ = _lora_trainer(tiny_model_dir)
    save_checkpoint(tmp_path / "ck", trainer, consumed=ConsumedState(), adapter=policy)
    ckpt = load_latest_checkpoint(tmp_path / "ck")
    assert ckpt is not None
    other_rank = LoraConfig(**{**LORA.model_dump(), "rank": 8})
    bigger, bigger_policy, _ = _lora_trainer(tiny_model_dir, other_rank)
    with pytest.raises(ValueError, match=r"r = 4.*learner\.lora has 8"):
        restore(bigger, ckpt, adapter=bigger_policy)
    full = Trainer(load_policy(tiny_model_dir)[0], LearnerConfig(device="cpu"), temperature=1.0)
    with pytest.raises(ValueError, match=r"holds a LoRA adapter but learner\.lora\.enabled is False"):
        restore(full, ckpt)


def test_kl_reference_is_the_policy_with_its_adapter_off_and_matches_a_loaded_base(
    tiny_model_dir: Path,
) -> None:
    """With LoRA, the KL reference is the base the adapter applies to (B starts at zero): the same model
    with the adapter disabled gives the steps a second loaded copy of the base gives, without the copy."""
    cfg = learner_cfg(lr=1e-2, mini_batches=1, warmup_steps=2, device="cpu", lora=LORA, kl_coef=0.1)

    def run(shared: bool) -> tuple[list[dict[str, float]], LoraPolicy, Trainer]:
        torch.manual_seed(0)  # the adapter's dropout draws from the global generator
        model, tokenizer = load_policy(tiny_model_dir)
        policy = apply_lora(model, LORA)
        reference = policy.adapter_off() if shared else load_policy(tiny_model_dir)[0]
        trainer = Trainer(policy.model, cfg, temperature=1.0, seed=7, reference=reference)
        return [trainer.step(groups_of(batch)) for batch in _batches(tokenizer)[:3]], policy, trainer

    loaded, loaded_policy, _ = run(shared=False)
    shared, policy, trainer = run(shared=True)
    assert shared[0]["kl_reference"] == pytest.approx(0.0, abs=1e-7)  # version 0 is the base
    assert shared[2]["kl_reference"] > 1e-5
    for a, b in zip(loaded, shared, strict=True):
        assert b["kl_reference"] == pytest.approx(a["kl_reference"], rel=1e-4, abs=1e-9)
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-7)
    for (name, a), b in zip(
        loaded_policy.adapter_parameters().items(), policy.adapter_parameters().values(), strict=True
    ):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6, msg=name)
    # After each reference forward the adapter is on again, in train mode, and still the only thing training.
    assert policy.model.training and trainer.reference is not None
    assert all(p.requires_grad for p in policy.adapter_parameters().values())
    ids = [1, 2, 3, 4, 5]
    with policy.adapter_off().active() as base:
        off = _logits(base, ids)
    assert not torch.equal(off, _logits(policy.model, ids))  # the adapter is applied outside `active()`
    torch.testing.assert_close(off, _logits(load_policy(tiny_model_dir)[0], ids), rtol=0, atol=1e-6)


def test_published_adapter_is_peft_format_and_loads_to_the_same_policy(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from peft import PeftModel

    trainer, policy, tokenizer = _lora_trainer(tiny_model_dir)
    trainer.step(groups_of(_batches(tokenizer)[0]))
    out = policy.publish_adapter(tmp_path / "weights" / "v1", 1)
    assert sorted(p.name for p in out.iterdir()) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS, VERSION_FILE]
    config = json.loads((out / ADAPTER_CONFIG).read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8.0
    assert sorted(config["target_modules"]) == ["q_proj", "up_proj", "v_proj"]
    with safe_open(str(out / ADAPTER_WEIGHTS), "pt") as f:
        keys = list(f.keys())
    # The key names SGLang's LoRA loader reads: base_model.model.<module>.lora_{A,B}.weight.
    assert keys and all(k.startswith("base_model.model.model.layers.") for k in keys)
    assert all(k.endswith((".lora_A.weight", ".lora_B.weight")) for k in keys)

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    served = PeftModel.from_pretrained(base, str(out))
    ids = tokenizer.encode("<|im_start|>user\nGuess my number<|im_end|>\n<|im_start|>assistant\n7")
    torch.testing.assert_close(_logits(served, ids), _logits(policy.model, ids), rtol=0, atol=1e-5)


def test_merged_weights_equal_the_adapter_policy_and_leave_the_base_untouched(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    trainer, policy, tokenizer = _lora_trainer(tiny_model_dir)
    trainer.step(groups_of(_batches(tokenizer)[0]))
    base_before = {n: p.detach().clone() for n, p in policy.model.named_parameters() if not p.requires_grad}
    out = policy.publish_merged(tmp_path / "weights" / "v1", tokenizer, 1)
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    merged = AutoModelForCausalLM.from_pretrained(out)
    assert not any("lora" in n or "base_layer" in n for n, _ in merged.named_parameters())
    ids = tokenizer.encode("<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n12")
    torch.testing.assert_close(_logits(merged, ids), _logits(policy.model, ids), rtol=0, atol=1e-5)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert (_logits(merged, ids) - _logits(base, ids)).abs().max() > 1e-3  # the adapter did move it
    for name, p in policy.model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, base_before[name]), name


def test_apply_lora_names_the_key_for_an_unknown_target(tiny_model_dir: Path) -> None:
    model, _ = load_policy(tiny_model_dir)
    bad = LoraConfig(enabled=True, target_modules=["q_proj", "query_key_value"])
    with pytest.raises(ValueError, match=r"learner.lora.target_modules: \['query_key_value'\]"):
        apply_lora(model, bad)


def test_probe_logprobs_are_the_teacher_forced_logprobs_with_dropout_off(tiny_model_dir: Path) -> None:
    _, policy, tokenizer = _lora_trainer(tiny_model_dir)
    groups = groups_of(_batches(tokenizer)[0])
    ids = probe_ids(groups, max_tokens=12)
    assert len(ids) == 12 and ids == list(groups[0].episodes[0][0].token_ids[:12])
    first = probe_logprobs(policy.model, ids)
    assert policy.model.training  # restored to the mode the trainer needs
    assert probe_logprobs(policy.model, ids) == first  # eval mode: no dropout noise
    logits = _logits(policy.model, ids)
    expected = torch.log_softmax(logits[:-1].float(), dim=-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert first == pytest.approx(expected.tolist(), abs=1e-6)
    assert probe_ids([], 8) == [] and probe_logprobs(policy.model, ids[:1]) == []


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["learner.lora.enabled=true", "learner.lora.rank=0"], "learner.lora.rank"),
        (["learner.lora.target_modules=[]"], "learner.lora.target_modules"),
        (["learner.lora.serving=fused"], "learner.lora.serving"),
        (
            ["learner.lora.enabled=true", "learner.optim.embedding_weight_decay=0.1"],
            "learner.optim.embedding_weight_decay",
        ),
        (["learner.lora.enabled=true", "engine.kind=sglang", "engine.dp=2"], "engine.dp = 1"),
        (["async.served_check.tolerance=0"], "async.served_check.tolerance"),
    ],
)
def test_bad_lora_and_check_settings_name_the_key(overrides: list[str], key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, overrides)
