"""What a learner starts from: the policy as the config builds it (learner.policy_setup) and, when the run
directory holds a checkpoint, that checkpoint's weights, optimizer, counters, spool position and published
version. Every rank must see the same latest checkpoint. Rank 0 notes the restart in the consumed ledger.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from learner.process.group import Group
from learner.spool_cursor import SpoolCursor
from pipeline.contracts.config import Config
from pipeline.contracts.run_dir import RunDir, append_consumed, published_version

if TYPE_CHECKING:
    from learner.model.lora import LoraPolicy
    from learner.trainer import Trainer

log = logging.getLogger("rollwise.learner")


@dataclass
class Start:
    """The policy and where the learner resumes: `cursor` in the spool, `published` the last version
    written and announced (0 when none). `resumed`: from a checkpoint on disk."""

    trainer: Trainer
    tokenizer: Any
    lora: LoraPolicy | None
    vocab_size: int | None
    routing: tuple[int, int, int] | None  # (layers, top-k, experts) of an MoE policy
    cursor: SpoolCursor
    published: int
    resumed: bool


def start_policy(cfg: Config, run: RunDir, group: Group) -> Start:
    """Build the policy and restore the latest checkpoint into it (collective with several ranks)."""
    import torch

    from learner.policy_setup import build_policy
    from learner.process.checkpoint import restore
    from learner.process.checkpoint_state import load_latest_checkpoint

    policy = build_policy(cfg, run.initial_model, group.ranks)
    trainer = policy.trainer
    embeddings = trainer.model.get_input_embeddings()
    vocab_size = embeddings.num_embeddings if isinstance(embeddings, torch.nn.Embedding) else None
    moe = trainer.moe
    routing = (moe.layers, moe.topk, moe.num_experts) if moe is not None else None
    ckpt = load_latest_checkpoint(run.checkpoints)
    group.agree(None if ckpt is None else str(ckpt.path), "latest checkpoints")
    start = Start(trainer, policy.tokenizer, policy.lora, vocab_size, routing, SpoolCursor(), 0, False)
    if group.leader:
        append_consumed(run.consumed_log, {"restored": ckpt.step if ckpt is not None else 0})
    if ckpt is None:
        log.info("no checkpoint in %s: starting from %s", run.checkpoints, run.initial_model)
        return start
    restore(trainer, ckpt, adapter=policy.lora)
    start.cursor = SpoolCursor(max(0, ckpt.consumed.last_seq), ckpt.consumed.after)
    start.published, start.resumed = published_version(ckpt.path), True
    log.info(
        "restored %s: step %d, version %d, consumed through seq %d and %d group(s) after it",
        ckpt.path,
        ckpt.step,
        trainer.policy_version,
        start.cursor.committed.watermark,
        len(start.cursor.committed.after),
    )
    return start
