"""observers/: the registry builds the run's sinks from its config, in order; the fan-out keeps a
failing observer from stopping the others and fires the lifecycle hooks (on_error, summary_entries,
check_complete) as observers/base.py says; the TensorBoard sink, fed real Reports in this process,
writes every history point's numbers and the config's hyperparameters, read back with
TensorBoard's own EventAccumulator."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2

from tests.helpers.runs import tiny_run
from trainforge.config import Config, load_config, validate
from trainforge.errors import ConfigError, TrainforgeError
from trainforge.observers import Observer, Observers, SinkSetup
from trainforge.observers.console import ProgressDisplay
from trainforge.observers.metrics_log import MetricsLog
from trainforge.observers.mlflow import MlflowTracker
from trainforge.observers.prometheus import RunMetrics
from trainforge.observers.registry import build_observers
from trainforge.observers.report import ReportWriter
from trainforge.observers.tensorboard import TENSORBOARD_DIR, TensorBoardWriter, hyperparameters
from trainforge.observers.worker_log import WorkerLog
from trainforge.protocol import Report, Resumed, RunInfo

SECRET = "s3cr3t-value"


def config_for(tmp_path: Path, **sections: Any) -> Config:
    return validate(tiny_run(tmp_path, **sections))


def setup_for(config: Config) -> SinkSetup:
    return SinkSetup(config, config.run_dir, Console(quiet=True))


class Extra(Observer):
    """A caller's observer (trainforge.fit(observers=...))."""


def test_the_registry_builds_the_sinks_the_config_turns_on_in_order(tmp_path: Path) -> None:
    extra = Extra()
    default = build_observers(setup_for(config_for(tmp_path)), [extra])
    assert [type(o) for o in default] == [
        ProgressDisplay,
        MetricsLog,
        WorkerLog,
        RunMetrics,
        Extra,
        ReportWriter,  # after the caller's: it reads what the others wrote
        MlflowTracker,  # last: it uploads the report
    ]
    chosen = config_for(tmp_path, tracking={"enabled": False, "tensorboard": True}, metrics={"enabled": False})
    built = build_observers(setup_for(chosen))
    assert [type(o) for o in built] == [ProgressDisplay, MetricsLog, WorkerLog, TensorBoardWriter, ReportWriter]


def test_tracking_tensorboard_is_a_boolean_named_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("model: {name: mlp}\ndata: {name: digits}\ntracking: {tensorboard: sometimes}\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    message = str(caught.value)
    assert "tracking.tensorboard" in message and "\n" not in message
    assert config_for(tmp_path).tracking.tensorboard is False


class Lifecycle(Observer):
    """Records the optional hooks it gets; ``broken`` raises from on_report."""

    def __init__(self, log: list[str], name: str, *, broken: bool = False, incomplete: bool = False) -> None:
        self.log, self.name, self.broken, self.incomplete = log, name, broken, incomplete

    def on_report(self, report: Report) -> None:
        self.log.append(f"{self.name} report {report.step}")
        if self.broken:
            raise RuntimeError("the sink's store is away")

    def on_error(self, error: BaseException) -> None:
        self.log.append(f"{self.name} error {error}")

    def summary_entries(self) -> dict[str, Any]:
        return {f"{self.name}_record": 1}

    def check_complete(self) -> None:
        if self.incomplete:
            raise TrainforgeError(f"{self.name}'s record is incomplete")


def test_the_fanout_isolates_a_failing_observer_and_fires_the_lifecycle_hooks(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log: list[str] = []
    plain = Extra()  # none of the optional hooks: skipped, not an error
    fanout = Observers([Lifecycle(log, "a", broken=True), plain, Lifecycle(log, "b", incomplete=True)])
    with caplog.at_level(logging.WARNING, logger="trainforge"):
        fanout.on_report(Report(step=1))
        fanout.on_report(Report(step=2))
    assert log == ["a report 1", "b report 1", "a report 2", "b report 2"]  # a still gets later calls
    assert [r.getMessage() for r in caplog.records] == ["Lifecycle.on_report failed: the sink's store is away"]
    fanout.on_error(ValueError("bad data path"))
    assert log[-2:] == ["a error bad data path", "b error bad data path"]
    assert fanout.summary_entries() == {"a_record": 1, "b_record": 1}
    with pytest.raises(TrainforgeError, match="b's record is incomplete"):
        fanout.check_complete()  # the one hook whose error is the point


def report(step: int, history: list[dict[str, float]], **extra: Any) -> Report:
    return Report(step=step, epoch=1, total_steps=40, time=1_700_000_000.0 + step, history=history, **extra)


def interval(step: int, loss: float) -> dict[str, float]:
    return {"step": step, "time/unix": 1_700_000_000.0 + step, "train/loss": loss, "perf/samples_per_s": 100.0 + step}


def scalars(logdir: Path) -> EventAccumulator:
    events = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return events


def test_tensorboard_has_every_history_point_and_the_hyperparameters(tmp_path: Path) -> None:
    config = config_for(tmp_path, tracking={"tensorboard": True}, optim={"lr": 0.0123})
    writer = TensorBoardWriter(config, config.run_dir)
    writer.on_start(RunInfo("t", 1, "local", str(config.run_dir)))
    # Two reports spanning four log intervals of 5 steps, a validation pass inside the second.
    writer.on_report(report(10, [interval(5, 2.0), interval(10, 1.5)], figures={"train/loss": 1.75}))
    second = [interval(15, 1.2), {"step": 15, "val/loss": 1.1, "val/accuracy": 0.6}, interval(20, 1.0)]
    writer.on_report(report(20, second, figures={"train/loss": 1.1, "checkpoint/stall_s": 0.01}))
    writer.on_end({"status": "finished"})

    events = scalars(config.run_dir / TENSORBOARD_DIR)
    loss = {e.step: e.value for e in events.Scalars("train/loss")}
    assert loss == pytest.approx({5: 2.0, 10: 1.5, 15: 1.2, 20: 1.0})  # every logged step, its own value
    assert [e.step for e in events.Scalars("perf/samples_per_s")] == [5, 10, 15, 20]
    assert [(e.step, e.value) for e in events.Scalars("val/accuracy")] == [(15, pytest.approx(0.6))]
    assert [e.step for e in events.Scalars("checkpoint/stall_s")] == [20]  # the report's own figure, at its step
    assert events.Scalars("train/loss")[0].wall_time == 1_700_000_005.0

    start = plugin_data_pb2.HParamsPluginData.FromString(
        events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    ).session_start_info
    assert start.hparams["optim.lr"].number_value == pytest.approx(0.0123)
    assert start.hparams["optim.name"].string_value == "sgd"
    assert start.hparams["run.name"].string_value == "t"


def test_tensorboard_hyperparameters_are_scalars_with_credentials_masked(tmp_path: Path) -> None:
    tree: dict[str, Any] = {"optim": {"lr": 0.1, "betas": [0.9, 0.99]}, "data": {"path": None}}
    tree["tracking"] = {"uri": f"http://trainforge:{SECRET}@mlflow.internal:5000"}
    tree["checkpoint"] = {"encryption": {"password": SECRET}, "keep_last": 2, "async_save": True}
    flat = hyperparameters(tree)
    assert flat["optim.lr"] == 0.1 and flat["checkpoint.keep_last"] == 2 and flat["checkpoint.async_save"] is True
    assert "optim.betas" not in flat and "data.path" not in flat  # lists and unset keys
    assert SECRET not in str(flat) and "mlflow.internal" in str(flat["tracking.uri"])
    assert flat["checkpoint.encryption.password"] != SECRET


def test_a_resumed_report_replaces_the_steps_after_its_checkpoint(tmp_path: Path) -> None:
    config = config_for(tmp_path, tracking={"tensorboard": True})
    writer = TensorBoardWriter(config, config.run_dir)
    writer.on_start(RunInfo("t", 1, "local", str(config.run_dir)))
    writer.on_report(report(20, [interval(step, 9.0) for step in (5, 10, 15, 20)]))
    # The worker group failed after step 20 and restored the checkpoint of step 10: 15 and 20 again.
    again = report(20, [interval(15, 1.0), interval(20, 0.5)], events=(Resumed(step=10, path="ckpt"),))
    writer.on_report(again)
    writer.on_end({"status": "finished"})
    loss = [(e.step, e.value) for e in scalars(config.run_dir / TENSORBOARD_DIR).Scalars("train/loss")]
    assert loss == [(5, 9.0), (10, 9.0), (15, 1.0), (20, 0.5)]
