"""pipeline.engine.model_loading: an engine loads a checkpoint at every weight update, so a load must
leave nothing behind (safetensors' memory-mapped reads keep two Python ints per tensor read)."""

from __future__ import annotations

import gc
import shutil
import tracemalloc
from pathlib import Path

import pytest

from pipeline.engine import model_loading
from pipeline.engine.model_loading import load_model, read_whole


def _objects_kept_per_load(path: Path, loads: int) -> float:
    gc.collect()
    before = tracemalloc.take_snapshot()
    for _ in range(loads):
        load_model(str(path), "cpu", "float32")
    gc.collect()
    after = tracemalloc.take_snapshot()
    return sum(stat.count_diff for stat in after.compare_to(before, "filename")) / loads


def test_loading_a_checkpoint_again_and_again_keeps_far_less_than_the_mapped_read(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mapped read keeps 2 objects per tensor (the tiny preset has 24: 48 per load). What else a load
    keeps is caches filling over its first hundred loads (module paths, dispatch tables), the same for
    both reads; so the reads are compared, after warming both, with tracing on throughout (the last
    model's own objects are then in both snapshots)."""
    tensors = 24
    assert read_whole(tiny_model_dir)
    tracemalloc.start()
    try:
        for limit in (0, model_loading.READ_WHOLE_LIMIT):
            monkeypatch.setattr(model_loading, "READ_WHOLE_LIMIT", limit)
            _objects_kept_per_load(tiny_model_dir, 10)
        monkeypatch.setattr(model_loading, "READ_WHOLE_LIMIT", 0)
        mapped = _objects_kept_per_load(tiny_model_dir, 30)
        monkeypatch.undo()
        whole = _objects_kept_per_load(tiny_model_dir, 30)
    finally:
        tracemalloc.stop()
    assert mapped - whole > 1.5 * tensors, (mapped, whole)
    assert whole < tensors / 2, (mapped, whole)


def test_a_checkpoint_above_the_limit_is_mapped_not_read_whole(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    copy = tmp_path / "big"
    shutil.copytree(tiny_model_dir, copy)
    size = (copy / "model.safetensors").stat().st_size
    monkeypatch.setattr(model_loading, "READ_WHOLE_LIMIT", size - 1)
    assert not read_whole(copy)
    monkeypatch.setattr(model_loading, "READ_WHOLE_LIMIT", size)
    assert read_whole(copy)
    (copy / "model.safetensors").unlink()
    assert not read_whole(copy)  # no safetensors: transformers' own choice
