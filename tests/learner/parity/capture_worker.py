"""The learner process's publish and checkpoint paths, run as the supervisor runs them, reduced to hashes.

    PYTHONPATH=. python -m tests.learner.parity.capture_worker      (rewrites fixtures/worker_parity.json)

Every variant is the learner process as the supervisor starts it (`python -m learner.process`, before
the move `learner.worker`; under torchrun with 2 gloo ranks for `sharded`) on a fresh
run directory holding the tiny preset and the same spool groups, stopped by `run.max_steps`:

- publish paths: full weights inline and in the background, LoRA adapter, LoRA merged, gathered over
  2 ranks; each written file of weights/v1 and v2 by name, size and sha256;
- checkpoint resume: 2 steps, the checkpoint at step 2 (one process; sharded over 2 ranks), then a new
  learner on the same run directory takes step 3: its `step` event's metrics and its published v3's
  tensors (a sha256 over names, dtypes, shapes and bytes, and per-tensor sums for a tolerance check).

Bytes are compared exactly only on the machine fingerprint the fixture was captured on (`fingerprint`).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

FIXTURE = Path(__file__).parent / "fixtures" / "worker_parity.json"
REPO = Path(__file__).resolve().parents[3]
B = 2
STEPS = 2  # before the checkpoint; the resumed learner takes one more

CONFIG = """
[run]
max_steps = {max_steps}
[env]
group_size = 2
[learner]
batch_groups = {batch}
mini_batches = 1
checkpoint_every = {steps}
keep_checkpoints = 2
device = "cpu"
export_in_background = {background}
[learner.optim]
lr = 0.01
[learner.lora]
enabled = {lora}
rank = 4
alpha = 8
serving = "{serving}"
[learner.distributed]
nproc = {nproc}
[async]
max_staleness = 4
sync_every_steps = 1
"""

# name -> (export_in_background, lora, serving, ranks)
VARIANTS: dict[str, tuple[bool, bool, str, int]] = {
    "full_inline": (False, False, "adapter", 1),
    "full_background": (True, False, "adapter", 1),
    "lora_adapter": (False, True, "adapter", 1),
    "lora_merged": (False, True, "merged", 1),
    "sharded": (False, False, "adapter", 2),
}
RESUMED = ("full_inline", "sharded")  # the one-process checkpoint and the sharded one


def fingerprint() -> dict[str, str]:
    """What decides whether the bytes can repeat exactly: torch, the CPU and its kernels."""
    import torch

    model = ""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {
        "torch": torch.__version__,
        "machine": platform.machine(),
        "cpu": model,
        "capability": str(torch.backends.cpu.get_cpu_capability()),
    }


def file_hashes(directory: Path, run_dir: Path) -> dict[str, dict[str, Any]]:
    """Each file's size and sha256, with the run directory's path in it (a LoRA adapter names its base
    model by path) read as `<RUN_DIR>`. peft writes an adapter's target_modules from a set, in an order
    that follows the process's string hash seed: hashed sorted."""
    out = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        data = path.read_bytes().replace(str(run_dir).encode(), b"<RUN_DIR>")
        if path.name == "adapter_config.json":
            config = json.loads(data)
            config["target_modules"] = sorted(config["target_modules"])
            data = json.dumps(config, indent=2, sort_keys=True).encode()
        out[str(path.relative_to(directory))] = {
            "size": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
        }
    return out


def tensor_digest(weights: Path) -> dict[str, Any]:
    """sha256 over every tensor of `weights` (name, dtype, shape, bytes) and each tensor's sum."""
    import torch
    from safetensors.torch import load_file

    tensors = load_file(str(weights / "model.safetensors"))
    digest = hashlib.sha256()
    sums = {}
    for name in sorted(tensors):
        tensor = tensors[name].contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.view(-1).view(dtype=torch.uint8).numpy().tobytes())
        sums[name] = float(tensor.double().sum())
    return {"sha256": digest.hexdigest(), "sums": sums}


def write_spool(run_dir: Path) -> None:
    from pipeline.contracts.schema import segments_to_batch
    from pipeline.transport.spool import SpoolWriter
    from tests.helpers.train_groups import one_turn_row

    spool = SpoolWriter(run_dir / "spool")
    for k in range((STEPS + 1) * B):
        rows = [one_turn_row(f"g{k}", i, 0) for i in range(2)]
        spool.write_group(segments_to_batch(rows), group_id=f"g{k}")


def make_run_dir(root: Path, model: Path, name: str) -> Path:
    run_dir = root / name
    shutil.copytree(model, run_dir / "model")
    write_spool(run_dir)
    return run_dir


def write_config(run_dir: Path, name: str, max_steps: int) -> None:
    background, lora, serving, ranks = VARIANTS[name]
    text = CONFIG.format(
        max_steps=max_steps,
        batch=B,
        steps=STEPS,
        background=str(background).lower(),
        lora=str(lora).lower(),
        serving=serving,
        nproc=ranks,
    )
    path = run_dir / "config.toml"
    path.write_text(text)
    try:
        from pipeline.contracts.config import ConfigError, load_config

        load_config(path)
    except ConfigError:  # the capture's code: learner.lr before it was learner.optim.lr
        flat = text.replace("[learner.optim]\nlr = 0.01\n", "").replace(
            "[learner]\n", "[learner]\nlr = 0.01\n"
        )
        path.write_text(flat)


def run_learner(run_dir: Path, ranks: int, timeout_s: float = 300.0) -> list[dict[str, Any]]:
    """One learner on `run_dir` until it exits at run.max_steps; its events. stdin stays open: its EOF
    would stop the learner early."""
    entry = (
        "learner.process" if (REPO / "learner" / "process" / "__main__.py").is_file() else "learner.worker"
    )
    launch = ["-m", entry]
    if ranks > 1:
        launch = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), *launch]
    command = [sys.executable, *launch, "--config", str(run_dir / "config.toml"), "--run-dir", str(run_dir)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    log_path = run_dir / f"learner-{len(list(run_dir.glob('learner-*.log')))}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            command, cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True
        )
        timer = threading.Timer(timeout_s, proc.kill)
        timer.start()
        try:
            assert proc.stdout is not None
            found = [json.loads(line) for line in proc.stdout]
            code = proc.wait()
        finally:
            timer.cancel()
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    stream.close()
    if code != 0:
        tail = log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"learner on {run_dir} exited {code}: {tail}")
    return found


def published(found: list[dict[str, Any]], run_dir: Path) -> list[dict[str, Any]]:
    """The published events, less what names this run directory: `bytes` counts its path in the files
    as `<RUN_DIR>` (file_hashes)."""
    keep = ("version", "probe_ids", "probe_logprobs", "probe_logprobs_prev")
    out = []
    for e in found:
        if e["event"] != "published":
            continue
        files = [p.read_bytes() for p in Path(e["path"]).rglob("*") if p.is_file()]
        path_bytes = sum(len(data) - len(data.replace(str(run_dir).encode(), b"<RUN_DIR>")) for data in files)
        out.append({"bytes": e["bytes"] - path_bytes, **{k: e[k] for k in keep}})
    return out


def capture_variant(root: Path, model: Path, name: str) -> dict[str, Any]:
    run_dir = make_run_dir(root, model, name)
    ranks = VARIANTS[name][3]
    write_config(run_dir, name, STEPS)
    first = run_learner(run_dir, ranks)
    record: dict[str, Any] = {
        "published": published(first, run_dir),
        "files": {f"v{v}": file_hashes(run_dir / "weights" / f"v{v}", run_dir) for v in range(1, STEPS + 1)},
    }
    if name in RESUMED:
        write_config(run_dir, name, STEPS + 1)
        second = run_learner(run_dir, ranks)
        ready = next(e for e in second if e["event"] == "ready")
        step = next(e for e in second if e["event"] == "step")
        step["metrics"] = {k: v for k, v in step["metrics"].items() if not k.endswith("_s")}  # timings aside
        record["resume"] = {
            "ready": {k: ready[k] for k in ("version", "step", "consumed_seq", "consumed_after")},
            "step": {
                k: step[k] for k in ("step", "version", "groups", "group_ids", "consumed_seq", "metrics")
            },
            "published": published(second, run_dir),
            "params": tensor_digest(run_dir / "weights" / f"v{STEPS + 1}"),
        }
    return record


def tiny_model(root: Path) -> Path:
    from learner.model.model_init import init_model

    return init_model(root / "tiny-model", preset="tiny", seed=0)


def capture(root: Path, names: tuple[str, ...] = tuple(VARIANTS)) -> dict[str, Any]:
    model = tiny_model(root)
    return {"fingerprint": fingerprint(), "variants": {n: capture_variant(root, model, n) for n in names}}


def main() -> int:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="worker-parity-") as tmp:
        record = capture(Path(tmp))
    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    FIXTURE.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    print(f"wrote {FIXTURE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
