"""A spool file, a checkpoint, a weights directory or a config file from elsewhere is data, not code:
every loader rollwise has refuses (or ignores) the parts of such a file that would run code, and the
code planted in them never runs. Each plant, if it ran, would create a marker file."""

from __future__ import annotations

import contextlib
import json
import pickle
import shutil
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import torch

from pipeline.contracts.schema import TRAJECTORY_SCHEMA


class _Plant:
    """Unpickling this creates `marker` (what an attacker's payload would do, harmlessly)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.marker,))


def test_the_plant_would_run_if_anything_unpickled_it(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    pickle.loads(pickle.dumps(_Plant(marker)))
    assert marker.exists()


def test_a_spool_file_with_a_pickled_extension_type_is_quarantined_not_unpickled(tmp_path: Path) -> None:
    from pipeline.transport.spool import SpoolReader, spool_name

    marker = tmp_path / "ran"
    # pyarrow's legacy "arrow.py_extension_type" stores a pickle in the field metadata; readers that
    # honour it unpickle attacker bytes (CVE-2023-47248).
    evil = pa.field(
        "payload",
        pa.binary(),
        metadata={
            b"ARROW:extension:name": b"arrow.py_extension_type",
            b"ARROW:extension:metadata": pickle.dumps(_Plant(marker)),
        },
    )
    schema = pa.schema([*TRAJECTORY_SCHEMA, evil], metadata=TRAJECTORY_SCHEMA.metadata)
    batch = pa.RecordBatch.from_arrays(
        [pa.array([], type=f.type) for f in TRAJECTORY_SCHEMA] + [pa.array([], type=pa.binary())],
        schema=schema,
    )
    spool = tmp_path / "spool"
    spool.mkdir()
    with pa.OSFile(str(spool / spool_name(1)), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        writer.write_batch(batch)
    reader = SpoolReader(spool, after_seq=0)
    assert reader.poll() == []
    [bad] = reader.drain_quarantined()
    assert bad.seq == 1
    assert not marker.exists()


def test_a_checkpoint_whose_trainer_state_is_a_pickle_bomb_is_refused(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    from learner.model.model_io import load_policy
    from learner.process.checkpoint import restore, save_checkpoint
    from learner.process.checkpoint_state import ConsumedState, load_latest_checkpoint
    from learner.trainer import Trainer
    from pipeline.contracts.learner_config import LearnerConfig

    model, tokenizer = load_policy(tiny_model_dir)
    trainer = Trainer(model, LearnerConfig(device="cpu"), temperature=1.0, seed=0, device=torch.device("cpu"))
    save_checkpoint(tmp_path / "ckpt", trainer, consumed=ConsumedState(), tokenizer=tokenizer)
    ckpt = load_latest_checkpoint(tmp_path / "ckpt")
    assert ckpt is not None
    marker = tmp_path / "ran"
    torch.save({"optimizer": _Plant(marker)}, ckpt.path / "trainer_state.pt")
    with pytest.raises(pickle.UnpicklingError):
        restore(trainer, ckpt)
    assert not marker.exists()


def _weights_with_plants(source: Path, target: Path, marker: Path) -> None:
    """A copy of a model directory that also asks for remote code and ships a pickled state dict."""
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "evil_modeling.EvilForCausalLM"}
    (target / "config.json").write_text(json.dumps(config))
    (target / "evil_modeling.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n")
    torch.save({"model.embed_tokens.weight": _Plant(marker)}, target / "pytorch_model.bin")


def test_weights_from_elsewhere_run_no_remote_code_and_no_pickle(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    from learner.model.model_io import load_policy
    from pipeline.engine.model_loading import load_model

    marker = tmp_path / "ran"
    weights = tmp_path / "v9"
    _weights_with_plants(tiny_model_dir, weights, marker)
    for load in (lambda: load_model(str(weights), "cpu", "float32"), lambda: load_policy(weights)):
        with contextlib.suppress(Exception):  # refusing is fine; running the plant is not
            load()
        assert not marker.exists()
    (weights / "model.safetensors").unlink()  # only the pickle is left: it must be refused, not loaded
    for load in (lambda: load_model(str(weights), "cpu", "float32"), lambda: load_policy(weights)):
        with pytest.raises(Exception):  # noqa: B017 - transformers' own error type varies
            load()
        assert not marker.exists()


def test_a_config_file_is_validated_without_importing_what_it_names(tmp_path: Path) -> None:
    from pipeline.contracts.config import load_config

    marker = tmp_path / "ran"
    package = tmp_path / "planted_env_pkg"
    package.mkdir()
    (package / "__init__.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n")
    config = tmp_path / "config.toml"
    config.write_text('[env]\nname = "planted_env_pkg:Env"\n[model]\npath = "/nowhere"\n')
    sys.path.insert(0, str(tmp_path))
    try:
        cfg = load_config(config)
    finally:
        sys.path.remove(str(tmp_path))
    assert cfg.env.name == "planted_env_pkg:Env"
    assert not marker.exists()  # naming a plugin is data; `rollwise run` imports it on purpose
