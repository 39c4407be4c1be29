"""``model.task: custom``: a model that owns its step, on batches of the data's own shape (dicts).

In the worker's Session in gloo ranks without Ray: 2 workers with batch b step like 1 worker with
2b; a crash after the step-8 checkpoint and a restart end bit-identical to the run uninterrupted,
under ddp and fsdp; the model's own values (accuracy) are averaged like the built-in metrics.
In one process: what a step may return, and the checks of a model against its data before the
first step (one line naming the key, instead of an IndexError in a worker).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.ranks import spawn_ranks
from tests.helpers.runs import tiny_run
from tests.helpers.sessions import Outcome, assert_bit_identical, final_weights, sessions, train_each_once
from tests.helpers.user_models import Returns, own_step, tiny_lm
from trainforge.config import ModelConfig
from trainforge.data import DataSpec
from trainforge.errors import ModelError
from trainforge.models.task_registry import build_task, check_fits
from trainforge.models.tasks import CustomTask


def config(tmp: Path, name: str, *, workers: int = 2, batch: int = 16, strategy: str = "ddp", dropout: float = 0.0):
    return tiny_run(
        tmp,
        run={"name": name, "output_dir": str(tmp)},
        model={
            "name": None,
            "factory": "tests.helpers.user_models:own_step",
            "kwargs": {"hidden": 32, "dropout": dropout},
            "task": "custom",
        },
        data={"name": "factory", "factory": "tests.helpers.user_data:digits_dicts"},
        train={"max_steps": 20, "batch_size": batch, "log_every_n_steps": 4, "eval_every_n_steps": 10},
        optim={"name": "sgd", "lr": 0.1, "momentum": 0.9},
        scaling={"num_workers": workers},
        parallel={"strategy": strategy},
        checkpoint={"every_n_steps": 8, "keep_last": 5},
        seed=3,
    )


@pytest.fixture(scope="module")
def equivalence(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("custom")
    configs = {"one-x-2b": config(tmp, "one", workers=1, batch=32), "two-x-b": config(tmp, "two")}
    return {name: (configs[name], trained.outcome) for name, trained in train_each_once(configs).items()}


@pytest.mark.slow  # 15-70 s: full suite only, so the fast subset stays under 5 minutes
def test_two_workers_with_batch_b_equal_one_worker_with_batch_2b(equivalence: dict[str, Any]) -> None:
    (one_cfg, one), (two_cfg, two) = equivalence["one-x-2b"], equivalence["two-x-b"]
    assert one.final["status"] == two.final["status"] == "finished"
    for name, value in final_weights(two_cfg).items():
        assert torch.allclose(value, final_weights(one_cfg)[name], atol=1e-6), name
    # The model's own values, averaged over samples like the built-in metrics, training and validation.
    assert {"train/loss", "train/accuracy", "val/loss", "val/accuracy"} <= one.final.keys()
    assert one.final["val/accuracy"] == pytest.approx(two.final["val/accuracy"], abs=1e-6)
    assert one.final["val/accuracy"] > 0.5


@pytest.fixture(scope="module")
def crashes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict[str, Any], Outcome]]:
    """Per strategy: straight, then crashed after the step-8 checkpoint and restarted; dropout on,
    so every rank's RNG state matters. Six runs in one start-up of 2 ranks."""
    tmp = tmp_path_factory.mktemp("crashes")
    plans, names = [], []
    for strategy in ("ddp", "fsdp"):
        straight = config(tmp, f"{strategy}-straight", strategy=strategy, dropout=0.1)
        crashed = config(tmp, f"{strategy}-crashed", strategy=strategy, dropout=0.1)
        plans += [(straight, None), (crashed, 12), (crashed, None)]
        names += [f"{strategy}-straight", f"{strategy}-crashed", f"{strategy}-resumed"]
    outcomes = spawn_ranks(sessions, 2, plans)[0]
    return {name: (plan[0], outcome) for name, plan, outcome in zip(names, plans, outcomes, strict=True)}


@pytest.mark.slow  # 15-70 s: full suite only, so the fast subset stays under 5 minutes
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_crashed_and_restarted_is_bit_identical(crashes: dict[str, Any], strategy: str) -> None:
    straight_cfg, straight = crashes[f"{strategy}-straight"]
    crashed_cfg, crashed = crashes[f"{strategy}-crashed"]
    _, resumed = crashes[f"{strategy}-resumed"]
    assert crashed.crashed and resumed.final["status"] == "finished"
    assert any("checkpoint_000000008" in event for event in resumed.events), resumed.events
    assert_bit_identical(final_weights(straight_cfg), final_weights(crashed_cfg))
    assert straight.final["val/loss"] == resumed.final["val/loss"]
    assert straight.final["train/accuracy"] == resumed.final["train/accuracy"]


@pytest.mark.parametrize(
    ("what", "message"),
    [
        ("vector", "training_step returned a loss of shape (3,); it must be a scalar"),
        ("number", "training_step returned float as its loss; it must return a scalar tensor"),
        ("dict", "training_step returned a dict without 'loss' (keys: total)"),
    ],
)
def test_what_a_step_returns_is_checked_in_one_line(what: str, message: str) -> None:
    task = CustomTask(Returns(what))
    with pytest.raises(ModelError) as caught:
        task.train_step(Returns(what), {"x": torch.zeros(2)})
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_a_custom_task_needs_a_training_step_and_custom_data_needs_the_custom_task() -> None:
    spec = DataSpec(kind="custom", input_shape=())
    with pytest.raises(ModelError, match="needs the model to define training_step"):
        build_task(ModelConfig(factory="m:f", task="custom"), spec, torch.nn.Linear(2, 2))
    with pytest.raises(ModelError, match=r"set model\.task: custom"):
        build_task(ModelConfig(factory="m:f"), spec)
    assert isinstance(build_task(ModelConfig(factory="m:f", task="custom"), spec, own_step()), CustomTask)


def test_a_model_too_small_for_its_data_is_one_line_naming_the_key() -> None:
    # A user's LM with vocab_size 256 on a corpus of 257 token ids (bytes + end of document).
    tokens = DataSpec(kind="tokens", input_shape=(8,), vocab_size=257, seq_len=8)
    sample = (torch.arange(8), torch.arange(1, 9))
    cfg = ModelConfig(factory="tests.helpers.user_models:tiny_lm", kwargs={"vocab_size": 256})
    with pytest.raises(ModelError) as caught:
        check_fits(tiny_lm(256), cfg, tokens, sample)
    assert str(caught.value) == (
        "the model's input embedding has 256 token ids but the data's vocabulary has 257 (ids up to 256): "
        "set model.kwargs.vocab_size: 257"
    )
    check_fits(tiny_lm(257), cfg, tokens, sample)  # fits
    # A classifier with 9 outputs on 10 classes: its head, from a forward on fake tensors.
    images = DataSpec(kind="image", input_shape=(1, 8, 8), num_classes=10)
    head = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 9))
    with pytest.raises(ModelError, match=r"gives 9 outputs per prediction but the data has 10 classes: build the"):
        check_fits(head, ModelConfig(factory="m:f"), images, (torch.zeros(1, 8, 8), 3))
