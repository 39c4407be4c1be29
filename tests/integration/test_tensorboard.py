"""``tracking.tensorboard: true`` end to end: ``trainforge train quickstart`` (2 workers on its own
local Ray, a few epochs) writes TensorBoard event files under runs/<name>/tensorboard/ that
TensorBoard's own EventAccumulator reads: ``train/loss`` at every logged step, with the values
metrics.jsonl has, and the config as hyperparameters."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2

from tests.helpers.timing import scaled
from trainforge.protocol import curve_points

pytestmark = pytest.mark.slow

LOG_EVERY = 10


def test_trainforge_train_writes_train_loss_for_every_logged_step(tmp_path: Path) -> None:
    overrides = {
        "tracking.tensorboard": "true",
        "tracking.enabled": "false",  # MLflow is not what this test is about
        "train.epochs": "3",
        "train.log_every_n_steps": str(LOG_EVERY),
    }
    command = [sys.executable, "-m", "trainforge", "train", "quickstart"]
    for key, value in overrides.items():
        command += ["--set", f"{key}={value}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=scaled(300))
    assert done.returncode == 0, done.stderr[-3000:]

    run_dir = tmp_path / "runs" / "quickstart"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished"
    last = summary["global_step"]
    logged: dict[int, float] = {}  # metrics.jsonl's train/loss points: every log interval's, from the history
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "step" in record:
            logged.update({int(p["step"]): p["train/loss"] for p in curve_points(record) if "train/loss" in p})

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    board = {event.step: event.value for event in events.Scalars("train/loss")}
    assert set(range(LOG_EVERY, last + 1, LOG_EVERY)) <= set(board), sorted(board)
    assert board == pytest.approx(logged)
    assert {"val/loss", "val/accuracy", "perf/samples_per_s"} <= set(events.Tags()["scalars"])

    start = plugin_data_pb2.HParamsPluginData.FromString(
        events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    ).session_start_info
    assert start.hparams["optim.lr"].number_value == pytest.approx(0.003)
    assert start.hparams["train.epochs"].number_value == 3
    assert start.hparams["model.name"].string_value == "mlp"
