"""The user's own code named in the config as ``"package.module:function"``.

``model.factory``, ``data.factory`` and ``parallel.tp_plan`` all resolve through
:func:`load_factory`. It lives below both ``models/`` and ``data/`` because ``models/`` already
reads ``data/`` (the DataSpec a model is shaped for): a loader in either would make the two a circle.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable
from typing import Any

from trainforge.errors import ModelError, TrainforgeError


def one_line(text: str) -> str:
    return " ".join(text.split())


def describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {one_line(str(err))}"


def load_factory(
    path: str,
    key: str = "model.factory",
    returns: str = "a torch.nn.Module",
    error: type[TrainforgeError] = ModelError,
) -> Callable[..., Any]:
    """Import ``package.module`` and walk the attribute path after the colon.

    Errors are ``error`` and name ``key``, so the user sees which config key to fix.
    """
    module_name, sep, attr_path = path.partition(":")
    if not sep or not module_name or not attr_path:
        raise error(f"{key} must look like 'package.module:function', got {path!r}")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as err:
        raise error(
            f"{key} {path!r}: cannot import module {module_name!r} ({one_line(str(err))}); "
            "check the spelling and that it is importable on every worker (PYTHONPATH or an installed package)"
        ) from err
    except Exception as err:
        raise error(f"{key} {path!r}: importing module {module_name!r} raised {describe(err)}") from err
    owner = module_name
    for part in attr_path.split("."):
        if not hasattr(target, part):
            public = [n for n in dir(target) if not n.startswith("_")]
            close = difflib.get_close_matches(part, public, n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise error(f"{key} {path!r}: {owner!r} has no attribute {part!r}{hint}")
        target = getattr(target, part)
        owner = f"{owner}.{part}"
    if not callable(target):
        raise error(
            f"{key} {path!r} is not callable (got a value of type {type(target).__name__}); "
            f"point it at a function that returns {returns}"
        )
    return target
