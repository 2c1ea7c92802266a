"""What the advisor reports: findings, ranked alarms first, advice held back while any alarm stands.

An alarm says the run is broken or wasting its time; advice says it could learn faster. Tuning a broken
run only hides the break, so advice is shown only when no alarm stands (miles' advisor ranks the same
way). Among alarms the higher `score` comes first: roughly the share of the run's time or tokens the
problem costs, so the one to fix first leads."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Literal

Level = Literal["alarm", "advice"]


@dataclass(frozen=True)
class Finding:
    """`check` names the rule (health_checks); `evidence` lines each carry a number and where it came
    from; `action` is what to change or run."""

    check: str
    level: Level
    score: float
    title: str
    evidence: list[str] = field(default_factory=list)
    action: str = ""


def ranked(findings: Iterable[Finding]) -> list[Finding]:
    """Alarms by score, highest first; advice (by score) only when there is no alarm."""
    found = list(findings)
    alarms = sorted((f for f in found if f.level == "alarm"), key=lambda f: -f.score)
    if alarms:
        return alarms
    return sorted((f for f in found if f.level == "advice"), key=lambda f: -f.score)


def held_back(findings: Iterable[Finding]) -> int:
    """Advice not shown because an alarm stands."""
    found = list(findings)
    return sum(f.level == "advice" for f in found) if any(f.level == "alarm" for f in found) else 0


def render_text(findings: Sequence[Finding], held: int, source: str) -> str:
    """The report a person reads: one block per finding, numbered in rank order."""
    if not findings:
        return f"doctor: {source}: no finding; nothing to fix, nothing to tune\n"
    lines = [f"doctor: {source}: {len(findings)} finding(s), most important first"]
    for rank, f in enumerate(findings, 1):
        lines.append(f"{rank}. [{f.level}] {f.title} ({f.check})")
        lines.extend(f"     - {e}" for e in f.evidence)
        if f.action:
            lines.append(f"     => {f.action}")
    if held:
        lines.append(f"({held} tuning advice held back until the alarms above are cleared)")
    return "\n".join(lines) + "\n"


def render_json(findings: Sequence[Finding], held: int, source: str) -> str:
    return json.dumps({"source": source, "findings": [asdict(f) for f in findings], "advice_held_back": held})
