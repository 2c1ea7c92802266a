"""The cores split between embedded engines and the learner (pipeline.supervisor.fleet.core_split)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.contracts.config import load_config
from pipeline.contracts.core_lease import time_shared
from pipeline.contracts.run_dir import RunDir
from pipeline.supervisor.fleet.core_split import apply_split, choose_split
from pipeline.supervisor.fleet.engine_launch import EngineSlot, engine_argv


def _cfg(*overrides: str):  # type: ignore[no-untyped-def]
    return load_config(None, ["engine.port=0", *overrides])


@pytest.mark.parametrize(
    ("cores", "engines", "engine_threads", "learner_threads"),
    [(2, 1, 1, 1), (16, 1, 8, 8), (16, 2, 4, 8), (3, 1, 1, 2), (1, 1, 1, 1), (4, 3, 1, 1)],
)
def test_a_cpu_learner_and_the_embedded_engines_get_disjoint_halves(
    cores: int, engines: int, engine_threads: int, learner_threads: int
) -> None:
    split = choose_split(_cfg(f"engine.num_engines={engines}"), cores, gpu_present=False)
    assert (split.engine_threads, split.learner_threads) == (engine_threads, learner_threads)
    assert "chosen" in split.reason


def test_values_the_config_sets_are_kept_and_an_oversubscription_is_said() -> None:
    split = choose_split(_cfg("engine.threads=2", "learner.threads=2"), 2, gpu_present=False)
    assert (split.engine_threads, split.learner_threads) == (2, 2)
    assert split.reason == "both as configured; 4 threads on 2 cores: they will slow each other"
    # One set, the other chosen around it.
    split = choose_split(_cfg("engine.threads=3"), 8, gpu_present=False)
    assert (split.engine_threads, split.learner_threads) == (3, 5)


def test_a_learner_on_a_gpu_or_another_machine_leaves_every_core_to_the_engines() -> None:
    assert choose_split(_cfg(), 8, gpu_present=True).engine_threads == 8
    assert choose_split(_cfg('learner.device="cuda"'), 8, gpu_present=False).engine_threads == 8
    remote = _cfg(
        'learner.remote.run_dir="/elsewhere"',
        'learner.remote.spool_url="grpc://127.0.0.1:1"',
        'transport.kind="flight"',
    )
    split = choose_split(remote, 8, gpu_present=False)
    assert (split.engine_threads, split.learner_threads) == (8, 1)


def test_an_engine_that_is_not_embedded_is_not_given_threads() -> None:
    cfg = load_config(None, ['engine.kind="external"', 'engine.urls=["http://127.0.0.1:1"]'])
    new, split = apply_split(cfg, 8, gpu_present=False)
    assert split.engine_threads is None and new is cfg
    assert "no embedded engine" in split.describe()


def test_the_resolved_config_records_the_choice() -> None:
    cfg, split = apply_split(_cfg(), 6, gpu_present=False)
    assert (cfg.engine.threads, cfg.learner.threads) == (3, 3)
    assert split.describe() == (
        "cores: 6 usable; embedded engine 3 torch thread(s) each; learner 3 "
        "(engine.threads and learner.threads chosen: engines and learner on disjoint cores)"
    )
    # Applied again (a resumed run reads its resolved config): nothing moves.
    again, _ = apply_split(cfg, 6, gpu_present=False)
    assert (again.engine.threads, again.learner.threads) == (3, 3)


def test_shared_in_time_each_side_gets_every_core_and_the_engines_yield(tmp_path: Path) -> None:
    cfg, split = apply_split(_cfg('engine.share_cores="time"'), 2, gpu_present=False)
    assert (split.engine_threads, split.learner_threads, split.time_shared) == (2, 2, True)
    assert (cfg.engine.threads, cfg.learner.threads) == (2, 2)
    assert split.describe() == (
        "cores: 2 usable; embedded engine 2 torch thread(s) each; learner 2; shared in time (the engines "
        "hold while the learner computes) (engine.threads and learner.threads chosen: every core for each "
        "in turn)"
    )
    split.prepare(tmp_path)
    assert (tmp_path / "cores.lease").read_bytes() == b"\0"
    argv = engine_argv(cfg, EngineSlot("engine-0", "127.0.0.1", 1234, True), model_dir=tmp_path, version=0)
    assert argv[argv.index("--yield-to") + 1] == str(RunDir.at(cfg.run.run_dir).core_lease)
    assert time_shared(cfg)


def test_a_learner_elsewhere_turns_time_sharing_back_to_split() -> None:
    cfg, split = apply_split(_cfg('engine.share_cores="time"'), 8, gpu_present=True)
    assert not split.time_shared and split.engine_threads == 8
    assert cfg.engine.share_cores == "split" and not time_shared(cfg)
    assert "--yield-to" not in engine_argv(
        cfg, EngineSlot("engine-0", "127.0.0.1", 1, True), model_dir=Path("m"), version=0
    )
