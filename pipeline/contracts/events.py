"""What the learner process tells the supervisor: one typed record per event, one JSON object per line.

`encode(event)` writes `{"event": <name>, <fields>}`; `decode(obj)` turns such an object back into its
record and raises `ValueError` naming the event and the field when it breaks the contract. Each value
is sent once. The table of events, fields and meanings is in docs/architecture.md (Contract 5).

Import-light (standard library only): the supervisor imports it without torch.
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any, ClassVar, Union, get_type_hints


@dataclass(frozen=True)
class Ready:
    """The learner restored its checkpoint (or starts fresh) and serves `version` from `path`.

    A learner with its own run directory (learner.remote.run_dir) adds `weights_url`, its weight server, where
    the supervisor fetches `version` (`path` is then a path on the learner's machine), and, when it built
    the initial model from the preset itself, `initial_model_digest`
    (pipeline.contracts.run_dir.model_digest),
    which the supervisor compares with its own copy's."""

    name: ClassVar[str] = "ready"
    version: int
    step: int
    consumed_seq: int
    path: str
    weights_url: str | None = None
    initial_model_digest: str | None = None
    consumed_after: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Dropped:
    """A spool group the learner will never train (sent at once; the supervisor dedupes by `seq`, since a
    restarted learner re-reads the groups after its checkpoint). `tokens` = the generated tokens of its
    trainable rows (pipeline.contracts.waste; 0 when unknown: a quarantined file)."""

    name: ClassVar[str] = "dropped"
    seq: int
    group_id: str
    reason: str
    tokens: int = 0


@dataclass(frozen=True)
class Step:
    """One optimizer step of B groups. `groups` = groups whose rows are in the new weights (0 when the
    step changed no weight: those groups were announced as dropped, reason no_update). `staleness` =
    generated tokens trained, by how many versions behind the learner they were; `staleness_in_flight`
    and `staleness_in_queue` the same tokens by the part of that spent before their group was written
    and after (pipeline.contracts.staleness.split_staleness; empty from an older learner). `metrics` =
    the trainer's step metrics, None where a value was not finite (a skipped update)."""

    name: ClassVar[str] = "step"
    step: int
    version: int
    groups: int
    group_ids: list[str]
    consumed_seq: int
    metrics: dict[str, float | None]
    staleness: dict[int, int]
    idle_s: float  # waiting for spool files since the last step
    busy_s: float  # this step: train, publish, checkpoint
    spool_read_s: float  # listing, reading, decoding and validating spool files since the last step
    spool_depth_groups: int
    spool_depth_bytes: int
    consumed_after: list[int] = field(default_factory=list)
    staleness_in_flight: dict[int, int] = field(default_factory=dict)
    staleness_in_queue: dict[int, int] = field(default_factory=dict)

    def metric(self, key: str) -> float | None:
        return self.metrics.get(key)


@dataclass(frozen=True)
class Published:
    """Weights of `version` are complete at `path` and may be loaded by the engines: an HF directory, or
    with LoRA served as adapters a PEFT adapter directory. `bytes` = the size of that directory. The probe
    (learner.served_probe) is what the supervisor's served-policy check compares each engine against:
    `probe_logprobs[i]` = the learner's log P(probe_ids[i + 1] | probe_ids[: i + 1]) for these weights,
    `probe_logprobs_prev` the same under the previously published version's (so the check can ask
    whether an engine is closer to the new policy than to the old one, whatever its numerical floor);
    all empty when the check is off. With `weights_url` (a learner with its own run directory) `path`
    is on the learner's machine and the version is fetched from that weight server
    (pipeline.transport.weights_http). `traceparent` (W3C, with [tracing] on) is the learner's publish
    span: the supervisor's sync of this version continues that trace (pipeline.contracts.tracing)."""

    name: ClassVar[str] = "published"
    version: int
    path: str
    bytes: int = 0
    probe_ids: list[int] = field(default_factory=list)
    probe_logprobs: list[float] = field(default_factory=list)
    weights_url: str | None = None
    probe_logprobs_prev: list[float] = field(default_factory=list)
    traceparent: str | None = None


@dataclass(frozen=True)
class CheckpointSaved:
    """A checkpoint of `step` is complete at `path`; it consumed the spool up to `consumed_seq` and the seqs
    in `consumed_after` beyond it (learner.spool_cursor), and took `seconds` to write."""

    name: ClassVar[str] = "checkpoint"
    step: int
    path: str
    consumed_seq: int
    seconds: float
    consumed_after: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Quarantined:
    """A spool file that could not be read moved to spool/quarantine (a `dropped` event follows)."""

    name: ClassVar[str] = "quarantined"
    seq: int
    file: str
    kind: str
    reason: str


@dataclass(frozen=True)
class StorageFault:
    """A checkpoint or weight export (`component`: checkpoint | weights) was refused by the storage
    (`kind`: ENOSPC, EROFS, EDQUOT, EIO, other); the learner holds its work and retries (`blocked`), or
    the write went through again after a refusal (`blocked` false; `kind` is then the last refusal's)."""

    name: ClassVar[str] = "storage"
    component: str
    blocked: bool
    kind: str
    message: str


@dataclass(frozen=True)
class Unreachable:
    """The learner cannot reach `what` (the spool service over the network) and keeps retrying
    (`blocked`), or reaches it again (`blocked` false): once each, however long it lasts."""

    name: ClassVar[str] = "unreachable"
    what: str
    blocked: bool
    message: str


@dataclass(frozen=True)
class Finished:
    """The learner stops on its own (it reached run.max_steps) and checkpoints; the daemon stops too."""

    name: ClassVar[str] = "finished"
    step: int
    reason: str


@dataclass(frozen=True)
class Error:
    """Something the learner reports without stopping (an unreadable command) or just before it exits
    with an error."""

    name: ClassVar[str] = "error"
    message: str


LearnerEvent = Union[  # noqa: UP007
    Ready, Dropped, Step, Published, CheckpointSaved, Quarantined, StorageFault, Unreachable, Finished, Error
]
EVENT_TYPES: dict[str, type[LearnerEvent]] = {
    cls.name: cls
    for cls in (
        Ready,
        Dropped,
        Step,
        Published,
        CheckpointSaved,
        Quarantined,
        StorageFault,
        Unreachable,
        Finished,
        Error,
    )
}


def encode(event: LearnerEvent) -> str:
    """One JSON line (no newline). Non-finite floats cannot travel as JSON: metrics send them as null."""
    body = asdict(event)
    if isinstance(event, Step):
        body["staleness"] = {str(k): v for k, v in sorted(event.staleness.items())}
    return json.dumps({"event": event.name, **body}, allow_nan=False, separators=(",", ":"))


def finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


def decode(obj: object) -> LearnerEvent:
    """The record of one decoded JSON object; ValueError naming the event and field if it is malformed."""
    if not isinstance(obj, dict):
        raise ValueError(f"learner event must be a JSON object, got {type(obj).__name__}")
    name = obj.get("event")
    cls = EVENT_TYPES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(f"unknown learner event {name!r} (known: {', '.join(EVENT_TYPES)})")
    hints = get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in fields(cls):
        if f.name not in obj:
            if f.default is not MISSING or f.default_factory is not MISSING:  # optional (added later)
                continue
            raise ValueError(f"learner event {name!r} lacks field {f.name!r}")
        values[f.name] = _coerce(obj[f.name], hints[f.name], f"{name}.{f.name}")
    return cls(**values)


def _coerce(value: object, hint: object, where: str) -> Any:
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif hint is str:
        if isinstance(value, str):
            return value
    elif hint == (str | None):
        if value is None or isinstance(value, str):
            return value
    elif hint is bool:
        if isinstance(value, bool):
            return value
    elif hint == list[str]:
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return value
    elif hint == list[int]:
        if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return value
    elif hint == list[float]:
        if isinstance(value, list) and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in value
        ):
            return [float(v) for v in value]
    elif hint == dict[str, float | None]:
        if isinstance(value, dict) and all(
            v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)) for v in value.values()
        ):
            return {str(k): (None if v is None else float(v)) for k, v in value.items()}
    elif hint == dict[int, int] and isinstance(value, dict):
        try:
            return {int(k): int(v) for k, v in value.items()}
        except (TypeError, ValueError):
            pass
    raise ValueError(f"learner event field {where} has {value!r}, expected {hint}")
