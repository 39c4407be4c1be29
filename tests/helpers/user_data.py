"""Stand-ins for a user's own data module, resolved through ``data.factory`` in tests.

The digits come from scikit-learn's own file, read the way trainforge reads it (sparing each
worker the import of scikit-learn); a user's module would call ``sklearn.datasets.load_digits``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from trainforge.config import DataConfig
from trainforge.data import UserData
from trainforge.data.sources import digits_arrays

NOT_CALLABLE = 7


class NumpyDigits(Dataset[Any]):
    """Digits as a user might hold them: numpy images (1, 8, 8) float32 in [0, 1], int labels."""

    classes = tuple(str(d) for d in range(10))

    def __init__(self, part: slice = slice(None)) -> None:
        images, labels = digits_arrays()
        self.images = (images[part] / 16.0).astype(np.float32)[:, None]
        self.labels = labels[part]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[np.ndarray, int]:
        return self.images[index], int(self.labels[index])


def digits(data: DataConfig, seed: int) -> UserData:
    """Digits with the last 360 images held out; the facts given, as the contract asks."""
    return UserData(train=NumpyDigits(slice(0, 1437)), val=NumpyDigits(slice(1437, None)), num_classes=10)


def digits_bare() -> Dataset[Any]:
    """The training set alone, no arguments: kind, shape and classes are inferred, val split off."""
    return NumpyDigits()


class Sequences(Dataset[Any]):
    """Shifted counting sequences mod ``vocab``: (tokens[:-1], tokens[1:])."""

    def __init__(self, vocab: int, seq_len: int, count: int, top: int | None = None) -> None:
        self.vocab, self.seq_len, self.count, self.top = vocab, seq_len, count, top

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = (torch.arange(self.seq_len + 1, dtype=torch.int32) + index) % self.vocab
        if self.top is not None:
            tokens[0] = self.top
        return tokens[:-1], tokens[1:]


def tokens(data: DataConfig, seed: int) -> UserData:
    return UserData(train=Sequences(50, data.seq_len, 40), vocab_size=50)


def tokens_out_of_vocabulary() -> UserData:
    return UserData(train=Sequences(50, 8, 40, top=50), vocab_size=50)


def tokens_without_vocabulary() -> UserData:
    return UserData(train=Sequences(50, 8, 40))


class Items(Dataset[Any]):
    """Any items, for the checks: ``items[i]`` is sample i."""

    def __init__(self, items: list[Any]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> Any:
        return self.items[index]


def image(label: Any = 1, shape: tuple[int, ...] = (1, 4, 4), dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    return torch.zeros(shape, dtype=dtype), label


def wrong_type() -> list[int]:
    return [1, 2, 3]


def splits_as_tuple() -> tuple[Dataset[Any], Dataset[Any]]:
    return NumpyDigits(slice(0, 100)), NumpyDigits(slice(100, 200))


def dicts() -> UserData:
    return UserData(train=Items([{"x": 1, "y": 2}] * 4), num_classes=2)


def float_targets() -> UserData:
    return UserData(train=Items([image(0.5)] * 4), num_classes=2)


def integer_images() -> UserData:
    return UserData(train=Items([image(1, dtype=torch.uint8)] * 4), num_classes=2)


def class_out_of_range() -> UserData:
    return UserData(train=Items([image(1), image(1), image(5), image(1)]), num_classes=3)


def ragged() -> UserData:
    """The first sample is right, the third has another shape: caught when it is read."""
    return UserData(train=Items([image(), image(), image(shape=(1, 5, 5)), image()]), num_classes=2)


def wrong_declared_shape() -> UserData:
    return UserData(train=Items([image()] * 4), num_classes=2, input_shape=(3, 4, 4))


def without_classes() -> UserData:
    return UserData(train=Items([image()] * 4))


def empty() -> UserData:
    return UserData(train=Items([]), num_classes=2)


class Stream(torch.utils.data.IterableDataset[Any]):
    def __iter__(self) -> Any:
        return iter([image()])


def iterable() -> UserData:
    return UserData(train=Stream(), num_classes=2)


def raising(data: DataConfig, seed: int) -> UserData:
    raise FileNotFoundError(f"/data/shards for seed {seed} not found")


def three_arguments(a: int, b: int, c: int) -> UserData:
    raise AssertionError("never called")


def ray_rows() -> UserData:
    """A ray.data.Dataset, handed back unchanged. An unexecuted shell: building a real one starts Ray,
    which the unit tests of the contract do not need."""
    import ray.data

    shell = ray.data.Dataset.__new__(ray.data.Dataset)
    shell._current_executor = None  # what Dataset.__del__ reads
    return UserData(train=shell, num_classes=10, input_shape=(1, 8, 8))


def digits_ray(data: DataConfig, seed: int) -> UserData:
    """The digits as Ray Datasets (rows of 64 pixel values and a label), the last 360 held out."""
    import ray.data

    images, labels = digits_arrays()
    rows = [
        {"input": (image / 16.0).astype(np.float32).ravel(), "target": int(label)}
        for image, label in zip(images, labels, strict=True)
    ]
    return UserData(
        train=ray.data.from_items(rows[:1437]),
        val=ray.data.from_items(rows[1437:]),
        num_classes=10,
        input_shape=(1, 8, 8),
    )


class DictDigits(Dataset[Any]):
    """Digits as dict samples, {"image": (1, 8, 8) float, "label": int}: a batch of the data's own
    shape, for a model that owns its step (model.task: custom)."""

    def __init__(self, part: slice = slice(None)) -> None:
        self.pairs = NumpyDigits(part)

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index: int) -> dict[str, Any]:
        image, label = self.pairs[index]
        return {"image": torch.from_numpy(image), "label": label}


def digits_dicts(data: DataConfig, seed: int) -> UserData:
    """Digits as dicts, the last 360 held out, for model.task custom."""
    return UserData(train=DictDigits(slice(0, 1437)), val=DictDigits(slice(1437, None)), kind="custom", num_classes=10)


def digits_with_test(data: DataConfig, seed: int) -> UserData:
    """Digits in three parts: 1200 to train, 300 to validate and the last 297 held out as a test set."""
    return UserData(
        train=NumpyDigits(slice(0, 1200)),
        val=NumpyDigits(slice(1200, 1500)),
        test=NumpyDigits(slice(1500, None)),
        num_classes=10,
    )


class IndexedDigits(Dataset[Any]):
    """Digits rows whose first value is the sample's index (for ``user_models.id_recorder``): 65
    float32 values, the index then the 64 pixels in [0, 1]."""

    def __init__(self, part: slice) -> None:
        self.digits = NumpyDigits(part)

    def __len__(self) -> int:
        return len(self.digits)

    def __getitem__(self, index: int) -> tuple[np.ndarray, int]:
        image, label = self.digits[index]
        return np.concatenate([np.float32([index]), image.reshape(-1)]), label


def indexed_digits(data: DataConfig, seed: int) -> UserData:
    """251 training rows (odd: 2 workers cut the epoch's order to 250) and 60 validation rows."""
    return UserData(train=IndexedDigits(slice(0, 251)), val=IndexedDigits(slice(1437, 1497)), num_classes=10)
