"""Parameters chosen by name: ``model.freeze`` and the matching behind ``optim.param_groups``.

Names are the plain model's (``named_parameters()`` before any DDP or FSDP wrapping; the wrappers
keep them), matched by fnmatch-style globs, case-sensitive: ``*`` also crosses dots, so
``encoder.*`` is every parameter under ``encoder``. A glob that matches no name is a mistake (a
typo, another model's names), said in one line with some names the model does have.

Freezing sets ``requires_grad=False`` on the plain model before the parallel plan wraps it: DDP
then leaves those parameters out of its gradient buckets, FSDP2 shards them with the rest and
never gives them a gradient, and the optimizer is built over trainable parameters only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from fnmatch import fnmatchcase

from torch import nn

from trainforge.errors import ConfigError
from trainforge.protocol import ParameterCounts

EXAMPLES = 4  # names an error message shows


def named_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Every name of every parameter, tied ones under each of their names (a glob may name either)."""
    return list(model.named_parameters(remove_duplicate=False))


def matching(globs: Sequence[str], names: Iterable[str]) -> list[str]:
    """The names any of ``globs`` matches, in the model's order."""
    return [name for name in names if any(fnmatchcase(name, glob) for glob in globs)]


def check_globs(key: str, globs: Sequence[str], names: Sequence[str]) -> None:
    """Refuse a glob of ``key`` that matches none of ``names``, naming a few that exist."""
    for glob in globs:
        if not any(fnmatchcase(name, glob) for name in names):
            raise ConfigError(f"{key}: {glob!r} matches no parameter of the model ({some_names(names)})")


def some_names(names: Sequence[str]) -> str:
    """A few of the model's names, from its first to its last (the input layers to the head)."""
    if len(names) <= EXAMPLES:
        return f"it has {', '.join(repr(name) for name in names)}"
    picked = sorted({round(i * (len(names) - 1) / (EXAMPLES - 1)) for i in range(EXAMPLES)})
    return f"it has {len(names)} names, such as {', '.join(repr(names[i]) for i in picked)}"


def freeze(model: nn.Module, globs: Sequence[str]) -> ParameterCounts:
    """Hold the parameters ``model.freeze`` names fixed; how many elements train and how many do not.

    Raises ConfigError for a glob that matches nothing, and when nothing would be left to train.
    """
    named = named_parameters(model)
    names = [name for name, _ in named]
    check_globs("model.freeze", globs, names)
    chosen = set(matching(globs, names))
    for name, param in named:
        if name in chosen:
            param.requires_grad_(False)
    counts = count_parameters(model)
    if globs and counts.trainable == 0:
        raise ConfigError(
            f"model.freeze {list(globs)} freezes every parameter of the model ({len(names)} names): leave some to train"
        )
    return counts


def count_parameters(model: nn.Module) -> ParameterCounts:
    """Elements of the model's parameters that train and that are frozen (a tied one counted once)."""
    trainable = frozen = 0
    for param in model.parameters():
        if param.requires_grad:
            trainable += param.numel()
        else:
            frozen += param.numel()
    return ParameterCounts(trainable=trainable, frozen=frozen)
