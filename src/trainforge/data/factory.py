"""The user's own data: ``data.factory: "package.module:function"`` (docs/data.md).

The contract, kept small so that any data a user can index fits:

* the function takes the data config and the run seed, ``def my_data(data: DataConfig, seed: int)``,
  or nothing, ``def my_data()``;
* it returns a :class:`UserData` (the training set, optionally a validation set and a held-out
  test set that only ``trainforge evaluate --split test`` reads, and what the model needs to
  know), or the training set alone;
* a training set is a map-style torch ``Dataset`` (``__len__`` and ``__getitem__``) of
  ``(input, target)`` pairs, tensors or numpy arrays, or a ``ray.data.Dataset``, which is handed
  on unchanged to the streaming path.

Every worker process calls the function, so it must build the same samples in the same order on
every rank: the distributed sampler splits the set by index. Map-style sets are wrapped so that the
first sample is checked at build time (a pair, its shape, dtypes, class range) and every sample
afterwards cheaply (shape and dtype, a class target's range): a wrong return is one line naming
``data.factory`` and what was expected, not a traceback deep in the model.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal, cast

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset, IterableDataset

from trainforge.config import DataConfig, FactoryData
from trainforge.config.data import DEFAULT_SOURCE, FACTORY_SOURCE, NEEDS_FACTORY, factory_conflict_message
from trainforge.config.factories import describe, load_factory
from trainforge.data.sources import Pair, PairDataset, Splits, split_indices, val_count
from trainforge.data.spec import DataSpec
from trainforge.errors import ConfigError, DataError, TrainforgeError

EXPECTED = (
    "a trainforge.data.UserData(train=..., val=..., num_classes=... or vocab_size=...), "
    "a map-style torch Dataset of (input, target) pairs or a ray.data.Dataset"
)
Kind = Literal["image", "tokens", "regression", "custom"]


@dataclass(frozen=True)
class UserData:
    """What a data factory returns: the data and the facts a model is shaped by.

    ``kind`` is ``image`` for classification (a float input of any shape, or integer token ids
    where ``vocab_size`` is given, and an integer class target),
    ``tokens`` for language modelling (integer input and target of ``seq_len`` tokens),
    ``regression`` for float targets (a float input of any shape, float targets of one shape,
    ``target_shape``: ``()`` one value per sample) and ``custom`` for samples of the data's own
    shape (dicts, tuples of any length) that a model with its own ``training_step`` reads
    (``model.task: custom``). Left out, ``kind``, ``input_shape``, ``seq_len`` and ``target_shape``
    are read from the first training sample and
    ``num_classes`` from the set's ``classes`` attribute where it has one; ``num_classes`` (image)
    or ``vocab_size`` (tokens) must otherwise be given (for custom data they are optional facts the
    model factory may read). ``collate``: how a batch is made of samples (default: torch's
    ``default_collate``, which stacks tensors and keeps dicts and tuples). ``mean``/``std`` are the
    per-channel statistics ``data.augment`` normalises with. A Ray Dataset is not read here: give
    its facts.
    """

    train: Any
    val: Any = None
    num_classes: int | None = None
    input_shape: tuple[int, ...] | None = None
    vocab_size: int | None = None
    seq_len: int | None = None
    kind: Kind | None = None
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    collate: Callable[[list[Any]], Any] | None = None
    target_shape: tuple[int, ...] | None = None
    test: Any = None  # held out: training never reads it; ``trainforge evaluate --split test`` does


def is_ray_dataset(obj: object) -> bool:
    """Whether ``obj`` is a ``ray.data.Dataset``; never imports Ray (such an object means it is loaded)."""
    module = sys.modules.get("ray.data")
    dataset_type = getattr(module, "Dataset", None)
    return isinstance(dataset_type, type) and isinstance(obj, dataset_type)


def source_name(cfg: DataConfig) -> str:
    """The source ``cfg`` is the section of: ``factory`` for a factory's (``data.factory`` set,
    ``data.name`` left out or ``factory``), else ``data.name``.

    A factory's section built in Python may still name another source or no factory (the config
    refuses both); that is a ConfigError here. ``digits`` passes: older resolved configs wrote a
    left-out name so (:func:`check_data_factory` refuses it where it was set by hand).
    """
    if not isinstance(cfg, FactoryData):
        return cfg.name
    if cfg.factory is None:
        raise ConfigError(NEEDS_FACTORY)
    if cfg.name not in (FACTORY_SOURCE, DEFAULT_SOURCE):
        raise ConfigError(factory_conflict_message(cfg.name, cfg.factory))
    return FACTORY_SOURCE


def check_data_factory(cfg: DataConfig, *, local: bool = True) -> None:
    """Driver-side checks before Ray starts: data.name and data.factory agree and, for a local Ray
    (whose workers share this Python path), the factory imports and takes (data, seed) or nothing.

    The factory is not called: the driver never builds the run's data.
    """
    source_name(cfg)
    if not isinstance(cfg, FactoryData):
        return
    if "name" in cfg.model_fields_set and cfg.name != FACTORY_SOURCE:
        raise ConfigError(factory_conflict_message(cfg.name, cfg.factory))
    if local:
        arguments_for(load(str(cfg.factory)), cfg, 0)


def load(path: str) -> Callable[..., Any]:
    return load_factory(path, key="data.factory", returns=EXPECTED, error=DataError)


def arguments_for(function: Callable[..., Any], cfg: FactoryData, seed: int) -> tuple[Any, ...]:
    """(data config, seed) when the function takes two arguments, () when it takes none."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return (cfg, seed)  # a builtin without a signature: call it the documented way
    for arguments in ((cfg, seed), ()):
        try:
            signature.bind(*arguments)
        except TypeError:
            continue
        return arguments
    raise DataError(
        f"data.factory {cfg.factory!r} takes {signature}; it must take (data, seed), "
        "the data config and the run seed, or no arguments"
    )


def load_user_data(cfg: FactoryData, seed: int) -> UserData:
    """Call the factory and check what it returned.

    A map-style training set comes back wrapped in checked views with every fact filled in (and,
    without a validation set, ``data.val_fraction`` of it split off by a fixed permutation, as for
    image folders); a Ray Dataset comes back unchanged.
    """
    path = str(cfg.factory)
    function = load(path)
    arguments = arguments_for(function, cfg, seed)
    try:
        result = function(*arguments)
    except TrainforgeError:
        raise
    except Exception as err:
        raise DataError(f"data.factory {path!r} raised {describe(err)}") from err
    user = as_user_data(result, path)
    if is_ray_dataset(user.train):
        if user.val is not None and not is_ray_dataset(user.val):
            raise DataError(
                f"data.factory {path!r}: val is {type_name(user.val)}, expected a ray.data.Dataset like train"
            )
        return user
    return checked_map_style(user, cfg, path)


def as_user_data(result: object, path: str) -> UserData:
    if isinstance(result, UserData):
        return result
    if is_ray_dataset(result) or isinstance(result, Dataset):
        return UserData(train=result)
    raise DataError(f"data.factory {path!r} returned {type_name(result)}, expected {EXPECTED}")


def type_name(value: object) -> str:
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def dataset_length(dataset: object, what: str, path: str) -> int:
    """The length of a map-style set, or a DataError saying what a map-style set is."""
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__getitem__"):
        raise DataError(
            f"data.factory {path!r}: {what} is {type_name(dataset)}, expected a map-style Dataset "
            "(__len__ and __getitem__) or a ray.data.Dataset"
        )
    try:
        length = len(dataset)  # type: ignore[arg-type]
    except TypeError:
        raise DataError(
            f"data.factory {path!r}: {what} ({type_name(dataset)}) has no __len__; a map-style Dataset needs one"
        ) from None
    if length == 0:
        raise DataError(f"data.factory {path!r}: {what} is empty")
    return length


# ---------------------------------------------------------------------------------------------
# Map-style sets: facts from the first sample, checked views


@dataclass(frozen=True)
class SampleRule:
    """What every sample of a factory's set must look like; converts it to a tensor pair."""

    path: str
    kind: Kind
    input_shape: tuple[int, ...]
    num_classes: int | None = None
    vocab_size: int | None = None
    target_shape: tuple[int, ...] | None = None

    def pair(self, item: object, where: str) -> Pair:
        """The item as (input, target) tensors, or a DataError naming the sample and what was expected."""
        inputs, target = split_pair(item, self.path, where)
        if tuple(inputs.shape) != self.input_shape:
            self.fail(where, f"an input of shape {tuple(inputs.shape)}", f"shape {self.input_shape}")
        if self.kind == "regression":
            if not inputs.is_floating_point():
                self.fail(where, f"a {dtype_name(inputs)} input", "a floating-point input")
            if not target.is_floating_point() or tuple(target.shape) != self.target_shape:
                self.fail(
                    where,
                    f"a {dtype_name(target)} target of shape {tuple(target.shape)}",
                    f"a float target of shape {self.target_shape}",
                )
            return (inputs.float() if inputs.dtype == torch.float64 else inputs), target.float()
        if self.kind == "image":
            # Classification: float inputs, or token ids (a sequence to classify) where vocab_size says so.
            if self.vocab_size is not None and not is_integer(inputs):
                self.fail(where, f"a {dtype_name(inputs)} input", "integer token ids (vocab_size is given)")
            if self.vocab_size is None and not inputs.is_floating_point():
                self.fail(
                    where,
                    f"a {dtype_name(inputs)} input",
                    "a floating-point input (e.g. x.float() / 255), or token ids with UserData(vocab_size=N)",
                )
            if target.ndim != 0 or not is_integer(target):
                self.fail(where, f"a {dtype_name(target)} target of shape {tuple(target.shape)}", "an integer class")
            label = int(target)
            if self.num_classes is not None and not 0 <= label < self.num_classes:
                self.fail(where, f"class {label}", f"a class in 0..{self.num_classes - 1} (num_classes)")
            if self.vocab_size is not None:
                return inputs.long(), target.long()
            return (inputs.float() if inputs.dtype == torch.float64 else inputs), target.long()
        if not is_integer(inputs) or not is_integer(target) or target.shape != inputs.shape:
            self.fail(
                where,
                f"a {dtype_name(inputs)} input and a {dtype_name(target)} target of shape {tuple(target.shape)}",
                f"integer token ids for both, each of shape {self.input_shape}",
            )
        return inputs.long(), target.long()

    def check_token_range(self, pair: Pair, where: str) -> None:
        """Token ids inside the vocabulary (on the first sample: a reduction over every token)."""
        if self.vocab_size is None:
            return
        tokens = pair[0] if self.kind == "image" else torch.stack(pair)  # a classified sequence: its input
        low, high = int(tokens.min()), int(tokens.max())
        if low < 0 or high >= self.vocab_size:
            self.fail(where, f"token ids {low}..{high}", f"ids in 0..{self.vocab_size - 1} (vocab_size)")

    def fail(self, where: str, got: str, expected: str) -> None:
        raise DataError(f"data.factory {self.path!r}: {where} has {got}, expected {expected}")


def dtype_name(tensor: Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def is_integer(tensor: Tensor) -> bool:
    return not tensor.is_floating_point() and not tensor.is_complex() and tensor.dtype != torch.bool


def as_tensor(value: object) -> Tensor | None:
    if isinstance(value, Tensor):
        return value
    if isinstance(value, np.ndarray | np.generic) or (isinstance(value, int | float) and not isinstance(value, bool)):
        return torch.as_tensor(value)
    return None


def split_pair(item: object, path: str, where: str) -> tuple[Tensor, Tensor]:
    if not isinstance(item, tuple | list) or len(item) != 2:
        raise DataError(
            f"data.factory {path!r}: {where} is {type_name(item)}, expected an (input, target) pair "
            "(samples of your own shape: return UserData(..., kind='custom') for a model.task custom model)"
        )
    inputs, target = as_tensor(item[0]), as_tensor(item[1])
    if inputs is None or target is None:
        raise DataError(
            f"data.factory {path!r}: {where} is ({type_name(item[0])}, {type_name(item[1])}), "
            "expected tensors or numpy arrays (a target may be an int)"
        )
    return inputs, target


class CheckedPairs(PairDataset):
    """A factory's map-style set (or the ``indices`` of it) whose samples pass ``rule``."""

    def __init__(self, dataset: Any, rule: SampleRule, what: str, indices: Tensor | None = None) -> None:
        self.dataset = dataset
        self.rule = rule
        self.what = what
        self.indices = indices.tolist() if indices is not None else None
        self.length = len(self.indices) if self.indices is not None else len(dataset)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> Pair:
        source = self.indices[index] if self.indices is not None else index
        return self.rule.pair(self.dataset[source], f"{self.what} sample {source}")


def sample_zero(dataset: Any, path: str, what: str) -> Any:
    try:
        return dataset[0]
    except TrainforgeError:
        raise
    except Exception as err:
        raise DataError(f"data.factory {path!r}: reading {what} sample 0 raised {describe(err)}") from err


def first_sample(dataset: Any, path: str, what: str) -> tuple[Tensor, Tensor]:
    return split_pair(sample_zero(dataset, path, what), path, f"{what} sample 0")


class Samples(Dataset[Any]):
    """A factory's map-style set of custom samples (or the ``indices`` of it), as they come, with
    the factory's ``collate``: the loaders batch it with that."""

    def __init__(self, dataset: Any, collate: Callable[[list[Any]], Any] | None, indices: Tensor | None = None):
        self.dataset = dataset
        self.collate = collate
        self.indices = indices.tolist() if indices is not None else None

    def __len__(self) -> int:
        return len(self.indices) if self.indices is not None else len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[self.indices[index] if self.indices is not None else index]


def custom_samples(user: UserData, cfg: FactoryData, path: str) -> UserData:
    """Custom samples: no (input, target) checks (the model's training_step reads them); the
    validation set given, or ``data.val_fraction`` split off as for the other kinds."""
    train, val = Samples(user.train, user.collate), None
    test = Samples(user.test, user.collate) if user.test is not None else None
    if test is not None:
        dataset_length(user.test, "test", path)
    if user.val is not None:
        dataset_length(user.val, "val", path)
        val = Samples(user.val, user.collate)
    elif cfg.val_fraction > 0:
        total = len(train)
        train_idx, val_idx = split_indices(total, val_count(total, cfg.val_fraction, f"data.factory {path!r}"))
        train, val = Samples(user.train, user.collate, train_idx), Samples(user.train, user.collate, val_idx)
    return replace(user, train=train, val=val, test=test, kind="custom", input_shape=tuple(user.input_shape or ()))


def infer_kind(inputs: Tensor, target: Tensor, *, classes: bool = False) -> Kind | None:
    """The kind the first sample shows; float targets are regression unless classes were declared."""
    if target.ndim == 0 and is_integer(target):
        return "image"
    if inputs.is_floating_point() and target.is_floating_point() and not classes:
        return "regression"
    if is_integer(inputs) and is_integer(target) and target.shape == inputs.shape and inputs.ndim == 1:
        return "tokens"
    return None


def checked_map_style(user: UserData, cfg: FactoryData, path: str) -> UserData:
    """``user`` with its sets wrapped in checked views and every fact filled in, or a DataError."""
    dataset_length(user.train, "train", path)
    if user.kind == "custom":
        return custom_samples(user, cfg, path)
    inputs, target = first_sample(user.train, path, "train")
    kind = user.kind or infer_kind(inputs, target, classes=user.num_classes is not None)
    if kind is None:
        classes = user.num_classes is not None and target.is_floating_point()
        raise DataError(
            f"data.factory {path!r}: train sample 0 is a {dtype_name(inputs)} input of shape {tuple(inputs.shape)} "
            f"and a {dtype_name(target)} target of shape {tuple(target.shape)}, expected a float input and an "
            "integer class (kind image), float targets (kind regression) or integer token ids of one shape "
            "(kind tokens)"
            + ("; num_classes says classes: for regression return UserData(kind='regression') without it" * classes)
        )
    shape = declared_shape(user, path) or tuple(inputs.shape)
    if kind == "regression":
        target_shape = tuple(user.target_shape) if user.target_shape is not None else tuple(target.shape)
        rule = SampleRule(path, kind, shape, target_shape=target_shape)
    elif kind == "tokens":
        if user.vocab_size is None:
            raise DataError(f"data.factory {path!r}: token data needs vocab_size; return UserData(..., vocab_size=N)")
        rule = SampleRule(path, kind, shape, vocab_size=user.vocab_size)
    else:
        num_classes = user.num_classes if user.num_classes is not None else classes_of(user.train)
        if num_classes is None or num_classes < 2:
            raise DataError(
                f"data.factory {path!r}: classification needs num_classes >= 2 (targets 0..num_classes-1); "
                "return UserData(..., num_classes=N)"
            )
        rule = SampleRule(path, kind, shape, num_classes=num_classes, vocab_size=user.vocab_size)
    first = rule.pair((inputs, target), "train sample 0")
    rule.check_token_range(first, "train sample 0")
    train = CheckedPairs(user.train, rule, "train")
    val: CheckedPairs | None = None
    if user.val is not None:
        dataset_length(user.val, "val", path)
        rule.check_token_range(rule.pair(first_sample(user.val, path, "val"), "val sample 0"), "val sample 0")
        val = CheckedPairs(user.val, rule, "val")
    elif cfg.val_fraction > 0:
        total = len(train)
        train_idx, val_idx = split_indices(total, val_count(total, cfg.val_fraction, f"data.factory {path!r}"))
        train = CheckedPairs(user.train, rule, "train", train_idx)
        val = CheckedPairs(user.train, rule, "train", val_idx)
    test: CheckedPairs | None = None
    if user.test is not None:
        dataset_length(user.test, "test", path)
        rule.check_token_range(rule.pair(first_sample(user.test, path, "test"), "test sample 0"), "test sample 0")
        test = CheckedPairs(user.test, rule, "test")
    seq_len = shape[0] if kind == "tokens" else None
    return replace(
        user,
        train=train,
        val=val,
        test=test,
        kind=kind,
        input_shape=shape,
        seq_len=seq_len,
        num_classes=rule.num_classes,
        target_shape=rule.target_shape,
    )


def declared_shape(user: UserData, path: str) -> tuple[int, ...] | None:
    """The input shape the factory declared (``input_shape``, or ``(seq_len,)`` for tokens), if any."""
    shape = tuple(user.input_shape) if user.input_shape is not None else None
    if user.seq_len is not None:
        if shape is not None and shape != (user.seq_len,):
            raise DataError(f"data.factory {path!r}: input_shape {shape} and seq_len {user.seq_len} disagree")
        shape = (user.seq_len,)
    return shape


def classes_of(dataset: Any) -> int | None:
    """``len(dataset.classes)``, the convention of torchvision's and many users' sets, if it has one."""
    classes = getattr(dataset, "classes", None)
    return len(classes) if isinstance(classes, list | tuple) else None


def user_data_spec(user: UserData, path: str) -> DataSpec:
    """The DataSpec a model is built from; for a Ray Dataset from the declared facts alone."""
    kind = user.kind or ("tokens" if user.vocab_size is not None else "image")
    if kind == "custom":
        return DataSpec(
            kind="custom",
            input_shape=tuple(user.input_shape or ()),
            num_classes=user.num_classes,
            vocab_size=user.vocab_size,
            seq_len=user.seq_len,
            train_size=len(user.train),
            val_size=len(user.val) if user.val is not None else 0,
        )
    shape = declared_shape(user, path)
    if kind == "regression":
        if is_ray_dataset(user.train):
            raise DataError(
                f"data.factory {path!r}: float targets from a ray.data.Dataset are not read; return map-style "
                "sets, or stream parquet or jsonl files with data.target"
            )
        return DataSpec(
            kind="image",
            input_shape=tuple(shape or ()),
            target_shape=tuple(user.target_shape or ()),
            train_size=len(user.train),
            val_size=len(user.val) if user.val is not None else 0,
        )
    needed = "vocab_size and seq_len" if kind == "tokens" else "num_classes and input_shape"
    facts = (user.vocab_size, shape) if kind == "tokens" else (user.num_classes, shape)
    if any(fact is None for fact in facts):
        raise DataError(f"data.factory {path!r}: {kind} data needs {needed}; return UserData(..., {needed})")
    sized = not is_ray_dataset(user.train)
    return DataSpec(
        kind=kind,
        input_shape=tuple(shape or ()),
        num_classes=user.num_classes if kind == "image" else None,
        vocab_size=user.vocab_size if kind == "tokens" else None,
        seq_len=(shape or (0,))[0] if kind == "tokens" else None,
        train_size=len(user.train) if sized else 0,
        val_size=len(user.val) if sized and user.val is not None else 0,
        pixel_mean=tuple(user.mean) if user.mean is not None else None,
        pixel_std=tuple(user.std) if user.std is not None else None,
    )


def build_factory(cfg: FactoryData, seed: int) -> Splits:
    """The map-style builder of ``data.factory``: the checked map-style sets and their DataSpec."""
    path = str(cfg.factory)
    user = load_user_data(cfg, seed)
    if is_ray_dataset(user.train):
        raise DataError(
            f"data.factory {path!r} returned a ray.data.Dataset, which only the streaming data path reads; "
            "this step needs a map-style torch Dataset"
        )
    return user.train, user.val, user_data_spec(user, path)


def factory_test_set(cfg: FactoryData, seed: int) -> PairDataset:
    """The factory's held-out ``UserData(test=...)``, checked as its training samples are (the
    factory is called again: training never built it)."""
    path = str(cfg.factory)
    user = load_user_data(cfg, seed)
    if user.test is None:
        raise DataError(f"data.factory {path!r} returned no test set: return UserData(..., test=...) to evaluate one")
    if is_ray_dataset(user.test) or is_ray_dataset(user.train):
        raise DataError(f"data.factory {path!r}: a test set is evaluated from a map-style Dataset, not a ray.data one")
    return cast(PairDataset, user.test)
