"""The soak's books: every group written to the spool is trained, dropped (with its reason), quarantined
or still pending, exactly once, and no group is trained twice into the committed weights.

Sources, all on disk (a SIGKILLed supervisor remembers nothing):
- written: spool sequence numbers are contiguous and never reused, so the highest one found in the
  spool, in quarantine or in retention.json is the number of groups ever written;
- consumed: each checkpoint's record (as in its state.json: the group ids consumed since the previous
  checkpoint and, under extra.dropped_groups, which of them were dropped and why) from the learner's
  consumption ledger, logs/consumed.jsonl (`pipeline.contracts.run_dir.committed_consumption`: retention
  deletes
  old checkpoints, the ledger keeps their records; steps redone after a restart supersede the lost
  lineage's). The committed chain is the records up to the final checkpoint's step;
- quarantined: spool/quarantine/g<seq>.arrow;
- pending: sequence numbers after the final checkpoint's consumed_seq, less those it consumed out of
  order (its `after`, learner.spool_cursor), still in the spool (the next start of the learner reads them).
"""

from __future__ import annotations

import collections
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pipeline.contracts.run_dir import (
    CHECKPOINT_STATE,
    DROPPED_GROUPS_KEY,
    RunDir,
    committed_consumption,
    latest_checkpoint_dir,
)
from pipeline.transport.spool import QUARANTINE_DIR, deleted_through, parse_seq


@dataclass(frozen=True)
class Books:
    """The reconciliation. `ok` = every check held; `problems` says which did not and why."""

    written: int
    consumed_seq: int
    consumed_after: int
    final_step: int
    trained: int
    dropped: dict[str, int]
    quarantined: int
    pending: int
    trained_twice: list[str]
    problems: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def _seqs(directory: Path) -> list[int]:
    if not directory.is_dir():
        return []
    return sorted(s for p in directory.iterdir() if (s := parse_seq(p.name)) is not None)


def reconcile(run: RunDir, *, learner: RunDir | None = None) -> Books:
    """Check the identity in the module docstring on a stopped run (module docstring for the sources).
    `learner`: the learner's own run directory (learner.remote.run_dir), where its checkpoints and
    ledger are; the spool is always the supervisor's."""
    problems: list[str] = []
    books_dir = learner if learner is not None else run
    records = committed_consumption(books_dir.consumed_log)
    latest = latest_checkpoint_dir(books_dir.checkpoints)
    final: dict[str, Any] = {"step": 0, "consumed": {"last_seq": 0, "group_ids": []}, "extra": {}}
    if latest is not None:
        final = json.loads((latest / CHECKPOINT_STATE).read_text(encoding="utf-8"))
        records[int(final["step"])] = final  # the last word (the same record the ledger holds)
    final_step = int(final["step"])
    consumed_seq = max(0, int(final["consumed"]["last_seq"]))
    after = {int(s) for s in final["consumed"].get("after") or []}

    chain: list[dict[str, Any]] = [records[s] for s in sorted(records) if s <= final_step]
    last_seqs = [int(r["consumed"]["last_seq"]) for r in chain]
    if last_seqs != sorted(last_seqs):
        problems.append(f"checkpoint chain's consumed_seq goes backwards: {last_seqs}")
    consumed_ids = [gid for r in chain for gid in r["consumed"]["group_ids"]]
    dropped_by_id: dict[str, str] = {}
    for r in chain:
        dropped_by_id.update((r.get("extra") or {}).get(DROPPED_GROUPS_KEY) or {})
    counts = collections.Counter(consumed_ids)
    twice = sorted(gid for gid, n in counts.items() if n > 1)
    trained_twice = [gid for gid in twice if gid not in dropped_by_id]
    if twice:
        problems.append(f"{len(twice)} group(s) consumed twice along the committed chain: {twice[:5]}")
    trained = [gid for gid in counts if gid not in dropped_by_id]
    dropped = collections.Counter(dropped_by_id[gid] for gid in counts if gid in dropped_by_id)

    spool_seqs = _seqs(run.spool)
    quarantine_seqs = _seqs(run.spool / QUARANTINE_DIR)
    pruned_through = deleted_through(run.spool)
    written = max([pruned_through, *spool_seqs, *quarantine_seqs])
    present = set(spool_seqs) | set(quarantine_seqs)
    missing = [s for s in range(pruned_through + 1, written + 1) if s not in present]
    if missing:
        problems.append(f"{len(missing)} spool sequence number(s) lost: {missing[:10]}")
    quarantined_consumed = sum(1 for s in quarantine_seqs if s <= consumed_seq)
    if len(consumed_ids) + quarantined_consumed != consumed_seq + len(after):
        problems.append(
            f"the committed chain accounts for {len(consumed_ids)} consumed + {quarantined_consumed} "
            f"quarantined groups, but its consumed_seq is {consumed_seq} with {len(after)} consumed after it "
            "(a checkpoint record was missed, or a group was counted twice)"
        )
    missing_after = sorted(after - set(spool_seqs))
    if missing_after:
        problems.append(f"consumed after consumed_seq but not in the spool: {missing_after[:10]}")
    if pruned_through > consumed_seq:
        problems.append(f"retention pruned through seq {pruned_through}, past consumed_seq {consumed_seq}")
    quarantined_after = len(quarantine_seqs) - quarantined_consumed
    pending = written - consumed_seq - len(after) - quarantined_after
    if len(trained) + sum(dropped.values()) + len(quarantine_seqs) + pending != written:
        problems.append(
            f"written {written} != trained {len(trained)} + dropped {sum(dropped.values())} + quarantined "
            f"{len(quarantine_seqs)} + pending {pending}"
        )
    return Books(
        written=written,
        consumed_seq=consumed_seq,
        consumed_after=len(after),
        final_step=final_step,
        trained=len(trained),
        dropped=dict(sorted(dropped.items())),
        quarantined=len(quarantine_seqs),
        pending=pending,
        trained_twice=trained_twice,
        problems=problems,
    )
