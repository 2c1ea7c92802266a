"""`[learner]` and its tables: what the learner process is told, one table per concern (prime-rl style).

    [learner]                batch shape, device and precision, checkpoints
    [learner.optim]          AdamW
    [learner.schedule]       warm-up, then constant or a decay (kind selects; a decay needs its length)
    [learner.loss]           GSPO-token, GSPO or GRPO; clip band; aggregation
    [learner.advantages]     per-turn estimator and normalisation
    [learner.regularizers]   KL, entropy bonus, action prior, over-long penalty
    [learner.mismatch]       training/inference mismatch correction
    [learner.lora]           LoRA adapters instead of full weights
    [learner.moe]            Mixture-of-Experts: routing records, routing replay, routing metrics
    [learner.distributed]    ranks and nodes (torchrun, FSDP2)
    [learner.remote]         a learner that does not share the run directory

A key from before the tables (`learner.lr`, `learner.lr_schedule`, `learner.dtype`, ...) is refused,
naming its place in a table (`refuse_flat_keys`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, model_validator

from pipeline.contracts.config_base import Section, secret_from_env


class OptimConfig(Section):
    lr: float = Field(1e-6, gt=0, description="AdamW learning rate (1e-6: a pretrained LLM, full weights).")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    embedding_weight_decay: float | None = Field(
        None,
        ge=0,
        description=(
            "AdamW weight decay of the token embeddings and the output layer (None = weight_decay). Decay "
            "there keeps tokens the policy stopped sampling within reach instead of letting their logits "
            "sink without bound."
        ),
    )
    betas: tuple[float, float] = Field((0.9, 0.99), description="AdamW betas.")
    grad_clip: float = Field(1.0, gt=0, description="Global gradient-norm clip.")
    grad_accum: int = Field(1, ge=1, description="Mini-batches accumulated per optimizer update.")


WARMUP_DOC = "Linear learning-rate warm-up over the first optimizer updates (AdamW's moments)."


class ConstantSchedule(Section):
    kind: Literal["constant"] = Field("constant", description="Warm-up, then lr for good.")
    warmup_steps: int = Field(
        10,
        ge=0,
        description="Linear learning-rate warm-up over the first optimizer updates (AdamW's moments).",
    )


class DecaySchedule(Section):
    kind: Literal["linear", "cosine"] = Field(description="Warm-up, then a linear or cosine decay.")
    warmup_steps: int = Field(
        10,
        ge=0,
        description="Linear learning-rate warm-up over the first optimizer updates (AdamW's moments).",
    )
    decay_steps: int = Field(ge=1, description="Optimizer updates of the decay after warm-up.")
    min_ratio: float = Field(0.0, ge=0, le=1, description="The decay's floor as a fraction of lr.")


Schedule = Annotated[ConstantSchedule | DecaySchedule, Field(discriminator="kind")]
SCHEDULE_KINDS = ("constant", "linear", "cosine")

LossKind = Literal["gspo_token", "gspo", "grpo"]
# The importance-ratio level of each loss in learner.gspo's terms.
LOSS_LEVELS: dict[str, Literal["sequence_token", "sequence", "token"]] = {
    "gspo_token": "sequence_token",
    "gspo": "sequence",
    "grpo": "token",
}


class LossConfig(Section):
    kind: LossKind = Field(
        "gspo_token",
        description=(
            "gspo_token: GSPO-token (sequence-level ratio and clip, per-token advantages); gspo: GSPO "
            "(sequence ratio); grpo: the token-level ratio with per-token clipping (GRPO/PPO baseline)."
        ),
    )
    clip_low: float = Field(3e-4, ge=0, description="Clip epsilon below 1 (GSPO paper: 3e-4; GRPO: 0.2).")
    clip_high: float = Field(4e-4, ge=0, description="Clip epsilon above 1 (GSPO paper: 4e-4; GRPO: 0.27).")
    agg: Literal["seq_mean_token_mean", "token_mean"] = Field(
        "seq_mean_token_mean",
        description=(
            "Loss aggregation: every episode weighs the same (seq_mean_token_mean), or every generated "
            "token does (token_mean: each turn of a multi-turn episode keeps its full weight)."
        ),
    )

    @property
    def level(self) -> Literal["sequence_token", "sequence", "token"]:
        return LOSS_LEVELS[self.kind]


class AdvantagesConfig(Section):
    estimator: Literal["turn", "outcome", "anchor"] = Field(
        "turn",
        description=(
            "Per-turn advantages (turn), GRPO broadcast (outcome), or per-turn advantages whose baselines "
            "are the group's episodes that saw the same history before the turn (anchor, GiGPO-style)."
        ),
    )
    norm: Literal["std", "none"] = Field(
        "std",
        description=(
            "Divide each advantage channel by its batch std (std, GRPO-style) or keep reward units (none, "
            "Dr. GRPO; lam then balances the channels' units)."
        ),
    )
    gamma: float = Field(1.0, ge=0, le=1, description="Discount of the turn-reward return-to-go.")
    lam: float = Field(1.0, ge=0, description="Weight of the shaping (turn reward) channel.")


class RegularizersConfig(Section):
    kl_coef: float = Field(
        0.0,
        ge=0,
        description=(
            "Weight of a KL penalty towards the initial weights (0 = off). The learner then holds a frozen "
            "copy of them (one more set of weights, no gradients or optimizer state) and runs it on every "
            "mini-batch."
        ),
    )
    kl_estimator: Literal["k1", "k2", "k3"] = Field(
        "k3", description="Per-token KL estimate: k1 = log ratio, k2 = squared / 2, k3 = low-variance."
    )
    kl_mode: Literal["loss", "reward"] = Field(
        "loss",
        description=(
            "loss: kl_coef x the token-mean estimate is added to the loss (differentiated); reward: the "
            "estimate (detached) is subtracted from each token's advantage, a per-token reward penalty."
        ),
    )
    entropy_coef: float = Field(
        0.0,
        ge=0,
        description="Entropy bonus weight (0 = off): keeps exploring when the policy sharpens fast.",
    )
    entropy_decay_steps: int = Field(
        0,
        ge=0,
        description=(
            "Optimizer updates over which entropy_coef falls linearly to 0 (0 = constant): explore while "
            "learning, then let the policy settle on what it found."
        ),
    )
    action_prior_coef: float = Field(
        0.0,
        ge=0,
        description=(
            "Weight of the action prior (0 = off): cross-entropy of a uniform distribution over the env's "
            "action_hints against the policy's first token of each turn, so no valid answer is lost "
            "before it is tried where it is right. Needs an env that declares action_hints."
        ),
    )
    action_prior_decay_steps: int = Field(
        0,
        ge=0,
        description="Optimizer updates over which action_prior_coef falls linearly to 0 (0 = constant).",
    )
    overlong_budget: int | None = Field(
        None,
        ge=1,
        description=(
            "DAPO's soft over-long penalty (None = off): a turn longer than this many generated tokens "
            "gets -1 added to its reward, and one within overlong_slope tokens of it a linear share."
        ),
    )
    overlong_slope: int = Field(
        0, ge=0, description="Tokens before the budget over which the penalty ramps in."
    )

    @model_validator(mode="after")
    def _overlong_rules(self) -> RegularizersConfig:
        if self.overlong_budget is not None and self.overlong_slope > self.overlong_budget:
            raise ValueError("overlong_slope must be <= overlong_budget")
        return self


class MismatchConfig(Section):
    """Training/inference mismatch correction (docs/train.md, "Mismatch correction")."""

    proximal: Literal["engine", "learner"] = Field(
        "learner",
        description=(
            "Which log-probs the clip is centred on: the engine's (engine, no extra pass) or the learner's "
            "own at the start of the step (learner: one no-grad forward over the batch, decoupled PPO)."
        ),
    )
    is_weights: Literal["none", "token", "sequence"] = Field(
        "token",
        description=(
            "Truncated importance weights w = min(pi_prox / pi_engine, is_cap) on each token (token) or "
            "the product over the sequence (sequence); needs proximal = learner."
        ),
    )
    is_cap: float = Field(2.0, ge=1.0, description="Upper truncation C of the importance weights.")
    reject: Literal["none", "token", "sequence", "geometric"] = Field(
        "none",
        description=(
            "Mask tokens (token) or whole sequences (sequence: the product of token ratios; geometric: "
            "their geometric mean) whose pi_prox / pi_engine leaves reject_band; needs proximal = learner."
        ),
    )
    reject_band: tuple[float, float] = Field(
        (0.5, 2.0), description="[low, high] of the ratio kept by `reject` (geometric: e.g. [0.999, 1.001])."
    )

    @model_validator(mode="after")
    def _rules(self) -> MismatchConfig:
        low, high = self.reject_band
        if not 0.0 <= low < 1.0 < high:
            raise ValueError(f"reject_band must satisfy 0 <= low < 1 < high, got {self.reject_band}")
        for key in ("is_weights", "reject"):
            if getattr(self, key) != "none" and self.proximal != "learner":
                raise ValueError(
                    f"learner.mismatch.{key} = {getattr(self, key)!r} needs learner.mismatch.proximal = "
                    "'learner': the correction compares the engine's log-probs with the learner's at the "
                    "start of the step"
                )
        return self


class LoraConfig(Section):
    """LoRA on the learner with peft; adapters published in PEFT format (docs/train.md, LoRA)."""

    enabled: bool = Field(False, description="Train LoRA adapters instead of the full weights.")
    rank: int = Field(16, ge=1, le=1024, description="LoRA rank r.")
    alpha: int = Field(32, ge=1, description="LoRA alpha; the update is scaled by alpha / rank.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapters' input while training.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1,
        description="Module names (as in the HF model) that get adapters; SGLang's --lora-target-modules.",
    )
    serving: Literal["adapter", "merged"] = Field(
        "adapter",
        description=(
            "adapter: engines load each version with /load_lora_adapter and requests name it (SGLang "
            "dynamic LoRA); merged: the adapter merged into the base is published as full weights."
        ),
    )


class MoeConfig(Section):
    """Mixture-of-Experts models (docs/train.md, "Mixture-of-Experts"). Every key needs an MoE model
    (a config with num_experts and num_experts_per_tok); a dense one is refused before the run starts."""

    routing_replay: bool = Field(
        False,
        description=(
            "Force the learner's top-k expert choice of every token to the experts the engine routed it to "
            "when it sampled (routing replay), in every forward of the step; the router still learns through "
            "the replayed experts' gate weights. GRPO's remedy for routing volatility on MoE models; GSPO "
            "does not need it. Implies record_routing."
        ),
    )
    record_routing: bool = Field(
        False,
        description=(
            "Ask the engines for each token's routed experts (SGLang's return_routed_experts; engines "
            "started with --enable-return-routed-experts) and keep them in the trajectory rows, without "
            "replaying them: the learner then measures the router's share of the engine/learner log-prob "
            "mismatch (one more no-grad forward per mini-batch)."
        ),
    )
    load_balance_coef: float = Field(
        0.0,
        ge=0,
        description=(
            "Weight of the load-balancing loss (the Switch Transformer's, transformers' "
            "load_balancing_loss_func; 0 = off): num_experts x sum_e (share of the top-k assignments to "
            "expert e) x (mean router probability of e), per layer, mean over layers: 1 when the load is "
            "even. A mean over each micro-batch (and rank), as transformers' and Megatron's. Without it a "
            "router trained by RL alone can send every token to the same experts (the moe-tiny toy does "
            "within a few steps: docs/training_curve.md)."
        ),
    )
    routing_metrics: bool = Field(
        True,
        description=(
            "Per step on an MoE model: expert load balance (from the training forward) and the expert-"
            "activation change after the step's first update on the same inputs (one more no-grad forward "
            "of its mini-batch)."
        ),
    )

    @property
    def records_routing(self) -> bool:
        """The engines must return routed experts (replay or the router-mismatch measurement)."""
        return self.routing_replay or self.record_routing


class DistributedConfig(Section):
    nproc: int = Field(
        1,
        ge=1,
        description=(
            "Learner processes (ranks) per node. Above 1 the supervisor starts the learner through torchrun "
            "and the model is sharded with FSDP2 (gloo on a CPU, NCCL on GPUs: one GPU per rank)."
        ),
    )
    nnodes: int = Field(
        1,
        ge=1,
        description=(
            "Nodes the learner spans (torchrun --nnodes, c10d rendezvous at rdzv_endpoint); every node's "
            "torchrun must be started by one launcher command (see launcher)."
        ),
    )
    rdzv_endpoint: str | None = Field(
        None,
        description=(
            "host:port of torchrun's c10d rendezvous, reachable from every learner node (needed when "
            "nnodes > 1; one node alone picks a free local port)."
        ),
    )
    launcher: list[str] = Field(
        default_factory=list,
        description=(
            "Command prefix the supervisor starts the learner with, e.g. ['srun', '--nodes=2', "
            "'--ntasks-per-node=1'] or ['ssh', 'gpu-b']: the learner runs where it puts it, and the "
            "launcher must carry the learner's stdin and stdout (srun and ssh do). Empty: this machine."
        ),
    )

    @property
    def world_size(self) -> int:
        """Learner ranks in all: nproc x nnodes."""
        return self.nproc * self.nnodes

    @model_validator(mode="after")
    def _rendezvous_rules(self) -> DistributedConfig:
        if self.nnodes > 1 and self.rdzv_endpoint is None:
            raise ValueError(
                "learner.distributed.rdzv_endpoint (host:port reachable from every learner node) is needed "
                "when learner.distributed.nnodes > 1"
            )
        if self.rdzv_endpoint is not None:
            host, _, port = self.rdzv_endpoint.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(
                    f"learner.distributed.rdzv_endpoint must be host:port, got {self.rdzv_endpoint!r}"
                )
        return self


class RemoteConfig(Section):
    """A learner that does not share the run directory (docs/scale_out.md, "Three machines")."""

    spool_url: str | None = Field(
        None,
        description=(
            "Where the learner reads groups: None = the run directory's spool; grpc://host:port = a "
            "supervisor's Flight service (transport.kind = flight; its checkpoint still records the "
            "consumed sequence, and transport.token authenticates it)."
        ),
    )
    run_dir: str | None = Field(
        None,
        description=(
            "The learner's own directory on its machine (checkpoints, published weights, its copy of the "
            "config, a preset model); None = the run directory, shared. Set: the supervisor hands the "
            "learner its config over stdin, the learner serves its weights over HTTP (weights_host, "
            "weights_port) and the supervisor copies each published version into the run directory, "
            "checked against its manifest, before the engines load it. Needs spool_url."
        ),
    )
    weights_host: str = Field(
        "127.0.0.1", description="Bind address of the learner's weight server (with run_dir)."
    )
    weights_port: int = Field(
        8816,
        ge=0,
        le=65535,
        description="Port of the learner's weight server (0 = pick a free one; the learner reports it).",
    )
    weights_url: str | None = Field(
        None,
        description=(
            "The URL the supervisor fetches the learner's weights from; None = http://weights_host:port "
            "(the machine's host name when weights_host is a wildcard such as 0.0.0.0)."
        ),
    )
    weights_token: SecretStr | None = Field(
        default_factory=lambda: secret_from_env("ROLLWISE_LEARNER_TOKEN"),
        description=(
            "Bearer token of the learner's weight server (default: $ROLLWISE_LEARNER_TOKEN); required when "
            "weights_host is not loopback. The supervisor hands it to the learner over stdin. Never "
            "written or logged."
        ),
    )

    tls_cert_file: str | None = Field(
        None, description="The learner machine's certificate for its weight server (None: tls.cert_file)."
    )
    tls_key_file: str | None = Field(None, description="Its private key (None: tls.key_file).")
    tls_ca_file: str | None = Field(
        None, description="The CA bundle the learner trusts, for Flight (None: tls.ca_file)."
    )

    @model_validator(mode="after")
    def _own_run_dir_rules(self) -> RemoteConfig:
        if self.run_dir is not None and self.spool_url is None:
            raise ValueError(
                "learner.remote.run_dir (the learner's own directory) needs learner.remote.spool_url = "
                "'grpc://supervisor:port': the spool is on the supervisor's disk, not the learner's"
            )
        if self.spool_url is not None and not self.spool_url.startswith(
            ("grpc://", "grpc+tcp://", "grpc+tls://")
        ):
            raise ValueError(
                "learner.remote.spool_url must be grpc://host:port or grpc+tls://host:port, got "
                f"{self.spool_url!r}"
            )
        if self.weights_url is not None and not self.weights_url.startswith(("http://", "https://")):
            raise ValueError(
                f"learner.remote.weights_url must be http(s)://host:port, got {self.weights_url!r}"
            )
        return self


class LearnerConfig(Section):
    @model_validator(mode="before")
    @classmethod
    def _flat_keys(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        refuse_flat_keys(data)
        schedule = data.get("schedule")
        if isinstance(schedule, dict) and "kind" not in schedule:
            data["schedule"] = {"kind": "constant", **schedule}  # a table without kind: the default kind
        return data

    batch_groups: int = Field(8, ge=1, description="B: groups per optimizer step (the rollout batch).")
    mini_batches: int = Field(4, ge=1, description="Mini-batches per rollout batch (paper: 4).")
    optim: OptimConfig = Field(default_factory=OptimConfig)
    schedule: Schedule = Field(default_factory=ConstantSchedule)
    loss: LossConfig = Field(default_factory=LossConfig)
    advantages: AdvantagesConfig = Field(default_factory=AdvantagesConfig)
    regularizers: RegularizersConfig = Field(default_factory=RegularizersConfig)
    mismatch: MismatchConfig = Field(default_factory=MismatchConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    moe: MoeConfig = Field(default_factory=MoeConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    remote: RemoteConfig = Field(default_factory=RemoteConfig)
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Learner device.")
    precision: Literal["auto", "fp32", "bf16-mixed", "bf16"] = Field(
        "auto",
        description=(
            "fp32; bf16-mixed (fp32 master weights and optimizer state, bf16 autocast compute); or bf16 "
            "(pure: weights and AdamW state in bf16, so updates smaller than bf16's spacing, ~0.4% of a "
            "weight, are lost). auto = bf16-mixed on CUDA and on a CPU with native bf16 matmuls (AMX, "
            "AVX512-BF16), fp32 elsewhere."
        ),
    )
    fused_logprobs: bool = Field(
        True,
        description=(
            "Sampled-token log-probs from the final hidden states through the output layer, fused per "
            "chunk: no (tokens x vocabulary) logits tensor in forward or backward."
        ),
    )
    shared_prefix: bool = Field(
        True,
        description=(
            "Run the prompt a group's episodes share once per mini-batch and reuse its keys and values for "
            "every member (same log-probs to float rounding). A short-answer task's prompt is most of its "
            "tokens: 2-3x less learner work there. Off under gradient checkpointing, several ranks and for "
            "MoE models (their router hooks see every position in one forward)."
        ),
    )
    gradient_checkpointing: bool = Field(
        False,
        description="Recompute each decoder layer's activations in backward (less memory, more compute).",
    )
    export_in_background: bool = Field(
        True,
        description=(
            "Write each published version on a thread while the next step trains, from a CPU copy of the "
            "weights taken at the step's end (one more copy of the weights in host memory). Versions are "
            "still published in order, none skipped: a publish waits for the previous one. Full weights in "
            "one learner process; LoRA adapters and several ranks publish inline."
        ),
    )
    checkpoint_every: int = Field(5, ge=1, description="Checkpoint every n steps (and on shutdown).")
    keep_checkpoints: int = Field(2, ge=1, description="Checkpoints kept on disk.")
    threads: int = Field(1, ge=1, description="torch intra-op threads of the learner process.")

    @property
    def world_size(self) -> int:
        """Learner ranks in all: nproc x nnodes."""
        return self.distributed.world_size

    @model_validator(mode="after")
    def _rules(self) -> LearnerConfig:
        if self.lora.enabled and self.world_size > 1:
            raise ValueError(
                "learner.lora with more than one learner rank is not supported: LoRA runs in one process "
                "(learner.distributed.nproc x learner.distributed.nnodes must be 1)"
            )
        if self.remote.spool_url is not None and self.world_size > 1:
            raise ValueError(
                "learner.remote.spool_url (reading the spool over Flight) works with one learner process: "
                "ranks other than 0 read the step's spool files from the shared run directory "
                "(learner.distributed.nproc x learner.distributed.nnodes must be 1)"
            )
        if self.lora.enabled and self.optim.embedding_weight_decay is not None:
            raise ValueError(
                "learner.optim.embedding_weight_decay: LoRA (learner.lora.enabled) freezes the embeddings, "
                "so there is nothing for it to decay; unset it"
            )
        return self


# --- keys from before the tables ----------------------------------------------------------------------
# flat key -> (table, key in the table): refused naming the new place; tests use the flat names as shorthand
FLAT_KEYS: dict[str, tuple[str, str]] = {
    **{k: ("optim", k) for k in ("lr", "weight_decay", "embedding_weight_decay", "betas", "grad_clip")},
    "grad_accum": ("optim", "grad_accum"),
    "lr_schedule": ("schedule", "kind"),
    "warmup_steps": ("schedule", "warmup_steps"),
    "lr_decay_steps": ("schedule", "decay_steps"),
    "lr_min_ratio": ("schedule", "min_ratio"),
    "loss_level": ("loss", "kind"),
    "clip_low": ("loss", "clip_low"),
    "clip_high": ("loss", "clip_high"),
    "loss_agg": ("loss", "agg"),
    "estimator": ("advantages", "estimator"),
    "advantage_norm": ("advantages", "norm"),
    "gamma": ("advantages", "gamma"),
    "lam": ("advantages", "lam"),
    **{
        k: ("regularizers", k)
        for k in (
            "kl_coef",
            "kl_estimator",
            "kl_mode",
            "entropy_coef",
            "entropy_decay_steps",
            "action_prior_coef",
            "action_prior_decay_steps",
            "overlong_budget",
            "overlong_slope",
        )
    },
    **{k: ("distributed", k) for k in ("nproc", "nnodes", "rdzv_endpoint", "launcher")},
    **{
        k: ("remote", k)
        for k in ("spool_url", "run_dir", "weights_host", "weights_port", "weights_url", "weights_token")
    },
}


def refuse_flat_keys(data: dict[str, Any]) -> None:
    """A `[learner]` key from before its tables is an error naming the key's table (FLAT_KEYS)."""
    if "dtype" in data:
        raise ValueError('learner.dtype is learner.precision now ("fp32", "bf16-mixed", "bf16" or "auto")')
    for key in data:
        if key in FLAT_KEYS:
            table, new_key = FLAT_KEYS[key]
            values = ' (values "gspo_token", "gspo", "grpo")' if key == "loss_level" else ""
            raise ValueError(f"learner.{key} is learner.{table}.{new_key} now{values}")
