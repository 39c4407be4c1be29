"""The user's own code named in the config as ``"package.module:function"``.

``model.factory``, ``data.factory`` and ``parallel.tp_plan`` all resolve through
:func:`load_factory`. It lives below both ``models/`` and ``data/`` because ``models/`` already
reads ``data/`` (the DataSpec a model is shaped for): a loader in either would make the two a circle.
"""

from __future__ import annotations

import difflib
import importlib
import os
import sys
import sysconfig
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from trainforge.errors import ModelError, TrainforgeError
from trainforge.redact import redact_config, redact_text

PASSED_MODEL = "trainforge.models.passed:model"  # model.factory of a model given to trainforge.fit(model=...)
PASSED_DATA = "trainforge.models.passed:data"  # data.factory of data given to trainforge.fit(data=...)


def passed_again(key: str, value: str) -> str:
    """Why a run whose ``key`` is ``value`` (:data:`PASSED_MODEL`, :data:`PASSED_DATA`) cannot be
    built here: the object lived in the process that called ``trainforge.fit``, not in the run."""
    what = "model" if value == PASSED_MODEL else "data"
    return (
        f"{key}: {value} is the {what} object given to trainforge.fit({what}=...), which is not kept with "
        f"the run: call trainforge.fit(config, {what}=...) with it again (a re-run or resume of this run "
        f"directory), or set {key}: 'package.module:function' to build it by name"
    )


def import_from_working_directory() -> None:
    """Put the working directory first on ``sys.path``, as a local run's workers have it (their
    ``PYTHONPATH``): a factory's module beside the config imports in this process too."""
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)


PACKAGE = str(Path(__file__).resolve().parents[1]) + os.sep  # trainforge's own files
STDLIB = str(Path(sysconfig.get_paths()["stdlib"]).resolve()) + os.sep
INSTALLED = ("site-packages", "dist-packages")


def raised_at(err: BaseException) -> str:
    """`` at FILE:LINE (in FUNCTION)``: where ``err`` was raised in the user's own code (not
    trainforge, the standard library or an installed package); else the innermost frame outside
    trainforge (a library the user's model calls); empty when only trainforge's frames are there
    (a call with the wrong arguments)."""
    frames = traceback.extract_tb(err.__traceback__)
    paths = [os.path.realpath(frame.filename) for frame in frames]
    own = [f for f, p in zip(frames, paths, strict=True) if not library(p)]
    outside = [f for f, p in zip(frames, paths, strict=True) if not p.startswith(PACKAGE)]
    if not own and not outside:
        return ""
    frame = (own or outside)[-1]
    return f" at {frame.filename}:{frame.lineno} (in {frame.name})"


def library(path: str) -> bool:
    """Whether ``path`` is trainforge's, the standard library's or an installed package's file."""
    return (
        path.startswith((PACKAGE, STDLIB, sys.prefix + os.sep))
        or any(part in path.split(os.sep) for part in INSTALLED)
        or path.startswith("<")
    )


def one_line(text: str) -> str:
    return " ".join(text.split())


def describe(err: BaseException) -> str:
    """``Type: message`` on one line, credentials masked (``trainforge.redact``)."""
    return f"{type(err).__name__}: {redact_text(one_line(str(err)))}"


def shown_kwargs(kwargs: Mapping[str, Any]) -> str:
    """A factory's keyword arguments as a message quotes them: every value under a secret-named
    key masked, however deep (``{'hf_token': '***', 'hidden': 64}``)."""
    return str(redact_config(dict(kwargs)))


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
