"""The three experiment trackers, each written through its own library and imported only when opened.

`log(axis, step, values)`: `axis` is "learner" or "eval", each series' own x-axis (an evaluation that
started at step s ends after later steps were logged, so one shared step counter would reject it).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any


def flat(tree: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested config as dotted keys -> text (MLflow parameters)."""
    out: dict[str, str] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = str(value)
    return out


class WandbTracker:
    """Weights & Biases in offline mode: nothing leaves the machine (`wandb sync <dir>` uploads later)."""

    name = "wandb"

    def __init__(self, directory: Path, *, project: str, run_name: str) -> None:
        self.directory = directory
        self.project = project
        self.run_name = run_name
        self.run: Any = None

    def open(self, config: dict[str, Any], config_text: str) -> None:
        import wandb

        self.directory.mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(console="off", silent=True, disable_git=True, x_disable_stats=True)
        self.run = wandb.init(
            project=self.project,
            name=self.run_name,
            dir=str(self.directory),
            mode="offline",
            config=config,
            settings=settings,
        )
        for axis in ("learner", "eval"):
            self.run.define_metric(f"{axis}/step")
            self.run.define_metric(f"{axis}/*", step_metric=f"{axis}/step")

    def log(self, axis: str, step: int, values: dict[str, float]) -> None:
        self.run.log({f"{axis}/step": step, **values})

    def close(self) -> None:
        if self.run is not None:
            import wandb

            self.run.finish()
            # finish() may return before W&B's service process has written the run's last records to its
            # file; teardown waits for it (nothing else in the supervisor uses W&B).
            wandb.teardown()


class MlflowTracker:
    """MLflow through its client: by default a file store under the trackers' directory."""

    name = "mlflow"
    PARAMS_PER_CALL = 100  # MLflow's limit for one log_batch

    def __init__(self, tracking_uri: str, *, experiment: str, run_name: str) -> None:
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self.run_name = run_name
        self.client: Any = None
        self.run_id: str | None = None

    def open(self, config: dict[str, Any], config_text: str) -> None:
        if self.tracking_uri.startswith("file:"):
            # MLflow 3 keeps its file store behind this switch; a local store is what [trackers] asks for.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        found = self.client.get_experiment_by_name(self.experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(self.experiment)
        self.run_id = self.client.create_run(experiment_id, run_name=self.run_name).info.run_id
        params = [Param(key, value[:6000]) for key, value in flat(config).items()]
        for start in range(0, len(params), self.PARAMS_PER_CALL):
            self.client.log_batch(self.run_id, params=params[start : start + self.PARAMS_PER_CALL])
        self.client.log_text(self.run_id, config_text, "config.toml")

    def log(self, axis: str, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(key, value, now, step) for key, value in values.items()]
        self.client.log_batch(self.run_id, metrics=batch)

    def close(self) -> None:
        if self.client is not None and self.run_id is not None:
            self.client.set_terminated(self.run_id)


class TensorBoardTracker:
    """TensorBoard event files written with tensorboard's own writer and protos (no torch, no TF)."""

    name = "tensorboard"

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.writer: Any = None

    def open(self, config: dict[str, Any], config_text: str) -> None:
        from tensorboard.compat.proto import types_pb2
        from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
        from tensorboard.compat.proto.tensor_pb2 import TensorProto
        from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.directory.mkdir(parents=True, exist_ok=True)
        self.writer = EventFileWriter(str(self.directory), flush_secs=10)
        # The config on TensorBoard's Text tab: a string tensor tagged for the text plugin.
        text = TensorProto(
            dtype=types_pb2.DT_STRING,
            string_val=[f"```toml\n{config_text}\n```".encode()],
            tensor_shape=TensorShapeProto(dim=[TensorShapeProto.Dim(size=1)]),
        )
        plugin = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="text"))
        self._write(0, Summary(value=[Summary.Value(tag="config", metadata=plugin, tensor=text)]))

    def log(self, axis: str, step: int, values: dict[str, float]) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        scalars = [Summary.Value(tag=key, simple_value=value) for key, value in values.items()]
        self._write(step, Summary(value=scalars))

    def _write(self, step: int, summary: Any) -> None:
        from tensorboard.compat.proto.event_pb2 import Event

        self.writer.add_event(Event(wall_time=time.time(), step=step, summary=summary))

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
