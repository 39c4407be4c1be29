"""Data sources by name: one registry line per source, its config section (the config's ``data``
union, trainforge.config.data, knows the names and keys) and how its data is built.

A source is read in memory or streamed. In memory: every worker builds the same map-style sets
(``build``). Streamed: the driver builds Ray datasets once (``stream``) and the workers read Ray
Train's shards of them. ``data.factory`` may give either, which the driver learns by calling it
once (its ``stream`` returns None for map-style sets). The driver decides with :func:`open_stream`
and sends the stream's shape to the workers; a worker builds map-style sets (:func:`build_datasets`)
unless it got one, and never decides again.

Adding a source is a section class in config/data.py's union and one line in ``REGISTRY`` here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from trainforge.config import (
    Cifar10Data,
    DataConfig,
    DigitsData,
    FactoryData,
    ImageFolderData,
    ImagesData,
    JsonlData,
    ParquetData,
    StreamedData,
    SyntheticData,
    TokensData,
)
from trainforge.config.data import unknown_source_message
from trainforge.data.factory import build_factory, factory_test_set, source_name
from trainforge.data.images import build_cifar10, build_imagefolder, imagefolder_test
from trainforge.data.sources import DIGITS_NO_TEST, PairDataset, Splits, build_digits
from trainforge.data.spec import DataSpec
from trainforge.data.stream import Stream, build_stream, list_files, stream_from_factory
from trainforge.data.synthetic import build_synthetic, synthetic_test
from trainforge.data.tokens import build_tokens
from trainforge.errors import DataError

C = TypeVar("C", bound=DataConfig)

SourceBuilder = Callable[[Any, int], Splits]
"""(the source's data section, run seed) -> (train set, validation set or None, DataSpec)."""

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Source(Generic[C]):
    """A data source: its config section's class and its builders (at least one)."""

    section: type[C]
    build: Callable[[C, int], Splits] | None = None  # map-style sets, on every worker
    stream: Callable[[C, int, Progress], Stream | None] | None = None  # Ray datasets, once on the driver
    # A held-out test set (``trainforge evaluate --split test``); a source without one says why.
    test: Callable[[C, int], PairDataset] | None = None
    no_test: str = "its data has train and val splits only"

    @property
    def name(self) -> str:
        return str(self.section.model_fields["name"].default)

    @property
    def streamed(self) -> bool:
        """Always streamed (it has no map-style builder): checked as such before Ray starts."""
        return self.build is None


REGISTRY: dict[str, Source[Any]] = {
    source.name: source
    for source in (
        Source(SyntheticData, build=build_synthetic, test=synthetic_test),
        Source(DigitsData, build=build_digits, no_test=DIGITS_NO_TEST),
        Source(Cifar10Data, build=build_cifar10, no_test="its test batch is the validation set: evaluate --split val"),
        Source(ImageFolderData, build=build_imagefolder, test=imagefolder_test),
        Source(TokensData, build=build_tokens, no_test="a prepared corpus has train and val splits"),
        Source(FactoryData, build=build_factory, stream=stream_from_factory, test=factory_test_set),
        Source(ParquetData, stream=build_stream),
        Source(ImagesData, stream=build_stream),
        Source(JsonlData, stream=build_stream),
    )
}

MAP_STYLE = frozenset(name for name, source in REGISTRY.items() if source.build is not None)
"""The sources whose data every worker builds in memory (the factory's when it returns map-style sets)."""


def source_of(cfg: DataConfig) -> Source[Any]:
    """The registered source of a data section, or a DataError naming the sources there are
    (a section built in Python may name none; the config refuses such a name)."""
    source = REGISTRY.get(source_name(cfg))
    if source is None:
        raise DataError(unknown_source_message(cfg.name))
    return source


def build_test_set(cfg: DataConfig, seed: int) -> PairDataset:
    """The held-out test set of ``cfg``'s source, map-style; a DataError saying why when it has none."""
    source = source_of(cfg)
    if source.test is None:
        raise DataError(f"data.name {source.name} has no test split: {source.no_test}")
    return source.test(cfg, seed)


def open_stream(cfg: DataConfig, seed: int, progress: Progress = lambda _: None) -> Stream | None:
    """The driver's one decision: the Ray datasets (and their shape, for the workers) of a streamed
    source, or of a factory that returns Ray datasets; None when the workers build the data in memory."""
    source = source_of(cfg)
    return source.stream(cfg, seed, progress) if source.stream is not None else None


def check_local_paths(cfg: DataConfig) -> None:
    """The driver's check before a local Ray starts: ``data.path`` exists (a streamed source's, and
    its ``data.val_path``, hold files of its kind). The workers check again where they read."""
    if isinstance(cfg, StreamedData):
        for key, path in (("data.path", cfg.path), ("data.val_path", cfg.val_path)):
            if path is not None:
                list_files(path, cfg.name, key)
        return
    path = getattr(cfg, "path", None)  # the sources that read files
    if path is not None and not Path(path).expanduser().exists():
        raise DataError(f"data.path {path} does not exist (data.name {cfg.name})")


def build_datasets(cfg: DataConfig, seed: int) -> tuple[PairDataset, PairDataset | None, DataSpec]:
    """The train set, the validation set (None when there is none) and the DataSpec for ``cfg``.

    Both sets are map-style and yield ``(input, target)`` tensor pairs. The built-in sources
    ignore ``seed``: their data and splits are the same for every run seed. A streamed source has
    none: its rows reach the workers as Ray Train's dataset shards.
    """
    source = source_of(cfg)
    if source.build is None:
        raise DataError(
            f"data.name {source.name} is streamed by Ray Data and builds no map-style data set here; "
            f"this needs one of {', '.join(sorted(MAP_STYLE))}"
        )
    train, val, spec = source.build(cfg, seed)
    if len(train) == 0:
        raise DataError(f"data.name {source.name} built an empty training set: check data.path and data.num_samples")
    return train, val, spec
