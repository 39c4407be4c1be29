"""End-to-end runs on a real local Ray with gloo workers: the numerics of data parallelism."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import trainforge
from tests.helpers.runs import tiny_run
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
        train={"epochs": 4, "max_steps": None, "batch_size": 32},
        optim={"name": "adamw", "lr": 0.003},
        scaling={"num_workers": 2},
    )
    result = trainforge.fit(config)
    summary = json.loads((result.run_dir / "summary.json").read_text())
    assert summary.keys() >= SUMMARY_KEYS
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

    reports = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in reports if "step" in r]
    assert steps == sorted(steps) and steps[-1] == summary["global_step"]


@pytest.mark.slow
def test_two_workers_with_batch_b_equal_one_worker_with_batch_2b(tmp_path: Path) -> None:
    common = {"optim": {"name": "sgd", "lr": 0.1, "momentum": 0.9}, "data": {"name": "digits"}}
    two = trainforge.fit(
        tiny_run(tmp_path / "a", train={"max_steps": 3, "batch_size": 16}, scaling={"num_workers": 2}, **common)
    )
    one = trainforge.fit(
        tiny_run(tmp_path / "b", train={"max_steps": 3, "batch_size": 32}, scaling={"num_workers": 1}, **common)
    )
    resolved = load_config(tiny_run(tmp_path))
    torch.manual_seed(resolved.seed)  # the loop builds the model under the run's seed
    initial = build_model(resolved.model, build_datasets(resolved.data, resolved.seed)[2]).state_dict()
    for name, value in weights(two).items():
        assert torch.allclose(value, weights(one)[name], atol=1e-6), name
        assert not torch.allclose(value, initial[name]), f"{name} did not change: the comparison would be empty"


@pytest.mark.slow
def test_accumulation_of_k_micro_batches_equals_one_batch_of_k_b(tmp_path: Path) -> None:
    common = {"optim": {"name": "adamw", "lr": 0.01}}
    accumulated = trainforge.fit(
        tiny_run(tmp_path / "a", train={"max_steps": 3, "batch_size": 8, "grad_accum_steps": 4}, **common)
    )
    whole = trainforge.fit(tiny_run(tmp_path / "b", train={"max_steps": 3, "batch_size": 32}, **common))
    for name, value in weights(accumulated).items():
        assert torch.allclose(value, weights(whole)[name], atol=1e-5), name
    assert accumulated.summary["global_step"] == whole.summary["global_step"] == 3


@pytest.mark.slow
def test_bf16_autocast_trains(tmp_path: Path) -> None:
    result = trainforge.fit(
        tiny_run(
            tmp_path,
            precision="bf16",
            train={"max_steps": 60, "batch_size": 32},
            optim={"name": "adamw", "lr": 0.003},
        )
    )
    final = result.summary["final_metrics"]
    assert final["val/accuracy"] > 0.85
    assert final["train/skipped_steps"] == 0


@pytest.mark.slow
def test_user_factory_same_accuracy_with_one_and_two_workers(tmp_path: Path) -> None:
    def run(workers: int, batch: int, where: str) -> float:
        config = tiny_run(
            tmp_path / where,
            model={"name": None, "factory": "tests.helpers.user_models:tiny_net", "kwargs": {"hidden": 64}},
            train={"epochs": 15, "max_steps": None, "batch_size": batch},
            optim={"name": "adamw", "lr": 0.01},
            scaling={"num_workers": workers},
        )
        return float(trainforge.fit(config).metrics["val/accuracy"])

    one, two = run(1, 64, "one"), run(2, 32, "two")
    assert one > 0.93 and two > 0.93
    assert abs(one - two) <= 0.01


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
