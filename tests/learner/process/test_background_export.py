"""learner.process.background_export: the weight snapshot a background export writes, and the one-job
thread."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from learner.model.model_io import export_weights, load_policy
from learner.process.background_export import BackgroundExport, WeightSnapshot


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.name != "model.safetensors"}


def test_a_snapshot_exports_exactly_what_the_model_exports(tiny_model_dir: Path, tmp_path: Path) -> None:
    model, tokenizer = load_policy(tiny_model_dir)
    with torch.no_grad():
        for k, p in enumerate(model.parameters()):
            p.add_(0.01 * (k + 1))  # weights unlike the initial ones
    state = WeightSnapshot().take(model.state_dict())
    from_snapshot = export_weights(model, tokenizer, tmp_path / "snap", 3, state_dict=state)
    inline = export_weights(model, tokenizer, tmp_path / "inline", 3)
    written, expected = (
        load_file(from_snapshot / "model.safetensors"),
        load_file(inline / "model.safetensors"),
    )
    assert sorted(written) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(written[name], tensor), name
    assert _files(from_snapshot) == _files(inline)  # config, tokenizer, rollwise_version.json


def test_tied_entries_share_one_buffer_and_later_updates_do_not_reach_the_snapshot(
    tiny_model_dir: Path,
) -> None:
    model, _ = load_policy(tiny_model_dir)
    live = model.state_dict()
    assert live["lm_head.weight"].data_ptr() == live["model.embed_tokens.weight"].data_ptr()  # tied preset
    snapshot = WeightSnapshot()
    state = snapshot.take(live)
    assert state["lm_head.weight"] is state["model.embed_tokens.weight"]
    assert all(t.device.type == "cpu" for t in state.values())
    before = {name: t.clone() for name, t in state.items()}
    with torch.no_grad():
        model.model.embed_tokens.weight.add_(1.0)
    assert torch.equal(state["lm_head.weight"], before["lm_head.weight"])  # a copy, not a view
    again = snapshot.take(model.state_dict())
    assert again["lm_head.weight"].data_ptr() == state["lm_head.weight"].data_ptr()  # buffers reused
    assert torch.equal(again["lm_head.weight"], before["lm_head.weight"] + 1.0)


def test_a_changed_layout_gets_new_buffers() -> None:
    snapshot = WeightSnapshot()
    first = snapshot.take({"w": torch.ones(2, 3)})
    second = snapshot.take({"w": torch.zeros(4)})  # another model, or a reloaded one
    assert first["w"].shape == (2, 3) and second["w"].shape == (4,)
    assert torch.equal(second["w"], torch.zeros(4))


def test_jobs_run_one_at_a_time_in_order() -> None:
    export = BackgroundExport()
    order: list[str] = []
    release = threading.Event()

    def first() -> None:
        release.wait(5)
        order.append("first")

    export.start(first, name="first")
    assert export.busy
    threading.Timer(0.2, release.set).start()
    started = time.monotonic()
    export.start(lambda: order.append("second"), name="second")  # waits for the first to finish
    assert time.monotonic() - started >= 0.15
    export.wait()
    assert order == ["first", "second"] and not export.busy


def test_a_failed_job_is_raised_once_in_the_callers_thread() -> None:
    export = BackgroundExport()

    def broken() -> None:
        raise OSError("disk on fire")

    export.start(broken, name="broken")
    with pytest.raises(OSError, match="disk on fire"):
        export.wait()
    export.check()  # raised once: the learner goes on (or stops) from there
    export.start(lambda: None, name="next")
    export.wait()
