"""Parity fixtures of the learner's `Trainer`: one seeded `step()` of every variant it has, recorded.

For each variant (VARIANTS) the same fixed groups go through one step of a fresh trainer on the tiny or
moe-tiny preset (seed 0), on one CPU thread. Recorded: the value of every loss that is backpropagated
(one per micro-batch), at every optimizer update the gradients (a SHA-256 of their bytes and a fixed
sample of values), the parameters after the step (a SHA-256, and a sample of their change), the step's
metrics (less its timings) and the token trace where the variant traces.

`python -m tests.learner.parity.capture_trainer` rewrites fixtures/trainer.json and
fixtures/trainer.safetensors from the code as it is, with the CPU and torch version they were made on;
test_trainer_parity.py recomputes every variant and compares.
"""

from __future__ import annotations

import hashlib
import json
import platform
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from learner.groups import TrainGroup
from learner.model.lora import apply_lora
from learner.model.model_init import init_model
from learner.model.model_io import load_policy
from learner.trace import StepTracer
from learner.trainer import Trainer
from pipeline.contracts.learner_config import LearnerConfig, LoraConfig
from pipeline.contracts.schema import EpisodeSegment, RoutedExperts
from tests.helpers.train_groups import groups_of

FIXTURES = Path(__file__).resolve().parent / "fixtures"
JSON_FILE, TENSOR_FILE = "trainer.json", "trainer.safetensors"
SAMPLES_PER_TENSOR = 8
TIMINGS = ("tokens_per_s", "step_time_s")
ACTION_IDS = (20, 21, 25, 26, 40, 41)
_MOE_LAYERS, _MOE_TOPK, _MOE_EXPERTS = 2, 2, 8  # moe-tiny
TEMPERATURE = 0.9
NOISE = 0.15


@dataclass(frozen=True)
class Variant:
    """One trainer set-up: the config tables over BASE, and what the trainer is built with."""

    cfg: dict[str, Any] = field(default_factory=dict)
    preset: str = "tiny"
    lora: bool = False
    reference: str | None = None  # "copy": a second loaded model; "adapter_off": the LoRA base
    action_prior: bool = False
    reuse_first_forward: bool = True  # False: the proximal pass runs even where the first forward could do
    routed: bool = False  # the rows carry routing records (moe-tiny only)
    trace: bool = False


BASE: dict[str, Any] = {
    "precision": "fp32",
    "device": "cpu",
    "optim": {"lr": 1e-3},
    "schedule": {"warmup_steps": 0},
    "loss": {"kind": "grpo", "clip_low": 0.2, "clip_high": 0.27},
    "mini_batches": 2,
    "mismatch": {"proximal": "engine", "is_weights": "none"},
    "shared_prefix": False,
}
_LEARNER = {"proximal": "learner", "is_weights": "token"}

VARIANTS: dict[str, Variant] = {
    "engine": Variant(),
    "gspo_token": Variant({"loss": {"kind": "gspo_token", "clip_low": 3e-4, "clip_high": 4e-4}}),
    "gspo_sequence_token_mean": Variant(
        {"loss": {"kind": "gspo", "clip_low": 3e-4, "clip_high": 4e-4, "agg": "token_mean"}}
    ),
    "grad_accum": Variant({"mini_batches": 4, "optim": {"lr": 1e-3, "grad_accum": 2}}),
    "bf16_mixed": Variant({"precision": "bf16-mixed"}),
    "shared_prefix": Variant({"shared_prefix": True, "regularizers": {"entropy_coef": 0.01}}),
    "learner_first_forward": Variant({"mismatch": _LEARNER}),
    "learner_separate_pass": Variant({"mismatch": _LEARNER}, reuse_first_forward=False),
    "learner_sequence_weights": Variant({"mismatch": {"proximal": "learner", "is_weights": "sequence"}}),
    "learner_reject_token": Variant({"mismatch": {**_LEARNER, "reject": "token", "reject_band": (0.9, 1.1)}}),
    "learner_reject_geometric": Variant(
        {
            "mismatch": {
                "proximal": "learner",
                "is_weights": "none",
                "reject": "geometric",
                "reject_band": (0.97, 1.03),
            }
        }
    ),
    "kl_loss_k3": Variant({"regularizers": {"kl_coef": 0.05}}, reference="copy"),
    "kl_reward_k1": Variant(
        {"regularizers": {"kl_coef": 0.05, "kl_mode": "reward", "kl_estimator": "k1"}}, reference="copy"
    ),
    "entropy_decay": Variant({"regularizers": {"entropy_coef": 0.02, "entropy_decay_steps": 4}}),
    "action_prior": Variant(
        {"regularizers": {"action_prior_coef": 0.05, "action_prior_decay_steps": 10}}, action_prior=True
    ),
    "overlong_outcome_token_mean": Variant(
        {
            "regularizers": {"overlong_budget": 4, "overlong_slope": 2},
            "advantages": {"estimator": "outcome"},
            "loss": {"kind": "grpo", "clip_low": 0.2, "clip_high": 0.27, "agg": "token_mean"},
        }
    ),
    "all_terms_traced": Variant(
        {
            "mismatch": _LEARNER,
            "regularizers": {"kl_coef": 0.05, "entropy_coef": 0.01, "action_prior_coef": 0.05},
            "fused_logprobs": False,
        },
        reference="copy",
        action_prior=True,
        trace=True,
    ),
    "lora": Variant({"lora": {"enabled": True, "rank": 4, "alpha": 8}}, lora=True),
    "lora_kl_adapter_off_bf16": Variant(
        {
            "lora": {"enabled": True, "rank": 4, "alpha": 8},
            "regularizers": {"kl_coef": 0.05},
            "precision": "bf16-mixed",
            "mismatch": _LEARNER,
        },
        lora=True,
        reference="adapter_off",
    ),
    "moe_own_routing": Variant(preset="moe-tiny"),
    "moe_no_metrics": Variant({"moe": {"routing_metrics": False}}, preset="moe-tiny", routed=True),
    "moe_record": Variant({"moe": {"record_routing": True}}, preset="moe-tiny", routed=True),
    "moe_replay_learner": Variant(
        {"moe": {"routing_replay": True}, "mismatch": _LEARNER}, preset="moe-tiny", routed=True
    ),
    "moe_replay_balance": Variant(
        {"moe": {"routing_replay": True, "load_balance_coef": 0.01}, "regularizers": {"entropy_coef": 0.01}},
        preset="moe-tiny",
        routed=True,
    ),
    "moe_balance_own_routing_reject": Variant(
        {
            "moe": {"load_balance_coef": 0.01},
            "mismatch": {**_LEARNER, "reject": "sequence", "reject_band": (0.5, 2.0)},
        },
        preset="moe-tiny",
    ),
}


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        out[key] = (
            _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
        )
    return out


def config_of(variant: Variant) -> LearnerConfig:
    return LearnerConfig.model_validate(_merge(BASE, variant.cfg))


def _record(positions: int, seed: int) -> RoutedExperts:
    """A moe-tiny routing record of `positions` positions (distinct experts in each top-k)."""
    gen = torch.Generator().manual_seed(seed)
    ids = [
        e
        for _ in range(positions * _MOE_LAYERS)
        for e in torch.randperm(_MOE_EXPERTS, generator=gen)[:_MOE_TOPK].tolist()
    ]
    return RoutedExperts(
        layers=_MOE_LAYERS, topk=_MOE_TOPK, width=1, ids=RoutedExperts.encode(ids, layers=2, topk=2, width=1)
    )


def _segment(group: int, member: int) -> EpisodeSegment:
    """A two-turn episode (the second turn only for odd members) after a prompt its group shares, with
    versions 0 and 1 (the trainer starts at version 1); log-probs are filled in by `batch_groups`."""
    prompt = [5, 6, 7, 8 + group, 9]
    turns = [[20 + 5 * group + member, 40 + member, 25 + group, 2]]
    if member % 2:
        turns.append([26, 41 + group, 2])
    tokens, mask, turn_index, versions = (
        list(prompt),
        [0] * len(prompt),
        [-1] * len(prompt),
        [-1] * len(prompt),
    )
    for k, action in enumerate(turns):
        if k:
            reply = [11, 12 + member]
            tokens += reply
            mask += [0] * len(reply)
            turn_index += [-1] * len(reply)
            versions += [-1] * len(reply)
        tokens += action
        mask += [1] * len(action)
        turn_index += [k] * len(action)
        versions += [(member + k) % 2] * len(action)
    return EpisodeSegment(
        episode_id=f"g{group}e{member}",
        group_id=f"g{group}",
        task_id="task",
        env="test-env",
        token_ids=tokens,
        prompt_len=len(prompt),
        loss_mask=mask,
        logprobs=[0.0] * len(tokens),
        turn_index=turn_index,
        versions=versions,
        turn_rewards=[0.1 * member - 0.1 * k for k in range(len(turns))],
        outcome=float((member + group) % 3 == 0),
        num_turns=len(turns),
        finish_reason="stop",
    )


@torch.no_grad()
def _engine_logprobs(model: Any, row: EpisodeSegment, seed: int) -> list[float]:
    """The model's own log-probs of the row's generated tokens at TEMPERATURE, plus noise of up to
    +-NOISE nats (an engine's numerics and staleness), 0.0 elsewhere."""
    ids = torch.tensor([row.token_ids])
    logits = model(input_ids=ids).logits[0, :-1].float() / TEMPERATURE
    own = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None])[:, 0]
    noise = (torch.rand(own.shape[0], generator=torch.Generator().manual_seed(seed)) * 2 - 1) * NOISE
    values = [0.0, *(own + noise).tolist()]
    return [v if m else 0.0 for v, m in zip(values, row.loss_mask, strict=True)]


def batch_groups(model_dir: Path, *, routed: bool) -> list[TrainGroup]:
    """Three groups of four episodes; the last group's members all score alike (no policy gradient)."""
    model, _ = load_policy(model_dir)
    model.eval()
    rows = []
    for g in range(3):
        for m in range(4):
            row = _segment(g, m)
            if g == 2:
                row.turn_rewards = [0.0] * len(row.turn_rewards)
                row.outcome = 1.0
            row.logprobs = _engine_logprobs(model, row, seed=10 * g + m)
            if routed and m != 3:  # one row without a record: it routes on its own
                row.routed_experts = _record(len(row.token_ids) - 1, seed=10 * g + m)
            rows.append(row)
    return groups_of(rows)


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(_bytes(t))
    return h.hexdigest()


def _sample(tensors: list[torch.Tensor]) -> torch.Tensor:
    """SAMPLES_PER_TENSOR evenly spaced values of each tensor, in fp32, one vector."""
    parts = []
    for t in tensors:
        flat = t.detach().float().cpu().reshape(-1)
        index = torch.linspace(0, flat.numel() - 1, min(flat.numel(), SAMPLES_PER_TENSOR)).long()
        parts.append(flat[index])
    return torch.cat(parts)


@contextmanager
def _recorded_backwards(losses: list[float]) -> Iterator[None]:
    """Every Tensor.backward() inside records the value it backpropagates."""
    original: Callable[..., Any] = torch.Tensor.backward

    def backward(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        losses.append(float(self.detach()))
        return original(self, *args, **kwargs)

    torch.Tensor.backward = backward  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.backward = original  # type: ignore[method-assign]


def build_trainer(variant: Variant, model_dirs: dict[str, Path]) -> Trainer:
    torch.manual_seed(0)
    cfg = config_of(variant)
    model, _ = load_policy(model_dirs[variant.preset])
    reference: Any = None
    if variant.lora:
        policy = apply_lora(model, LoraConfig.model_validate(_merge(BASE, variant.cfg)["lora"]), seed=0)
        model = policy.model
        if variant.reference == "adapter_off":
            reference = policy.adapter_off()
    if variant.reference == "copy":
        reference = load_policy(model_dirs[variant.preset])[0]
    trainer = Trainer(
        model,
        cfg,
        temperature=TEMPERATURE,
        seed=3,
        action_token_ids=ACTION_IDS if variant.action_prior else (),
        reference=reference,
        tracer=StepTracer(groups_per_step=2) if variant.trace else None,
    )
    trainer.proximal_from_first_forward = variant.reuse_first_forward and trainer.proximal_from_first_forward
    trainer.load_counters({"steps": 0, "optimizer_updates": 0, "policy_version": 1})
    return trainer


def run_variant(
    variant: Variant, model_dirs: dict[str, Path]
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """One step of `variant`: its JSON record and its sampled tensors."""
    trainer = build_trainer(variant, model_dirs)
    trained = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    before = [p.detach().clone() for p in trained]
    grads: list[tuple[str, torch.Tensor]] = []

    def on_update(optimizer: Any, args: Any, kwargs: Any) -> None:
        g = [p.grad if p.grad is not None else torch.zeros_like(p) for p in trained]
        grads.append((_digest(g), _sample(g)))

    handle = trainer.optimizer.register_step_pre_hook(on_update)
    losses: list[float] = []
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with _recorded_backwards(losses):
            metrics = trainer.step(batch_groups(model_dirs[variant.preset], routed=variant.routed))
    finally:
        torch.set_num_threads(previous)
        handle.remove()
    after = [p.detach() for p in trained]
    trace = [
        {
            "episode": row.segment.episode_id,
            "learner_logprobs": row.learner_logprobs,
            "advantages": row.advantages,
            "is_weights": row.is_weights,
            "clip": row.clip,
        }
        for row in trainer.tracer.take()
    ]
    record = {
        "losses": losses,
        "grad_digests": [digest for digest, _ in grads],
        "param_digest": _digest(list(trainer.model.state_dict().values())),
        "metrics": {k: v for k, v in sorted(metrics.items()) if k not in TIMINGS},
        "trace": trace,
    }
    tensors = {f"grad{u}": sample for u, (_, sample) in enumerate(grads)}
    tensors["delta"] = _sample([a - b for a, b in zip(after, before, strict=True)])
    return record, tensors


def fingerprint() -> dict[str, str]:
    """What exact equality of floats depends on: the CPU (its model and instruction set) and torch."""
    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    model, flags = info.get("model name", platform.processor()), info.get("flags", "")
    return {
        "cpu": model,
        "cpu_flags_sha256": hashlib.sha256(" ".join(sorted(flags.split())).encode()).hexdigest(),
        "torch": torch.__version__,
    }


def model_dirs(root: Path) -> dict[str, Path]:
    """The tiny and moe-tiny presets (seed 0) under `root`, as the test session builds them."""
    return {
        preset: init_model(root / preset / "model", preset=preset, seed=0) for preset in ("tiny", "moe-tiny")
    }


def capture(out_dir: Path = FIXTURES) -> None:
    """Rewrite the fixtures from the code as it is."""
    out_dir.mkdir(parents=True, exist_ok=True)
    records: dict[str, Any] = {}
    tensors: dict[str, torch.Tensor] = {}
    with tempfile.TemporaryDirectory() as tmp:
        dirs = model_dirs(Path(tmp))
        for name, variant in VARIANTS.items():
            record, sampled = run_variant(variant, dirs)
            records[name] = record
            tensors.update({f"{name}/{key}": value.contiguous() for key, value in sampled.items()})
            print(f"{name}: loss {record['metrics']['loss']!r}, {len(record['losses'])} backwards")
    document = {"fingerprint": fingerprint(), "variants": records}
    (out_dir / JSON_FILE).write_text(json.dumps(document, indent=1, sort_keys=True) + "\n")
    save_file(tensors, str(out_dir / TENSOR_FILE))


def load_fixtures(out_dir: Path = FIXTURES) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    return json.loads((out_dir / JSON_FILE).read_text()), load_file(str(out_dir / TENSOR_FILE))


if __name__ == "__main__":
    capture()
