"""The learner's half of the served-policy check (docs/scale_out.md, "What the served-policy check does").

With each published version the learner sends a probe: token ids and its own log-probs of them under the
new weights, `logprobs[i] = log P(ids[i + 1] | ids[: i + 1])`, the log-softmax of the raw logits
(temperature 1, fp32, dropout off). That is exactly what SGLang returns as `input_token_logprobs` for
`logprob_start_len = 0` (entry 0 is null there), so the supervisor can ask every engine for the same
sequence and compare.

The probe is the start of the longest sequence the learner just trained on: tokens the policy visits,
where its updates move the log-probs most, so an engine still serving older weights shows up.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from learner.groups import TrainGroup


def probe_ids(groups: Sequence[TrainGroup], max_tokens: int) -> list[int]:
    """The first `max_tokens` ids of the longest first segment among `groups` ([] without groups)."""
    rows = [segments[0] for group in groups for segments in group.episodes if segments]
    if not rows:
        return []
    longest = max(rows, key=lambda row: len(row.token_ids))
    return [int(t) for t in longest.token_ids[:max_tokens]]


@torch.no_grad()
def probe_logprobs(model: Any, ids: Sequence[int]) -> list[float]:
    """log P(ids[i + 1] | ids[: i + 1]) for i < len(ids) - 1 under `model` in eval mode, fp32, no autocast.

    Returns [] when a value is not finite (the check is then skipped for this version, never wrong)."""
    if len(ids) < 2:
        return []
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        tokens = torch.tensor([list(ids)], dtype=torch.long, device=device)
        logits = model(input_ids=tokens, use_cache=False).logits[0, :-1].float()
    finally:
        model.train(was_training)
    logprobs = torch.log_softmax(logits, dim=-1).gather(1, tokens[0, 1:, None])[:, 0]
    values = [float(v) for v in logprobs.cpu()]
    return values if all(math.isfinite(v) for v in values) else []
