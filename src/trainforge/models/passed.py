"""Objects given to ``trainforge.fit(config, model=..., data=...)``, shipped to the workers.

The driver pickles each object once (cloudpickle: classes of ``__main__`` and of the user's own
modules by value, so a worker needs none of the caller's files) and the bytes travel in the run's
``Payload``. Every worker unpickles its own copy from the same bytes, so an instance starts from
its own weights, identical on every rank; a function or class is called on each worker after the
run seed is set, as a factory is. The config names these objects by two factories of this
module (``PASSED_MODEL``, ``PASSED_DATA``), so every path that builds a run's model or data reads
them the usual way. A process without them (a later re-run, ``export``) gets one line saying the
object has to be passed again.
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import os
import pickle
import sys
import types
from collections.abc import Callable, Iterator, Mapping
from itertools import chain
from pathlib import Path
from typing import Any

import cloudpickle
from torch import nn
from torch.utils.data import IterableDataset

from trainforge.config import Config, FactoryData, read_yaml
from trainforge.config.data import FACTORY_SOURCE
from trainforge.config.factories import PASSED_DATA, PASSED_MODEL, describe, library, passed_again, shown_kwargs
from trainforge.data.factory import UserData, is_ray_dataset, type_name
from trainforge.errors import DataError, ModelError, TrainforgeError
from trainforge.protocol import PassedObjects

log = logging.getLogger("trainforge")

__all__ = ["MAX_SHIPPED_BYTES", "PASSED_DATA", "PASSED_MODEL", "data", "installed", "model", "pack"]

# Every worker holds the pickled bytes and its own unpickled copy, Ray's object store one more: past
# 2 GiB that is memory a factory, which builds the model where it runs, does not spend.
MAX_SHIPPED_BYTES = 2 << 30
FACTORY_HINT = "build it on each worker instead with model.factory: 'package.module:function'"
DATA_HINT = "build it on each worker instead with data.factory: 'package.module:function'"

_current: PassedObjects | None = None  # this process's: the driver's during fit, a worker's during its run


def pack(model: Any = None, data: Any = None, *, limit: int = MAX_SHIPPED_BYTES) -> PassedObjects:
    """``model`` (an ``nn.Module``, or a function or class that builds one) and ``data`` (a
    map-style ``Dataset`` for training, or a ``UserData``) pickled for the workers; one-line
    ModelError / DataError for an object of another kind, one that cannot be pickled (naming the
    attribute that failed) or one over ``limit`` bytes."""
    model_bytes = data_bytes = None
    model_name = data_name = ""
    if model is not None:
        model_name = check_model(model, limit)
        model_bytes = dumps(model, f"model={model_name}", limit, FACTORY_HINT, ModelError)
    if data is not None:
        data_name = check_data(data)
        data_bytes = dumps(data, f"data={data_name}", limit, DATA_HINT, DataError)
    return PassedObjects(model_bytes, data_bytes, model_name, data_name)


def check_model(obj: Any, limit: int) -> str:
    """The model's name for messages (``Net``, ``make_net()``); a ModelError for what cannot train."""
    if isinstance(obj, nn.Module):
        name = type(obj).__qualname__
        tensors = list(chain(obj.parameters(), obj.buffers()))
        size = sum(t.numel() * t.element_size() for t in tensors)
        if size > limit:
            raise ModelError(too_large(f"model={name}", size, limit, "of parameters and buffers", FACTORY_HINT))
        if any(t.is_meta for t in tensors):
            raise ModelError(f"model={name} has parameters on the meta device (no weights to train); {FACTORY_HINT}")
        placed = sorted({str(t.device) for t in tensors if t.device.type != "cpu"})
        if placed:
            # Unpickled, such tensors would land on that device of every process (the driver's too).
            raise ModelError(
                f"model={name} has tensors on {', '.join(placed)}; pass it on the CPU (model.cpu()): "
                "each worker moves its own copy to its device"
            )
        return name
    if callable(obj):
        return f"{getattr(obj, '__name__', type(obj).__name__)}()"
    raise ModelError(f"model= takes a torch.nn.Module, or a function or class that builds one; got {type_name(obj)}")


def check_data(obj: Any) -> str:
    """The data's name for messages; a DataError for what is not a map-style set or a UserData."""
    sets = [obj.train, obj.val, *([obj.test] if hasattr(obj, "test") else [])] if isinstance(obj, UserData) else [obj]
    for dataset in sets:
        if dataset is None:
            continue
        if is_ray_dataset(dataset):
            raise DataError(
                "data= takes map-style sets; a ray.data.Dataset is read where it is built: return it from "
                "data.factory: 'package.module:function'"
            )
        if isinstance(dataset, IterableDataset) or not (
            hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")
        ):
            raise DataError(
                f"data= takes a map-style torch Dataset of (input, target) pairs (__len__ and __getitem__) or a "
                f"trainforge.data.UserData(train=..., val=...); got {type_name(dataset)}"
            )
    return f"UserData({type_name(obj.train)})" if isinstance(obj, UserData) else type_name(obj)


def dumps(obj: Any, what: str, limit: int, hint: str, error: type[TrainforgeError]) -> bytes:
    """``obj`` pickled as the workers will read it, or one line naming what could not be pickled."""
    with own_modules_by_value():
        try:
            blob = cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as err:
            where = first_unpicklable(obj, what.partition("=")[0])
            raise error(f"{what} cannot be shipped to the workers: {where or describe(err)}; {hint}") from err
    if len(blob) > limit:
        raise error(too_large(what, len(blob), limit, "pickled", hint))
    return blob


def too_large(what: str, size: int, limit: int, measure: str, hint: str) -> str:
    return f"{what} is {gib(size)} {measure}, over the {gib(limit)} an object is shipped to the workers with; {hint}"


def gib(size: int) -> str:
    return f"{size / (1 << 30):.2f} GiB" if size >= 1 << 28 else f"{size / (1 << 20):.1f} MiB"


@contextlib.contextmanager
def own_modules_by_value() -> Iterator[None]:
    """cloudpickle pickles classes and functions of the user's own modules (not trainforge's, the
    standard library's or an installed package's) by value while this lasts: the workers of a
    cluster, or of a script run from another directory, may not import them by name."""
    registered = []
    already = cloudpickle.list_registry_pickle_by_value()
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if name == "__main__" or name in already or not isinstance(module, types.ModuleType):
            continue
        if not isinstance(path, str) or library(os.path.realpath(path)):
            continue
        with contextlib.suppress(ValueError):  # a module whose __name__ is not its sys.modules key
            cloudpickle.register_pickle_by_value(module)
            registered.append(module)
    try:
        yield
    finally:
        for module in registered:
            cloudpickle.unregister_pickle_by_value(module)


def first_unpicklable(obj: Any, path: str, depth: int = 0) -> str | None:
    """``path.attribute is a TYPE`` for the innermost attribute, item or submodule of ``obj`` that
    cannot be pickled; None when none is found (``obj`` itself fails)."""
    if depth > 8:
        return None
    for name, child in parts(obj, path):
        try:
            cloudpickle.dumps(child)
        except Exception as err:
            return first_unpicklable(child, name, depth + 1) or f"{name} is a {type_name(child)} ({describe(err)})"
    return None


def parts(obj: Any, path: str) -> Iterator[tuple[str, Any]]:
    """What ``obj`` holds, each with its path: a module's submodules, parameters and other
    attributes by name, a mapping's or a sequence's items, an object's attributes."""
    if isinstance(obj, Mapping):
        yield from ((f"{path}[{key!r}]", value) for key, value in list(obj.items()))
    elif isinstance(obj, list | tuple):
        yield from ((f"{path}[{index}]", value) for index, value in enumerate(obj))
    elif hasattr(obj, "__dict__") and not isinstance(obj, type | types.FunctionType | types.ModuleType):
        for key, value in list(vars(obj).items()):
            if isinstance(obj, nn.Module) and key in ("_modules", "_parameters", "_buffers"):
                yield from ((f"{path}.{name}", item) for name, item in value.items())
            else:
                yield f"{path}.{key}", value


# The keys of a data section every source reads, which a data= object keeps; the rest describe a source.
DATA_KEYS_KEPT = ("shuffle", "num_workers", "pin_memory", "val_fraction", "augment")


def config_naming(
    source: str | os.PathLike[str] | Mapping[str, Any] | Config, *, model: bool, data: bool
) -> str | os.PathLike[str] | Mapping[str, Any] | Config:
    """``source`` (a config file, dict or Config) with its model section naming :data:`PASSED_MODEL`
    (``model``) and its data section :data:`PASSED_DATA` (``data``): the objects take the place of
    ``model.name`` / ``model.factory`` and of the data source; a key that then goes unread is
    said once in the log."""
    if not model and not data:
        return source
    if isinstance(source, Config):
        raw = source.to_dict()
    elif isinstance(source, Mapping):
        raw = copy.deepcopy(dict(source))
    else:
        raw = read_yaml(Path(source))
    if model:
        section = dict(raw.get("model") or {})
        given = {key: section.pop(key, None) for key in ("name", "factory")}
        replaced = [f"model.{key}" for key, value in given.items() if value not in (None, PASSED_MODEL)]
        if replaced:
            log.warning("model= takes the place of the config's %s", ", ".join(replaced))
        raw["model"] = {**section, "factory": PASSED_MODEL}
    if data:
        section = dict(raw.get("data") or {})
        unread = sorted(
            f"data.{key}" for key in section if key not in DATA_KEYS_KEPT and key not in ("name", "factory")
        )
        if section.get("factory") not in (None, PASSED_DATA):
            unread.insert(0, "data.factory")
        if unread and section.get("factory") != PASSED_DATA:  # not a section written for data= before
            log.warning("data= takes the place of the config's data source: %s not read", ", ".join(unread))
        kept = {key: value for key, value in section.items() if key in DATA_KEYS_KEPT}
        raw["data"] = {**kept, "name": FACTORY_SOURCE, "factory": PASSED_DATA}
    return raw


@contextlib.contextmanager
def installed(passed: PassedObjects | None) -> Iterator[None]:
    """``passed`` as this process's objects while the block runs (the driver's fit)."""
    global _current
    before, _current = _current, passed
    try:
        yield
    finally:
        _current = before


def install(passed: PassedObjects | None) -> None:
    """``passed`` as this process's objects from now on (a worker's run; None: a run without them)."""
    global _current
    _current = passed


def current() -> PassedObjects | None:
    """This process's objects, to ship with the run's payload; None when fit was given none."""
    return _current


def loads(blob: bytes, what: str, error: type[TrainforgeError]) -> Any:
    try:
        return pickle.load(io.BytesIO(blob))
    except Exception as err:
        raise error(
            f"{what}: this worker could not unpickle it ({describe(err)}); a module it was pickled by name "
            "from must import on every worker"
        ) from err


def model(**kwargs: Any) -> nn.Module:
    """The factory ``PASSED_MODEL`` names: a fresh copy of the instance given to fit (from the same
    bytes on every rank), or what the function or class given returns when called with ``model.kwargs``."""
    if _current is None or _current.model is None:
        raise ModelError(passed_again("model.factory", PASSED_MODEL))
    what = f"model={_current.model_name}"
    obj = loads(_current.model, what, ModelError)
    if isinstance(obj, nn.Module):
        if kwargs:
            raise ModelError(
                f"model.kwargs {sorted(kwargs)} cannot be applied to {what}, an instance already built; "
                "leave them out, or pass the function or class that builds it"
            )
        return obj
    return call(obj, what, kwargs)


def call(build: Callable[..., Any], what: str, kwargs: Mapping[str, Any]) -> nn.Module:
    try:
        built = build(**kwargs)
    except TrainforgeError:
        raise
    except Exception as err:
        raise ModelError(f"{what} raised {describe(err)} when called with model.kwargs {shown_kwargs(kwargs)}") from err
    if not isinstance(built, nn.Module):
        raise ModelError(f"{what} returned {type_name(built)}, expected a torch.nn.Module")
    return built


def data(cfg: FactoryData, seed: int) -> Any:
    """The data factory ``PASSED_DATA`` names: this worker's copy of the data given to fit."""
    del cfg, seed  # the object is the data: the section's other keys (val_fraction) apply as for any factory
    if _current is None or _current.data is None:
        raise DataError(passed_again("data.factory", PASSED_DATA))
    return loads(_current.data, f"data={_current.data_name}", DataError)
