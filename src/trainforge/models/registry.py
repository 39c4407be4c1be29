"""Turn a ``model`` config section into an ``nn.Module``: a built-in by name or a user factory.

Built-ins register themselves with :func:`register` when ``trainforge.models`` is imported; the
package ``__init__`` imports every builder module, so the table is complete before any lookup.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from trainforge.config import ModelConfig
from trainforge.config.factories import describe, load_factory, one_line, raised_at, shown_kwargs
from trainforge.data.spec import DataSpec
from trainforge.errors import ModelError, TrainforgeError

Builder = Callable[..., nn.Module]
"""``builder(spec, **kwargs) -> nn.Module``; raises ModelError when the data does not fit."""

BUILTIN_MODELS: dict[str, Builder] = {}
MASKED_LM_MODELS: dict[str, Builder] = {}  # the built-ins' forms for model.task masked_lm (an encoder)


def register(name: str, table: dict[str, Builder] = BUILTIN_MODELS) -> Callable[[Builder], Builder]:
    """Decorator adding a builder to ``table`` (:data:`BUILTIN_MODELS`) under ``name``."""

    def add(builder: Builder) -> Builder:
        if name in table:
            raise ValueError(f"built-in model {name!r} is registered twice")
        table[name] = builder
        return builder

    return add


def build_model(cfg: ModelConfig, spec: DataSpec) -> nn.Module:
    """Build the model the config names, shaped for ``spec`` (built-ins) or as the factory returns it."""
    if cfg.name is not None and cfg.task == "masked_lm":
        require_builtin(cfg.name)
        if cfg.name not in MASKED_LM_MODELS:
            raise ModelError(
                f"model.task masked_lm: built-in {cfg.name!r} has no masked-LM form; "
                f"use one of {', '.join(sorted(MASKED_LM_MODELS))} or your own model.factory"
            )
        return build_builtin(cfg.name, spec, cfg.kwargs, MASKED_LM_MODELS)
    if cfg.name is not None:
        return build_builtin(cfg.name, spec, cfg.kwargs)
    if cfg.factory is not None:
        return build_from_factory(cfg.factory, cfg.kwargs)
    raise ModelError("set model.name to a built-in or model.factory to 'package.module:function'")


def require_builtin(name: str) -> Builder:
    """The builder registered as ``name``, or a ModelError listing the built-ins and the closest one."""
    builder = BUILTIN_MODELS.get(name)
    if builder is None:
        known = ", ".join(sorted(BUILTIN_MODELS))
        close = difflib.get_close_matches(name, list(BUILTIN_MODELS), n=1, cutoff=0.5)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ModelError(
            f"unknown model.name {name!r}; {hint}built-ins are: {known} "
            "(or set model.factory: 'package.module:function' for your own model)"
        )
    return builder


def build_builtin(
    name: str, spec: DataSpec, kwargs: Mapping[str, Any], table: Mapping[str, Builder] | None = None
) -> nn.Module:
    """Look ``name`` up (in ``table``, or the built-ins), check ``kwargs`` against the builder, and
    turn any build failure into a ModelError."""
    builder = table[name] if table is not None else require_builtin(name)
    try:
        inspect.signature(builder).bind(spec, **kwargs)
    except TypeError:
        raise ModelError(
            f"model.kwargs {sorted(kwargs)} do not fit built-in {name!r}; it accepts: {accepted_kwargs(builder)}"
        ) from None
    try:
        return builder(spec, **kwargs)
    except ModelError:
        raise
    except Exception as err:
        raise ModelError(
            f"built-in {name!r} failed to build with model.kwargs {shown_kwargs(kwargs)}: {describe(err)}"
        ) from err


def accepted_kwargs(builder: Builder) -> str:
    names = [p.name for p in list(inspect.signature(builder).parameters.values())[1:] if p.kind is p.KEYWORD_ONLY]
    return ", ".join(names) or "none"


# ---------------------------------------------------------------------------------------------
# User factories: "package.module:function" (trainforge.config.factories), called with model.kwargs


def build_from_factory(path: str, kwargs: Mapping[str, Any]) -> nn.Module:
    """Call the user's factory with ``model.kwargs``; the returned module is used as is."""
    factory = load_factory(path)
    try:
        model = factory(**kwargs)
    except TrainforgeError:
        raise
    except Exception as err:
        raise ModelError(
            f"model.factory {path!r} raised {type(err).__name__}{raised_at(err)} when called with model.kwargs "
            f"{shown_kwargs(kwargs)}: {one_line(str(err))}"
        ) from err
    if not isinstance(model, nn.Module):
        raise ModelError(
            f"model.factory {path!r} returned {type(model).__module__}.{type(model).__qualname__}, "
            "expected a torch.nn.Module whose forward returns logits"
        )
    return model


# ---------------------------------------------------------------------------------------------
# Shared by the Hugging Face builders in vision.py and language.py


class HFLogits(nn.Module):
    """Wrap a transformers model so ``forward(x)`` returns the logits tensor instead of a ModelOutput."""

    def __init__(self, model: nn.Module, **call_kwargs: Any) -> None:
        super().__init__()
        self.model = model
        self.call_kwargs = call_kwargs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x, **self.call_kwargs).logits


def config_fields(config_cls: type) -> list[str]:
    """The model-specific fields of a transformers config class (its own ``__init__`` arguments)."""
    from transformers import PretrainedConfig

    generic = set(inspect.signature(PretrainedConfig).parameters)
    own = inspect.signature(config_cls).parameters.values()
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in own if p.name not in generic and p.kind in keyword]


def hf_config(
    name: str, config_cls: type, defaults: Mapping[str, Any], fixed: Mapping[str, Any], overrides: Mapping[str, Any]
) -> Any:
    """Build ``config_cls(**defaults | overrides | fixed)``, refusing overrides the class does not know.

    transformers configs store unknown keys silently, so a typo would otherwise do nothing; ``fixed``
    holds what trainforge decides (shapes from the data, the attention kernel) and may not be overridden.
    """
    from_data = sorted(set(overrides) & set(fixed))
    if from_data:
        raise ModelError(
            f"model.kwargs {from_data} for {name!r} are set by trainforge from the data section; remove them"
        )
    fields = config_fields(config_cls)
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        allowed = ", ".join(f for f in fields if f not in fixed)
        raise ModelError(f"model.kwargs {unknown} are not {config_cls.__name__} fields; {name!r} accepts: {allowed}")
    return config_cls(**{**defaults, **overrides, **fixed})
