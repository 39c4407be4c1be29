"""The data facts a model is built from, shared by the data and model components."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class DataSpec:
    """What a model needs to know about its data: shapes, classes, vocabulary, float targets."""

    # image: (input, class) pairs; tokens: (ids, next ids) pairs; custom: samples of the data's own
    # shape (dicts, tuples), for a model that owns its step (model.task custom)
    kind: Literal["image", "tokens", "custom"]
    input_shape: tuple[int, ...]  # per sample, e.g. (1, 8, 8) or (seq_len,); () for custom samples
    num_classes: int | None = None  # image classification
    vocab_size: int | None = None  # tokens
    seq_len: int | None = None  # tokens
    train_size: int = 0
    val_size: int = 0
    # Per-channel statistics the source publishes for normalising its images (CIFAR-10's own);
    # None: data.augment normalises with data.augment.mean/std or 0.5 (data/augment.py).
    pixel_mean: tuple[float, ...] | None = None
    pixel_std: tuple[float, ...] | None = None
    # Float targets (regression) of this shape per sample: () one value, (k,) k values; None: the
    # targets are classes (image) or token ids (tokens).
    target_shape: tuple[int, ...] | None = None
