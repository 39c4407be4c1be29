"""data.factory: the user's own data through the factory contract (data/factory.py), with the
stand-in user module tests/helpers/user_data.py. Real data sets, no Ray."""

from __future__ import annotations

import pytest
import torch

from trainforge.config import Config, DataConfig
from trainforge.data import UserData, build_datasets, check_data_factory, is_ray_dataset, load_user_data
from trainforge.data.sources import digits_arrays, split_indices
from trainforge.errors import ConfigError, DataError, TrainforgeError

HELPERS = "tests.helpers.user_data"


def factory(function: str, **data: object) -> DataConfig:
    return DataConfig(factory=f"{HELPERS}:{function}", **data)


def test_a_factory_with_data_and_seed_returns_checked_tensor_pairs() -> None:
    train, val, spec = build_datasets(factory("digits"), seed=3)
    assert val is not None and (len(train), len(val)) == (1437, 360)
    assert (spec.kind, spec.input_shape, spec.num_classes, spec.train_size, spec.val_size) == (
        "image",
        (1, 8, 8),
        10,
        1437,
        360,
    )
    images, labels = digits_arrays()
    x, y = val[5]  # numpy image and int label, as the user's set holds them, come back as tensors
    assert x.dtype == torch.float32 and y.dtype == torch.int64 and y.ndim == 0
    assert torch.allclose(x[0], torch.as_tensor(images[1442] / 16.0, dtype=torch.float32)) and int(y) == labels[1442]


def test_facts_are_inferred_and_a_validation_set_split_off() -> None:
    """No arguments, the training set alone: kind and shape from sample 0, classes from
    ``.classes``, data.val_fraction split off by the fixed permutation image folders use."""
    train, val, spec = build_datasets(factory("digits_bare", val_fraction=0.1), seed=0)
    assert (spec.kind, spec.input_shape, spec.num_classes) == ("image", (1, 8, 8), 10)
    assert val is not None and (len(train), len(val)) == (1617, 180)
    train_idx, val_idx = split_indices(1797, 180)
    _, labels = digits_arrays()
    assert int(train[7][1]) == labels[int(train_idx[7])] and int(val[3][1]) == labels[int(val_idx[3])]
    train, val, _ = build_datasets(factory("digits_bare", val_fraction=0.0), seed=0)
    assert val is None and len(train) == 1797


def test_token_data() -> None:
    train, val, spec = build_datasets(factory("tokens", seq_len=8), seed=0)
    assert (spec.kind, spec.input_shape, spec.seq_len, spec.vocab_size, spec.num_classes) == (
        "tokens",
        (8,),
        8,
        50,
        None,
    )
    x, y = train[0]
    assert x.dtype == y.dtype == torch.int64 and torch.equal(x[1:], y[:-1])
    assert val is not None and len(train) + len(val) == 40


def test_a_ray_dataset_is_handed_back_unchanged() -> None:
    user = load_user_data(factory("ray_rows"), seed=0)
    assert is_ray_dataset(user.train) and (user.num_classes, user.input_shape) == (10, (1, 8, 8))
    assert not is_ray_dataset(torch.utils.data.TensorDataset(torch.zeros(1))) and not is_ray_dataset(None)
    with pytest.raises(DataError, match=r"returned a ray\.data\.Dataset, which only the streaming"):
        build_datasets(factory("ray_rows"), seed=0)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("wrong_type", "returned list, expected a trainforge.data.UserData(train=..."),
        ("splits_as_tuple", "returned tuple, expected a trainforge.data.UserData(train=..."),
        ("dicts", "train sample 0 is dict, expected an (input, target) pair"),
        ("float_targets", "integer class (kind image), float targets (kind regression) or integer token ids"),
        ("float_targets", "num_classes says classes: for regression return UserData(kind='regression') without it"),
        ("integer_images", "train sample 0 has a uint8 input, expected a floating-point input"),
        ("wrong_declared_shape", "an input of shape (1, 4, 4), expected shape (3, 4, 4)"),
        ("without_classes", "classification needs num_classes >= 2"),
        ("tokens_without_vocabulary", "token data needs vocab_size"),
        ("tokens_out_of_vocabulary", "train sample 0 has token ids 1..50, expected ids in 0..49 (vocab_size)"),
        ("empty", "train is empty"),
        ("iterable", "expected a map-style Dataset (__len__ and __getitem__) or a ray.data.Dataset"),
        ("raising", "raised FileNotFoundError: /data/shards for seed 5 not found"),
        ("three_arguments", "it must take (data, seed), the data config and the run seed, or no arguments"),
        ("NOT_CALLABLE", "is not callable (got a value of type int)"),
        ("no_such_function", "has no attribute 'no_such_function'"),
    ],
)
def test_bad_factories_are_one_line_naming_the_key_and_what_was_expected(name: str, expected: str) -> None:
    with pytest.raises(DataError) as caught:
        build_datasets(factory(name), seed=5)
    message = str(caught.value)
    assert message.startswith(f"data.factory '{HELPERS}:{name}'") and expected in message
    assert "\n" not in message and caught.value.exit_code == 2


def test_samples_after_the_first_are_checked_when_read() -> None:
    train, val, _ = build_datasets(factory("ragged", val_fraction=0.0), seed=0)
    assert val is None and train[1][0].shape == (1, 4, 4)
    with pytest.raises(DataError, match=r"train sample 2 has an input of shape \(1, 5, 5\), expected shape"):
        train[2]
    train, _, _ = build_datasets(factory("class_out_of_range", val_fraction=0.0), seed=0)
    with pytest.raises(DataError, match=r"train sample 2 has class 5, expected a class in 0..2 \(num_classes\)"):
        train[2]


def test_data_name_and_factory() -> None:
    assert build_datasets(factory("digits", name="factory"), seed=0)[2].train_size == 1437
    with pytest.raises(ConfigError, match=r"data\.name 'cifar10' and data\.factory .* both say where the data"):
        build_datasets(factory("digits", name="cifar10"), seed=0)
    with pytest.raises(ConfigError, match=r"data\.name factory needs data\.factory"):
        build_datasets(DataConfig(name="factory"), seed=0)


def test_the_driver_check_loads_without_calling_and_sees_an_explicit_name() -> None:
    def config(**data: object) -> Config:
        return Config.model_validate({"model": {"name": "mlp"}, "train": {"max_steps": 1}, "data": data})

    check_data_factory(config(factory=f"{HELPERS}:raising").data)  # imports; does not call
    check_data_factory(config(factory=f"{HELPERS}:digits", name="factory").data)
    with pytest.raises(ConfigError, match=r"data\.name 'digits' and data\.factory"):  # set, not defaulted
        check_data_factory(config(factory=f"{HELPERS}:digits", name="digits").data)
    with pytest.raises(DataError, match="it must take \\(data, seed\\)"):
        check_data_factory(config(factory=f"{HELPERS}:three_arguments").data)
    with pytest.raises(DataError, match=r"cannot import module 'tests\.helpers\.nowhere'"):
        check_data_factory(config(factory="tests.helpers.nowhere:data").data)
    check_data_factory(config(factory="tests.helpers.nowhere:data").data, local=False)  # a remote cluster's path


def test_user_data_is_exported_and_errors_are_trainforge_errors() -> None:
    assert UserData(train=[]).val is None
    assert issubclass(DataError, TrainforgeError) and issubclass(ConfigError, TrainforgeError)
