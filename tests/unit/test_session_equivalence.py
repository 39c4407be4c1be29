"""The numerics of data parallelism, in the worker's Session in gloo ranks without Ray.

k micro-batches accumulate to one batch of k x b; 2 workers with batch b step like 1 worker with
2b; bf16 autocast trains; a user's model factory reaches the same accuracy on 1 and 2 workers.
These are properties of the loop's arithmetic, so they run where the loop runs, without the ~18 s
of Ray start-up per run. Every run is trained once per module, in two process start-ups (1 and
2 ranks). What needs Ray (the files a real run writes, worker log shipping, a user factory
imported in Ray workers) stays in tests/integration/test_engine.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.runs import tiny_run
from tests.helpers.sessions import Trained, final_weights, train_each_once
from trainforge.config import load_config
from trainforge.data import build_datasets
from trainforge.models import build_model

pytestmark = pytest.mark.slow  # the module's runs together take over 20 s

ADAMW = {"optim": {"name": "adamw", "lr": 0.01}}
MOMENTUM = {"optim": {"name": "sgd", "lr": 0.1, "momentum": 0.9}}
USER_FACTORY = {"model": {"name": None, "factory": "tests.helpers.user_models:tiny_net", "kwargs": {"hidden": 64}}}
FIFTEEN_EPOCHS = {"epochs": 15, "max_steps": None}
# name -> sections of tiny_run.
RUNS: dict[str, dict[str, Any]] = {
    "accumulated": {"train": {"max_steps": 3, "batch_size": 8, "grad_accum_steps": 4}, **ADAMW},
    "whole": {"train": {"max_steps": 3, "batch_size": 32}, **ADAMW},
    "two-x-b": {"train": {"max_steps": 3, "batch_size": 16}, "scaling": {"num_workers": 2}, **MOMENTUM},
    "one-x-2b": {"train": {"max_steps": 3, "batch_size": 32}, **MOMENTUM},
    "bf16": {
        "precision": "bf16",
        "train": {"max_steps": 60, "batch_size": 32},
        "optim": {"name": "adamw", "lr": 0.003},
    },
    "factory-1": {
        **USER_FACTORY,
        "train": {**FIFTEEN_EPOCHS, "batch_size": 64},
        "optim": {"name": "adamw", "lr": 0.01},
    },
    "factory-2": {
        **USER_FACTORY,
        "train": {**FIFTEEN_EPOCHS, "batch_size": 32},
        "optim": {"name": "adamw", "lr": 0.01},
        "scaling": {"num_workers": 2},
    },
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Trained]:
    return train_each_once(
        {name: tiny_run(tmp_path_factory.mktemp(name), **sections) for name, sections in RUNS.items()}
    )


def test_accumulation_of_k_micro_batches_equals_one_batch_of_k_b(runs: dict[str, Trained]) -> None:
    accumulated, whole = runs["accumulated"], runs["whole"]
    assert accumulated.outcome.final["step"] == whole.outcome.final["step"] == 3
    for name, value in final_weights(accumulated.config).items():
        assert torch.allclose(value, final_weights(whole.config)[name], atol=1e-5), name


def test_two_workers_with_batch_b_equal_one_worker_with_batch_2b(runs: dict[str, Trained], tmp_path: Path) -> None:
    two, one = final_weights(runs["two-x-b"].config), final_weights(runs["one-x-2b"].config)
    resolved = load_config(tiny_run(tmp_path))
    torch.manual_seed(resolved.seed)  # the loop builds the model under the run's seed
    initial = build_model(resolved.model, build_datasets(resolved.data, resolved.seed)[2]).state_dict()
    for name, value in two.items():
        assert torch.allclose(value, one[name], atol=1e-6), name
        assert not torch.allclose(value, initial[name]), f"{name} did not change: the comparison would be empty"


def test_bf16_autocast_trains(runs: dict[str, Trained]) -> None:
    final = runs["bf16"].outcome.final
    assert final["status"] == "finished"
    assert final["val/accuracy"] > 0.85
    assert final["train/skipped_steps"] == 0


def test_user_factory_same_accuracy_with_one_and_two_workers(runs: dict[str, Trained]) -> None:
    one = float(runs["factory-1"].outcome.final["val/accuracy"])
    two = float(runs["factory-2"].outcome.final["val/accuracy"])
    assert one > 0.93 and two > 0.93
    assert abs(one - two) <= 0.01
