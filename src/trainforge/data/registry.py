"""Data sources by name: ``data.name`` picks a builder that turns the data config into data sets.

Adding a source is one builder function with the ``SourceBuilder`` signature and one line in
``SOURCES``. ``data.factory`` (the user's own data, data/factory.py) is the source ``factory``
whether ``data.name`` says so or is left at its default.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable

from trainforge.config import DataConfig
from trainforge.data.factory import build_factory, source_name
from trainforge.data.images import build_cifar10, build_imagefolder
from trainforge.data.sources import PairDataset, Splits, build_digits
from trainforge.data.spec import DataSpec
from trainforge.data.synthetic import build_synthetic
from trainforge.data.tokens import build_tokens
from trainforge.errors import DataError

SourceBuilder = Callable[[DataConfig, int], Splits]
"""(data config, run seed) -> (train set, validation set or None, DataSpec); sets are PairDatasets."""

SOURCES: dict[str, SourceBuilder] = {
    "synthetic": build_synthetic,
    "digits": build_digits,
    "cifar10": build_cifar10,
    "imagefolder": build_imagefolder,
    "tokens": build_tokens,
    "factory": build_factory,
}


def build_datasets(cfg: DataConfig, seed: int) -> tuple[PairDataset, PairDataset | None, DataSpec]:
    """The train set, the validation set (None when there is none) and the DataSpec for ``cfg``.

    Both sets are map-style and yield ``(input, target)`` tensor pairs. The built-in sources
    ignore ``seed``: their data and splits are the same for every run seed.
    """
    name = source_name(cfg)
    builder = SOURCES.get(name)
    if builder is None:
        raise DataError(unknown_source_message(name))
    train, val, spec = builder(cfg, seed)
    if len(train) == 0:
        raise DataError(f"data.name {name} built an empty training set: check data.path and data.num_samples")
    return train, val, spec


def unknown_source_message(name: str) -> str:
    """Says which names exist and, where one is close, which was probably meant."""
    close = difflib.get_close_matches(name, list(SOURCES), n=1, cutoff=0.5)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown data.name {name!r}{hint}: choose one of {', '.join(sorted(SOURCES))}"
