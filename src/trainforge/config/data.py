"""The ``data`` section: one class per data source, chosen by ``data.name`` (a pydantic union
discriminated by it), each holding only the keys its source reads, so that a key a source would
ignore is refused when the config is validated.

``data.factory`` (the user's own data) is the source ``factory`` whether ``data.name`` says so or
is left out. The sources' builders live in ``trainforge.data`` (data/registry.py registers one per
name here); this module knows names and keys only, so the config stays a leaf.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal, cast, get_args

from pydantic import AfterValidator, BeforeValidator, Discriminator, Field, Tag, field_validator, model_validator
from typing_extensions import Self

from trainforge.config.section import MAX_BATCH, MAX_DIM, MAX_SAMPLES, Dim, Section

DEFAULT_SOURCE = "digits"  # data.name when the section leaves it out
FACTORY_SOURCE = "factory"  # data.name of the user's data.factory
NEEDS_FACTORY = "data.name factory needs data.factory: 'package.module:function' (docs/data.md)"
_PREPARE_NEEDS = "data.name: tokens and data.path (the folder it writes the corpus to)"

# Every key of the one data section that configs had before sections were per source: a section
# holding all of them is an older run's resolved config (config.yaml), read back (see DataConfig).
WHOLE_SECTION_KEYS = frozenset(
    {
        "name", "path", "val_path", "factory", "columns", "augment", "windows", "prepare", "shuffle_buffer",
        "prefetch_batches", "kind", "input_shape", "num_classes", "num_samples", "seq_len", "vocab_size",
        "val_fraction", "image_size", "num_workers", "pin_memory", "shuffle",
    }
)  # fmt: skip

MAX_TARGET_COLUMNS = 4096


class ColumnsConfig(Section):
    """Which columns of a streaming source (parquet, images, jsonl) hold the input and the target;
    None takes the source's default (docs/data.md)."""

    input: str | None = None
    target: str | None = None


class AugmentConfig(Section):
    """Training augmentation for image sources, per batch (data/augment.py); off unless ``data.augment`` is set."""

    crop: Literal["none", "random_resized", "pad"] = "pad"
    crop_scale: tuple[Annotated[float, Field(gt=0.0, le=1.0)], Annotated[float, Field(gt=0.0, le=1.0)]] = (0.08, 1.0)
    pad: Annotated[int, Field(ge=0, le=1024)] = 4
    flip: bool = True
    normalize: bool = True
    mean: Annotated[list[float], Field(min_length=1, max_length=8)] | None = None
    std: Annotated[list[Annotated[float, Field(gt=0.0)]], Field(min_length=1, max_length=8)] | None = None
    backend: Literal["auto", "torchvision", "kornia"] = "auto"


class PrepareConfig(Section):
    """``data.prepare``: the token corpus ``trainforge train`` writes at ``data.path`` when it holds
    none (data/tokens.py), as ``trainforge data prepare`` would; the same options."""

    inputs: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=4096)]
    tokenizer: Annotated[str, Field(min_length=1)] = "bytes"  # bytes, bpe:VOCAB or a tokenizer.json path
    val_fraction: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.05
    max_files: Annotated[int, Field(ge=1, le=MAX_SAMPLES)] | None = None
    include: Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=256)] = Field(default_factory=list)
    workers: Annotated[int, Field(ge=1, le=1024)] | None = None


def _augment_switch(value: Any) -> Any:
    """``augment: true`` is the defaults, ``false`` is off."""
    if value is True:
        return {}
    return None if value is False else value


def _factory_path(value: str | None) -> str | None:
    if value is not None and not re.fullmatch(r"[\w.]+:[\w.]+", value):
        raise ValueError(f"must look like 'package.module:function', got {value!r}")
    return value


_Augment = Annotated[AugmentConfig | None, BeforeValidator(_augment_switch)]
_ValFraction = Annotated[float, Field(ge=0.0, lt=1.0)]
_InputShape = Annotated[list[Dim], Field(min_length=1, max_length=8)]
_NumClasses = Annotated[int, Field(ge=2, le=MAX_DIM)]
_NumSamples = Annotated[int, Field(ge=1, le=MAX_SAMPLES)]
_SeqLen = Annotated[int, Field(ge=2, le=MAX_DIM)]
_VocabSize = Annotated[int, Field(ge=2, le=MAX_DIM)]
_ShuffleBuffer = Annotated[int, Field(ge=0, le=MAX_BATCH)]
_PrefetchBatches = Annotated[int, Field(ge=0, le=1024)]
_FactoryPath = Annotated[str | None, AfterValidator(_factory_path)]
_Column = Annotated[str, Field(min_length=1, max_length=256)]


def _distinct_columns(value: str | list[str] | None) -> str | list[str] | None:
    if isinstance(value, list) and len(set(value)) != len(value):
        raise ValueError(f"names a column twice: {value}")
    return value


_Target = Annotated[
    _Column | Annotated[list[_Column], Field(min_length=1, max_length=MAX_TARGET_COLUMNS)] | None,
    AfterValidator(_distinct_columns),
]


class DataConfig(Section):
    """The keys every source reads (how the training process loads and shuffles), and the base of
    each source's section.

    ``DataConfig(...)`` and ``DataConfig.model_validate(...)`` give the section of the source the
    keys name (``DataConfig(name="tokens", path=...)`` is a :class:`TokensData`), as the config's
    ``data`` does; a name no source has gives a bare DataConfig, which the config refuses and no
    builder builds (data/registry.py says so, naming the sources).
    """

    # Keys a source's section accepts without reading them, for configs that have always set them.
    unread: ClassVar[frozenset[str]] = frozenset()

    name: str
    shuffle: bool = True  # reshuffle every epoch (deterministic from seed and epoch)
    num_workers: Annotated[int, Field(ge=0, le=1024)] = 0  # loader processes per training process
    pin_memory: bool | None = None  # None: on with GPUs

    def __new__(cls, *args: Any, **data: Any) -> DataConfig:
        chosen = _section_class(data) if cls is DataConfig else cls
        return super().__new__(chosen)

    def __init__(self, **data: Any) -> None:  # any source's keys: __new__ chose the section's class
        super().__init__(**data)

    @property
    def float_targets(self) -> bool | None:
        """Whether the samples' targets are floats (``model.task: regression``); None where that is
        known only once the data is built (a factory's)."""
        return False

    @classmethod
    def model_validate(cls, obj: Any, **options: Any) -> Self:
        chosen = _section_class(obj) if cls is DataConfig else cls
        if chosen is not cls:
            return cast(Self, chosen.model_validate(obj, **options))
        return super().model_validate(obj, **options)

    @model_validator(mode="before")
    @classmethod
    def _whole_section(cls, data: Any) -> Any:
        """An older run's resolved config lists every key of the one section there was, whatever
        the source read; this source keeps its own (the others were ignored then, too)."""
        if isinstance(data, Mapping) and data.keys() >= WHOLE_SECTION_KEYS:
            return {key: value for key, value in data.items() if key in cls.model_fields}
        return data


class SyntheticData(DataConfig):
    """``synthetic``: generated, learnable samples (data/synthetic.py), images or token sequences."""

    name: Literal["synthetic"] = "synthetic"
    # regression: float inputs of input_shape, one float target (a linear function of them plus noise)
    kind: Literal["image", "tokens", "regression"] = "image"
    input_shape: _InputShape = Field(default_factory=lambda: [3, 32, 32])  # image: C, H, W; regression: any
    num_classes: _NumClasses = 10  # image
    num_samples: _NumSamples = 1024  # train + validation
    seq_len: _SeqLen = 64  # tokens
    vocab_size: _VocabSize = 1000  # tokens
    val_fraction: _ValFraction = 0.2  # the last samples validate
    augment: _Augment = None

    @property
    def float_targets(self) -> bool:
        return self.kind == "regression"


class DigitsData(DataConfig):
    """``digits``: scikit-learn's 8x8 digits, with their fixed split (data/sources.py)."""

    # The split is fixed (1438 / 359) whatever val_fraction says; it is accepted (and bounded)
    # because configs have always been allowed to set it on the default source.
    unread = frozenset({"val_fraction"})

    name: Literal["digits"] = "digits"
    augment: _Augment = None
    val_fraction: _ValFraction = 0.2


class Cifar10Data(DataConfig):
    """``cifar10``: CIFAR-10 from its standard files at ``path``; the test batch validates."""

    name: Literal["cifar10"] = "cifar10"
    path: str | None = None
    augment: _Augment = None


class ImageFolderData(DataConfig):
    """``imagefolder``: ``path/train/<class>/*`` and optionally ``path/val/<class>/*`` (data/images.py)."""

    unread = frozenset({"val_path"})  # the split is path/val/; accepted as configs have set it

    name: Literal["imagefolder"] = "imagefolder"
    path: str | None = None
    val_fraction: _ValFraction = 0.2  # without a val/ folder
    image_size: Dim | None = None  # resize to this square size; None: the first image's
    augment: _Augment = None
    val_path: str | None = None


class TokensData(DataConfig):
    """``tokens``: windows of a corpus ``trainforge data prepare`` wrote (data/tokens.py)."""

    name: Literal["tokens"] = "tokens"
    path: str | None = None
    seq_len: _SeqLen = 64
    windows: Literal["random", "sequential"] = "random"  # training windows' offsets
    prepare: PrepareConfig | None = None  # write the corpus at path first when it is not there

    @model_validator(mode="after")
    def _prepare_needs_path(self) -> TokensData:
        if self.prepare is not None and self.path is None:
            raise ValueError(f"data.prepare needs {_PREPARE_NEEDS}")
        return self


class StreamedData(DataConfig):
    """The keys of the sources Ray Data streams (data/stream.py); their rows reach the workers as
    Ray Train's dataset shards, decoded in Ray Data's tasks rather than in loader processes."""

    path: str | None = None  # a directory, a glob or an s3:// prefix
    val_path: str | None = None  # validation files instead of val_fraction of path's
    val_fraction: _ValFraction = 0.2  # of the files
    columns: ColumnsConfig = Field(default_factory=ColumnsConfig)
    shuffle_buffer: _ShuffleBuffer = 1024  # rows per worker
    prefetch_batches: _PrefetchBatches = 2
    augment: _Augment = None

    @field_validator("num_workers")
    @classmethod
    def _no_loader_processes(cls, value: int) -> int:
        if value:
            raise ValueError(
                "streamed sources are decoded in Ray Data's tasks, not in loader processes: leave data.num_workers out"
            )
        return value


class TabularData(StreamedData):
    """The keys of the streamed sources whose rows are columns (parquet, jsonl): numeric inputs, and
    an integer class (``columns.target``) or float targets (``target``: one column or a list)."""

    input_shape: _InputShape | None = None  # numeric inputs are reshaped to it
    num_classes: _NumClasses = 10  # class targets; not read with target
    # float target column(s), read as float32: one name gives a target per row, a list k per row
    target: _Target = None

    @model_validator(mode="after")
    def _one_kind_of_target(self) -> Self:
        if self.target is None:
            return self
        if self.columns.target is not None:
            raise ValueError(
                "data.target names float target columns (regression) and data.columns.target an integer class "
                "column (classification): set one of them"
            )
        return self

    @property
    def float_targets(self) -> bool:
        return self.target is not None

    @property
    def target_columns(self) -> tuple[str, ...]:
        """``data.target`` as a tuple of column names (empty for class targets)."""
        if self.target is None:
            return ()
        return (self.target,) if isinstance(self.target, str) else tuple(self.target)


class ParquetData(TabularData):
    """``parquet``: rows of parquet files; the input a fixed-length list of numbers or image bytes."""

    name: Literal["parquet"] = "parquet"
    image_size: Dim | None = None  # encoded images are resized to this square size


class ImagesData(StreamedData):
    """``images``: image files, one folder per class (the classes are the folders)."""

    name: Literal["images"] = "images"
    image_size: Dim | None = None


class JsonlData(TabularData):
    """``jsonl``: one JSON object per line; the input a list of numbers."""

    name: Literal["jsonl"] = "jsonl"


class FactoryData(DataConfig):
    """``factory``: the user's ``data.factory`` (data/factory.py). The function is handed this
    section and may read any key, so it keeps every key the one section had (but ``prepare``)."""

    name: str = FACTORY_SOURCE  # factory, or left out (older resolved configs say digits)
    factory: _FactoryPath = None
    path: str | None = None
    val_path: str | None = None
    val_fraction: _ValFraction = 0.2  # held out when the factory returns no validation set
    columns: ColumnsConfig = Field(default_factory=ColumnsConfig)  # a Ray Dataset's columns
    augment: _Augment = None
    windows: Literal["random", "sequential"] = "random"
    shuffle_buffer: _ShuffleBuffer = 1024
    prefetch_batches: _PrefetchBatches = 2
    kind: Literal["image", "tokens"] = "image"
    input_shape: _InputShape = Field(default_factory=lambda: [3, 32, 32])
    num_classes: _NumClasses = 10
    num_samples: _NumSamples = 1024
    seq_len: _SeqLen = 64
    vocab_size: _VocabSize = 1000
    image_size: Dim | None = None

    @property
    def float_targets(self) -> None:
        return None  # the factory's samples say, once it is called


def _section_tag(value: Any) -> str | None:
    """The source a raw data section is for: ``factory`` when it names a ``data.factory``, else its
    ``data.name`` (``digits`` when left out); None for a name that is not a string."""
    if isinstance(value, DataConfig):
        return FACTORY_SOURCE if isinstance(value, FactoryData) else value.name
    if not isinstance(value, Mapping):
        return DEFAULT_SOURCE  # the member then says what a section must be
    if value.get("factory") is not None:
        return FACTORY_SOURCE
    name = value.get("name", DEFAULT_SOURCE)
    return name if isinstance(name, str) else None


def _factory_names(section: DataConfig) -> DataConfig:
    """With data.factory, data.name is left out or ``factory`` (``digits`` was how older resolved
    configs wrote a left-out name; the driver's check refuses it when set by hand)."""
    if isinstance(section, FactoryData):
        if section.factory is None:
            raise ValueError(NEEDS_FACTORY)
        if section.name not in (FACTORY_SOURCE, DEFAULT_SOURCE):
            raise ValueError(factory_conflict_message(section.name, section.factory))
    return section


def float_targets_hint(section: DataConfig) -> str:
    """How ``section`` would give float targets (model.task regression), in a few words."""
    if isinstance(section, TabularData):
        return f"set data.target to the float column(s) of the {section.name} files"
    if isinstance(section, SyntheticData):
        return "set data.kind: regression"
    return (
        f"data.name {section.name} has class or token targets; use a parquet or jsonl source with data.target, "
        "synthetic data with data.kind: regression, or a data.factory whose targets are floats"
    )


def factory_conflict_message(name: str, factory: str | None) -> str:
    return (
        f"data.name {name!r} and data.factory {factory!r} both say where the data comes from: "
        "leave data.name out (or set it to factory) to train on the factory's data"
    )


DataSection = Annotated[
    Annotated[SyntheticData, Tag("synthetic")]
    | Annotated[DigitsData, Tag("digits")]
    | Annotated[Cifar10Data, Tag("cifar10")]
    | Annotated[ImageFolderData, Tag("imagefolder")]
    | Annotated[TokensData, Tag("tokens")]
    | Annotated[FactoryData, Tag("factory")]
    | Annotated[ParquetData, Tag("parquet")]
    | Annotated[ImagesData, Tag("images")]
    | Annotated[JsonlData, Tag("jsonl")],
    Discriminator(_section_tag),
    AfterValidator(_factory_names),
]
"""The config's ``data``: the section of the source ``data.name`` names."""

SECTIONS: dict[str, type[DataConfig]] = {
    get_args(member)[1].tag: get_args(member)[0] for member in get_args(get_args(DataSection)[0])
}
"""Every source's name and its section's class: the config's half of the data registry."""


def _section_class(value: Any) -> type[DataConfig]:
    """The section class for a raw data section; DataConfig itself for a name no source has."""
    return SECTIONS.get(_section_tag(value) or "", DataConfig)


def _is_streamed_section(section: type[DataConfig]) -> bool:
    return issubclass(section, StreamedData)


def unknown_source_message(name: object) -> str:
    """Says which names exist and, where one is close, which was probably meant."""
    close = difflib.get_close_matches(name, list(SECTIONS), n=1, cutoff=0.5) if isinstance(name, str) else []
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    in_memory = sorted(n for n, section in SECTIONS.items() if not _is_streamed_section(section))
    streamed = sorted(n for n, section in SECTIONS.items() if _is_streamed_section(section))
    return (
        f"unknown data.name {name!r}{hint}: choose one of {', '.join(in_memory)}, "
        f"or a streamed source: {', '.join(streamed)}"
    )


def foreign_key_message(key: str, source: str) -> str | None:
    """For a key the section of ``source`` does not have: which sources read it, or None when none
    does (then it is a plain unknown key). The factory's section, which keeps every key for the
    user's function, is not named, nor a section that only accepts the key (``unread``)."""
    if key == "prepare":
        needs = _PREPARE_NEEDS
    else:
        owners = sorted(
            name
            for name, section in SECTIONS.items()
            if key in section.model_fields and key not in section.unread and name != FACTORY_SOURCE
        )
        if not owners:
            return None
        needs = "data.name: " + (" or ".join([", ".join(owners[:-1]), owners[-1]]) if len(owners) > 1 else owners[0])
    return f"data.{key} needs {needs}; data.name {source} does not read it"
