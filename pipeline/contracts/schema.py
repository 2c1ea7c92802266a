"""The trajectory contract between actors and the learner: one Arrow row per episode segment.

Every side imports this module and nothing else defines the layout. Rows are validated when written
and again when read; a row that breaks an invariant is rejected with a reason, never repaired.

Optional columns (OPTIONAL_COLUMNS) came after schema version 1 and keep it: a writer always writes them,
a reader accepts a file without them (the field is then None), and a reader that predates them ignores
them (it reads only the columns it knows). `trace_id`: the episode's OpenTelemetry trace ([tracing]), 32
hex digits, null when tracing is off or the trace was not sampled.

`routed_experts` (ROUTED_EXPERTS_FIELD) is optional the other way round: a writer adds it only to a batch
in which some row has a routing record (an MoE run with learner.moe asking for them), so batches of every
other run are byte for byte what they were; a reader accepts its absence (None) and checks its type.
"""

from __future__ import annotations

import math
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import compress
from operator import not_

import pyarrow as pa

from pipeline.contracts.staleness import WRITTEN_AT_KEY

SCHEMA_VERSION = "1"
SCHEMA_VERSION_KEY = b"rollwise.schema_version"

FINISH_REASONS = ("stop", "length", "truncated", "env_error", "engine_error", "timeout", "cut")
# Episodes that failed for reasons outside the policy's control carry no learning signal.
TRAINABLE_FINISH_REASONS = frozenset({"stop", "length", "truncated"})

TRAJECTORY_SCHEMA = pa.schema(
    [
        pa.field("episode_id", pa.string(), nullable=False),
        pa.field("group_id", pa.string(), nullable=False),
        pa.field("task_id", pa.string(), nullable=False),
        pa.field("env", pa.string(), nullable=False),
        pa.field("segment", pa.int16(), nullable=False),
        pa.field("token_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("prompt_len", pa.int32(), nullable=False),
        pa.field("loss_mask", pa.list_(pa.uint8()), nullable=False),
        pa.field("logprobs", pa.list_(pa.float32()), nullable=False),
        pa.field("turn_index", pa.list_(pa.int16()), nullable=False),
        pa.field("versions", pa.list_(pa.int32()), nullable=False),
        pa.field("turn_rewards", pa.list_(pa.float32()), nullable=False),
        pa.field("outcome", pa.float32(), nullable=True),
        pa.field("num_turns", pa.int16(), nullable=False),
        pa.field("finish_reason", pa.string(), nullable=False),
        pa.field("trace_id", pa.string(), nullable=True),
    ],
    metadata={SCHEMA_VERSION_KEY: SCHEMA_VERSION.encode()},
)

OPTIONAL_COLUMNS = frozenset({"trace_id"})

_INT16_MAX = 2**15 - 1

# Optional column: present in a batch only when some row carries a routing record (an MoE run that asked
# its engines for them: learner.moe). Batches without it, and files written before it existed, read as
# routed_experts = None. Readers that predate it ignore the column.
ROUTED_EXPERTS_TYPE = pa.struct(
    [
        pa.field("layers", pa.int16(), nullable=False),
        pa.field("topk", pa.int16(), nullable=False),
        pa.field("width", pa.int8(), nullable=False),
        pa.field("ids", pa.binary(), nullable=False),
    ]
)
ROUTED_EXPERTS_FIELD = pa.field("routed_experts", ROUTED_EXPERTS_TYPE, nullable=True)
TRAJECTORY_SCHEMA_WITH_ROUTING = TRAJECTORY_SCHEMA.append(ROUTED_EXPERTS_FIELD)
_ID_TYPECODES = {1: "B", 2: "H"}


@dataclass(frozen=True)
class RoutedExperts:
    """The experts the engine routed each token position to: for positions 0 .. `positions` - 1 of the
    row's token_ids, per MoE layer, the `topk` expert ids it chose (SGLang's `routed_experts`, shape
    (tokens, layers, topk)). The engine never forwards the last sampled token, so a complete record
    covers len(token_ids) - 1 positions.

    `ids` holds them C-ordered (position, layer, k) as unsigned integers of `width` bytes, little endian:
    1 byte for models with at most 256 experts per layer, else 2."""

    layers: int
    topk: int
    width: int
    ids: bytes

    @property
    def per_position(self) -> int:
        return self.layers * self.topk

    @property
    def positions(self) -> int:
        return len(self.ids) // (self.per_position * self.width) if self.per_position > 0 else 0

    @staticmethod
    def width_for(num_experts: int) -> int:
        """Bytes per expert id for a model with `num_experts` experts per layer."""
        if not 1 <= num_experts <= 2**16:
            raise ValueError(f"num_experts must be in [1, 65536], got {num_experts}")
        return 1 if num_experts <= 256 else 2

    @classmethod
    def encode(cls, values: Sequence[int], *, layers: int, topk: int, width: int) -> bytes:
        """`values` (expert ids, C-ordered (position, layer, k)) as the `ids` bytes of width `width`.
        ValueError when one does not fit."""
        if width not in _ID_TYPECODES:
            raise ValueError(f"width must be 1 or 2 bytes, got {width}")
        if len(values) % (layers * topk):
            raise ValueError(f"{len(values)} expert ids are not a whole number of ({layers} x {topk}) rows")
        try:
            packed = array(_ID_TYPECODES[width], values)
        except OverflowError as exc:
            raise ValueError(f"an expert id does not fit {width} byte(s) (or is negative): {exc}") from None
        if width > 1 and sys.byteorder != "little":
            packed.byteswap()
        return packed.tobytes()

    def values(self) -> list[int]:
        """Every expert id, C-ordered (position, layer, k)."""
        unpacked = array(_ID_TYPECODES[self.width])
        unpacked.frombytes(self.ids)
        if self.width > 1 and sys.byteorder != "little":
            unpacked.byteswap()
        return unpacked.tolist()

    def model_problem(self, layers: int, topk: int, num_experts: int) -> str | None:
        """Why this record cannot be replayed on a model routing `layers` layers to the top `topk` of
        `num_experts` experts, or None."""
        if (self.layers, self.topk) != (layers, topk):
            return (
                f"routed_experts records {self.layers} layers x top-{self.topk}; the model routes {layers} "
                f"layers x top-{topk} (the engine serves another model?)"
            )
        if self.ids and max(self.values()) >= num_experts:
            return f"routed_experts names an expert id >= the model's {num_experts} experts"
        return None

    def problem(self, num_tokens: int) -> str | None:
        """Why this record cannot belong to a row of `num_tokens` tokens, or None."""
        if self.layers < 1 or self.topk < 1:
            return f"routed_experts has layers={self.layers}, topk={self.topk}; both must be >= 1"
        if self.width not in _ID_TYPECODES:
            return f"routed_experts.width={self.width}, expected 1 or 2 bytes"
        if len(self.ids) % (self.per_position * self.width):
            return (
                f"routed_experts holds {len(self.ids)} bytes, not a whole number of positions of "
                f"{self.layers} layers x {self.topk} experts x {self.width} byte(s)"
            )
        if self.positions > num_tokens:
            return f"routed_experts covers {self.positions} positions of a row of {num_tokens} tokens"
        return None


@dataclass
class EpisodeSegment:
    """One episode segment, field for field the Arrow row (see docs/architecture.md, Contract 1)."""

    episode_id: str
    group_id: str
    task_id: str
    env: str
    token_ids: list[int]
    prompt_len: int
    loss_mask: list[int]
    logprobs: list[float]
    turn_index: list[int]
    versions: list[int]
    turn_rewards: list[float]
    outcome: float | None
    num_turns: int
    finish_reason: str
    segment: int = 0
    trace_id: str | None = None
    routed_experts: RoutedExperts | None = None

    @property
    def trainable(self) -> bool:
        return self.finish_reason in TRAINABLE_FINISH_REASONS

    @property
    def success(self) -> bool:
        return self.outcome is not None and self.outcome >= 1.0

    @property
    def num_generated(self) -> int:
        return sum(self.loss_mask)

    def min_version(self) -> int | None:
        """Oldest policy version among generated tokens (None if the row generated nothing)."""
        stamped = [v for v, m in zip(self.versions, self.loss_mask, strict=True) if m]
        return min(stamped) if stamped else None


@dataclass(frozen=True)
class RejectedRow:
    index: int
    episode_id: str
    reason: str


class InvalidSegmentError(ValueError):
    """An episode that breaks the schema's invariants; the message names the episode and the rule."""


def validate_segment(ep: EpisodeSegment) -> str | None:
    """Return why `ep` breaks an invariant, or None when it is valid."""
    n = len(ep.token_ids)
    for name in ("loss_mask", "logprobs", "turn_index", "versions"):
        if len(getattr(ep, name)) != n:
            return f"len({name})={len(getattr(ep, name))} != len(token_ids)={n}"
    if n == 0:
        return "token_ids is empty"
    if ep.finish_reason not in FINISH_REASONS:
        return f"finish_reason {ep.finish_reason!r} not in {FINISH_REASONS}"
    if not 0 <= ep.prompt_len <= n:
        return f"prompt_len={ep.prompt_len} outside [0, {n}]"
    if ep.num_turns < 0 or ep.num_turns > _INT16_MAX:
        return f"num_turns={ep.num_turns} out of range"
    if len(ep.turn_rewards) != ep.num_turns:
        return f"len(turn_rewards)={len(ep.turn_rewards)} != num_turns={ep.num_turns}"
    if ep.segment < 0:
        return f"segment={ep.segment} is negative"
    for k, r in enumerate(ep.turn_rewards):
        if not math.isfinite(r):
            return f"turn_rewards[{k}]={r} is not finite"
    if ep.outcome is not None and not math.isfinite(ep.outcome):
        return f"outcome={ep.outcome} is not finite"
    if ep.routed_experts is not None and (problem := ep.routed_experts.problem(n)) is not None:
        return problem
    if _tokens_valid(ep):
        return None
    return _first_token_violation(ep)


def _tokens_valid(ep: EpisodeSegment) -> bool:
    """The per-token invariants of `_first_token_violation`, checked with C-level passes (list.count,
    min/max, itertools.compress): rows are validated on every write and read, and a Python loop over
    every token was a measurable share of the actors' per-turn cost. True means valid; False means
    `_first_token_violation` finds the first broken position and says why."""
    mask, turns, versions, logprobs = ep.loss_mask, ep.turn_index, ep.versions, ep.logprobs
    n, prompt = len(mask), ep.prompt_len
    generated = mask.count(1)
    if generated + mask.count(0) != n:
        return False
    if any(mask[:prompt]) or turns[:prompt].count(-1) != prompt:
        return False
    if min(turns) < -1 or max(turns) >= max(ep.num_turns, 1):
        return False
    if generated:
        if min(compress(turns, mask)) < 0 or min(compress(versions, mask)) < 0:
            return False
        gen_logprobs = list(compress(logprobs, mask))
        if not all(map(math.isfinite, gen_logprobs)) or max(gen_logprobs) > 0.0:
            return False
    # Generated versions are >= 0 (above), so exactly n - generated entries of -1 means every
    # non-generated token has version -1.
    if versions.count(-1) != n - generated:
        return False
    return not any(compress(logprobs, map(not_, mask)))  # NaN is truthy: caught too


def _first_token_violation(ep: EpisodeSegment) -> str | None:
    n = len(ep.token_ids)
    for t in range(n):
        m = ep.loss_mask[t]
        if m not in (0, 1):
            return f"loss_mask[{t}]={m} is not 0 or 1"
        turn = ep.turn_index[t]
        if turn < -1 or turn >= max(ep.num_turns, 1):
            return f"turn_index[{t}]={turn} outside [-1, num_turns)"
        if m:
            if t < ep.prompt_len:
                return f"loss_mask[{t}]=1 inside the prompt (prompt_len={ep.prompt_len})"
            if turn < 0:
                return f"loss_mask[{t}]=1 on a token with turn_index -1 (not generated)"
            if not math.isfinite(ep.logprobs[t]) or ep.logprobs[t] > 0.0:
                return f"logprobs[{t}]={ep.logprobs[t]} is not a finite log-probability on a generated token"
            if ep.versions[t] < 0:
                return f"versions[{t}]={ep.versions[t]}: generated token without a policy version"
        else:
            if ep.versions[t] != -1:
                return f"versions[{t}]={ep.versions[t]} on a non-generated token (must be -1)"
            if ep.logprobs[t] != 0.0:
                return f"logprobs[{t}]={ep.logprobs[t]} on a non-generated token (must be 0)"
        if t < ep.prompt_len and turn != -1:
            return f"turn_index[{t}]={turn} inside the prompt (must be -1)"
    return None


def stamp_written_at(batch: pa.RecordBatch, learner_version: int) -> pa.RecordBatch:
    """The group's batch with the learner version its writer had last heard of (optional metadata,
    pipeline.contracts.staleness.WRITTEN_AT_KEY): where its tokens' staleness accrued is then known."""
    metadata = dict(batch.schema.metadata or {})
    metadata[WRITTEN_AT_KEY] = str(learner_version).encode()
    return batch.replace_schema_metadata(metadata)


def segments_to_batch(episodes: Sequence[EpisodeSegment]) -> pa.RecordBatch:
    """Encode episodes as one RecordBatch; raises InvalidSegmentError naming the first bad episode."""
    for ep in episodes:
        reason = validate_segment(ep)
        if reason is not None:
            raise InvalidSegmentError(f"episode {ep.episode_id!r} (segment {ep.segment}): {reason}")
    columns = {f.name: [getattr(ep, f.name) for ep in episodes] for f in TRAJECTORY_SCHEMA}
    arrays = [pa.array(columns[f.name], type=f.type) for f in TRAJECTORY_SCHEMA]
    if all(ep.routed_experts is None for ep in episodes):
        return pa.RecordBatch.from_arrays(arrays, schema=TRAJECTORY_SCHEMA)
    routed = [
        None
        if (r := ep.routed_experts) is None
        else {"layers": r.layers, "topk": r.topk, "width": r.width, "ids": r.ids}
        for ep in episodes
    ]
    arrays.append(pa.array(routed, type=ROUTED_EXPERTS_TYPE))
    return pa.RecordBatch.from_arrays(arrays, schema=TRAJECTORY_SCHEMA_WITH_ROUTING)


def check_schema(schema: pa.Schema) -> str | None:
    """Why a batch's schema cannot be read as trajectories, or None."""
    version = (schema.metadata or {}).get(SCHEMA_VERSION_KEY)
    if version is None:
        return "schema metadata lacks rollwise.schema_version"
    if version.decode() != SCHEMA_VERSION:
        return f"schema version {version.decode()!r}, this build reads {SCHEMA_VERSION!r}"
    for f in TRAJECTORY_SCHEMA:
        idx = schema.get_field_index(f.name)
        if idx < 0:
            if f.name in OPTIONAL_COLUMNS:
                continue
            return f"missing column {f.name!r}"
        if schema.field(idx).type != f.type:
            return f"column {f.name!r} has type {schema.field(idx).type}, expected {f.type}"
    idx = schema.get_field_index(ROUTED_EXPERTS_FIELD.name)
    if idx >= 0 and schema.field(idx).type != ROUTED_EXPERTS_TYPE:
        return (
            f"column {ROUTED_EXPERTS_FIELD.name!r} has type {schema.field(idx).type}, "
            f"expected {ROUTED_EXPERTS_TYPE}"
        )
    return None


def batch_to_segments(batch: pa.RecordBatch) -> tuple[list[EpisodeSegment], list[RejectedRow]]:
    """Decode a RecordBatch; rows that break an invariant come back in the rejected list with a reason.

    A batch whose schema is not a trajectory schema raises InvalidSegmentError (nothing in it is usable).
    """
    problem = check_schema(batch.schema)
    if problem is not None:
        raise InvalidSegmentError(problem)
    data = batch.to_pydict()
    for name in OPTIONAL_COLUMNS:
        data.setdefault(name, [None] * batch.num_rows)  # a file written before the column existed
    routed = data.get(ROUTED_EXPERTS_FIELD.name, [None] * batch.num_rows)
    episodes: list[EpisodeSegment] = []
    rejected: list[RejectedRow] = []
    for i in range(batch.num_rows):
        row = {f.name: data[f.name][i] for f in TRAJECTORY_SCHEMA}
        record = routed[i]
        ep = EpisodeSegment(**row, routed_experts=None if record is None else RoutedExperts(**record))
        reason = validate_segment(ep)
        if reason is None:
            episodes.append(ep)
        else:
            rejected.append(RejectedRow(index=i, episode_id=str(row["episode_id"]), reason=reason))
    return episodes, rejected
