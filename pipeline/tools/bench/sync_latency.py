"""`rollwise bench sync`: weight publish -> version served by the embedded engine (goal < 0.5 s, tiny).

Real parts only: the embedded engine as a child process (launched exactly as the daemon launches it),
EnginePool/EngineClient over HTTP, and `sync_weights` (pause -> update_weights_from_disk -> continue).
Each repeat publishes a new version directory (HF format, the learner's `export_weights`) and measures,
with requests in flight or not (`--load`), the time from "the directory is complete" to "the engine
answers /generate with the new weight_version". Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

GOAL_S = 0.5


async def _measure(model_dir: Path, work: Path, repeats: int, load: int, threads: int) -> dict[str, Any]:
    from learner.model.model_io import export_weights, load_policy
    from pipeline.contracts.config import load_config
    from pipeline.contracts.run_dir import RunDir
    from pipeline.supervisor.engines.client import EngineClient
    from pipeline.supervisor.engines.pool import EnginePool
    from pipeline.supervisor.engines.protocol import SamplingParams
    from pipeline.supervisor.engines.weightsync import sync_weights
    from pipeline.supervisor.fleet.children import Child
    from pipeline.supervisor.fleet.engine_launch import engine_child_spec, plan_engines

    # The engine loads weights from the run directory's weights/ only: the bench's directory is the run's.
    cfg = load_config(
        None, ["engine.port=0", f"engine.threads={threads}", f"run.run_dir={json.dumps(str(work))}"]
    )
    slot = plan_engines(cfg)[0]
    run = RunDir.at(work, model_dir)
    child = Child(engine_child_spec(cfg, slot, model_dir=model_dir, version=0, log_dir=run.logs))
    await child.start()
    pool = EnginePool([EngineClient(slot.url)])
    model, tokenizer = await asyncio.to_thread(load_policy, model_dir)
    stop = asyncio.Event()
    generated = 0

    async def keep_busy(i: int) -> None:
        nonlocal generated
        sampling = SamplingParams(max_new_tokens=32)
        while not stop.is_set():
            await pool.generate([1, 2, 3, 4 + i], sampling, f"load-{i}-{generated}", affinity_key=str(i))
            generated += 1

    served: list[float] = []
    phases: list[dict[str, float]] = []
    busy: list[asyncio.Task[None]] = []
    try:
        await pool.members[0].wait_ready(120)
        busy += [asyncio.create_task(keep_busy(i)) for i in range(load)]
        for version in range(1, repeats + 1):
            path = await asyncio.to_thread(export_weights, model, tokenizer, run.weights_of(version), version)
            started = time.perf_counter()
            timings = await sync_weights(pool, model_path=str(path), version=version, mode="in_place")
            probe = await pool.generate(
                [1, 2, 3], SamplingParams(max_new_tokens=1), f"probe-{version}", affinity_key="p"
            )
            elapsed = time.perf_counter() - started
            if not timings.ok or probe.weight_version != str(version):
                raise RuntimeError(f"version {version} not served: {timings.errors or probe.weight_version}")
            served.append(elapsed)
            phases.append(
                {"pause_s": timings.pause_s, "load_s": timings.load_s, "continue_s": timings.continue_s}
            )
        stop.set()
        await asyncio.gather(*busy, return_exceptions=True)
    finally:
        stop.set()
        await asyncio.gather(*busy, return_exceptions=True)
        await pool.close()
        await child.stop(5.0)
    served.sort()
    return {
        "bench": "weight_sync",
        "engine": "embedded",
        "repeats": repeats,
        "concurrent_requests": load,
        "publish_to_served_s": {
            "median": round(statistics.median(served), 4),
            "p90": round(served[int(0.9 * (len(served) - 1))], 4),
            "max": round(served[-1], 4),
        },
        "load_s_median": round(statistics.median(p["load_s"] for p in phases), 4),
        "goal_s": GOAL_S,
        "meets_goal": statistics.median(served) < GOAL_S,
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rollwise bench sync", description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="HF model directory (default: a fresh tiny preset)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--load", type=int, default=8, help="requests kept in flight during the syncs")
    parser.add_argument("--threads", type=int, default=1, help="engine torch threads")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="rollwise-bench-sync-") as tmp:
        work = Path(tmp)
        model_dir = Path(args.model) if args.model else None
        if model_dir is None:
            from learner.model.model_init import init_model

            model_dir = init_model(work / "model", preset="tiny", seed=0)
        result = asyncio.run(_measure(model_dir, work, args.repeats, args.load, args.threads))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
