"""``model.task: regression``: float targets, MSE or L1, and mse/mae/r2 averaged over every sample
of every rank through sums.

The arithmetic against hand-computed values and scikit-learn's r2; float targets decoded from
parquet rows as Ray Data's tasks do; the one-line errors for a task and data that do not match,
through the CLI; and in gloo ranks without Ray: an MLP on synthetic regression data and on a
factory's two targets learns, 2 workers with batch b step like 1 with 2b, a crash and restart end
bit-identical.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from sklearn.metrics import r2_score
from torch import nn

from tests.helpers.ranks import spawn_ranks
from tests.helpers.runs import tiny_run
from tests.helpers.sessions import Outcome, assert_bit_identical, final_weights, sessions
from tests.integration.test_cli import assert_user_error, in_process
from trainforge.config import ModelConfig
from trainforge.data import DataSpec
from trainforge.data.stream import Decode, first_row, list_files
from trainforge.errors import DataError, ModelError
from trainforge.models import build_task
from trainforge.models.task_registry import check_fits
from trainforge.models.tasks import RegressionTask

SCALAR = DataSpec(kind="image", input_shape=(3,), target_shape=())
TWO = DataSpec(kind="image", input_shape=(3,), target_shape=(2,))
CLASSES = DataSpec(kind="image", input_shape=(3,), num_classes=4)


def floats(sums: dict[str, torch.Tensor]) -> dict[str, float]:
    return {name: float(value) for name, value in sums.items()}


def test_mse_l1_and_the_metrics_are_the_hand_computed_values() -> None:
    output = torch.tensor([[1.0], [2.0], [3.0], [4.0]])  # (B, 1) read as the (B,) targets' shape
    target = torch.tensor([1.5, 2.0, 2.0, 5.0])  # errors -0.5, 0, 1, -1
    mse, l1 = RegressionTask("mse"), RegressionTask("l1")
    assert mse.loss(output, target).item() == pytest.approx(2.25 / 4)
    assert l1.loss(output, target).item() == pytest.approx(2.5 / 4)
    metrics = mse.finalize(floats(mse.sums(mse.loss(output, target), output, target)))
    # the targets' mean is 2.625: squares around it 1.265625 + 0.390625 + 0.390625 + 5.640625 = 7.6875
    assert metrics == pytest.approx({"loss": 0.5625, "mse": 0.5625, "mae": 0.625, "r2": 1 - 2.25 / 7.6875})
    assert l1.finalize(floats(l1.sums(l1.loss(output, target), output, target)))["loss"] == pytest.approx(0.625)
    assert "accuracy" not in metrics


def test_the_sums_of_two_shards_give_the_whole_batch_metrics_and_sklearn_r2() -> None:
    generator = torch.Generator().manual_seed(0)
    target = torch.randn(40, 2, generator=generator) * torch.tensor([1.0, 4.0]) + torch.tensor([0.0, 9.0])
    output = target + torch.randn(40, 2, generator=generator)
    task = RegressionTask("mse", (2,))
    whole = task.finalize(floats(task.sums(task.loss(output, target), output, target)))
    halves: dict[str, float] = {}
    for part in (slice(0, 13), slice(13, 40)):  # ranks with unequal shares, summed as the all-reduce does
        for name, value in floats(task.sums(task.loss(output[part], target[part]), output[part], target[part])).items():
            halves[name] = halves.get(name, 0.0) + value
    assert task.finalize(halves) == pytest.approx(whole)
    assert whole["mse"] == pytest.approx(float((output - target).square().mean()))
    assert whole["mae"] == pytest.approx(float((output - target).abs().mean()))
    assert whole["r2"] == pytest.approx(r2_score(target.numpy(), output.numpy(), multioutput="variance_weighted"))


def test_outputs_that_do_not_fit_the_targets_are_one_line() -> None:
    task = RegressionTask("mse", (2,))
    with pytest.raises(ModelError, match=r"model output \(4, 3\) for targets \(4, 2\); the model must return 2"):
        task.loss(torch.zeros(4, 3), torch.zeros(4, 2))
    three = nn.Linear(3, 3)
    with pytest.raises(
        ModelError, match=r"gives 3 output\(s\) per sample but the data's float targets \(data.target\)"
    ):
        check_fits(three, ModelConfig(factory="pkg.mod:fn"), TWO, (torch.zeros(3), torch.zeros(2)))
    check_fits(nn.Linear(3, 2), ModelConfig(factory="pkg.mod:fn"), TWO, (torch.zeros(3), torch.zeros(2)))
    check_fits(nn.Linear(3, 1), ModelConfig(factory="pkg.mod:fn"), SCALAR, (torch.zeros(3), torch.zeros(())))


def test_the_task_follows_the_targets_and_refuses_what_does_not_fit() -> None:
    default = build_task(ModelConfig(name="mlp"), TWO)
    assert isinstance(default, RegressionTask) and default.loss_name == "mse" and default.target_shape == (2,)
    assert build_task(ModelConfig(name="mlp", task="regression", loss="l1"), SCALAR).loss_name == "l1"  # type: ignore[attr-defined]
    with pytest.raises(ModelError, match=r"model.task classification cannot learn: set model.task: regression"):
        build_task(ModelConfig(name="mlp", task="classification"), SCALAR)
    with pytest.raises(ModelError, match=r"model.task regression needs float targets"):
        build_task(ModelConfig(name="mlp", task="regression"), CLASSES)
    with pytest.raises(ModelError, match=r"model.loss needs model.task: regression"):
        build_task(ModelConfig(name="mlp", loss="l1"), CLASSES)


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        (
            {"model": {"name": "mlp", "task": "classification"}, "data": {"name": "synthetic", "kind": "regression"}},
            "data.kind regression gives float targets, which model.task classification cannot learn: "
            "set model.task: regression",
        ),
        (
            {"model": {"name": "mlp", "task": "classification"}, "data": {"name": "parquet", "target": ["a", "b"]}},
            "data.target names float targets, which model.task classification cannot learn",
        ),
        (
            {"model": {"name": "mlp", "task": "regression"}},
            "model.task regression needs float targets: data.name digits has class or token targets",
        ),
        (
            {"model": {"name": "mlp", "task": "regression"}, "data": {"name": "parquet"}},
            "model.task regression needs float targets: set data.target to the float column(s) of the parquet files",
        ),
        (
            {"model": {"name": "mlp", "task": "regression"}, "data": {"name": "synthetic"}},
            "model.task regression needs float targets: set data.kind: regression",
        ),
        ({"model": {"name": "mlp", "task": "classification", "loss": "l1"}}, "model.loss needs model.task: regression"),
        (
            {"model": {"name": "mlp"}, "data": {"name": "jsonl", "target": "y", "columns": {"target": "label"}}},
            "data.target names float target columns (regression) and data.columns.target an integer class column",
        ),
        ({"model": {"name": "mlp"}, "data": {"name": "synthetic", "target": "y"}}, "data.target needs data.name"),
    ],
)
def test_a_task_and_targets_that_do_not_match_are_one_line_from_the_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], sections: dict[str, Any], message: str
) -> None:
    import yaml

    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(tiny_run(tmp_path, **sections)))
    assert_user_error(in_process("train", str(config), capsys=capsys), message)


def test_a_regression_config_reads_back_as_the_workers_and_a_resumed_run_read_it(tmp_path: Path) -> None:
    from trainforge.config import Config, load_config

    data = {"name": "parquet", "path": "/data", "columns": {"input": "x"}, "target": ["price", "rent"]}
    config = load_config(tiny_run(tmp_path, model={"name": "mlp", "task": "regression", "loss": "l1"}, data=data))
    again = Config.model_validate(config.to_dict())  # every default written out, as config.yaml holds it
    assert again == config and again.data.float_targets and again.model.loss == "l1"


def write_table(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table(
        {
            "features": [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]],
            "y": [0.5, -1.25],
            "z": [3, 4],  # integers, read as floats
            "pair": [[1.0, 2.0], [3.0, 4.0]],
            "label": [1.0, 2.5],
        }
    )
    pq.write_table(table, path)
    return path


def test_float_targets_decode_from_parquet_rows_as_one_column_or_several(tmp_path: Path) -> None:
    path = write_table(tmp_path / "rows" / "part-0.parquet")
    batch = pq.read_table(path).to_pydict()
    batch = {
        name: np.array(values, dtype=object) if name in ("features", "pair") else np.array(values)
        for name, values in batch.items()
    }
    one = Decode("features", "target", None, float_targets="y")(batch)
    assert one["target"].dtype == np.float32 and one["target"].tolist() == [0.5, -1.25]
    assert one["input"].shape == (2, 3)
    several = Decode("features", "target", None, float_targets=("y", "z"))(batch)["target"]
    assert several.dtype == np.float32 and several.tolist() == [[0.5, 3.0], [-1.25, 4.0]]
    assert Decode("features", "target", None, float_targets="pair")(batch)["target"].shape == (2, 2)
    # the driver's first row, as Ray Data reads it, gives the shapes the model is checked against
    row = first_row("parquet", list_files(str(tmp_path / "rows"), "parquet"), None)
    assert Decode("features", "target", None, float_targets=("y", "z"))(row)["target"].shape == (1, 2)
    with pytest.raises(DataError, match=r"the data has no column 'w' .*: set data.target"):
        Decode("features", "target", None, float_targets=("y", "w"))(batch)
    with pytest.raises(DataError, match="a list of columns needs one number per row"):
        Decode("features", "target", None, float_targets=("y", "pair"))(batch)
    with pytest.raises(
        DataError, match=r"'label' holds fractions \(2.5\), not classes: for regression set data.target"
    ):
        Decode("features", "label", None)(batch)
    assert Decode("features", "z", None)(batch)["target"].dtype == np.int64  # whole numbers stay classes


# ---------------------------------------------------------------------------------------------
# Training, in gloo ranks without Ray

SYNTHETIC = {"name": "synthetic", "kind": "regression", "input_shape": [8], "num_samples": 1280, "val_fraction": 0.2}


def run(tmp: Path, name: str, *, steps: int, workers: int = 1, batch: int = 32, **sections: Any) -> dict[str, Any]:
    config = tiny_run(
        tmp,
        run={"name": name, "output_dir": str(tmp)},
        model={"name": "mlp", "task": "regression", "kwargs": {"hidden_sizes": [32]}},
        data=SYNTHETIC,
        train={"max_steps": steps, "batch_size": batch, "log_every_n_steps": 5, "eval_every_n_steps": steps},
        optim={"name": "adamw", "lr": 0.01},
        scaling={"num_workers": workers},
        seed=3,
    )
    for key, values in sections.items():  # a data section replaces the synthetic one
        config[key] = values if key == "data" else {**config.get(key, {}), **values}
    return config


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict[str, Any], Outcome]]:
    tmp = tmp_path_factory.mktemp("regression")
    momentum = {"optim": {"name": "sgd", "lr": 0.05, "momentum": 0.9}}
    factory = {
        "model": {"name": "mlp", "task": "regression", "loss": "l1", "kwargs": {"hidden_sizes": [32]}},
        "data": {"name": "factory", "factory": "tests.helpers.regression_data:two_targets"},
    }
    one = {
        "learns": (run(tmp, "learns", steps=150), None),
        "one-x-2b": (run(tmp, "one-x-2b", steps=4, batch=32, **momentum), None),
        "factory": (run(tmp, "factory", steps=150, **factory), None),
    }
    two = {
        "two-x-b": (run(tmp, "two-x-b", steps=4, batch=16, workers=2, **momentum), None),
        "straight": (run(tmp, "straight", steps=20, workers=2, checkpoint={"every_n_steps": 8}), None),
        "crashed": (run(tmp, "crashed", steps=20, workers=2, checkpoint={"every_n_steps": 8}), 12),
        "resumed": (run(tmp, "crashed", steps=20, workers=2, checkpoint={"every_n_steps": 8}), None),
    }
    done: dict[str, tuple[dict[str, Any], Outcome]] = {}
    for world, plans in ((1, one), (2, two)):
        outcomes = spawn_ranks(sessions, world, list(plans.values()))[0]
        done.update({name: (plan[0], outcome) for (name, plan), outcome in zip(plans.items(), outcomes, strict=True)})
    return done


@pytest.mark.slow  # 15-70 s: full suite only, so the fast subset stays under 5 minutes
def test_an_mlp_learns_synthetic_regression_far_below_the_target_variance(runs: dict) -> None:
    _, learns = runs["learns"]
    final = learns.final
    print(f"\nsynthetic regression: val/mse {final['val/mse']:.4f}, val/r2 {final['val/r2']:.4f}")
    assert final["status"] == "finished"
    # the targets' variance is 1.01 and the noise's 0.01
    assert final["val/mse"] < 0.05, final
    assert final["val/r2"] > 0.9 and final["val/loss"] == pytest.approx(final["val/mse"])
    assert "val/accuracy" not in final and math.isfinite(final["train/mae"])


def test_an_mlp_learns_a_factorys_two_targets_with_l1(runs: dict) -> None:
    _, factory = runs["factory"]
    final = factory.final
    print(
        f"\ntwo targets, l1: val/mae {final['val/mae']:.4f}, val/mse {final['val/mse']:.4f}, "
        f"val/r2 {final['val/r2']:.4f}"
    )
    assert final["status"] == "finished"
    assert final["val/loss"] == pytest.approx(final["val/mae"])  # model.loss: l1
    # the second target's variance is 9 and the first's 1: variance-weighted r2 near 1
    assert final["val/r2"] > 0.95 and final["val/mse"] < 0.5, final


def test_two_workers_with_batch_b_equal_one_worker_with_batch_2b(runs: dict) -> None:
    two, one = final_weights(runs["two-x-b"][0]), final_weights(runs["one-x-2b"][0])
    for name, value in two.items():
        assert torch.allclose(value, one[name], atol=1e-6), name
    assert runs["two-x-b"][1].final["val/mse"] == pytest.approx(runs["one-x-2b"][1].final["val/mse"], rel=1e-5)


def test_regression_crashed_and_restarted_is_bit_identical(runs: dict) -> None:
    straight_cfg, straight = runs["straight"]
    crashed_cfg, crashed = runs["crashed"]
    _, resumed = runs["resumed"]
    assert crashed.crashed and resumed.final["status"] == "finished"
    assert any("checkpoint_000000008" in event for event in resumed.events), resumed.events
    assert_bit_identical(final_weights(straight_cfg), final_weights(crashed_cfg))
    assert straight.final["val/mse"] == resumed.final["val/mse"]


def test_the_console_line_shows_val_mse_and_no_accuracy() -> None:
    from trainforge.observers.console import describe

    line = describe({"train/loss": 0.5, "val/loss": 0.25, "val/mse": 0.0123, "val/mae": 0.1}, epoch=2)
    assert "val_mse 0.0123" in line and "acc" not in line
