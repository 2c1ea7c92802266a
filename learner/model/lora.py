"""LoRA on the learner (`[learner.lora]`): peft adapters on the policy, their checkpoints, their publication.

    policy = apply_lora(model, cfg.learner.lora)   adapters injected in place; only they require grad
    policy.model                                   the HF model the Trainer runs (its forward applies them)
    policy.publish_adapter(dir, v)                 PEFT dir: adapter_config.json + adapter_model.safetensors
    policy.publish_merged(dir, tokenizer, v)       HF directory of W + (alpha / r) B A; the model is unchanged
    policy.save(dir) / policy.load(dir)            the adapter tensors of a checkpoint, bit for bit
    policy.adapter_off()                           the KL reference: the same model, adapter disabled

Everything LoRA-specific is peft's: layer injection, the PEFT file format, the delta weights of the merge.
The base weights never change and are never written again: a checkpoint holds the adapter and AdamW's
state of the adapter parameters only, and `model/` (the initial model) is what it applies to.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor

from learner.model.model_io import quiet_transformers, save_tokenizer, write_dir_atomically
from pipeline.contracts.learner_config import LoraConfig

ADAPTER_NAME = "default"  # peft's name of the one adapter the learner trains
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# Written by peft's save_pretrained next to the adapter; not part of the format an engine reads.
_MODEL_CARD = "README.md"


def peft_config(cfg: LoraConfig) -> Any:
    """peft's LoraConfig for `[learner.lora]` (no task type: the learner runs the bare causal LM)."""
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
        bias="none",
    )


class LoraPolicy:
    """The policy with one trainable LoRA adapter. `model` is the HF causal LM whose target modules peft
    replaced in place (so `model.base_model`, the output layer and the fused log-prob path are the
    model's own); `peft_model` is peft's wrapper of it, used for saving and loading the adapter."""

    def __init__(self, peft_model: Any, cfg: LoraConfig) -> None:
        self.peft_model = peft_model
        self.cfg = cfg
        self.model: Any = peft_model.base_model.model

    def adapter_parameters(self) -> dict[str, Tensor]:
        return {name: p for name, p in self.model.named_parameters() if p.requires_grad}

    def adapter_off(self) -> AdapterOff:
        """The initial policy (B starts at zero, so it is the base) as the KL reference, without a
        second copy of the base weights."""
        return AdapterOff(self)

    # ------------------------------------------------------------------ publishing
    def publish_adapter(self, out_dir: str | Path, version: int) -> Path:
        """Policy `version` as a PEFT adapter directory an engine loads with /load_lora_adapter."""
        return write_dir_atomically(Path(out_dir), self._save_adapter, version=version)

    def publish_merged(self, out_dir: str | Path, tokenizer: Any, version: int) -> Path:
        """Policy `version` as full HF weights (base + adapter delta) for update_weights_from_disk."""

        def write(staged: Path) -> None:
            self.model.save_pretrained(staged, state_dict=self.merged_state_dict())
            if tokenizer is not None:
                save_tokenizer(tokenizer, staged)

        return write_dir_atomically(Path(out_dir), write, version=version)

    @torch.no_grad()
    def merged_state_dict(self) -> dict[str, Tensor]:
        """The state dict of the base architecture with each target weight replaced by W + delta (peft's
        `get_delta_weight`), computed aside: merging in place and back would drift the base by rounding."""
        from peft.tuners.lora import LoraLayer

        merged: dict[str, Tensor] = {}
        for key, tensor in self.model.state_dict().items():
            if ".lora_" in key:
                continue
            merged[key.replace(".base_layer.", ".")] = tensor
        for name, module in self.model.named_modules():
            if isinstance(module, LoraLayer):
                base = module.get_base_layer().weight
                delta = cast(Any, module).get_delta_weight(ADAPTER_NAME)
                merged[f"{name}.weight"] = (base.float() + delta.float()).to(base.dtype)
        return merged

    # ------------------------------------------------------------------ checkpoints
    def save(self, directory: Path) -> None:
        """The adapter's tensors and config into `directory` (a checkpoint's `adapter/`)."""
        directory.mkdir(parents=True, exist_ok=True)
        self._save_adapter(directory)

    def load(self, directory: Path) -> None:
        """Restore the adapter tensors saved by `save`, exactly. ValueError naming the key when the
        checkpoint's adapter was trained with other `[learner.lora]` settings or its tensors differ."""
        from peft.utils import load_peft_weights, set_peft_model_state_dict

        config_file = directory / ADAPTER_CONFIG
        if not config_file.is_file():
            raise FileNotFoundError(f"{directory} holds no {ADAPTER_CONFIG}")
        saved = json.loads(config_file.read_text(encoding="utf-8"))
        for key, ours in (("r", self.cfg.rank), ("lora_alpha", self.cfg.alpha)):
            if float(saved.get(key, -1)) != float(ours):
                raise ValueError(
                    f"checkpoint adapter {directory} has {key} = {saved.get(key)!r}, learner.lora has "
                    f"{ours!r}: resume with the LoRA settings the run was started with"
                )
        if sorted(saved.get("target_modules") or []) != sorted(self.cfg.target_modules):
            raise ValueError(
                f"checkpoint adapter {directory} targets {sorted(saved.get('target_modules') or [])}, "
                f"learner.lora.target_modules is {sorted(self.cfg.target_modules)}"
            )
        weights = load_peft_weights(str(directory), device=str(next(self.model.parameters()).device))
        result: Any = set_peft_model_state_dict(self.peft_model, weights, adapter_name=ADAPTER_NAME)
        missing = [k for k in result.missing_keys if ".lora_" in k]
        if result.unexpected_keys or missing:
            raise ValueError(
                f"checkpoint adapter {directory} does not fit the model: unexpected "
                f"{result.unexpected_keys[:5]}, missing {missing[:5]}"
            )

    # ------------------------------------------------------------------ machinery
    def _save_adapter(self, directory: Path) -> None:
        quiet_transformers()
        self.peft_model.save_pretrained(str(directory), selected_adapters=[ADAPTER_NAME])
        (directory / _MODEL_CARD).unlink(missing_ok=True)


class AdapterOff:
    """The frozen KL reference of a LoRA policy: the policy's own model run with its adapter disabled
    (peft's `disable_adapter`) and in eval mode. The Trainer enters `active()` around the reference's
    no-grad forward; the model is back as it was (adapter on, train mode) before any backward, which
    gradient checkpointing's recomputation needs."""

    def __init__(self, policy: LoraPolicy) -> None:
        self.policy = policy

    @contextmanager
    def active(self) -> Iterator[Any]:
        model = self.policy.model
        was_training = model.training
        model.eval()
        try:
            with self.policy.peft_model.disable_adapter():
                yield model
        finally:
            model.train(was_training)


def apply_lora(model: Any, cfg: LoraConfig, *, seed: int = 0) -> LoraPolicy:
    """Inject `[learner.lora]` adapters into `model` (in place) and freeze everything else. ValueError
    naming learner.lora.target_modules when a name matches no module of the model.

    The adapters start as peft initialises them (A random, B zero: version 0 is exactly the base), drawn
    from `seed` without touching the global RNG, so a run's initial adapter depends on its seed only."""
    from peft import get_peft_model

    from learner.model.moe_routing import find_routers, moe_shape

    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    unknown = sorted(set(cfg.target_modules) - names)
    moe = moe_shape(getattr(model, "config", None)) is not None
    if unknown:
        hint = (
            "; an MoE model keeps its experts as 3D parameters (experts.gate_up_proj, experts.down_proj), "
            "which peft's LoRA layers do not adapt here: target the attention projections"
            if moe
            else ""
        )
        raise ValueError(
            f"learner.lora.target_modules: {unknown} match no module of {type(model).__name__} "
            f"(its linear layers include {sorted(n for n in names if n.endswith('_proj'))}){hint}"
        )
    routers = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if m in find_routers(model)}
    if moe and (hit := sorted(routers & set(cfg.target_modules))):
        raise ValueError(
            f"learner.lora.target_modules: {hit} are the MoE routers of {type(model).__name__}, not linear "
            "layers; LoRA cannot adapt them"
        )
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        # peft reads transformers' renamed `is_gradient_checkpointing`; the warning is theirs to fix.
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated")
        torch.manual_seed(seed)
        peft_model = get_peft_model(model, peft_config(cfg), adapter_name=ADAPTER_NAME)
    return LoraPolicy(peft_model, cfg)


def directory_bytes(path: Path) -> int:
    """Bytes of the files under `path` (what one published version costs to write and to load)."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
