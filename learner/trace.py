"""The learner's token trace: what the loss saw on a few trained groups per step, for `rollwise inspect`.

Every `every_steps`-th step, `groups_per_step` of the step's trained groups (chosen by a generator seeded
with the step) are traced: for each of their rows, token by token, the learner's log-prob in the forward
that computed the loss, the advantage, the importance weight (learner.mismatch; 1 without one) and the
clip state. The file `trace/s<step:012d>.arrow` holds those rows in Contract 1's columns (so a traced
group can be shown after its spool file was pruned) plus:

| column | type | meaning |
|---|---|---|
| step | int64 | learner step that trained the row (the step counter after it) |
| learner_version | int32 | policy version the step started from |
| learner_logprobs | list<float32> | the trained policy's log-prob of each generated token, 0.0 elsewhere |
| advantages | list<float32> | per-token advantage (its turn's), 0.0 elsewhere |
| is_weights | list<float32> | truncated importance weight of each generated token (1.0 without correction) |
| clip | list<int8> | -1 not scored (prompt, env reply, token 0), 0 trained, 1 clipped, 2 rejected |

"clipped" = the clipped branch of the GSPO(-token) surrogate is strictly active on the token (no gradient
from it), the per-token view of `clip_fraction_token`; "rejected" = `learner.mismatch.reject` took the
token out of the loss. Files are written to a temporary name and renamed; the newest `keep_steps` stay.
"""

from __future__ import annotations

import os
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa

from pipeline.contracts.schema import EpisodeSegment, segments_to_batch

if TYPE_CHECKING:  # torch only where the learner calls in: the inspector reads trace files without it
    import torch

    from learner.batching import PackedBatch, TrainSequence
    from learner.loss.gspo import Level

NOT_SCORED, TRAINED, CLIPPED, REJECTED = -1, 0, 1, 2
TRACE_COLUMNS = pa.schema(
    [
        pa.field("step", pa.int64(), nullable=False),
        pa.field("learner_version", pa.int32(), nullable=False),
        pa.field("learner_logprobs", pa.list_(pa.float32()), nullable=False),
        pa.field("advantages", pa.list_(pa.float32()), nullable=False),
        pa.field("is_weights", pa.list_(pa.float32()), nullable=False),
        pa.field("clip", pa.list_(pa.int8()), nullable=False),
    ]
)
_NAME = re.compile(r"^s(\d{12})\.arrow$")


def trace_name(step: int) -> str:
    return f"s{step:012d}.arrow"


def token_clip_active(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    level: Level,
    clip_low: float,
    clip_high: float,
) -> torch.Tensor:
    """(B, T) bool: the clipped branch of gspo_token_loss is strictly active on the token (same ratio,
    clamp and band as the loss; its mean over the mask is the loss's `clip_fraction_token`)."""
    import torch

    from learner.loss.gspo import MAX_LOG_RATIO

    keep = mask != 0
    lp = torch.where(keep, logprobs.detach().double(), 0.0)
    old = torch.where(keep, old_logprobs.double(), 0.0)
    adv = torch.where(keep, advantages.double(), 0.0)
    if level == "token":
        log_ratio = lp - old
    else:
        seq = (lp - old).sum(-1) / keep.sum(-1).clamp(min=1)
        log_ratio = seq.unsqueeze(-1).expand_as(lp)
    ratio = torch.exp(log_ratio.clamp(max=MAX_LOG_RATIO))
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    return keep & (clipped > unclipped)


@dataclass
class TracedRow:
    """One traced row: its segment and the per-token values (one per token of segment.token_ids)."""

    segment: EpisodeSegment
    learner_logprobs: list[float]
    advantages: list[float]
    is_weights: list[float]
    clip: list[int]


class StepTracer:
    """Chooses the traced rows of a step (`begin`) and collects them from the loss's mini-batches
    (`record`); `take` hands the step's rows over. Inactive when `groups_per_step` is 0."""

    def __init__(self, groups_per_step: int = 0, every_steps: int = 1) -> None:
        if groups_per_step < 0 or every_steps < 1:
            raise ValueError(f"StepTracer: groups >= 0, every >= 1; got {groups_per_step}, {every_steps}")
        self.groups_per_step = groups_per_step
        self.every_steps = every_steps
        self._sources: dict[int, EpisodeSegment] = {}  # sequence index -> its row
        self._rows: list[TracedRow] = []

    def begin(self, step: int, sequences: Sequence[TrainSequence]) -> None:
        """Step `step` (0-based) trains `sequences`: pick the rows of `groups_per_step` of its groups."""
        self._sources, self._rows = {}, []
        if self.groups_per_step == 0 or step % self.every_steps != 0:
            return
        groups = sorted({s.source.group_id for s in sequences if s.source is not None})
        chosen = set(random.Random(step).sample(groups, min(self.groups_per_step, len(groups))))
        self._sources = {
            i: seq.source
            for i, seq in enumerate(sequences)
            if seq.source is not None and seq.source.group_id in chosen
        }

    @property
    def active(self) -> bool:
        return bool(self._sources)

    def record(
        self,
        batch: PackedBatch,
        logprobs: torch.Tensor,
        clip_active: torch.Tensor,
    ) -> None:
        """A mini-batch the loss just scored: `batch.rows` names its sequences, `logprobs` and
        `clip_active` are (B, T) as the loss saw them; the rows being traced are kept."""
        if batch.rows is None:
            return
        for r, index in enumerate(batch.rows):
            source = self._sources.get(index)
            if source is None:
                continue
            n = len(source.token_ids)
            lp = [0.0, *logprobs[r, : n - 1].detach().float().cpu().tolist()]
            adv = [0.0, *batch.advantages[r, : n - 1].float().cpu().tolist()]
            w = batch.token_weights
            weights = w[r, : n - 1].float().cpu().tolist() if w is not None else None
            kept = batch.loss_mask[r, : n - 1].cpu().tolist()
            active = clip_active[r, : n - 1].cpu().tolist()
            clip = [NOT_SCORED] * n
            is_w = [1.0] * n
            for t in range(1, n):
                if not source.loss_mask[t]:
                    lp[t], adv[t] = 0.0, 0.0
                    continue
                clip[t] = REJECTED if not kept[t - 1] else CLIPPED if active[t - 1] else TRAINED
                if weights is not None:
                    is_w[t] = weights[t - 1]
            self._rows.append(TracedRow(source, lp, adv, is_w, clip))

    def take(self) -> list[TracedRow]:
        rows, self._rows, self._sources = self._rows, [], {}
        return rows


def trace_batch(rows: Sequence[TracedRow], *, step: int, learner_version: int) -> pa.RecordBatch:
    """The rows as one record batch: Contract 1's columns, then TRACE_COLUMNS (module docstring)."""
    base = segments_to_batch([r.segment for r in rows])
    extra = [
        pa.array([step] * len(rows), pa.int64()),
        pa.array([learner_version] * len(rows), pa.int32()),
        pa.array([r.learner_logprobs for r in rows], pa.list_(pa.float32())),
        pa.array([r.advantages for r in rows], pa.list_(pa.float32())),
        pa.array([r.is_weights for r in rows], pa.list_(pa.float32())),
        pa.array([r.clip for r in rows], pa.list_(pa.int8())),
    ]
    schema = pa.schema(list(base.schema) + list(TRACE_COLUMNS), metadata=base.schema.metadata)
    return pa.RecordBatch.from_arrays([*base.columns, *extra], schema=schema)


def write_trace(trace_dir: Path, batch: pa.RecordBatch, *, step: int, keep: int) -> Path:
    """Write `trace/s<step>.arrow` (temp name, then rename) and delete all but the newest `keep` files."""
    trace_dir.mkdir(parents=True, exist_ok=True)
    path = trace_dir / trace_name(step)
    tmp = path.with_suffix(".arrow.tmp")
    with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, batch.schema) as writer:
        writer.write_batch(batch)
    os.replace(tmp, path)
    files = sorted(p for p in trace_dir.iterdir() if _NAME.match(p.name))
    for old in files[: max(0, len(files) - keep)]:
        old.unlink(missing_ok=True)
    return path


def trace_files(trace_dir: Path) -> list[tuple[int, Path]]:
    """(step, path) of the complete trace files, oldest first."""
    if not trace_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in trace_dir.iterdir() if (m := _NAME.match(p.name))]
    return sorted(found)
