"""How the cores of this machine are split between the embedded engines and the learner.

Both run torch on the CPU when the engine is the embedded one and the learner trains here on the CPU. Each
is compute-bound, and torch's OpenMP threads spin-wait at every parallel region: two processes whose
threads add up to more than the cores slow each other far more than their share (on 2 cores a learner
with 2 threads beside a busy engine thread took longer per step than with 1). So the two get disjoint
shares: the engines half of the cores, split evenly among them, and the learner the rest. Measured on the
2-core machine with the real-model recipe (docs/benchmarks.md, "bench learner --replay"): engine and
learner each one thread, both near 100% busy, the learner at 0.89x its speed alone; a learner with a
second, passively waiting thread made the same number of steps (the engine lost what the learner won).

`engine.share_cores = "time"` instead gives both every core, in turn (pipeline/contracts/core_lease.py):
the engines hold their decoding while the learner computes a step.

A value the config sets is kept (`engine.threads`, an explicit `learner.threads`). Elsewhere nothing is
shared: an engine that is not embedded runs on its own hardware and keeps its own flags, and a learner on
a GPU or on another machine leaves every core to the engines. The choice is printed at start.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.contracts.config import Config
from pipeline.contracts.core_lease import LEASE_FILE, CoreLease
from pipeline.contracts.cpu_features import usable_cores

NVIDIA_DEVICE = Path("/dev/nvidiactl")


@dataclass(frozen=True)
class CoreSplit:
    """Torch threads per embedded engine and of the learner, and why."""

    cores: int
    engine_threads: int | None  # per embedded engine; None when no engine runs here
    learner_threads: int
    reason: str
    time_shared: bool = False  # engine.share_cores = "time" with the learner on this CPU

    def prepare(self, run_root: Path) -> None:
        """Before the engines and the learner start: a fresh lease (nobody holds it) when shared in time."""
        if self.time_shared:
            CoreLease.create(run_root / LEASE_FILE).close()

    def describe(self) -> str:
        engine = (
            "no embedded engine"
            if self.engine_threads is None
            else (f"embedded engine {self.engine_threads} torch thread(s) each")
        )
        shared = "; shared in time (the engines hold while the learner computes)" if self.time_shared else ""
        return f"cores: {self.cores} usable; {engine}; learner {self.learner_threads}{shared} ({self.reason})"


def learner_shares_cpu(cfg: Config, *, gpu_present: bool) -> bool:
    """The learner trains on this machine's CPU: not on another machine, not on a GPU."""
    if cfg.learner.remote.run_dir is not None:
        return False
    device = cfg.learner.device
    return device == "cpu" or (device == "auto" and not gpu_present)


def choose_split(cfg: Config, cores: int, *, gpu_present: bool) -> CoreSplit:
    """The split `cfg` gets on a machine of `cores` usable cores (module docstring)."""
    learner_set = "threads" in cfg.learner.model_fields_set
    learner = cfg.learner.threads
    if cfg.engine.kind != "embedded":
        return CoreSplit(cores, None, learner, "learner.threads")
    engines = cfg.engine.num_engines
    if not learner_shares_cpu(cfg, gpu_present=gpu_present):
        engine = cfg.engine.threads or max(1, cores // engines)
        return CoreSplit(cores, engine, learner, "the learner is not on this CPU: the cores are the engines'")
    time_shared = cfg.engine.share_cores == "time"
    engine = cfg.engine.threads or max(1, cores // engines if time_shared else cores // 2 // engines)
    if not learner_set:
        learner = cores if time_shared else max(1, cores - engines * engine)
    chosen = [
        name
        for name, auto in (
            ("engine.threads", cfg.engine.threads is None),
            ("learner.threads", not learner_set),
        )
        if auto
    ]
    if time_shared:
        reason = f"{' and '.join(chosen) or 'none'} chosen: every core for each in turn"
        return CoreSplit(cores, engine, learner, reason, time_shared=True)
    reason = (
        f"{' and '.join(chosen)} chosen: engines and learner on disjoint cores"
        if chosen
        else "both as configured"
    )
    if engines * engine + learner > cores:
        reason += f"; {engines * engine + learner} threads on {cores} cores: they will slow each other"
    return CoreSplit(cores, engine, learner, reason)


def apply_split(
    cfg: Config, cores: int | None = None, *, gpu_present: bool | None = None
) -> tuple[Config, CoreSplit]:
    """`cfg` with the chosen thread counts written into it (the resolved config records them), and the
    split. A config that sets both keeps them."""
    split = choose_split(
        cfg,
        usable_cores() if cores is None else cores,
        gpu_present=NVIDIA_DEVICE.exists() if gpu_present is None else gpu_present,
    )
    if split.engine_threads is None:
        return cfg, split
    engine_cfg = cfg.engine
    if engine_cfg.kind == "embedded" and engine_cfg.share_cores == "time" and not split.time_shared:
        engine_cfg = engine_cfg.model_copy(update={"share_cores": "split"})  # the learner is elsewhere
    cfg = cfg.model_copy(update={"engine": engine_cfg})
    learner = cfg.learner
    if "threads" not in learner.model_fields_set and learner.threads != split.learner_threads:
        learner = learner.model_copy(update={"threads": split.learner_threads})
    engine = cfg.engine.model_copy(update={"threads": split.engine_threads})
    return cfg.model_copy(update={"engine": engine, "learner": learner}), split
