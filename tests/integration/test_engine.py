"""End-to-end runs on a real local Ray with gloo workers: the files a run writes (summary, metrics,
final weights), a user's model factory imported in the workers, worker logs shipped to the driver.

The numerics of data parallelism (accumulation, 2 x b = 1 x 2b, bf16, a user factory on 1 and 2
workers) are properties of the loop, tested without Ray in tests/unit/test_session_equivalence.py.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import trainforge
from tests.helpers.runs import tiny_run
from trainforge.cli import main
from trainforge.config import load_config
from trainforge.data import build_datasets
from trainforge.models import build_model

pytestmark = pytest.mark.usefixtures("ray_local")

SUMMARY_KEYS = {
    "status",
    "global_step",
    "epoch",
    "num_workers",
    "restarts",
    "final_metrics",
    "throughput_samples_per_s",
    "wall_time_s",
    "checkpoint",
    "config",
}


def weights(result: trainforge.RunResult) -> dict[str, torch.Tensor]:
    return load_file(str(result.model_path))


def test_two_workers_train_digits_and_write_the_contract(tmp_path: Path) -> None:
    config = tiny_run(
        tmp_path,
        train={"epochs": 4, "max_steps": None, "batch_size": 32, "ema": {"decay": 0.9}},
        optim={"name": "adamw", "lr": 0.003},
        scaling={"num_workers": 2},
    )
    called = time.time()
    result = trainforge.fit(config)
    summary = json.loads((result.run_dir / "summary.json").read_text())
    assert summary.keys() >= SUMMARY_KEYS
    # The start is timed from the fit call: the config read ("cli") and the observers made
    # ("imports") are phases of it, and the phases add up to the first step.
    startup = summary["startup"]
    assert startup["start_unix"] >= called
    assert {"cli", "imports", "controller", "first_step"} <= startup["phases"].keys()
    assert startup["to_first_step_s"] == pytest.approx(sum(startup["phases"].values()), abs=0.01)
    assert summary["status"] == "finished"
    assert summary["num_workers"] == 2
    assert summary["epoch"] == 4
    # digits: 1438 training samples, 2 ranks x 32 per step -> 22 steps per epoch
    assert summary["global_step"] == 4 * 22
    assert summary["final_metrics"]["val/accuracy"] > 0.9
    assert {"train/loss", "val/loss", "val/accuracy"} <= summary["final_metrics"].keys()
    assert summary["throughput_samples_per_s"] > 0
    assert Path(summary["checkpoint"]).is_dir()

    # The final weights load into the plain module the builder returns, and reproduce val accuracy.
    resolved = load_config(config)
    _, val_set, spec = build_datasets(resolved.data, resolved.seed)
    model = build_model(resolved.model, spec)
    model.load_state_dict(weights(result))
    model.eval()
    inputs = torch.stack([val_set[i][0] for i in range(len(val_set))])
    targets = torch.stack([val_set[i][1] for i in range(len(val_set))])
    with torch.no_grad():
        accuracy = (model(inputs).argmax(1) == targets).float().mean().item()
    assert accuracy == pytest.approx(summary["final_metrics"]["val/accuracy"], abs=1e-6)
    # train.ema: the averaged weights beside them load the same way and give the val_ema figures.
    model.load_state_dict(load_file(str(result.run_dir / "model_ema.safetensors")))
    with torch.no_grad():
        accuracy = (model(inputs).argmax(1) == targets).float().mean().item()
    assert accuracy == pytest.approx(summary["final_metrics"]["val_ema/accuracy"], abs=1e-6)
    # trainforge evaluate in this process: the last checkpoint's figures as metrics.jsonl has them at its step.
    evaluated = tmp_path / "evaluate.json"
    main(["evaluate", str(result.run_dir), "--output", str(evaluated)])
    found = json.loads(evaluated.read_text())
    assert found["step"] == summary["global_step"] and found["samples"] == 359
    for name in ("val/loss", "val/accuracy", "val_ema/loss", "val_ema/accuracy"):
        assert found["metrics"][name] == pytest.approx(found["reported"][name], rel=1e-6)
        assert found["reported"][name] == pytest.approx(summary["final_metrics"][name], rel=1e-9)

    reports = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in reports if "step" in r]
    assert steps == sorted(steps) and steps[-1] == summary["global_step"]


@pytest.mark.slow
def test_worker_log_lines_carry_rank_and_node_and_warnings_reach_the_console(tmp_path: Path) -> None:
    import io

    from rich.console import Console

    config = tiny_run(
        tmp_path,
        model={"name": None, "factory": "tests.helpers.user_models:chatty_net", "kwargs": {"hidden": 8}},
        scaling={"num_workers": 2},
        train={"max_steps": 6},
    )
    shown = io.StringIO()
    result = trainforge.fit(config, console=Console(file=shown, width=200))
    lines = (result.run_dir / "workers.log").read_text().splitlines()
    for rank in (0, 1):
        mine = [line for line in lines if f" rank={rank} node=" in line]
        assert any("WARNING" in line and "user.models: chatty_net: hidden=8 is small" in line for line in mine)
        assert any("INFO" in line and "stdout: building chatty_net with hidden=8" in line for line in mine)
    console = shown.getvalue()
    assert console.count("chatty_net: hidden=8 is small") == 2  # one warning per worker, each shown once
    assert "building chatty_net" not in console  # INFO lines stay in the file
