"""The official PyTorch MNIST example ported (#35's acceptance): Adadelta, StepLR per epoch, a
validation pass per epoch as its ``test()``, early stopping and a user callback, on 2 Ray Train
workers. It stops early where val/loss stalls, and a run whose worker is SIGKILLed mid-epoch
resumes to the same stop, bit for bit: weights, Adadelta's state, the callback's state and early
stopping's count, and the best pass's weights in model.safetensors.

The digits (8x8) stand in for MNIST (28x28): the same network shape, sized down.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import trainforge
from tests.helpers.faults import kill_a_worker_after
from tests.helpers.runs import tiny_run
from tests.helpers.sessions import assert_bit_identical, checkpoint_state
from tests.helpers.user_callbacks import records

EPOCH = 44  # steps an epoch: the digits' training share in batches of 2 workers x 16
EPOCHS, PATIENCE = 14, 1


def mnist_config(tmp: Path) -> dict[str, Any]:
    config = tiny_run(
        tmp,
        model={"name": None, "factory": "tests.helpers.mnist_example:mnist_net"},
        train={
            "epochs": EPOCHS,
            "batch_size": 16,
            "log_every_n_steps": 4,
            "early_stopping": {
                "metric": "val/loss",
                "mode": "min",
                "patience": PATIENCE,
                "min_delta": 0.03,
                "restore_best": True,
            },
        },
        optim={"name": "Adadelta", "lr": 1.0},
        schedule={"name": "StepLR", "kwargs": {"step_size": 1, "gamma": 0.7}, "interval": "epoch"},
        checkpoint={"every_n_steps": 40, "keep_last": 2},
        scaling={"num_workers": 2},
        failure={"max_failures": 1},
        callbacks=[{"path": "tests.helpers.user_callbacks:Recorder", "kwargs": {"log": str(tmp / "calls")}}],
        seed=1,
    )
    del config["train"]["max_steps"]
    return config


def callback_state(run_dir: Path, step: int) -> dict[str, Any]:
    state = json.loads((run_dir / f"checkpoint_{step:09d}" / "trainer_state.json").read_text())
    return {name: state["components"][name] for name in ("callbacks", "early_stopping")}


@pytest.mark.slow  # two Ray runs on 2 workers and a restart, ~2 min
@pytest.mark.usefixtures("ray_local")
def test_mnist_example_stops_early_and_resumes_bit_identical_after_a_sigkill(tmp_path: Path) -> None:
    straight = trainforge.fit(mnist_config(tmp_path / "straight"))
    summary = straight.summary
    # Where val/loss stalls is the straight run's (floating point on this CPU); the resumed run must
    # stop at the same step with the same best. A stall is PATIENCE validations (one an epoch)
    # without a gain of min_delta over the best, before the last epoch.
    stop = summary["stopped_early"]
    stop_step, best_step = stop["step"], stop["best_step"]
    assert summary["status"] == "finished" and summary["global_step"] == stop_step < EPOCHS * EPOCH
    assert stop_step % EPOCH == 0 and stop_step - best_step == PATIENCE * EPOCH, stop
    assert stop_step > 2 * EPOCH, f"stopped at {stop_step}: too early for a worker killed at step 80 to matter"
    assert stop["metric"] == "val/loss" and summary["stopped_by"]["source"] == "early_stopping"
    lines = [json.loads(line) for line in (straight.run_dir / "metrics.jsonl").read_text().splitlines()]
    points = [p for line in lines[:-1] if "history" in line for p in line["history"] if "train/lr" in p]
    # StepLR per epoch: epoch e's steps at 0.7 ** (e - 1)
    assert {p["step"]: p["train/lr"] for p in points} == {
        p["step"]: pytest.approx(0.7 ** ((p["step"] - 1) // EPOCH)) for p in points
    }
    assert len({round(p["train/lr"], 9) for p in points}) == stop_step // EPOCH
    for rank in (0, 1):
        hooks = [r["hook"] for r in records(tmp_path / "straight" / "calls", rank)]
        assert hooks.count("on_step_end") == stop_step and hooks.count("on_validation_end") == stop_step // EPOCH
        assert hooks[-1] == "on_train_end"

    run_dir = tmp_path / "killed" / "t"
    killed = kill_a_worker_after(run_dir / "checkpoint_000000080")
    resumed = trainforge.fit(mnist_config(tmp_path / "killed"))
    assert killed, "no worker was killed"
    assert resumed.summary["restarts"] == 1
    assert resumed.summary["global_step"] == stop_step
    assert resumed.summary["stopped_early"] == summary["stopped_early"]
    assert_bit_identical(checkpoint_state(straight.run_dir, stop_step), checkpoint_state(run_dir, stop_step))
    assert callback_state(straight.run_dir, stop_step) == callback_state(run_dir, stop_step)
    # restore_best: both runs' product is the best pass's weights
    best = load_file(str(run_dir / f"checkpoint_{best_step:09d}" / "model.safetensors"))
    for result in (straight, resumed):
        exported = load_file(str(result.model_path))
        assert exported.keys() == best.keys() and all(torch.equal(exported[k], best[k]) for k in best)
