"""`rollwise bench hosts`: the three machines of docs/scale_out.md on hosts of their own (network
namespaces, pipeline.tools.hosts.three_hosts), trained through a hostile network, one fault after the
other on the same run:

- `latency`: every route delays each chunk by 50-200 ms;
- `drops`: every route closes 30 % of new connections at once and resets a connection after 2 % of chunks;
- `throttle`: the learner -> supervisor weight link at `--throttle-kbps`;
- `learner-cut`: the learner's host partitioned (its link down) for `--partition-s` seconds;
- `engine-cut`: the engine's host partitioned for `--partition-s` seconds.

Each fault lasts until `--steps` learner steps happened under it (a partition: its fixed time), then the
network is healed and the run must make `--steps` more on its own; those are the calm steps the next
fault is compared with (topped up to `--steps` intervals from the first step after healing). Per fault it
prints the steps under it, the seconds per step under it against the calm ones before it, the longest gap
between two steps, the seconds from healing to the next step, and the messages the supervisor printed
while it lasted.
At the end the run stops and the soak's books must balance (nothing lost, nothing trained twice).
Root only (ip netns). Prints one JSON object and writes it to `--out`/summary.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pipeline.tools.hosts.three_hosts import SECRETS, FleetOnHosts

SCENARIOS = ("latency", "drops", "throttle", "learner-cut", "engine-cut")


@dataclass
class Outcome:
    """One fault and what the run did under it and after it (module docstring)."""

    name: str
    fault_s: float
    steps_during: int
    s_per_step_calm: float | None
    s_per_step_during: float | None
    longest_gap_s: float
    resume_s: float | None
    dropped: int = 0  # connections the proxy closed at once while the fault lasted
    resets: int = 0  # connections it reset
    messages: list[str] = field(default_factory=list)


def _per_step(times: list[float]) -> float | None:
    return (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None


def _longest_gap(times: list[float], start: float, end: float) -> float:
    points = [start, *(t for t in times if start <= t <= end), end]
    return max(b - a for a, b in itertools.pairwise(points))


def _faults(
    fleet: FleetOnHosts, args: argparse.Namespace
) -> dict[str, tuple[Callable[[], None], float | None]]:
    """name -> (start the fault, its fixed duration in seconds or None: until --steps steps)."""
    return {
        "latency": (lambda: fleet.proxy.set(None, latency_s=(0.05, 0.2)), None),
        "drops": (lambda: fleet.proxy.set(None, drop=0.3, reset=0.02), None),
        "throttle": (lambda: fleet.proxy.set("weights", rate_bps=args.throttle_kbps * 1000.0), None),
        "learner-cut": (lambda: fleet.net.cut("learner"), args.partition_s),
        "engine-cut": (lambda: fleet.net.cut("eng1"), args.partition_s),
    }


def _heal(fleet: FleetOnHosts) -> None:
    fleet.proxy.clear()
    for host in ("learner", "eng1"):
        fleet.net.mend(host)


def run_scenarios(fleet: FleetOnHosts, names: list[str], args: argparse.Namespace) -> list[Outcome]:
    """The faults one after the other; the steps after one fault are the calm steps before the next."""
    outcomes: list[Outcome] = []
    calm_since = 0.0
    for name in names:
        outcome, calm_since = run_scenario(fleet, name, args, calm_since)
        outcomes.append(outcome)
        print(json.dumps(asdict(outcome)), file=sys.stderr, flush=True)
    return outcomes


def run_scenario(
    fleet: FleetOnHosts, name: str, args: argparse.Namespace, calm_since: float = 0.0
) -> tuple[Outcome, float]:
    """Calm steps (those since `calm_since`, waited for when fewer than `--steps` + 1), the fault,
    healing, steps on its own: the outcome, and the time the run resumed after it."""
    calm = [t for t, _ in fleet.steps() if t >= calm_since]
    if len(calm) < args.steps + 1:
        fleet.wait_steps(args.steps + 1 - len(calm), timeout_s=args.step_timeout_s)
    calm = [t for t, _ in fleet.steps() if t >= calm_since][-(args.steps + 1) :]
    start_fault, fixed_s = _faults(fleet, args)[name]
    began = fleet.now()
    counted = _dropped_and_reset(fleet)
    start_fault()
    try:
        if fixed_s is None:
            fleet.wait_steps(args.steps, timeout_s=args.step_timeout_s)
        else:
            time.sleep(fixed_s)
    finally:
        _heal(fleet)
    healed = fleet.now()
    dropped, resets = (b - a for a, b in zip(counted, _dropped_and_reset(fleet), strict=True))
    during = [t for t, _ in fleet.steps() if began <= t <= healed]
    fleet.wait_steps(args.steps, timeout_s=args.step_timeout_s)
    after = [t for t, _ in fleet.steps() if t > healed]
    resumed = after[0] if after else fleet.now()
    said = [str(e.get("text")) for t, e in fleet.snapshot("message") if began <= t <= resumed]
    outcome = Outcome(
        name=name,
        fault_s=round(healed - began, 1),
        steps_during=len(during),
        s_per_step_calm=_round(_per_step(calm)),
        s_per_step_during=_round(_per_step(during)),
        longest_gap_s=round(_longest_gap(during, began, healed), 1),
        resume_s=round(after[0] - healed, 1) if after else None,
        dropped=dropped,
        resets=resets,
        messages=list(dict.fromkeys(said)),
    )
    return outcome, resumed


def _dropped_and_reset(fleet: FleetOnHosts) -> tuple[int, int]:
    routes = fleet.proxy.routes.values()
    return sum(r.dropped for r in routes), sum(r.resets for r in routes)


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


def measure(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The whole bench on a fleet under `root`: outcomes, books, secrets seen on the wire."""
    with FleetOnHosts(root, tls=not args.plaintext, seed=args.seed) as fleet:
        fleet.start()
        outcomes = run_scenarios(fleet, args.scenarios, args)
        code = fleet.stop()
        books = fleet.books()
        seen = {key: fleet.proxy.seen(secret) for key, secret in SECRETS.items()}
        routes = {
            name: {
                "connections": r.connections,
                "dropped": r.dropped,
                "resets": r.resets,
                "bytes": r.bytes_forwarded,
            }
            for name, r in fleet.proxy.routes.items()
        }
    return {
        "tls": not args.plaintext,
        "exit_code": code,
        "scenarios": [asdict(o) for o in outcomes],
        "books": books.as_dict(),
        "secrets_seen_in_clear": seen,
        "routes": routes,
    }


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="rollwise bench hosts", description=__doc__.split("\n\n")[0])
    p.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    p.add_argument("--steps", type=int, default=3, help="learner steps before, under and after each fault")
    p.add_argument("--partition-s", type=float, default=35.0, help="how long a partition lasts")
    p.add_argument("--throttle-kbps", type=float, default=500.0, help="the throttled weight link, kB/s")
    p.add_argument("--step-timeout-s", type=float, default=300.0, help="give up waiting for steps after")
    p.add_argument("--plaintext", action="store_true", help="no TLS (tls.allow_plaintext)")
    p.add_argument("--seed", type=int, default=0, help="the proxy's random faults")
    p.add_argument("--out", type=Path, help="directory for the hosts' files and summary.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from pipeline.tools.hosts.namespaces import sweep_stale, unavailable

    args = parse(sys.argv[1:] if argv is None else argv)
    why = unavailable()
    if why is not None:
        print(f"rollwise bench hosts: {why}", file=sys.stderr)
        return 2
    sweep_stale()
    if args.out is None:
        with tempfile.TemporaryDirectory(prefix="rollwise-hosts-") as tmp:
            summary = measure(Path(tmp), args)
    else:
        args.out.mkdir(parents=True, exist_ok=True)
        summary = measure(args.out, args)
        (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    ok = (
        summary["books"]["ok"]
        and summary["exit_code"] == 0
        and not any(summary["secrets_seen_in_clear"].values())
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
