"""What `rollwise inspect` shows, as JSON-ready data: a run's groups from its spool and the learner's trace.

Sources, all read-only:
- `spool/g<seq>.arrow`: every group written and not yet pruned (Contract 4); `spool/quarantine/` with
  each file's `.reason`;
- `trace/s<step>.arrow` (learner.trace): a few trained groups per step, token by token as the loss saw
  them; a traced group whose spool file was pruned is still shown, from the trace's own rows;
- `logs/steps.jsonl`: which learner step trained which group, at which version.

A group's *staleness* is the learner version that trained it (for a group not trained yet: the newest
version the step log knows) minus the oldest policy version among its tokens. Its *outcome* is `solved`
(every episode), `failed` (none), `mixed`, or `none` (no episode has an outcome). Token text is decoded
one id at a time with the run's tokenizer; the page inserts every string as text, never as markup.
"""

from __future__ import annotations

import collections
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from learner.trace import trace_files
from pipeline.contracts.run_dir import RunDir, log_events
from pipeline.contracts.schema import TRAJECTORY_SCHEMA, EpisodeSegment, batch_to_segments
from pipeline.transport.spool import QUARANTINE_DIR, parse_seq, read_group_file

CHANNELS = ("logprob", "mismatch", "advantage", "version", "is_weight", "clip")
OUTCOMES = ("solved", "failed", "mixed", "none")
_TRACE_VALUES = ("learner_logprobs", "advantages", "is_weights", "clip")


@dataclass
class TraceValues:
    """The trace's per-token values of one row (learner.trace), and the learner step and version."""

    step: int
    learner_version: int
    learner_logprobs: list[float]
    advantages: list[float]
    is_weights: list[float]
    clip: list[int]


@dataclass
class Group:
    """One group as the page lists it; `rows` are its segments in episode order."""

    group_id: str
    seq: int | None
    source: str  # "spool" or "trace"
    rows: list[EpisodeSegment]
    traced: dict[tuple[str, int], TraceValues] = field(default_factory=dict)
    trained_step: int | None = None
    learner_version: int | None = None

    @property
    def env(self) -> str:
        return self.rows[0].env if self.rows else "?"

    def episodes(self) -> dict[str, list[EpisodeSegment]]:
        out: dict[str, list[EpisodeSegment]] = {}
        for row in self.rows:
            out.setdefault(row.episode_id, []).append(row)
        for segments in out.values():
            segments.sort(key=lambda r: r.segment)
        # Episode order, not the trace's (mini-batch) order: "g-2" before "g-10".
        return dict(sorted(out.items(), key=lambda item: _natural(item[0])))

    def outcome(self) -> str:
        firsts = [segments[0] for segments in self.episodes().values()]
        if not firsts or all(r.outcome is None for r in firsts):
            return "none"
        solved = sum(r.success for r in firsts)
        return "solved" if solved == len(firsts) else "failed" if solved == 0 else "mixed"

    def versions(self) -> tuple[int, int] | None:
        seen = [v for r in self.rows for v, m in zip(r.versions, r.loss_mask, strict=True) if m and v >= 0]
        return (min(seen), max(seen)) if seen else None

    def staleness(self, newest_version: int | None) -> int | None:
        versions = self.versions()
        trained_at = self.learner_version if self.learner_version is not None else newest_version
        # A pending group can hold tokens newer than the step log's newest version (the log lags): 0.
        return None if versions is None or trained_at is None else max(0, trained_at - versions[0])

    def summary(self, newest_version: int | None) -> dict[str, Any]:
        firsts = [segments[0] for segments in self.episodes().values()]
        versions = self.versions()
        return {
            "group_id": self.group_id,
            "seq": self.seq,
            "source": self.source,
            "env": self.env,
            "task_id": self.rows[0].task_id if self.rows else None,
            "episodes": len(firsts),
            "solved": sum(r.success for r in firsts),
            "outcome": self.outcome(),
            "finish_reasons": dict(sorted(collections.Counter(r.finish_reason for r in firsts).items())),
            "versions": list(versions) if versions else None,
            "trained_step": self.trained_step,
            "learner_version": self.learner_version,
            "staleness": self.staleness(newest_version),
            "traced": bool(self.traced),
        }


@dataclass(frozen=True)
class GroupFilter:
    """The page's filters; None = any."""

    env: str | None = None
    outcome: str | None = None
    finish_reason: str | None = None
    version_min: int | None = None
    version_max: int | None = None
    staleness_min: int | None = None
    staleness_max: int | None = None
    traced: bool | None = None

    def keeps(self, s: dict[str, Any]) -> bool:
        versions, staleness = s["versions"], s["staleness"]
        checks = [
            self.env is None or s["env"] == self.env,
            self.outcome is None or s["outcome"] == self.outcome,
            self.finish_reason is None or self.finish_reason in s["finish_reasons"],
            self.version_min is None or (versions is not None and versions[1] >= self.version_min),
            self.version_max is None or (versions is not None and versions[0] <= self.version_max),
            self.staleness_min is None or (staleness is not None and staleness >= self.staleness_min),
            self.staleness_max is None or (staleness is not None and staleness <= self.staleness_max),
            self.traced is None or s["traced"] == self.traced,
        ]
        return all(checks)


class RunView:
    """Reads a run directory on each call (cheap: spool files are parsed once and cached by name and
    modification time; the learner renames files into place, so a name never changes content)."""

    def __init__(self, run_dir: Path, tokenizer: Any, *, max_groups: int = 500) -> None:
        self.run = RunDir.at(run_dir)
        self.tokenizer = tokenizer
        self.max_groups = max_groups
        self._files: dict[Path, tuple[float, tuple[str, list[EpisodeSegment]] | str]] = {}
        self._trace_cache: dict[Path, tuple[float, list[tuple[EpisodeSegment, TraceValues]]]] = {}
        self._token_text: dict[int, str] = {}

    # ---- reading -----------------------------------------------------------------------------------
    def _spool_file(self, path: Path) -> tuple[str, list[EpisodeSegment]] | str:
        """(group_id, rows) of one spool file, or why it cannot be read (cached by mtime)."""
        try:
            mtime = path.stat().st_mtime
        except FileNotFoundError:
            return "pruned while reading"
        cached = self._files.get(path)
        if cached is not None and cached[0] == mtime:
            return cached[1]
        parsed: tuple[str, list[EpisodeSegment]] | str
        try:
            group_id, batch = read_group_file(path)
            rows, _ = batch_to_segments(batch)
            parsed = (group_id, rows)
        except Exception as exc:  # shown, not fatal: the learner will quarantine it
            parsed = f"unreadable: {exc}"
        self._files[path] = (mtime, parsed)
        return parsed

    def _trained(self) -> tuple[dict[str, tuple[int, int]], int | None]:
        """group_id -> (learner step, learner version before the step), and the newest version."""
        trained: dict[str, tuple[int, int]] = {}
        newest = None
        for step in log_events(self.run.step_log, "step"):
            version = int(step.get("version", 0))
            before = version - (1 if step.get("groups", 0) else 0)
            newest = version
            for group_id in step.get("group_ids") or []:
                trained[str(group_id)] = (int(step["step"]), before)
        return trained, newest

    def _trace_file(self, path: Path) -> list[tuple[EpisodeSegment, TraceValues]]:
        """The rows of one trace file with their values (cached by mtime; [] when unreadable)."""
        try:
            mtime = path.stat().st_mtime
        except FileNotFoundError:
            return []
        cached = self._trace_cache.get(path)
        if cached is not None and cached[0] == mtime:
            return cached[1]
        parsed: list[tuple[EpisodeSegment, TraceValues]] = []
        try:
            table = pa.ipc.open_file(str(path)).read_all()
        except (OSError, pa.ArrowInvalid):
            return []  # pruned or being replaced: read again next time
        if table.num_rows:
            batch = table.combine_chunks().to_batches()[0]
            present = set(batch.schema.names)
            rows, _ = batch_to_segments(batch.select([n for n in TRAJECTORY_SCHEMA.names if n in present]))
            values = batch.select(["step", "learner_version", *_TRACE_VALUES]).to_pylist()
            for row, v in zip(rows, values, strict=False):
                step, version = int(v["step"]), int(v["learner_version"])
                parsed.append((row, TraceValues(step, version, *(v[c] for c in _TRACE_VALUES))))
        self._trace_cache[path] = (mtime, parsed)
        return parsed

    def _traces(self) -> dict[str, list[tuple[EpisodeSegment, TraceValues]]]:
        out: dict[str, list[tuple[EpisodeSegment, TraceValues]]] = {}
        files = trace_files(self.run.trace)
        for stale in set(self._trace_cache) - {path for _, path in files}:
            del self._trace_cache[stale]  # pruned by the learner's retention
        for _, path in files:
            for row, values in self._trace_file(path):
                out.setdefault(row.group_id, []).append((row, values))
        return out

    def groups(self) -> tuple[list[Group], int | None]:
        """The newest `max_groups` groups (spool order, then trace-only groups by step) and the newest
        version the step log knows."""
        trained, newest = self._trained()
        traces = self._traces()
        listed = sorted(
            (seq, p) for p in self.run.spool.glob("g*.arrow") if (seq := parse_seq(p.name)) is not None
        )[-self.max_groups :]
        for stale in set(self._files) - {path for _, path in listed}:
            del self._files[stale]  # pruned, or older than the newest max_groups
        groups: dict[str, Group] = {}
        for seq, path in listed:
            parsed = self._spool_file(path)
            if isinstance(parsed, str):
                continue
            group_id, rows = parsed
            groups[group_id] = Group(group_id, seq, "spool", rows)
        for group_id, traced in traces.items():
            group = groups.get(group_id)
            if group is None:
                group = groups[group_id] = Group(group_id, None, "trace", [row for row, _ in traced])
            for row, values in traced:
                group.traced[(row.episode_id, row.segment)] = values
                group.trained_step, group.learner_version = values.step, values.learner_version
        for group_id, (step, before) in trained.items():
            if group_id in groups and groups[group_id].trained_step is None:
                groups[group_id].trained_step, groups[group_id].learner_version = step, before
        ordered = sorted(groups.values(), key=lambda g: (g.seq is None, g.seq or 0, g.trained_step or 0))
        return ordered, newest

    # ---- pages ---------------------------------------------------------------------------------------
    def list_groups(self, keep: GroupFilter, *, limit: int = 200) -> dict[str, Any]:
        """Newest first: the groups the filter keeps (at most `limit`) and every filter's choices."""
        groups, newest = self.groups()
        summaries = [g.summary(newest) for g in groups]
        kept = [s for s in reversed(summaries) if keep.keeps(s)]
        return {
            "groups": kept[:limit],
            "matched": len(kept),
            "total": len(summaries),
            "newest_version": newest,
            "choices": {
                "env": sorted({s["env"] for s in summaries}),
                "outcome": list(OUTCOMES),
                "finish_reason": sorted({r for s in summaries for r in s["finish_reasons"]}),
            },
        }

    def group_detail(self, group_id: str) -> dict[str, Any] | None:
        groups, newest = self.groups()
        group = next((g for g in groups if g.group_id == group_id), None)
        if group is None:
            return None
        return {
            "summary": group.summary(newest),
            "channels": list(CHANNELS),
            "episodes": [self._episode(group, segments) for segments in group.episodes().values()],
        }

    def quarantine(self) -> list[dict[str, Any]]:
        qdir = self.run.spool / QUARANTINE_DIR
        if not qdir.is_dir():
            return []
        out = []
        for path in sorted(qdir.iterdir()):
            if path.name.endswith(".reason"):
                continue
            reason_file = path.with_name(path.name + ".reason")
            reason = ""
            if reason_file.exists():
                reason = reason_file.read_text(encoding="utf-8", errors="replace").strip()
            size = path.stat().st_size
            out.append({"file": path.name, "seq": parse_seq(path.name), "bytes": size, "reason": reason})
        return out

    def run_info(self) -> dict[str, Any]:
        _, newest = self._trained()
        return {"run_dir": str(self.run.root), "newest_version": newest, "channels": list(CHANNELS)}

    # ---- one episode as chat turns -------------------------------------------------------------------
    def _text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = str(self.tokenizer.decode([token_id]))
        return text

    def _episode(self, group: Group, segments: list[EpisodeSegment]) -> dict[str, Any]:
        first = segments[0]
        blocks: list[dict[str, Any]] = []
        for seg in segments:
            trace = group.traced.get((seg.episode_id, seg.segment))
            for i, token_id in enumerate(seg.token_ids):
                generated = bool(seg.loss_mask[i])
                turn = int(seg.turn_index[i])
                role = "prompt" if turn < 0 else "model" if generated else "env"
                if not blocks or (blocks[-1]["role"], blocks[-1]["turn"], blocks[-1]["segment"]) != (
                    role,
                    turn,
                    seg.segment,
                ):
                    blocks.append({"role": role, "turn": turn, "segment": seg.segment, "tokens": []})
                token: dict[str, Any] = {"text": self._text(int(token_id)), "id": int(token_id)}
                if generated:
                    token["logprob"] = _finite(seg.logprobs[i])
                    token["version"] = int(seg.versions[i])
                    if trace is not None:
                        learner = _finite(trace.learner_logprobs[i])
                        token["learner_logprob"] = learner
                        engine = token["logprob"]
                        token["mismatch"] = None if learner is None or engine is None else learner - engine
                        token["advantage"] = _finite(trace.advantages[i])
                        token["is_weight"] = _finite(trace.is_weights[i])
                        token["clip"] = int(trace.clip[i])
                blocks[-1]["tokens"].append(token)
        return {
            "episode_id": first.episode_id,
            "task_id": first.task_id,
            "outcome": first.outcome,
            "success": first.success,
            "finish_reason": first.finish_reason,
            "num_turns": first.num_turns,
            "turn_rewards": list(first.turn_rewards),
            "segments": len(segments),
            "traced": any((s.episode_id, s.segment) in group.traced for s in segments),
            "trace_id": first.trace_id,  # the episode's OpenTelemetry trace ([tracing]), None without one
            "blocks": blocks,
        }


def _natural(text: str) -> tuple[str, int]:
    head, _, tail = text.rpartition("-")
    return (head, int(tail)) if tail.isdigit() else (text, -1)


def _finite(x: float | None) -> float | None:
    return float(x) if x is not None and math.isfinite(x) else None


_INT = re.compile(r"^-?\d+$")


def parse_filter(query: dict[str, str]) -> GroupFilter:
    """The page's query string as a GroupFilter; ValueError names a bad parameter."""

    def text(key: str, allowed: tuple[str, ...] | None = None) -> str | None:
        value = query.get(key) or None
        if value is not None and allowed is not None and value not in allowed:
            raise ValueError(f"{key} must be one of {', '.join(allowed)}, got {value!r}")
        return value

    def number(key: str) -> int | None:
        value = query.get(key) or None
        if value is None:
            return None
        if not _INT.match(value):
            raise ValueError(f"{key} must be an integer, got {value!r}")
        return int(value)

    traced = text("traced", ("yes", "no"))
    return GroupFilter(
        env=text("env"),
        outcome=text("outcome", OUTCOMES),
        finish_reason=text("finish_reason"),
        version_min=number("version_min"),
        version_max=number("version_max"),
        staleness_min=number("staleness_min"),
        staleness_max=number("staleness_max"),
        traced=None if traced is None else traced == "yes",
    )
