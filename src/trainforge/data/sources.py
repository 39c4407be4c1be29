"""Pieces the data component shares (seeds, tensor data sets, fixed splits, path checks) and digits.

Splits use a permutation from a fixed seed, never the run seed, so every run, tool and peer
benchmark that reads the same data sees the same train and validation samples.
"""

from __future__ import annotations

import abc
import hashlib
import importlib.util
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from trainforge.config import Cifar10Data, DigitsData, ImageFolderData
from trainforge.data.spec import DataSpec
from trainforge.errors import DataError

Pair = tuple[Tensor, Tensor]


class PairDataset(Dataset[Pair], abc.ABC):
    """A map-style data set of (input, target) tensor pairs whose length is known."""

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @abc.abstractmethod
    def __getitem__(self, index: int) -> Pair: ...


Splits = tuple[PairDataset, PairDataset | None, DataSpec]
"""What a source builds: (train set, validation set or None, DataSpec)."""

SPLIT_SEED = 0
DIGITS_VAL_FRACTION = 0.2
DIGITS_NO_TEST = "its fixed split puts every image in training (1438) or validation (359): evaluate --split val"


def mix_seed(*parts: int) -> int:
    """A 63-bit seed from several integers (seed, epoch, rank, index...), the same on every machine."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class TensorPairs(PairDataset):
    """Inputs and targets held in memory as tensors.

    Tensors (unlike numpy arrays) travel to loader worker processes through shared memory, so
    each worker does not get its own copy of the data.
    """

    def __init__(self, inputs: Tensor, targets: Tensor) -> None:
        if len(inputs) != len(targets):
            raise ValueError(f"{len(inputs)} inputs but {len(targets)} targets")
        self.inputs = inputs
        self.targets = targets

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int) -> Pair:
        return self.inputs[index], self.targets[index]


def val_count(total: int, val_fraction: float, what: str) -> int:
    """How many of ``total`` samples go to validation; the training part must not be empty."""
    count = round(total * val_fraction)
    if val_fraction > 0 and count == 0:
        count = 1
    if total - count < 1:
        raise DataError(
            f"{what} has {total} samples: too few to split off data.val_fraction={val_fraction} "
            "and keep a training set; add data or lower data.val_fraction"
        )
    return count


def split_indices(total: int, num_val: int, seed: int = SPLIT_SEED) -> tuple[Tensor, Tensor]:
    """A fixed random split of ``range(total)`` into (train, val) index tensors, each sorted."""
    perm = torch.randperm(total, generator=torch.Generator().manual_seed(seed))
    return perm[num_val:].sort().values, perm[:num_val].sort().values


def require_path(cfg: Cifar10Data | ImageFolderData, layout: str) -> Path:
    """The existing ``data.path`` of a file-based source, or a DataError that shows the layout."""
    if cfg.path is None:
        raise DataError(f"data.name {cfg.name} needs data.path: set it to {layout}")
    path = Path(cfg.path).expanduser()
    if not path.exists():
        raise DataError(f"data.path {path} does not exist: point it at {layout}")
    if not path.is_dir():
        raise DataError(f"data.path {path} is a file: point it at {layout}")
    return path


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """The digits as scikit-learn ships them: images (1797, 8, 8) of 0-16, targets (1797,).

    Read straight from the package's ``datasets/data/digits.csv.gz`` (what ``load_digits`` reads),
    which spares every worker process the 1-2 s import of scikit-learn; ``load_digits`` where the
    file is not there.
    """
    spec = importlib.util.find_spec("sklearn")  # finds the package without importing it
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = Path(folder) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            table = np.loadtxt(path, delimiter=",")
            return table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return bunch.images, bunch.target


def build_digits(cfg: DigitsData, seed: int) -> Splits:
    """scikit-learn's 8x8 digits (1797 images, shipped with the library, no download).

    Inputs are float32 (1, 8, 8) in [0, 1], targets int64 0-9. The split is fixed: 1438 training
    and 359 validation images whatever ``seed`` or ``data.val_fraction`` say, so results compare
    across runs and tools.
    """
    pixels, targets = digits_arrays()
    images = torch.as_tensor(pixels, dtype=torch.float32).div_(16.0).unsqueeze(1)
    labels = torch.as_tensor(targets, dtype=torch.int64)
    train_idx, val_idx = split_indices(len(labels), val_count(len(labels), DIGITS_VAL_FRACTION, "digits"))
    train = TensorPairs(images[train_idx].contiguous(), labels[train_idx].contiguous())
    val = TensorPairs(images[val_idx].contiguous(), labels[val_idx].contiguous())
    spec = DataSpec(kind="image", input_shape=(1, 8, 8), num_classes=10, train_size=len(train), val_size=len(val))
    return train, val, spec
