"""Learner options for real models: mismatch correction, LR schedules, and the accumulation weights of
the entropy bonus and the action prior. Hand-computed values; the trainer on the tiny preset."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from learner.adamw import lr_factor
from learner.loss.action_prior import action_token_ids
from learner.loss.gspo import gspo_token_loss
from learner.loss.mismatch import correct
from learner.model.model_io import load_policy
from learner.trainer import Trainer
from pipeline.contracts.config import ConfigError, load_config
from pipeline.contracts.learner_config import (
    ConstantSchedule,
    DecaySchedule,
    LearnerConfig,
)
from pipeline.contracts.schema import EpisodeSegment
from pipeline.supervisor.fleet.engine_launch import engine_argv, plan_engines
from tests.helpers.configs import learner_cfg
from tests.helpers.train_groups import groups_of

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# --- mismatch correction, pure ----------------------------------------------------------------------------
LOG2 = math.log(2.0)
# Two sequences of three generated tokens; log rho = proximal - engine per token.
PROX = torch.tensor([[-1.0 + LOG2, -1.0, -1.0 - LOG2], [-1.0 + 2 * LOG2, -1.0 + LOG2, -1.0]])
ENGINE = torch.full((2, 3), -1.0)
MASK = torch.ones(2, 3)


def _correct(**kw: Any) -> Any:
    args: dict[str, Any] = {"weights": "none", "cap": 2.0, "reject": "none", "band": (0.5, 2.0)} | kw
    return correct(PROX, ENGINE, MASK, **args)


def test_token_weights_are_truncated_ratios() -> None:
    c = _correct(weights="token", cap=3.0)
    # rho: [2, 1, 0.5] and [4, 2, 1]; 4 is truncated at 3.
    assert torch.allclose(c.weights, torch.tensor([[2.0, 1.0, 0.5], [3.0, 2.0, 1.0]]))
    assert (c.tokens, c.rejected_tokens, c.truncated_tokens) == (6, 0, 1)
    assert c.weight_sum == pytest.approx(9.5) and c.weight_max == pytest.approx(3.0)


def test_sequence_weights_are_the_truncated_product_on_every_token() -> None:
    c = _correct(weights="sequence", cap=10.0)
    # products: 2 * 1 * 0.5 = 1 and 4 * 2 * 1 = 8
    assert torch.allclose(c.weights, torch.tensor([[1.0, 1.0, 1.0], [8.0, 8.0, 8.0]]))
    capped = _correct(weights="sequence", cap=2.0)
    assert torch.allclose(capped.weights[1], torch.full((3,), 2.0)) and capped.truncated_tokens == 3


def test_rejection_levels() -> None:
    token = _correct(reject="token", band=(0.6, 2.5))  # drops 0.5 and 4
    assert token.keep.tolist() == [[True, True, False], [False, True, True]]
    sequence = _correct(reject="sequence", band=(0.5, 4.0))  # products 1 and 8: the second goes
    assert sequence.keep.tolist() == [[True] * 3, [False] * 3] and sequence.rejected_tokens == 3
    geometric = _correct(reject="geometric", band=(0.5, 1.9))  # geometric means 1 and 2
    assert geometric.keep.tolist() == [[True] * 3, [False] * 3]
    assert torch.equal(geometric.weights[1], torch.zeros(3))  # a rejected token weighs nothing


def test_masked_positions_are_ignored_even_when_not_finite() -> None:
    prox = PROX.clone()
    prox[0, 2] = math.nan
    mask = MASK.clone()
    mask[0, 2] = 0.0
    c = correct(prox, ENGINE, mask, weights="sequence", cap=10.0, reject="token", band=(0.5, 4.5))
    assert c.tokens == 5 and c.weights[0].tolist() == [2.0, 2.0, 0.0]
    with pytest.raises(ValueError, match="share one"):
        correct(PROX, ENGINE[:, :2], MASK, weights="none", cap=2.0, reject="none", band=(0.5, 2.0))


def test_token_weights_scale_each_token_loss_and_gradient() -> None:
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old = lp.detach().clone()
    adv = torch.tensor([[1.0, 1.0]])
    mask = torch.ones(1, 2)
    w = torch.tensor([[0.5, 2.0]])
    loss, stats = gspo_token_loss(lp, old, adv, mask, level="token", token_weights=w)
    # on-policy: r = 1 on both tokens; loss = -(0.5 + 2.0) / 2 per the sequence's token mean
    assert float(loss.detach()) == pytest.approx(-1.25)
    loss.backward()
    assert lp.grad is not None and torch.allclose(lp.grad, torch.tensor([[-0.25, -1.0]]))
    assert float(stats["clip_fraction"]) == 0.0


# --- configuration ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["learner.mismatch.proximal='engine'", "learner.mismatch.is_weights='token'"],
            r"learner\.mismatch\.is_weights = 'token' needs",
        ),
        (
            [
                "learner.mismatch.proximal='engine'",
                "learner.mismatch.is_weights='none'",
                "learner.mismatch.reject='geometric'",
            ],
            r"learner\.mismatch\.reject = 'geometric' needs",
        ),
        (["learner.mismatch.reject_band=[1.1, 2.0]"], "reject_band must satisfy"),
        (["learner.mismatch.is_cap=0.5"], r"is_cap"),
        (
            ["learner.schedule.kind='cosine'"],
            r"learner\.schedule\.decay_steps: Field required \(learner\.schedule\.kind = 'cosine'\)",
        ),
        (["learner.schedule.decay_steps=5"], r"learner\.schedule\.decay_steps: Extra inputs"),
    ],
)
def test_bad_learner_options_name_the_key(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_engine_dtype_reaches_the_engine_command_line(tmp_path: Path) -> None:
    cfg = load_config(None, ["engine.port=0", "engine.dtype='bfloat16'"])
    argv = engine_argv(cfg, plan_engines(cfg)[0], model_dir=tmp_path, version=0)
    assert argv[argv.index("--dtype") + 1] == "bfloat16"
    default = load_config(None, ["engine.port=0"])
    assert "--dtype" not in engine_argv(default, plan_engines(default)[0], model_dir=tmp_path, version=0)


# --- learning-rate schedule ---------------------------------------------------------------------------------
def test_lr_factor_warms_up_then_decays_to_the_floor() -> None:
    linear = lr_factor(DecaySchedule(kind="linear", warmup_steps=2, decay_steps=4, min_ratio=0.2))
    assert [round(linear(u), 6) for u in range(8)] == [0.5, 1.0, 1.0, 0.8, 0.6, 0.4, 0.2, 0.2]
    cosine = lr_factor(DecaySchedule(kind="cosine", warmup_steps=0, decay_steps=4, min_ratio=0.0))
    assert [round(cosine(u), 6) for u in range(6)] == [1.0, 0.853553, 0.5, 0.146447, 0.0, 0.0]
    constant = lr_factor(ConstantSchedule(warmup_steps=4))
    assert [constant(u) for u in (0, 3, 100)] == [0.25, 1.0, 1.0]


# --- the trainer -------------------------------------------------------------------------------------------
@pytest.fixture
def policy(tiny_model_dir: Path) -> tuple[Any, Any]:
    torch.manual_seed(0)
    return load_policy(tiny_model_dir)


def _prompt(tokenizer: Any) -> list[int]:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Guess my number from 1 to 16."}],
        tokenize=True,
        add_generation_prompt=True,
    )
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _group(
    tokenizer: Any, name: str, *, engine_shift: float = 0.0, outcomes: tuple[float, ...] = (1, 0, 1, 0)
) -> list[EpisodeSegment]:
    """Four one-turn episodes answering "12" or "3" with an end token; engine log-probs -2.0 + shift."""
    prompt, end = _prompt(tokenizer), tokenizer.eos_token_id
    rows = []
    for i, outcome in enumerate(outcomes):
        answer = tokenizer.encode("12" if i % 2 == 0 else "3")
        action = [*answer, end]
        n, k = len(prompt), len(action)
        rows.append(
            EpisodeSegment(
                episode_id=f"{name}-{i}",
                group_id=name,
                task_id="t",
                env="guess-number",
                token_ids=prompt + action,
                prompt_len=n,
                loss_mask=[0] * n + [1] * k,
                logprobs=[0.0] * n + [-2.0 + engine_shift] * k,
                turn_index=[-1] * n + [0] * k,
                versions=[-1] * n + [0] * k,
                turn_rewards=[0.0],
                outcome=float(outcome),
                num_turns=1,
                finish_reason="stop",
            )
        )
    return rows


def _cfg(**kw: Any) -> LearnerConfig:
    """The toy's mechanics: no warm-up, engine log-probs as the old policy unless a test says otherwise."""
    base = {"lr": 1e-3, "mini_batches": 2, "device": "cpu", "warmup_steps": 0}
    return learner_cfg(**(base | {"mismatch": {"proximal": "engine", "is_weights": "none"}} | kw))


def test_learner_proximal_reports_weights_truncation_and_rejection(policy: tuple[Any, Any]) -> None:
    model, tokenizer = policy
    # The seed-0 tiny model gives these tokens log-probs -6.86, -6.45 ("12", end) and -6.50, -6.44
    # ("3", end); with the engine at -6.65 the ratios are 0.81, 1.22, 1.16 and 1.23.
    rows = _group(tokenizer, "g", engine_shift=-4.65)
    mismatch = {
        "proximal": "learner",
        "is_weights": "token",
        "is_cap": 1.2,
        "reject": "token",
        "reject_band": (0.9, 10.0),
    }
    metrics = Trainer(model, _cfg(mismatch=mismatch), temperature=1.0).step(groups_of(rows))
    # Rejected: the two 0.81 tokens of 8. Truncated: the 1.22 and 1.23 tokens, 4 of the 6 kept.
    assert metrics["rejected_fraction"] == pytest.approx(2 / 8)
    assert metrics["is_truncated_fraction"] == pytest.approx(4 / 6)
    assert metrics["is_weight_max"] == pytest.approx(1.2)
    assert 1.15 < metrics["is_weight_mean"] < 1.2
    assert metrics["mismatch_abs_mean_lag0"] == pytest.approx((0.211 + 0.202 + 0.149 + 0.209) / 4, abs=0.01)
    assert metrics["mismatch_abs_mean_lag1plus"] == 0.0
    engine = Trainer(model, _cfg(), temperature=1.0).step(groups_of(rows))
    assert (engine["is_weight_mean"], engine["rejected_fraction"], engine["is_truncated_fraction"]) == (
        1,
        0,
        0,
    )


def test_a_step_whose_every_token_is_rejected_changes_no_weight(policy: tuple[Any, Any]) -> None:
    model, tokenizer = policy
    rows = _group(tokenizer, "g", engine_shift=-4.65)  # ratios 0.81, 1.22, 1.16, 1.23 (test above)
    mismatch = {"proximal": "learner", "reject": "token", "reject_band": (0.95, 1.05)}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = Trainer(model, _cfg(mismatch=mismatch, weight_decay=0.1), temperature=1.0)
    metrics = trainer.step(groups_of(rows))
    assert metrics["rejected_fraction"] == 1.0
    assert (metrics["optimizer_updates"], metrics["skipped_updates_empty"]) == (0, 2)  # both mini-batches
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_learner_proximal_on_policy_equals_the_engine_path(tiny_model_dir: Path) -> None:
    """With engine log-probs equal to the learner's, decoupled PPO without weights is the same update."""
    first, tokenizer = load_policy(tiny_model_dir)
    second, _ = load_policy(tiny_model_dir)
    prompt = _prompt(tokenizer)
    rows = _group(tokenizer, "g")
    with torch.no_grad():  # replace the engine's log-probs by the model's own
        for row in rows:
            logits = first(input_ids=torch.tensor([row.token_ids])).logits[0].double()
            lp = torch.log_softmax(logits, dim=-1)
            row.logprobs = [0.0] * len(prompt) + [
                float(lp[t - 1, row.token_ids[t]]) for t in range(len(prompt), len(row.token_ids))
            ]
    a = Trainer(first, _cfg(mini_batches=1), temperature=1.0).step(groups_of(rows))
    b = Trainer(second, _cfg(mini_batches=1, mismatch={"proximal": "learner"}), temperature=1.0).step(
        groups_of(rows)
    )
    assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)


def test_entropy_bonus_and_prior_keep_their_weight_under_accumulation(tiny_model_dir: Path) -> None:
    """Two micro-batches accumulated into one update give the gradient of one whole batch (before the
    fix the bonus and the prior were added once per micro-batch, doubling their gradient)."""
    norms = []
    for mini_batches, accum in ((1, 1), (2, 2)):
        model, tokenizer = load_policy(tiny_model_dir)
        ids = action_token_ids(tokenizer, [str(n) for n in range(1, 17)])
        cfg = _cfg(mini_batches=mini_batches, grad_accum=accum, entropy_coef=0.5, action_prior_coef=0.5)
        # every episode scored the same: no policy-gradient signal, only the bonus and the prior
        rows = _group(tokenizer, "g", outcomes=(1, 1, 1, 1))
        metrics = Trainer(model, cfg, temperature=1.0, action_token_ids=ids).step(groups_of(rows))
        assert metrics["optimizer_updates"] == 1.0
        norms.append(metrics["grad_norm"])
    assert norms[1] == pytest.approx(norms[0], rel=1e-5)


# --- precision and memory ----------------------------------------------------------------------------------
def _on_policy(model: Any, rows: list[EpisodeSegment], prompt_len: int) -> None:
    """Set the rows' engine log-probs to the fp32 model's own (an fp32 engine on the same weights)."""
    with torch.no_grad():
        for row in rows:
            lp = torch.log_softmax(model(input_ids=torch.tensor([row.token_ids])).logits[0].double(), dim=-1)
            row.logprobs = [0.0] * prompt_len + [
                float(lp[t - 1, row.token_ids[t]]) for t in range(prompt_len, len(row.token_ids))
            ]


def test_precision_modes_keep_the_right_dtypes_and_show_bf16_numerics(tiny_model_dir: Path) -> None:
    results = {}
    for precision, weights in (("fp32", "float32"), ("bf16-mixed", "float32"), ("bf16", "bfloat16")):
        model, tokenizer = load_policy(tiny_model_dir, dtype=weights)
        reference, _ = load_policy(tiny_model_dir)
        rows = _group(tokenizer, "g")
        _on_policy(reference, rows, len(_prompt(tokenizer)))
        trainer = Trainer(model, _cfg(mini_batches=1, precision=precision), temperature=1.0)
        metrics = trainer.step(groups_of(rows))
        assert math.isfinite(metrics["loss"]) and metrics["optimizer_updates"] == 1.0
        state = next(iter(trainer.optimizer.state.values()))
        results[precision] = (
            metrics["mismatch_abs_mean_lag0"],
            next(model.parameters()).dtype,
            state["exp_avg"].dtype,
        )
    assert results["fp32"][0] < 1e-5  # the same numerics as the fp32 "engine"
    assert results["bf16-mixed"][0] > 1e-3  # bf16 compute: its log-prob spacing shows
    assert results["bf16-mixed"][1:] == (torch.float32, torch.float32)  # master weights and moments in fp32
    assert results["bf16"][1:] == (torch.bfloat16, torch.bfloat16)


def test_auto_precision_is_bf16_mixed_where_bf16_matmuls_are_native(monkeypatch: pytest.MonkeyPatch) -> None:
    import learner.model.precision
    from learner.model.precision import resolve_precision

    monkeypatch.setattr(learner.model.precision, "native_bf16", lambda: (False, "no avx512_bf16"))
    assert resolve_precision("auto", torch.device("cpu")).name == "fp32"
    monkeypatch.setattr(learner.model.precision, "native_bf16", lambda: (True, "avx512_bf16"))
    assert resolve_precision("auto", torch.device("cpu")).name == "bf16-mixed"
    assert resolve_precision("auto", torch.device("cuda")).name == "bf16-mixed"
    with pytest.raises(ValueError, match="unknown precision"):
        resolve_precision("fp8", torch.device("cpu"))


def test_gradient_checkpointing_gives_the_same_step(tiny_model_dir: Path) -> None:
    results = []
    for checkpointing in (False, True):
        model, tokenizer = load_policy(tiny_model_dir)
        cfg = _cfg(mini_batches=1, gradient_checkpointing=checkpointing)
        results.append(Trainer(model, cfg, temperature=1.0).step(groups_of(_group(tokenizer, "g"))))
        layers = [m for m in model.modules() if hasattr(m, "gradient_checkpointing")]
        assert layers and all(m.gradient_checkpointing == checkpointing for m in layers)
    assert results[1]["loss"] == pytest.approx(results[0]["loss"], abs=1e-7)
    assert results[1]["grad_norm"] == pytest.approx(results[0]["grad_norm"], rel=1e-5)


def test_a_run_directory_written_with_dtype_is_refused_naming_precision(tmp_path: Path) -> None:
    old = tmp_path / "config.toml"
    old.write_text('[learner]\ndtype = "float32"\n')
    with pytest.raises(ConfigError, match=r"learner\.dtype is learner\.precision now"):
        load_config(old)


@pytest.mark.slow
@pytest.mark.timeout(900)  # eight variants, each a process of its own that loads the model
def test_learner_bench_measures_every_variant_against_fp32() -> None:
    """Each variant in its own process; on the tiny preset checkpointing and bf16 weights cut the peak.

    Long replies after a short prompt: the baseline's shared-prompt forward (off under checkpointing)
    then saves little, and the peaks (~50 MiB against ~5 with 128 + 128 tokens, where a CI run read
    checkpointing at 1.09x) stand well above the allocator's page-level noise."""
    from pipeline.tools.bench.learner_step import run

    shape = ["--preset", "tiny", "--repeats", "1", "--groups", "2", "--prompt", "32", "--generated", "480"]
    report = run([*shape, "--threads", "1"])  # a second thread would spin against the other pytest worker
    results = report["results"]
    assert list(results) == [
        "fp32", "fp32+ckpt", "bf16-mixed", "bf16-mixed+ckpt", "bf16", "fp32+lora", "bf16-mixed+lora",
        "bf16-mixed+unshared",
    ]  # fmt: skip
    assert results["fp32"]["time_ratio"] == 1.0 and results["fp32"]["memory_ratio"] == 1.0
    assert all(r["peak_extra_bytes"] > 0 and r["seconds"] > 0 for r in results.values())
    assert results["fp32+ckpt"]["memory_ratio"] < 0.9
    assert results["bf16"]["memory_ratio"] < 0.9
    assert results["fp32+lora"]["memory_ratio"] < 1.0  # no AdamW state or gradients of the base weights
    assert report["auto"] in ("fp32", "bf16-mixed")


def test_a_variant_that_fails_is_named_with_its_error(tmp_path: Path) -> None:
    from pipeline.tools.bench.learner_step import _in_forked_processes

    with pytest.raises(RuntimeError, match=r"variant bf16-mixed\+lora failed: .*missing"):
        _in_forked_processes(tmp_path / "missing", ["bf16-mixed+lora"], ["--preset", "tiny"])


# --- regularisers ------------------------------------------------------------------------------------------
def test_kl_estimators_hand_computed() -> None:
    from learner.loss.regularizers import kl_estimate

    lp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0]])  # d = ref - lp = [-0.5, 1.0]
    assert torch.allclose(kl_estimate(lp, ref, "k1"), torch.tensor([[0.5, -1.0]]))
    assert torch.allclose(kl_estimate(lp, ref, "k2"), torch.tensor([[0.125, 0.5]]))
    expected_k3 = [math.exp(-0.5) - 1 + 0.5, math.e - 1 - 1.0]
    assert torch.allclose(kl_estimate(lp, ref, "k3"), torch.tensor([expected_k3]))
    with pytest.raises(ValueError, match="k1, k2 or k3"):
        kl_estimate(lp, ref, "k4")  # type: ignore[arg-type]


def test_overlong_penalty_is_dapos_ramp() -> None:
    from learner.loss.regularizers import overlong_penalty

    assert [overlong_penalty(n, budget=10, slope=4) for n in (0, 6, 7, 8, 10, 11)] == [
        0.0,
        0.0,
        -0.25,
        -0.5,
        -1.0,
        -1.0,
    ]
    assert (
        overlong_penalty(10, budget=10, slope=0) == 0.0 and overlong_penalty(11, budget=10, slope=0) == -1.0
    )
    with pytest.raises(ValueError, match="slope"):
        overlong_penalty(1, budget=4, slope=5)


def test_overlong_penalty_reaches_the_turn_advantages(policy: tuple[Any, Any]) -> None:
    from learner.step_input import build_step_input

    _, tokenizer = policy
    rows = _group(tokenizer, "g", outcomes=(1, 1, 1, 1))  # no signal except the penalty
    for row in rows[:2]:  # two answers get three more generated tokens
        for field, extra in (
            ("token_ids", 7),
            ("loss_mask", 1),
            ("logprobs", -2.0),
            ("turn_index", 0),
            ("versions", 0),
        ):
            getattr(row, field).extend([extra] * 3)
    lengths = [sum(r.loss_mask) for r in rows]
    assert lengths[0] == lengths[2] + 3 and lengths[1] == lengths[3] + 3
    budget = max(lengths[2:])  # the short ones fit exactly, the long ones are over
    plain = build_step_input(groups_of(rows), estimator="turn", gamma=1.0, lam=1.0)
    penalised = build_step_input(groups_of(rows), estimator="turn", gamma=1.0, lam=1.0, overlong=(budget, 0))
    assert plain.skipped_zero_adv_groups == 1 and plain.sequences == []
    assert (penalised.overlong_turns, penalised.turns) == (2, 4)
    # Rewards -1, -1, 0, 0: the long turns get a negative advantage, the short ones a positive one.
    assert [seq.advantages[-1] < 0 for seq in penalised.sequences] == [True, True, False, False]
    assert [seq.advantages[-1] > 0 for seq in penalised.sequences] == [False, False, True, True]


def test_kl_to_a_reference_that_equals_the_policy_is_zero_then_grows(tiny_model_dir: Path) -> None:
    model, tokenizer = load_policy(tiny_model_dir)
    reference, _ = load_policy(tiny_model_dir)
    with pytest.raises(ValueError, match="reference"):
        Trainer(model, _cfg(kl_coef=0.1), temperature=1.0)
    trainer = Trainer(model, _cfg(lr=1e-2, mini_batches=1, kl_coef=0.1), temperature=1.0, reference=reference)
    first = trainer.step(groups_of(_group(tokenizer, "g")))
    second = trainer.step(groups_of(_group(tokenizer, "h")))
    assert first["kl_reference"] == pytest.approx(0.0, abs=1e-7)  # trained on the reference's own weights
    assert second["kl_reference"] > 1e-4  # one update later the policy has moved away
    assert not any(p.requires_grad for p in reference.parameters())
    off = Trainer(load_policy(tiny_model_dir)[0], _cfg(mini_batches=1), temperature=1.0)
    assert off.step(groups_of(_group(tokenizer, "g")))["kl_reference"] == 0.0


def test_kl_in_reward_mode_shifts_the_advantages_by_the_estimate(tiny_model_dir: Path) -> None:
    from learner.model.model_init import init_model

    def step(reference_dir: Path | None, **kw: Any) -> dict[str, float]:
        model, tokenizer = load_policy(tiny_model_dir)
        reference = load_policy(reference_dir)[0] if reference_dir is not None else None
        rows = _group(tokenizer, "g")
        _on_policy(model, rows, len(_prompt(tokenizer)))  # ratio 1: the loss is -token_mean(A)
        cfg = _cfg(mini_batches=1, loss_agg="token_mean", **kw)
        return Trainer(model, cfg, temperature=1.0, reference=reference).step(groups_of(rows))

    plain = step(None)
    same = step(tiny_model_dir, kl_coef=0.5, kl_mode="reward")
    assert same["loss"] == pytest.approx(plain["loss"], abs=1e-7)  # kl = 0: nothing shifts
    other_dir = init_model(tiny_model_dir.parent / "other-ref", preset="tiny", seed=1)
    other = step(other_dir, kl_coef=0.5, kl_mode="reward", kl_estimator="k1")
    # k1 = log pi - log pi_ref per token; the advantages drop by 0.5 k1, so the on-policy loss
    # -token_mean(A) rises by 0.5 x the token mean of k1.
    assert other["loss"] == pytest.approx(plain["loss"] + 0.5 * other["kl_reference"], rel=1e-4, abs=1e-6)


def test_overlong_slope_beyond_the_budget_names_the_key() -> None:
    with pytest.raises(
        ConfigError, match=r"learner\.regularizers: Value error, overlong_slope must be <= overlong_budget"
    ):
        load_config(None, ["learner.regularizers.overlong_budget=8", "learner.regularizers.overlong_slope=9"])


def test_fused_log_probs_train_like_the_logits_path(tiny_model_dir: Path) -> None:
    """Same loss, entropy, gradient and weights after a step, with the entropy bonus and the action prior
    on (they take logits rows at generated positions and turn starts)."""
    from learner.policy_forward import fused_head

    results, weights = [], []
    for fused in (False, True):
        model, tokenizer = load_policy(tiny_model_dir)
        assert fused_head(model) is model.get_output_embeddings()
        ids = action_token_ids(tokenizer, [str(n) for n in range(1, 17)])
        cfg = _cfg(mini_batches=2, fused_logprobs=fused, entropy_coef=0.1, action_prior_coef=0.2)
        trainer = Trainer(model, cfg, temperature=0.8, action_token_ids=ids)
        results.append(trainer.step(groups_of(_group(tokenizer, "g"))))
        weights.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    for key in ("loss", "entropy", "grad_norm", "mismatch_abs_mean"):
        assert results[1][key] == pytest.approx(results[0][key], rel=1e-5, abs=1e-7), key
    # AdamW divides by sqrt(v): a near-zero gradient's float noise still moves a weight by up to ~lr (1e-3)
    assert (weights[1] - weights[0]).abs().max() < 1e-4


def test_scored_positions_alone_give_the_same_log_probs_and_gradients(tiny_model_dir: Path) -> None:
    """The output layer runs only where something is scored: equal values there, 0.0 elsewhere, and the
    same gradients (what is not scored contributed nothing to them before either)."""
    from learner.model.precision import resolve_precision
    from learner.policy_forward import forward_policy

    cpu = torch.device("cpu")
    model, _ = load_policy(tiny_model_dir)
    ids = torch.randint(3, model.config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(0))
    inputs, targets = ids[:, :-1], ids[:, 1:]
    attention = torch.ones_like(inputs)
    scored = torch.zeros_like(targets, dtype=torch.bool)
    scored[0, 5:] = scored[2, 2:4] = True  # row 1: a prompt-only row, nothing scored
    grads = []
    outs = []
    for only in (None, scored):
        model.zero_grad(set_to_none=True)
        out = forward_policy(
            model, inputs, attention, targets, temperature=0.7, precision=resolve_precision("fp32", cpu),
            device=cpu, fused=True, scored=only,
        )  # fmt: skip
        (out.logprobs * scored).sum().backward()
        outs.append(out.logprobs.detach())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert torch.allclose(outs[1][scored], outs[0][scored], atol=1e-6)
    assert (outs[1][~scored] == 0.0).all()
    assert torch.allclose(grads[1], grads[0], atol=1e-6)
