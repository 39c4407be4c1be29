"""Synthetic data sets that are learnable, deterministic and generated lazily per index.

Every sample is drawn from a generator seeded by a fixed data seed and the sample's index, so the
data set is the same for every run seed and on every machine, builds instantly whatever its size,
and costs a loader worker no memory beyond the sample it is producing.
"""

from __future__ import annotations

import math

import torch

from trainforge.config import SyntheticData
from trainforge.data.sources import Pair, PairDataset, Splits, mix_seed, val_count
from trainforge.data.spec import DataSpec
from trainforge.errors import DataError

DATA_SEED = 1234  # fixed on purpose: the data must not change with the training seed
IMAGE_NOISE_STD = 1.0  # noise around each class prototype, in prototype standard deviations
TOKEN_NOISE = 0.1  # chance that the next token is uniform instead of the table's successor
REGRESSION_NOISE_STD = 0.1  # noise added to the regression target, whose noise-free part has unit variance


def _generator(*parts: int) -> torch.Generator:
    """A CPU generator seeded from ``parts`` (data seed, stream, index)."""
    return torch.Generator().manual_seed(mix_seed(*parts))


class SyntheticImages(PairDataset):
    """Images of ``shape`` in ``num_classes`` classes: a fixed random prototype per class plus noise.

    Samples ``offset .. offset + length - 1`` of one endless stream; train and validation sets are
    disjoint ranges of it. Inputs are float32 with unit variance per pixel, targets int64.
    """

    def __init__(self, shape: tuple[int, ...], num_classes: int, offset: int, length: int) -> None:
        self.shape = shape
        self.num_classes = num_classes
        self.offset = offset
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> Pair:
        if not 0 <= index < self.length:
            raise IndexError(f"index {index} out of range for {self.length} samples")
        gen = _generator(DATA_SEED, 1, self.offset + index)
        label = int(torch.randint(self.num_classes, (), generator=gen))
        noise = torch.randn(self.shape, generator=gen)
        prototype = torch.randn(self.shape, generator=_generator(DATA_SEED, 0, label))
        image = prototype.add_(noise, alpha=IMAGE_NOISE_STD).mul_(1.0 / math.sqrt(1.0 + IMAGE_NOISE_STD**2))
        return image, torch.tensor(label, dtype=torch.int64)


class SyntheticTokens(PairDataset):
    """Token sequences from a fixed random successor table with ``TOKEN_NOISE`` uniform noise.

    A bigram model can predict about 90% of the next tokens, so a language model that learns
    shows a falling loss. Yields ``(tokens[:-1], tokens[1:])``, both int64 of length ``seq_len``.
    """

    def __init__(self, vocab_size: int, seq_len: int, offset: int, length: int) -> None:
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.offset = offset
        self.length = length
        table = torch.randint(vocab_size, (vocab_size,), generator=_generator(DATA_SEED, 2))
        self.successor: list[int] = table.tolist()

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> Pair:
        if not 0 <= index < self.length:
            raise IndexError(f"index {index} out of range for {self.length} samples")
        gen = _generator(DATA_SEED, 3, self.offset + index)
        noisy = (torch.rand(self.seq_len, generator=gen) < TOKEN_NOISE).tolist()
        uniform = torch.randint(self.vocab_size, (self.seq_len + 1,), generator=gen).tolist()
        tokens = [uniform[0]]
        for step in range(self.seq_len):
            tokens.append(uniform[step + 1] if noisy[step] else self.successor[tokens[-1]])
        sequence = torch.tensor(tokens, dtype=torch.int64)
        return sequence[:-1], sequence[1:]


class SyntheticRegression(PairDataset):
    """Float inputs of ``shape`` (standard normal) and one float target: a fixed random linear
    function of them with unit variance, plus ``REGRESSION_NOISE_STD`` noise. The best possible
    mean squared error is the noise's variance (0.01) against the target's variance (1.01)."""

    def __init__(self, shape: tuple[int, ...], offset: int, length: int) -> None:
        self.shape = shape
        self.offset = offset
        self.length = length
        weights = torch.randn(math.prod(shape), generator=_generator(DATA_SEED, 4))
        self.weights = weights / weights.norm()

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> Pair:
        if not 0 <= index < self.length:
            raise IndexError(f"index {index} out of range for {self.length} samples")
        gen = _generator(DATA_SEED, 5, self.offset + index)
        features = torch.randn(self.shape, generator=gen)
        noise = float(torch.randn((), generator=gen)) * REGRESSION_NOISE_STD
        return features, torch.tensor(float(features.reshape(-1) @ self.weights) + noise, dtype=torch.float32)


def synthetic_test(cfg: SyntheticData, seed: int) -> PairDataset:
    """A held-out test set: the ``data.val_fraction`` share's size again, the samples after the
    last validation one (neither training nor validation reads them; ``seed`` is unused)."""
    num_val = val_count(cfg.num_samples, cfg.val_fraction, "the synthetic data set (data.num_samples)")
    if num_val == 0:
        raise DataError("data.name synthetic sizes its test split as its validation split: data.val_fraction is 0")
    if cfg.kind == "regression":
        return SyntheticRegression(tuple(cfg.input_shape), cfg.num_samples, num_val)
    if cfg.kind == "image":
        return SyntheticImages(tuple(cfg.input_shape), cfg.num_classes, cfg.num_samples, num_val)
    return SyntheticTokens(cfg.vocab_size, cfg.seq_len, cfg.num_samples, num_val)


def build_synthetic(cfg: SyntheticData, seed: int) -> Splits:
    """``data.num_samples`` synthetic samples of ``data.kind``; the last ``data.val_fraction`` validate.

    ``seed`` is deliberately unused: the data set is the same whatever the training seed.
    """
    num_val = val_count(cfg.num_samples, cfg.val_fraction, "the synthetic data set (data.num_samples)")
    num_train = cfg.num_samples - num_val
    train: PairDataset
    val: PairDataset | None
    if cfg.kind == "regression":
        shape = tuple(cfg.input_shape)
        train = SyntheticRegression(shape, 0, num_train)
        val = SyntheticRegression(shape, num_train, num_val) if num_val else None
        spec = DataSpec(kind="image", input_shape=shape, target_shape=(), train_size=num_train, val_size=num_val)
    elif cfg.kind == "image":
        shape = tuple(cfg.input_shape)
        train = SyntheticImages(shape, cfg.num_classes, 0, num_train)
        val = SyntheticImages(shape, cfg.num_classes, num_train, num_val) if num_val else None
        spec = DataSpec(
            kind="image", input_shape=shape, num_classes=cfg.num_classes, train_size=num_train, val_size=num_val
        )
    else:
        train = SyntheticTokens(cfg.vocab_size, cfg.seq_len, 0, num_train)
        val = SyntheticTokens(cfg.vocab_size, cfg.seq_len, num_train, num_val) if num_val else None
        spec = DataSpec(
            kind="tokens",
            input_shape=(cfg.seq_len,),
            vocab_size=cfg.vocab_size,
            seq_len=cfg.seq_len,
            train_size=num_train,
            val_size=num_val,
        )
    return train, val, spec
