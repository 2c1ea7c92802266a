"""The dedicated evaluation engine as a real child process (the embedded engine on the tiny preset):
launched on its own port, loads published versions, costs a request when it is killed, and comes back
on the newest version asked for."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from pipeline.contracts.config import load_config
from pipeline.contracts.run_dir import RunDir
from pipeline.supervisor.engines.protocol import EngineError, SamplingParams
from pipeline.supervisor.fleet.eval_engine import EVAL_ENGINE, DedicatedEvalEngine, eval_engine_config
from pipeline.supervisor.observability.metrics import REGISTRY

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=3)


def dedicated_config(run_dir: Path, model: Path, *extra: str) -> Any:
    return load_config(
        None,
        [
            f"run.run_dir={json.dumps(str(run_dir))}",
            f"model.path={json.dumps(str(model))}",
            "engine.threads=1",
            'engine.dtype="float32"',
            'eval.engine="dedicated"',
            "eval.every_versions=1",
            *extra,
        ],
    )


def test_the_engine_is_launched_with_its_own_threads_and_arguments(tmp_path: Path) -> None:
    cfg = dedicated_config(
        tmp_path, tmp_path / "m", "eval.engine_threads=3", 'eval.engine_args=["--max-batch", "2"]'
    )
    launched = eval_engine_config(cfg)
    assert launched.engine.threads == 3 and launched.engine.extra_args[-2:] == ["--max-batch", "2"]
    assert cfg.engine.threads == 1  # the training engines' own config is untouched


def restarts() -> float:
    return REGISTRY.get_sample_value("rollwise_process_restarts_total", {"component": "eval_engine"}) or 0.0


@pytest.mark.integration
async def test_the_dedicated_engine_loads_versions_and_a_crash_costs_only_what_was_in_flight(
    tmp_path: Path, tiny_model_dir: Path, tok: Any
) -> None:
    run = RunDir.at(tmp_path / "run", tiny_model_dir)
    shutil.copytree(tiny_model_dir, run.weights / "v1")  # a published version 1 (same weights)
    engine = DedicatedEvalEngine(dedicated_config(run.root, tiny_model_dir), run, grace_s=5.0)
    prompt = tok.encode("Guess a number.", add_special_tokens=False)
    before = restarts()
    try:
        await engine.load(0)  # launches it and waits until it answers
        first = await engine.generate(prompt, GREEDY, "r0", affinity_key="a")
        assert first.weight_version == "0" and engine.slot.url.startswith("http://127.0.0.1:")
        await engine.load(1)
        assert (await engine.generate(prompt, GREEDY, "r1", affinity_key="a")).weight_version == "1"
        assert engine.child is not None
        crashed = engine.child
        crashed.kill()  # by PID: what the kernel does to an engine out of memory
        await crashed.wait()
        with pytest.raises(EngineError):
            await engine.generate(prompt, GREEDY, "r2", affinity_key="a")
        # Restarted (with backoff) on the newest version asked for; the next evaluation's load waits for it.
        await asyncio.wait_for(engine.load(1), 120)
        again = await engine.generate(prompt, GREEDY, "r3", affinity_key="a")
        assert again.weight_version == "1" and again.output_ids == first.output_ids
        assert engine.child is not crashed and engine.starts == 2 and restarts() == before + 1
    finally:
        await engine.stop()
    assert engine.child.returncode is not None  # stopped with its owner
    log = run.log_file(EVAL_ENGINE).read_text()
    assert log.count("start:") == 2 and "--threads 1" in log


def test_its_seed_follows_the_training_engines_and_the_training_engines_get_no_priority_flags(
    tmp_path: Path,
) -> None:
    from pipeline.supervisor.fleet.engine_launch import EngineSlot, engine_seed, priority_scheduling_args

    cfg = dedicated_config(tmp_path, tmp_path / "m", "engine.num_engines=2", "run.seed=7")
    slot = EngineSlot(name=EVAL_ENGINE, host="127.0.0.1", port=1, managed=True)
    assert engine_seed(cfg, slot) == 9 and engine_seed(cfg, EngineSlot("engine1", "h", 1, True)) == 8
    # Training requests are alone on the training engines: no priority scheduling to turn on.
    assert priority_scheduling_args(cfg) == []
    shared = load_config(None, ["eval.every_minutes=5"])
    assert priority_scheduling_args(shared) == [
        "--enable-priority-scheduling",
        "--default-priority-value",
        "0",
    ]
