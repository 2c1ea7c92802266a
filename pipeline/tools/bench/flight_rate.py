"""`rollwise bench transport`: groups/s and MB/s read through Arrow Flight on localhost against the local
spool reader, the same spool files, in one process.

The spool is written once (`--groups` groups of `--episodes` episodes, `--tokens` tokens each, the
trajectory schema), then each reader drains it from seq 0 `--repeats` times, alternating so that page
cache and machine load affect both alike: the local `SpoolReader` (open, read, validate each file) and
`FlightSpoolReader` against a `SpoolFlightService` on 127.0.0.1 (listing + one do_get per group, the
learner's path with `learner.remote.spool_url`). MB counts the spool files' bytes. Prints one JSON object
whose `flight_over_local` is the ratio of groups/s (median over repeats).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


def write_spool(spool: Path, groups: int, episodes: int, tokens: int) -> int:
    """Write the benchmark's groups; returns the spool's total bytes."""
    import numpy as np

    from pipeline.contracts.schema import EpisodeSegment, segments_to_batch
    from pipeline.transport.spool import SpoolWriter

    rng = np.random.default_rng(0)
    writer = SpoolWriter(spool)
    total = 0
    prompt = max(1, tokens // 4)
    for g in range(groups):
        rows = []
        for e in range(episodes):
            ids = rng.integers(1, 150_000, size=tokens).tolist()
            rows.append(
                EpisodeSegment(
                    episode_id=f"g{g}-e{e}",
                    group_id=f"g{g}",
                    task_id=f"t{g}",
                    env="bench",
                    token_ids=ids,
                    prompt_len=prompt,
                    loss_mask=[0] * prompt + [1] * (tokens - prompt),
                    logprobs=[0.0] * prompt + (-rng.random(tokens - prompt)).tolist(),
                    turn_index=[-1] * prompt + [0] * (tokens - prompt),
                    versions=[-1] * prompt + [0] * (tokens - prompt),
                    turn_rewards=[1.0],
                    outcome=1.0,
                    num_turns=1,
                    finish_reason="stop",
                )
            )
        total += writer.write_group(segments_to_batch(rows), group_id=f"g{g}").nbytes
    return total


def drain(reader: Any, expected: int) -> float:
    """Seconds to read `expected` groups from seq 0."""
    started = time.perf_counter()
    seen = 0
    while seen < expected:
        items = reader.poll(limit=64)
        if not items:
            raise RuntimeError(f"reader stopped after {seen} of {expected} groups")
        seen += len(items)
    return time.perf_counter() - started


def measure(groups: int, episodes: int, tokens: int, repeats: int) -> dict[str, Any]:
    from pipeline.transport.flight import FlightSpoolReader, SpoolFlightService
    from pipeline.transport.spool import SpoolReader

    with tempfile.TemporaryDirectory(prefix="rollwise-bench-transport-") as tmp:
        spool = Path(tmp) / "spool"
        nbytes = write_spool(spool, groups, episodes, tokens)
        service = SpoolFlightService(spool, host="127.0.0.1", port=0)
        service.start()
        try:
            local_s: list[float] = []
            flight_s: list[float] = []
            drain(FlightSpoolReader(service.url, after_seq=0, wait_s=0.0), groups)  # warm-up: connect
            for _ in range(repeats):
                local_s.append(drain(SpoolReader(spool, after_seq=0), groups))
                reader = FlightSpoolReader(service.url, after_seq=0, wait_s=0.0)
                flight_s.append(drain(reader, groups))
                reader.close()
        finally:
            service.stop()
    mb = nbytes / 1e6

    def rates(seconds: list[float]) -> dict[str, float]:
        median = statistics.median(seconds)
        return {
            "seconds": round(median, 4),
            "groups_per_s": round(groups / median, 1),
            "mb_per_s": round(mb / median, 1),
        }

    local, remote = rates(local_s), rates(flight_s)
    return {
        "groups": groups,
        "episodes_per_group": episodes,
        "tokens_per_episode": tokens,
        "spool_mb": round(mb, 2),
        "repeats": repeats,
        "local_spool_reader": local,
        "flight_localhost": remote,
        "flight_over_local": round(remote["groups_per_s"] / local["groups_per_s"], 3),
    }


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="rollwise bench transport", description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=200)
    p.add_argument("--episodes", type=int, default=8, help="episodes per group")
    p.add_argument("--tokens", type=int, default=2048, help="tokens per episode")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    if min(args.groups, args.episodes, args.tokens, args.repeats) < 1:
        p.error("--groups, --episodes, --tokens and --repeats must be >= 1")
    print(json.dumps(measure(args.groups, args.episodes, args.tokens, args.repeats), indent=2))
    return 0
