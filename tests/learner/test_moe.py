"""Mixture-of-Experts in the learner: the Qwen3-MoE presets, routing capture and replay, the routing
metrics by hand, and the options that need an MoE model refused on a dense one (learner.model.moe_routing,
learner.trainer, learner.groups, learner.lora)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from learner.groups import TrainGroup, triage_group
from learner.loss.load_balance import load_balance_loss
from learner.model.lora import apply_lora
from learner.model.model_init import MOE_PRESETS, PRESETS, count_parameters
from learner.model.model_io import export_weights, load_policy
from learner.model.moe_routing import (
    MoeShape,
    MoeStats,
    RouterHooks,
    expert_load,
    find_routers,
    load_imbalance,
    moe_shape,
    record_tensor,
    replay_tensor,
    require_moe,
    routing_change,
)
from learner.process.checkpoint import restore, save_checkpoint
from learner.process.checkpoint_state import ConsumedState, load_latest_checkpoint
from learner.trainer import Trainer
from pipeline.contracts.learner_config import LearnerConfig, LoraConfig
from pipeline.contracts.schema import EpisodeSegment, RoutedExperts
from tests.helpers.train_groups import groups_of, one_turn_segment

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SHAPE = MoeShape(layers=2, topk=2, num_experts=8)  # moe-tiny


def _cfg(**overrides: Any) -> LearnerConfig:
    base: dict[str, Any] = {
        "optim": {"lr": 1e-3},
        "schedule": {"warmup_steps": 0},
        "loss": {"kind": "grpo", "clip_low": 0.2, "clip_high": 0.27},
        "mini_batches": 2,
        "mismatch": {"proximal": "engine", "is_weights": "none"},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    return LearnerConfig.model_validate(base)


def _record(positions: int, seed: int) -> RoutedExperts:
    """A valid routing record of `positions` positions for moe-tiny (distinct experts per top-k)."""
    gen = torch.Generator().manual_seed(seed)
    ids = [
        e
        for _ in range(positions * SHAPE.layers)
        for e in torch.randperm(SHAPE.num_experts, generator=gen)[: SHAPE.topk].tolist()
    ]
    return RoutedExperts(layers=2, topk=2, width=1, ids=RoutedExperts.encode(ids, layers=2, topk=2, width=1))


def _groups(*, routed: bool) -> list[TrainGroup]:
    rows: list[EpisodeSegment] = []
    for group in range(2):
        for member in range(3):
            prompt = [5, 6, 7, 8 + group]
            action = [20 + 5 * group + member, 40 + member, 2]
            row = one_turn_segment(
                f"g{group}e{member}",
                f"g{group}",
                prompt,
                action,
                logprob=-3.0 - 0.2 * member,
                outcome=float(member == 0),
            )
            if routed:
                row.routed_experts = _record(len(row.token_ids) - 1, seed=10 * group + member)
            rows.append(row)
    return groups_of(rows)


@pytest.fixture
def moe_policy(moe_tiny_model_dir: Path) -> Any:
    return load_policy(moe_tiny_model_dir)[0]


# ------------------------------------------------------------------------------------------- presets
def test_moe_presets_are_qwen3_moe_with_8_experts_top_2(moe_tiny_model_dir: Path) -> None:
    assert {"moe-tiny", "moe-small"} <= set(PRESETS)
    assert all(p.num_experts == 8 and p.num_experts_per_tok == 2 for p in MOE_PRESETS.values())
    model = AutoModelForCausalLM.from_pretrained(moe_tiny_model_dir)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert (model.config.num_experts, model.config.num_experts_per_tok, model.config.head_dim) == (8, 2, 32)
    assert model.config.norm_topk_prob is True and model.config.mlp_only_layers == []
    assert 500_000 <= count_parameters(model) <= 2_000_000
    assert moe_shape(model.config) == SHAPE
    assert len(find_routers(model)) == 2


def test_moe_checkpoint_on_disk_holds_one_tensor_per_expert_as_sglang_loads_it(
    moe_tiny_model_dir: Path,
) -> None:
    with safe_open(str(moe_tiny_model_dir / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    for expert in range(8):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            assert f"model.layers.1.mlp.experts.{expert}.{proj}.weight" in keys
    assert "model.layers.0.mlp.gate.weight" in keys


def test_an_exported_moe_policy_loads_back_bit_for_bit(moe_policy: Any, tmp_path: Path) -> None:
    with torch.no_grad():
        for p in moe_policy.parameters():
            p.add_(0.01)
    out = export_weights(moe_policy, None, tmp_path / "v1", version=1)
    again = AutoModelForCausalLM.from_pretrained(out)
    ours, theirs = moe_policy.state_dict(), again.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_moe_shape_reads_a_config_json_dict_and_calls_a_dense_one_none() -> None:
    assert moe_shape({"num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48}) == MoeShape(
        48, 8, 128
    )
    assert moe_shape({"num_local_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 32}) == MoeShape(
        32, 2, 8
    )
    assert moe_shape({"num_hidden_layers": 2, "hidden_size": 96}) is None


# ------------------------------------------------------------------------------------- capture, replay
def test_capture_records_each_routers_own_top_k(moe_policy: Any) -> None:
    hooks = RouterHooks(moe_policy)
    ids = torch.tensor([[5, 6, 7, 8, 9], [9, 8, 7, 6, 5]])
    with torch.no_grad(), hooks.capture():
        moe_policy(input_ids=ids)
    captured = hooks.captured()
    assert captured.shape == (10, 2, 2)
    assert ((captured >= 0) & (captured < 8)).all()
    assert (captured[..., 0] != captured[..., 1]).all()  # top-k ids are distinct
    # the same top-k as the router computes it: its softmax's k largest, from its own logits
    logits: list[torch.Tensor] = []
    handle = find_routers(moe_policy)[0].register_forward_hook(lambda m, a, out: logits.append(out[0]))
    with torch.no_grad():
        moe_policy(input_ids=ids)
    handle.remove()
    top = torch.softmax(logits[0].float(), dim=-1).topk(2, dim=-1).indices
    assert torch.equal(top.sort(dim=-1).values, captured[:, 0].sort(dim=-1).values)
    hooks.remove()


def test_replay_forces_the_recorded_experts_and_minus_one_keeps_the_routers_own(moe_policy: Any) -> None:
    hooks = RouterHooks(moe_policy)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad(), hooks.capture():
        plain = moe_policy(input_ids=ids).logits
    own = hooks.captured()
    forced = torch.full((1, 5, 2, 2), -1, dtype=torch.int16)
    forced[0, :3] = torch.tensor([[6, 7], [6, 7]], dtype=torch.int16)  # positions 0-2: experts 6 and 7
    hooks.set_replay(forced)
    with torch.no_grad(), hooks.capture():
        replayed = moe_policy(input_ids=ids).logits
    # Capture sees the router's own choice, before the replay: layer 0's inputs did not change.
    under_replay = hooks.captured()
    assert torch.equal(under_replay[:, 0], own[:, 0])
    chosen: list[torch.Tensor] = []
    handle = find_routers(moe_policy)[1].register_forward_hook(lambda m, a, out: chosen.append(out[2]))
    with torch.no_grad():
        moe_policy(input_ids=ids)
    handle.remove()
    assert chosen[0][:3].tolist() == [[6, 7]] * 3
    assert torch.equal(chosen[0][3:], under_replay[3:, 1])  # unrecorded positions: the router's own
    # Forcing the experts the router would choose anyway changes nothing.
    hooks.set_replay(own.view(1, 5, 2, 2).to(torch.int16))
    with torch.no_grad():
        same = moe_policy(input_ids=ids).logits
    torch.testing.assert_close(same, plain, rtol=0, atol=1e-6)
    assert not torch.allclose(replayed, plain)
    hooks.remove()


def test_replayed_gate_weights_keep_the_routers_gradient(moe_policy: Any) -> None:
    hooks = RouterHooks(moe_policy)
    forced = torch.full((1, 4, 2, 2), 3, dtype=torch.int16)
    forced[..., 1] = 5
    hooks.set_replay(forced)
    moe_policy.zero_grad()
    moe_policy(input_ids=torch.tensor([[5, 6, 7, 8]])).logits.sum().backward()
    router = find_routers(moe_policy)[0]
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    # only the two replayed experts' rows of the router are reached through the renormalised weights
    assert router.weight.grad[[3, 5]].abs().sum() > 0
    hooks.remove()


def test_a_replay_of_the_wrong_size_is_refused(moe_policy: Any) -> None:
    hooks = RouterHooks(moe_policy)
    with pytest.raises(ValueError, match="replay has 3 layers, the model routes 2"):
        hooks.set_replay(torch.zeros(1, 4, 3, 2, dtype=torch.int16))
    hooks.set_replay(torch.zeros(1, 9, 2, 2, dtype=torch.int16))
    with pytest.raises(ValueError, match="routing replay of 9 positions for a forward of 4"):
        moe_policy(input_ids=torch.tensor([[5, 6, 7, 8]]))
    hooks.remove()


def test_replay_tensor_aligns_records_with_the_packed_input_positions() -> None:
    short = RoutedExperts.encode([1, 2, 3, 4] * 2, layers=2, topk=2, width=1)  # 2 positions
    records = [RoutedExperts(2, 2, 1, short), None]
    tensor, present = replay_tensor(records, 4, SHAPE)
    assert tensor.shape == (2, 4, 2, 2) and tensor.dtype == torch.int16
    assert tensor[0, :2].tolist() == [[[1, 2], [3, 4]]] * 2
    assert (tensor[0, 2:] == -1).all() and (tensor[1] == -1).all()
    assert present.tolist() == [[True, True, False, False], [False] * 4]


def test_record_tensor_reads_two_byte_ids() -> None:
    ids = RoutedExperts.encode([300, 7, 1, 299], layers=1, topk=2, width=2)
    assert record_tensor(RoutedExperts(1, 2, 2, ids)).tolist() == [[[300, 7]], [[1, 299]]]


# ------------------------------------------------------------------------------- metrics, by hand
def test_routing_change_counts_changed_sets_per_layer_ignoring_order() -> None:
    before = torch.tensor([[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[0, 1], [0, 1]]])
    after = torch.tensor([[[1, 0], [2, 4]], [[4, 5], [7, 6]], [[2, 3], [2, 3]]])
    keep = torch.tensor([True, True, False])
    changed, positions = routing_change(before, after, keep)
    assert changed.tolist() == [0, 1] and positions == 2  # swapped order is the same set


def test_expert_load_and_imbalance_by_hand() -> None:
    # 2 positions x 1 layer x top-2 of 4 experts: assignments {0: 2, 1: 1, 2: 1, 3: 0}
    indices = torch.tensor([[[0, 1]], [[0, 2]], [[3, 3]]])
    counts = expert_load(indices, torch.tensor([True, True, False]), 4)
    assert counts.tolist() == [[2, 1, 1, 0]]
    assert load_imbalance(counts).tolist() == [2.0]  # 2 / (4 / 4)
    assert load_imbalance(torch.tensor([[1, 1, 1, 1], [0, 0, 0, 0]])).tolist() == [1.0, 1.0]


def test_load_balance_loss_by_hand() -> None:
    # 1 layer, 4 experts, top-1 over 2 kept positions (a third is masked out): expert 0 and expert 1 each
    # get one assignment (f = [0.5, 0.5, 0, 0]); router probabilities [0.7, 0.1, 0.1, 0.1] and uniform.
    probs = torch.tensor([[0.7, 0.1, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25], [0.0, 0.0, 0.0, 1.0]])
    logits = probs.clamp(min=1e-9).log().requires_grad_(True)
    chosen = torch.tensor([[0], [1], [3]])
    keep = torch.tensor([True, True, False])
    value = load_balance_loss([(logits, chosen)], keep, 4)
    mean_p = [(0.7 + 0.25) / 2, (0.1 + 0.25) / 2]
    assert value.item() == pytest.approx(4 * (0.5 * mean_p[0] + 0.5 * mean_p[1]), abs=1e-6)
    value.backward()
    assert logits.grad is not None and logits.grad[2].abs().sum() == 0  # the masked position
    even = torch.zeros(4, 4)  # uniform router, each expert chosen once: the minimum, 1
    assert load_balance_loss(
        [(even, torch.tensor([[0], [1], [2], [3]]))], torch.ones(4, dtype=torch.bool), 4
    ).item() == pytest.approx(1.0)


def test_moe_stats_report_the_routers_share_and_merge_over_ranks() -> None:
    a = MoeStats(own_abs=0.4, replayed_abs=0.1, compared=2, replayed_positions=3, positions=4)
    a.add_change(torch.tensor([1, 3]), 4)
    a.add_counts(torch.tensor([[2, 2], [4, 0]]))
    b = MoeStats(own_abs=0.4, replayed_abs=0.3, compared=2, positions=4)
    b.add_change(torch.tensor([0, 1]), 4)
    metrics = MoeStats.merged([a, b]).metrics()
    assert metrics["moe_routing_change"] == pytest.approx((1 / 8 + 4 / 8) / 2)
    assert metrics["moe_routing_change_max_layer"] == pytest.approx(0.5)
    assert metrics["moe_load_imbalance"] == pytest.approx((1.0 + 2.0) / 2)
    assert metrics["moe_load_imbalance_max_layer"] == pytest.approx(2.0)
    assert metrics["router_mismatch_own"] == pytest.approx(0.2)
    assert metrics["router_mismatch_replayed"] == pytest.approx(0.1)
    assert metrics["router_mismatch_share"] == pytest.approx(0.5)
    assert metrics["routing_replayed_fraction"] == pytest.approx(3 / 8)
    assert MoeStats().metrics() == {}


# ------------------------------------------------------------------------------------------ trainer
def test_an_moe_step_reports_routing_change_load_and_ratio_spread(moe_policy: Any) -> None:
    trainer = Trainer(moe_policy, _cfg(), temperature=1.0)
    metrics = trainer.step(_groups(routed=False))
    assert metrics["optimizer_updates"] == 2.0
    assert 0.0 <= metrics["moe_routing_change"] <= metrics["moe_routing_change_max_layer"] <= 1.0
    assert 1.0 <= metrics["moe_load_imbalance"] <= metrics["moe_load_imbalance_max_layer"] <= 8.0
    assert metrics["ratio_spread_token"] > 0.0 and metrics["ratio_spread_sequence"] > 0.0
    assert "router_mismatch_share" not in metrics  # no routing records: nothing to compare
    assert trainer.router_hooks is not None and trainer.router_hooks.replay is None


def test_routing_replay_trains_on_the_engines_routing_and_measures_the_router_share(
    moe_policy: Any,
) -> None:
    trainer = Trainer(moe_policy, _cfg(moe={"routing_replay": True}), temperature=1.0)
    metrics = trainer.step(_groups(routed=True))
    assert metrics["routing_replayed_fraction"] == 1.0
    assert metrics["router_mismatch_own"] > 0.0 and metrics["router_mismatch_replayed"] > 0.0
    assert 0.0 <= metrics["router_mismatch_share"] <= 1.0
    assert trainer.router_hooks is not None and trainer.router_hooks.replay is None  # cleared after the step


def test_replay_changes_the_update_and_no_replay_ignores_the_records(moe_tiny_model_dir: Path) -> None:
    def params_after(cfg: LearnerConfig, routed: bool) -> dict[str, torch.Tensor]:
        model = load_policy(moe_tiny_model_dir)[0]
        Trainer(model, cfg, temperature=1.0).step(_groups(routed=routed))
        return {k: v.detach().clone() for k, v in model.named_parameters()}

    plain = params_after(_cfg(moe={"routing_metrics": False}), routed=False)
    ignored = params_after(_cfg(moe={"routing_metrics": False}), routed=True)
    replayed = params_after(_cfg(moe={"routing_replay": True, "routing_metrics": False}), routed=True)
    assert all(torch.equal(plain[k], ignored[k]) for k in plain)
    assert any(not torch.allclose(plain[k], replayed[k]) for k in plain)


def test_record_routing_without_replay_measures_with_an_engine_proximal(moe_policy: Any) -> None:
    trainer = Trainer(moe_policy, _cfg(moe={"record_routing": True}), temperature=1.0)
    metrics = trainer.step(_groups(routed=True))
    assert "router_mismatch_share" in metrics and "routing_replayed_fraction" in metrics
    assert metrics["routing_replayed_fraction"] == 0.0


def test_the_load_balancing_loss_keeps_the_routers_from_collapsing(moe_tiny_model_dir: Path) -> None:
    def imbalance_after(coef: float) -> dict[str, float]:
        model = load_policy(moe_tiny_model_dir)[0]
        trainer = Trainer(model, _cfg(moe={"load_balance_coef": coef}, optim={"lr": 3e-3}), temperature=1.0)
        for _ in range(8):
            metrics = trainer.step(_groups(routed=False))
        return metrics

    plain, balanced = imbalance_after(0.0), imbalance_after(0.1)
    assert "moe_load_balance_loss" not in plain
    assert 1.0 <= balanced["moe_load_balance_loss"] < plain["moe_load_imbalance"]
    assert balanced["moe_load_imbalance"] < plain["moe_load_imbalance"]


@pytest.mark.parametrize("key", ["routing_replay", "record_routing", "load_balance_coef"])
def test_routing_options_refuse_a_dense_model_naming_the_key(tiny_model_dir: Path, key: str) -> None:
    model = load_policy(tiny_model_dir)[0]
    value: Any = 0.1 if key == "load_balance_coef" else True
    with pytest.raises(ValueError, match=rf"learner\.moe\.{key} needs a Mixture-of-Experts model"):
        Trainer(model, _cfg(moe={key: value}), temperature=1.0)
    with pytest.raises(ValueError, match="Qwen3ForCausalLM is dense"):
        require_moe(model, f"learner.moe.{key}")


def test_a_dense_model_trains_without_routing_metrics(tiny_model_dir: Path) -> None:
    trainer = Trainer(load_policy(tiny_model_dir)[0], _cfg(), temperature=1.0)
    metrics = trainer.step(_groups(routed=False))
    assert trainer.router_hooks is None
    assert not any(key.startswith(("moe_", "router_", "routing_")) for key in metrics)
    assert "ratio_spread_token" in metrics


def test_an_moe_checkpoint_resumes_to_the_same_next_step(moe_tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = _cfg(moe={"routing_replay": True})
    first = Trainer(load_policy(moe_tiny_model_dir)[0], cfg, temperature=1.0)
    first.step(_groups(routed=True))
    save_checkpoint(tmp_path / "ckpt", first, consumed=ConsumedState(last_seq=1))
    resumed = Trainer(load_policy(moe_tiny_model_dir)[0], cfg, temperature=1.0)
    ckpt = load_latest_checkpoint(tmp_path / "ckpt")
    assert ckpt is not None
    restore(resumed, ckpt)
    first.step(_groups(routed=True))
    resumed.step(_groups(routed=True))
    a, b = dict(first.model.named_parameters()), dict(resumed.model.named_parameters())
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


# -------------------------------------------------------------------------------------- triage, LoRA
def test_a_record_that_does_not_fit_the_model_drops_the_group() -> None:
    rows = [row for group in _groups(routed=True) for row in group.rows]

    def verdict(routing: tuple[int, int, int]) -> TrainGroup | str:
        return triage_group("g", rows, learner_version=0, max_staleness=9, routing=routing)

    assert isinstance(verdict((2, 2, 8)), TrainGroup)
    assert verdict((3, 2, 8)) == "routing_mismatch"
    assert verdict((2, 2, 4)) == "routing_mismatch"
    bad = RoutedExperts(2, 2, 1, bytes([9, 1, 2, 3]))
    assert bad.model_problem(2, 2, 8) == "routed_experts names an expert id >= the model's 8 experts"
    assert "records 2 layers x top-2; the model routes 4 layers x top-2" in str(bad.model_problem(4, 2, 8))


def test_lora_on_an_moe_model_adapts_the_attention_and_trains(moe_policy: Any) -> None:
    policy = apply_lora(moe_policy, LoraConfig(enabled=True, rank=4, target_modules=["q_proj", "v_proj"]))
    assert policy.adapter_parameters()
    metrics = Trainer(policy.model, _cfg(), temperature=1.0).step(_groups(routed=False))
    assert metrics["optimizer_updates"] == 2.0 and "moe_routing_change" in metrics


def test_lora_refuses_an_moe_models_expert_and_router_names(moe_policy: Any) -> None:
    with pytest.raises(ValueError, match=r"learner\.lora\.target_modules: \[.*'gate_proj'.*3D parameters"):
        apply_lora(moe_policy, LoraConfig(enabled=True))  # the defaults name the dense MLP's projections
    with pytest.raises(ValueError, match=r"\['gate'\] are the MoE routers"):
        apply_lora(moe_policy, LoraConfig(enabled=True, target_modules=["q_proj", "gate"]))
