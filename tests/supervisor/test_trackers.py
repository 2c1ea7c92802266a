"""[trackers]: W&B (offline), MLflow (a local file store) and TensorBoard each receive the resolved config,
the learner's step metrics and the evaluation curves through their own library, read back here through
that library (or its file format); a failing tracker is logged once, counted, and never stops anything."""

from __future__ import annotations

import glob
import logging
import re
import struct
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from pipeline.contracts import events
from pipeline.contracts.config import Config, load_config
from pipeline.supervisor.observability import trackers as trackers_module
from pipeline.supervisor.observability.metrics import REGISTRY
from pipeline.supervisor.observability.trackers import Trackers, build_trackers, eval_values, step_values


def step(n: int, loss: float) -> events.Step:
    return events.Step(
        step=n,
        version=n,
        groups=2,
        group_ids=["a", "b"],
        consumed_seq=n,
        metrics={"loss": loss, "entropy": None},
        staleness={0: 3, 1: 1},
        idle_s=0.5,
        busy_s=1.5,
        spool_read_s=0.0,
        spool_depth_groups=0,
        spool_depth_bytes=0,
    )


EVAL_ROW = {
    "event": "eval",
    "version": 2,
    "step": 1,
    "greedy": {
        "success": 0.25,
        "pass_at_k": 0.25,
        "reward_mean": 0.5,
        "turns_mean": 3.0,
        "finish_reasons": {},
    },
}


def config(tmp_path: Path, *keys: str) -> Config:
    return load_config(None, [f"run.run_dir={tmp_path / 'run'}", *(f"trackers.{k}=true" for k in keys)])


def errors(tracker: str) -> float:
    return REGISTRY.get_sample_value("rollwise_tracker_errors_total", {"tracker": tracker}) or 0.0


def feed(cfg: Config, tmp_path: Path) -> None:
    hub = build_trackers(cfg, tmp_path / "run")
    assert hub is not None
    hub.start(cfg)
    hub.log_step(step(1, 0.5))
    hub.log_eval(EVAL_ROW)
    hub.log_step(step(2, 0.25))  # after an evaluation that started at step 1: each series keeps its axis
    hub.close(timeout_s=60)
    assert hub.thread is not None and not hub.thread.is_alive()


def test_values_of_a_step_and_of_an_evaluation() -> None:
    assert step_values(step(3, 0.5)) == {
        "learner/loss": 0.5,
        "learner/version": 3.0,
        "learner/groups": 2.0,
        "learner/busy_s": 1.5,
        "learner/idle_s": 0.5,
        "learner/staleness_mean": 0.25,
    }
    assert eval_values(EVAL_ROW) == {
        "eval/version": 2.0,
        "eval/greedy/success": 0.25,
        "eval/greedy/pass_at_k": 0.25,
        "eval/greedy/reward_mean": 0.5,
        "eval/greedy/turns_mean": 3.0,
    }


def test_all_off_by_default_builds_nothing(tmp_path: Path) -> None:
    assert build_trackers(config(tmp_path), tmp_path / "run") is None


def wandb_history(run_file: str) -> list[dict[str, str]]:
    """The history records of an offline W&B run file (LevelDB log blocks of wandb Record protos)."""
    from wandb.proto import wandb_internal_pb2

    data, position, chunk, records = Path(run_file).read_bytes(), 7, b"", []
    while position + 7 <= len(data):
        if 32768 - position % 32768 < 7:
            position += 32768 - position % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if length == 0 and kind == 0:
            break
        chunk += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            chunk = b""
            if record.WhichOneof("record_type") == "history":
                items = record.history.item
                records.append({item.key or "/".join(item.nested_key): item.value_json for item in items})
    return records


def test_wandb_offline_gets_config_steps_and_eval_curves(tmp_path: Path) -> None:
    pytest.importorskip("wandb", reason="wandb is not installed (pip install 'rollwise[trackers]')")
    feed(config(tmp_path, "wandb"), tmp_path)
    [run_file] = glob.glob(
        str(tmp_path / "run" / "trackers" / "wandb" / "wandb" / "offline-run-*" / "*.wandb")
    )
    history = wandb_history(run_file)
    learner = [(h["learner/step"], h["learner/loss"]) for h in history if "learner/loss" in h]
    assert learner == [("1", "0.5"), ("2", "0.25")]
    [evaluation] = [h for h in history if "eval/greedy/success" in h]
    assert (evaluation["eval/step"], evaluation["eval/greedy/success"]) == ("1", "0.25")
    assert b'"max_staleness"' in Path(run_file).read_bytes()  # the resolved config
    assert errors("wandb") == 0


def test_mlflow_file_store_gets_params_metrics_and_the_config_file(tmp_path: Path) -> None:
    pytest.importorskip("mlflow", reason="mlflow is not installed (pip install 'rollwise[trackers]')")
    from mlflow.tracking import MlflowClient

    feed(config(tmp_path, "mlflow"), tmp_path)
    client = MlflowClient(tracking_uri=(tmp_path / "run" / "trackers" / "mlflow").resolve().as_uri())
    experiment = client.get_experiment_by_name("rollwise")
    [run] = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "run" and run.info.status == "FINISHED"
    assert run.data.params["async.max_staleness"] == "2" and "engine.api_key" not in run.data.params
    history = client.get_metric_history(run.info.run_id, "learner/loss")
    assert [(m.step, m.value) for m in history] == [(1, 0.5), (2, 0.25)]
    [success] = client.get_metric_history(run.info.run_id, "eval/greedy/success")
    assert (success.step, success.value) == (1, 0.25)
    config_file = Path(client.download_artifacts(run.info.run_id, "config.toml", str(tmp_path)))
    assert "[async]" in config_file.read_text()
    assert errors("mlflow") == 0


def test_tensorboard_event_files_get_scalars_and_the_config_text(tmp_path: Path) -> None:
    pytest.importorskip(
        "tensorboard", reason="tensorboard is not installed (pip install 'rollwise[trackers]')"
    )
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    feed(config(tmp_path, "tensorboard"), tmp_path)
    reader = EventAccumulator(
        str(tmp_path / "run" / "trackers" / "tensorboard" / "run"), size_guidance={"tensors": 0}
    )
    reader.Reload()
    assert [(e.step, e.value) for e in reader.Scalars("learner/loss")] == [(1, 0.5), (2, 0.25)]
    assert [(e.step, e.value) for e in reader.Scalars("eval/greedy/success")] == [(1, 0.25)]
    [text] = reader.Tensors("config")
    assert b"max_staleness = 2" in text.tensor_proto.string_val[0]
    assert errors("tensorboard") == 0


class Recording:
    name = "wandb"  # a known label value

    def __init__(self, fail_open: bool = False, fail_log: bool = False, delay_s: float = 0.0) -> None:
        self.fail_open, self.fail_log, self.delay_s = fail_open, fail_log, delay_s
        self.logged: list[tuple[str, int]] = []
        self.closed = False
        self.thread: str | None = None

    def open(self, config: dict[str, Any], config_text: str) -> None:
        self.thread = threading.current_thread().name
        if self.fail_open:
            raise ConnectionError("cannot reach the tracking server")

    def log(self, axis: str, step: int, values: dict[str, float]) -> None:
        time.sleep(self.delay_s)
        if self.fail_log:
            raise OSError("disk full")
        self.logged.append((axis, step))

    def close(self) -> None:
        self.closed = True


def test_a_tracker_that_cannot_open_is_dropped_logged_once_and_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    broken, working = Recording(fail_open=True), Recording()
    working.name = "tensorboard"
    hub = Trackers([broken, working])
    before = errors("wandb")
    with caplog.at_level(logging.WARNING, logger="rollwise.trackers"):
        hub.start(config(tmp_path))
        hub.log_step(step(1, 0.5))
        hub.close()
    assert errors("wandb") == before + 1 and broken.logged == [] and not broken.closed
    assert working.logged == [("learner", 1)] and working.closed and working.thread == "trackers"
    assert [r.message.split(" (")[0] for r in caplog.records] == ["tracker wandb failed"]


def test_failed_writes_are_counted_each_time_and_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    failing = Recording(fail_log=True)
    failing.name = "mlflow"
    hub = Trackers([failing])
    before = errors("mlflow")
    with caplog.at_level(logging.WARNING, logger="rollwise.trackers"):
        hub.start(config(tmp_path))
        for n in range(5):
            hub.log_step(step(n, 0.5))
        hub.close()
    assert errors("mlflow") == before + 5 and failing.closed
    assert len([r for r in caplog.records if "tracker mlflow failed" in r.message]) == 1


def test_a_slow_tracker_never_blocks_the_caller_and_an_overflow_is_dropped_and_counted(
    tmp_path: Path,
) -> None:
    slow = Recording(delay_s=0.05)
    hub = Trackers([slow], queue_size=4)
    before = errors("queue")
    hub.start(config(tmp_path))
    started = time.perf_counter()
    for n in range(40):
        hub.log_step(step(n, 0.5))
    assert time.perf_counter() - started < 0.05  # 40 records, each 50 ms to write: none waited
    hub.close()
    assert errors("queue") - before >= 30 and len(slow.logged) < 10


def test_trackers_are_imported_only_when_turned_on() -> None:
    assert not any(name in trackers_module.__dict__ for name in ("wandb", "mlflow", "tensorboard"))


@pytest.mark.parametrize(
    ("key", "module"),
    [
        ("tracing.enabled", "opentelemetry.sdk"),
        ("trackers.wandb", "wandb"),
        ("trackers.mlflow", "mlflow"),
        ("trackers.tensorboard", "tensorboard"),
    ],
)
def test_a_library_that_is_not_installed_is_a_config_error_naming_the_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, key: str, module: str
) -> None:
    import importlib.util

    from pipeline.contracts.config import ConfigError
    from pipeline.supervisor.wiring import check_observer_libraries

    real = importlib.util.find_spec

    def find_spec(name: str, *args: Any) -> Any:
        return None if name == module else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    cfg = load_config(None, [f"{key}=true"])
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)}: needs the {re.escape(module)} package"):
        check_observer_libraries(cfg)
    check_observer_libraries(load_config(None, []))  # all off: nothing is looked for
