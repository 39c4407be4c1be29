"""Config layering and validation: every error names the key and what is allowed."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainforge.config import env_overrides, load_config, parse_override, to_yaml
from trainforge.errors import ConfigError

BASE = {"model": {"name": "mlp"}, "train": {"max_steps": 10}}


def test_defaults_fill_every_section() -> None:
    config = load_config(BASE, env={})
    assert config.data.name == "digits"
    assert config.scaling.num_workers == 1
    assert config.optim.name == "adamw"
    assert config.precision == "fp32"


def test_auto_batch_size_takes_the_global_batch_and_a_memory_budget() -> None:
    auto = load_config(BASE, ["train.batch_size=auto", "train.global_batch_size=256"], env={})
    assert auto.train.auto_batch and auto.train.global_batch_size == 256 and auto.train.memory_limit_gb == 4.0
    assert load_config(auto, env={}).train.batch_size == "auto"  # round-trips (the workers' copy)
    assert not load_config(BASE, env={}).train.auto_batch


def test_yaml_then_set_then_environment(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("model: {name: mlp}\ntrain: {max_steps: 10, batch_size: 8}\noptim: {lr: 0.5}\n")
    config = load_config(
        path,
        ["train.batch_size=64", "scaling.num_workers=[1, 2]", "model.kwargs={hidden: [4, 4]}", "optim.lr=0.2"],
        env={"TRAINFORGE_OPTIM__LR": "0.1", "UNRELATED": "x"},
    )
    assert config.train.batch_size == 64
    assert config.scaling.num_workers == (1, 2)
    assert config.model.kwargs == {"hidden": [4, 4]}
    assert config.optim.lr == 0.1  # the environment is the last layer


def test_override_values_are_typed() -> None:
    assert parse_override("train.batch_size=64") == ("train.batch_size", 64)
    assert parse_override("scaling.use_gpu=true") == ("scaling.use_gpu", True)
    assert parse_override("data.input_shape=[3, 8, 8]") == ("data.input_shape", [3, 8, 8])
    assert parse_override("run.name=abc") == ("run.name", "abc")
    assert env_overrides({"TRAINFORGE_TRAIN__MAX_STEPS": "5"}) == {"train.max_steps": 5}


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"train": {"bacth_size": 3, "max_steps": 1}}, "unknown key train.bacth_size — did you mean train.batch_size?"),
        ({"trian": {}}, "unknown key trian — did you mean train?"),
        (
            {"train": {"batch_size": 0, "max_steps": 1}},
            "train.batch_size = 0: Input should be greater than or equal to 1"[:60],
        ),
        ({"train": {"batch_size": "big", "max_steps": 1}}, "train.batch_size = 'big': Input should be a valid integer"),
        ({"optim": {"name": "torch.optim.LBFGS"}}, "optim.name = 'torch.optim.LBFGS': String should match pattern"),
        ({"data": {"val_fraction": 1.5}}, "data.val_fraction = 1.5: Input should be less than 1"),
        ({"scaling": {"num_workers": [3, 1]}}, "[min, max] needs min <= max"),
        ({"train": {"batch_size": 4}}, "set train.max_steps or train.epochs"),
        ({"model": {"name": "mlp", "factory": "a.b:c"}}, "give exactly one of model.name"),
        ({"model": {"factory": "not a path"}}, "model.factory must look like 'package.module:function'"),
        ({"precision": "fp16"}, "precision fp16 needs scaling.use_gpu: true"),
        ({"train": {"sync_batchnorm": True, "max_steps": 1}}, "train.sync_batchnorm needs scaling.use_gpu: true"),
        ({"run": {"name": "../escape"}}, "run.name = '../escape': must be 1-128 characters"),
        (
            {"train": {"batch_size": "automatic", "max_steps": 1}},
            "train.batch_size = 'automatic': Input should be a valid integer, unable to parse string as an integer "
            "(or 'auto')",
        ),
        (
            {"train": {"batch_size": "auto", "max_steps": 1}},
            "train.global_batch_size is required with train.batch_size: auto",
        ),
        (
            {"train": {"batch_size": 8, "global_batch_size": 64, "grad_accum_steps": 2, "max_steps": 1}},
            "train.grad_accum_steps follows from train.global_batch_size",
        ),
        (
            {"train": {"batch_size": 8, "global_batch_size": 60, "max_steps": 1}, "scaling": {"num_workers": 2}},
            "train.global_batch_size 60 must be divisible by train.batch_size 8 x scaling.num_workers 2 = 16",
        ),
        (
            {"train": {"batch_size": "auto", "global_batch_size": 64, "grad_accum_steps": 2, "max_steps": 1}},
            "train.grad_accum_steps is chosen by train.batch_size: auto",
        ),
        (
            {"train": {"batch_size": "auto", "global_batch_size": 30, "max_steps": 1}, "scaling": {"num_workers": 4}},
            "train.global_batch_size 30 must be divisible by scaling.num_workers 4",
        ),
        (
            {"train": {"memory_limit_gb": 0, "max_steps": 1}},
            "train.memory_limit_gb = 0: Input should be greater than 0",
        ),
    ],
)
def test_bad_values_name_the_key(change: dict, expected: str) -> None:
    raw = {**BASE, **change}
    if "train" in change and "max_steps" not in change["train"] and "epochs" not in change["train"]:
        raw["train"] = change["train"]
    with pytest.raises(ConfigError) as err:
        load_config(raw, env={})
    assert expected in str(err.value)
    assert "\n" not in str(err.value)


def test_bad_override_syntax_and_paths(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="expected key=value"):
        load_config(BASE, ["train.batch_size"], env={})
    with pytest.raises(ConfigError, match="is a value, not a section"):
        load_config(BASE, ["train.max_steps.x=1"], env={})
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML at line"):
        load_config(bad)


def test_resolved_config_round_trips_through_yaml(tmp_path: Path) -> None:
    config = load_config(BASE, ["scaling.num_workers=2"], env={})
    path = tmp_path / "resolved.yaml"
    path.write_text(to_yaml(config))
    assert load_config(path, env={}) == config


def test_bundled_quickstart_is_valid() -> None:
    from trainforge.cli.common import resolve_config_path

    config = load_config(resolve_config_path("quickstart"), env={})
    assert config.data.name == "digits"
    assert config.scaling.num_workers == 2
