"""The optimizer built from its config section; the LR multiplier of trainforge's own schedules."""

from __future__ import annotations

import difflib
import inspect
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
from torch import nn

from trainforge.config import OptimConfig, ScheduleConfig
from trainforge.config.factories import load_factory, one_line, raised_at
from trainforge.config.schema import OPTIMIZER_KEYS
from trainforge.errors import ConfigError
from trainforge.worker.params import check_globs, matching


def effective_lr(cfg: OptimConfig, global_batch: int) -> float:
    """The configured LR, scaled linearly with the global batch if asked (Goyal et al. 2017)."""
    if cfg.lr_scaling == "linear":
        return cfg.lr * global_batch / cfg.base_batch_size
    return cfg.lr


@dataclass(frozen=True)
class GroupSettings:
    """What the config sets for one of the optimizer's parameter groups."""

    lr: float | None  # an optim.param_groups entry's own (before lr_scaling); None: optim.lr
    weight_decay: float


def group_parameters(
    cfg: OptimConfig, named: Iterable[tuple[str, nn.Parameter]]
) -> list[tuple[GroupSettings, list[nn.Parameter]]]:
    """The optimizer's parameter groups, from the plain model's parameters by name; frozen ones are
    in none. First the parameters no ``optim.param_groups`` entry takes, then each entry's, in
    order: without entries the groups are what they always were, and group 0 is optim.lr's. An
    entry whose glob matches no name, or that takes no trainable parameter, is a ConfigError."""
    named = list(named)
    every_name = [name for name, _ in named]
    for number, entry in enumerate(cfg.param_groups):
        check_globs(f"optim.param_groups[{number}].params", entry.params, every_name)
    names = names_by_parameter(named)
    taken: dict[int | None, list[nn.Parameter]] = {None: [], **{i: [] for i in range(len(cfg.param_groups))}}
    for param in unique(p for _, p in named if p.requires_grad):
        taken[entry_of(cfg, names[id(param)])].append(param)
    groups: list[tuple[GroupSettings, list[nn.Parameter]]] = []
    for index, params in taken.items():
        if index is not None and not params:
            raise ConfigError(
                f"optim.param_groups[{index}].params: {cfg.param_groups[index].params} matches only parameters "
                "that are frozen (model.freeze) or that an earlier entry takes (a parameter goes to the first "
                "entry that matches)"
            )
        own = cfg.param_groups[index] if index is not None else None
        if own is not None and own.weight_decay is not None:
            parts = [params]
        else:  # weight decay on matrices and convolution kernels only, as is standard for biases and norms
            parts = [[p for p in params if p.ndim >= 2], [p for p in params if p.ndim < 2]]
        groups += [(settings_of(cfg, index, part), part) for part in parts if part]
    return groups


def names_by_parameter(named: Iterable[tuple[str, nn.Parameter]]) -> dict[int, list[str]]:
    """Every name of each parameter (a tied one has several), by the parameter's id."""
    names: dict[int, list[str]] = {}
    for name, param in named:
        names.setdefault(id(param), []).append(name)
    return names


def entry_of(cfg: OptimConfig, names: Sequence[str]) -> int | None:
    """The first ``optim.param_groups`` entry that matches one of a parameter's names; None: none does."""
    for index, entry in enumerate(cfg.param_groups):
        if matching(entry.params, names):
            return index
    return None


def settings_of(cfg: OptimConfig, entry: int | None, params: Sequence[nn.Parameter]) -> GroupSettings:
    """The settings of a group of ``entry``'s parameters: the entry's own, else the optimizer's
    (its weight decay on a group of matrices and kernels, none on biases and norms)."""
    own = cfg.param_groups[entry] if entry is not None else None
    if own is not None and own.weight_decay is not None:
        decay = own.weight_decay
    else:
        decay = cfg.weight_decay if any(p.ndim >= 2 for p in params) else 0.0
    return GroupSettings(own.lr if own is not None else None, decay)


def unique(params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
    """Each parameter once (a tied one has several names), in order."""
    return list({id(p): p for p in params}.values())


def group_lr(settings: GroupSettings, cfg: OptimConfig, lr: float) -> float:
    """A group's base LR: ``lr`` (optim.lr after lr_scaling), or the entry's own scaled the same way."""
    return lr if settings.lr is None else settings.lr * (lr / cfg.lr)


def build_optimizer(cfg: OptimConfig, model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """The optimizer over ``model``'s trainable parameters (``model``: the plain one, or one whose
    parameter names are the plain model's), grouped by ``group_parameters``; base LR ``lr``."""
    groups: list[dict[str, Any]] = []
    for settings, params in group_parameters(cfg, model.named_parameters(remove_duplicate=False)):
        group: dict[str, Any] = {"params": params, "weight_decay": settings.weight_decay}
        if settings.lr is not None:
            group["lr"] = group_lr(settings, cfg, lr)
        groups.append(group)
    kwargs = dict(cfg.kwargs)
    if cfg.factory is not None:
        return from_factory(cfg, groups, lr)
    if cfg.name == "sgd":
        nesterov = cfg.nesterov and cfg.momentum > 0
        return torch.optim.SGD(groups, lr=lr, momentum=cfg.momentum, nesterov=nesterov, **kwargs)
    if cfg.name == "adam":
        return torch.optim.Adam(groups, lr=lr, betas=cfg.betas, eps=cfg.eps, **kwargs)
    if cfg.name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=cfg.betas, eps=cfg.eps, **kwargs)
    optimizer_class: Any = check_optimizer(cfg)  # a subclass: lr is every torch.optim class's argument
    return cast(torch.optim.Optimizer, optimizer_class(groups, lr=lr, **kwargs))


def from_factory(cfg: OptimConfig, groups: list[dict[str, Any]], lr: float) -> torch.optim.Optimizer:
    """``optim.factory(param_groups, lr=..., **optim.kwargs)``: the user's optimizer over trainforge's
    parameter groups (their weight decay and per-group LRs set), or one line saying what it did."""
    assert cfg.factory is not None
    factory = load_factory(cfg.factory, "optim.factory", "a torch.optim.Optimizer", ConfigError)
    try:
        optimizer = factory(groups, lr=lr, **cfg.kwargs)
    except Exception as err:
        raise ConfigError(
            f"optim.factory {cfg.factory!r} raised {type(err).__name__}{raised_at(err)} when called with the parameter "
            f"groups, lr and optim.kwargs: {one_line(str(err))}"
        ) from err
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            f"optim.factory {cfg.factory!r} returned {type(optimizer).__name__}, expected a torch.optim.Optimizer "
            "(it gets the parameter groups, lr= and optim.kwargs)"
        )
    return optimizer


def optimizer_kind(cfg: OptimConfig) -> str:
    """What a checkpoint records of the optimizer that wrote the moments: its name, or the factory."""
    return cfg.factory if cfg.factory is not None else cfg.name


UNSUPPORTED = {"LBFGS": "it needs a closure that re-evaluates the loss", "SparseAdam": "it takes sparse gradients only"}


def check_optimizer(cfg: OptimConfig) -> type[torch.optim.Optimizer]:
    """The optimizer class ``optim.name`` names (trainforge's sgd, adam and adamw, or any
    ``torch.optim`` class by its name), with ``optim.kwargs`` checked against its arguments: one
    line naming what exists, before Ray starts (driver/run.preflight) and on every worker. With
    ``optim.factory`` the base class: the factory is the user's, imported where it runs."""
    if cfg.factory is not None:
        return torch.optim.Optimizer
    own = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}
    found = own.get(cfg.name) or getattr(torch.optim, cfg.name, None)
    if not (isinstance(found, type) and issubclass(found, torch.optim.Optimizer)):
        names = optimizer_names()
        by_lower = {name.lower(): name for name in names}
        close = difflib.get_close_matches(cfg.name.lower(), list(by_lower), n=1, cutoff=0.6)
        hint = f"; did you mean {by_lower[close[0]]!r}?" if close else ""
        raise ConfigError(
            f"optim.name {cfg.name!r} is not a torch.optim optimizer{hint} (one of sgd, adam, adamw, or a torch.optim "
            f"class: {', '.join(names)})"
        )
    if found.__name__ in UNSUPPORTED:
        raise ConfigError(f"optim.name {cfg.name!r} is not supported: {UNSUPPORTED[found.__name__]}")
    parameters = inspect.signature(found.__init__).parameters
    takes = [name for name in parameters if name not in ("self", "params", "lr")]
    unknown = sorted(set(cfg.kwargs) - set(takes))
    if unknown and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        raise ConfigError(f"optim.kwargs {unknown} are not arguments of torch.optim.{found.__name__}: it takes {takes}")
    return found


def optimizer_names() -> list[str]:
    """torch.optim's optimizer classes that trainforge can step, by name."""
    classes = (getattr(torch.optim, name) for name in dir(torch.optim))
    return sorted(
        cls.__name__
        for cls in classes
        if isinstance(cls, type)
        and issubclass(cls, torch.optim.Optimizer)
        and cls is not torch.optim.Optimizer
        and cls.__name__ not in UNSUPPORTED
    )


def lr_multiplier(cfg: ScheduleConfig, total_steps: int) -> Callable[[int], float]:
    """step -> factor on the base LR: linear warmup, then the named decay."""
    decay_steps = max(1, total_steps - cfg.warmup_steps)

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
        if cfg.name == "constant":
            return 1.0
        if cfg.name == "step":
            return float(cfg.gamma ** ((step - cfg.warmup_steps) // cfg.step_size))
        if cfg.name == "cosine":
            return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * (1 - progress)

    return factor


def hyperparameters_differ(saved: dict, cfg_optim: OptimConfig, cfg_schedule: ScheduleConfig) -> bool:
    """Whether a checkpoint's config (``saved``, a config dict) set other optimizer or schedule
    values than this run's: then restoring the optimizer and schedule state brought them back.
    A key the checkpoint's config lacks (written before the key existed) had its default."""
    mine = {"optim": cfg_optim, "schedule": cfg_schedule}
    for section, values in mine.items():
        theirs = saved.get(section)
        if not isinstance(theirs, dict):
            return True
        if {**type(values)().model_dump(mode="json"), **theirs} != values.model_dump(mode="json"):
            return True
    return False


class Rebases(Protocol):
    """An LR schedule whose base LRs can be replaced where it stands (worker/schedule.LRSchedule)."""

    def rebase(self, initial_lrs: Sequence[float]) -> None: ...


def apply_hyperparameters(
    optimizer: torch.optim.Optimizer,
    scheduler: Rebases,
    cfg: OptimConfig,
    lr: float,
    names: Mapping[int, Sequence[str]] | None = None,
) -> None:
    """Put this run's optimizer hyperparameters into a restored optimizer and schedule.

    ``load_state_dict`` restores the param groups (lr, initial_lr, weight decay, momentum, betas)
    and the schedule's base LRs of the run that saved the checkpoint. A run that starts from
    another run's checkpoint with its own values (a PBT exploit, a fine-tune) keeps the restored
    weights, moments and step count, but trains with its own values: base LR ``lr`` scaled by its
    own schedule at the restored step, or where ``optim.param_groups`` sets a group's own, that
    (``names``: each parameter's names by its id, to match the entries' globs).
    """
    initial_lrs = []
    extra = OPTIMIZER_KEYS.get(cfg.name, ())
    names = names or {}
    for group in optimizer.param_groups:
        first = next(iter(group["params"]), None)
        own = settings_of(cfg, entry_of(cfg, names.get(id(first), ())), group["params"])
        initial_lrs.append(group_lr(own, cfg, lr))
        group["weight_decay"] = own.weight_decay
        for key in extra:
            if key == "nesterov":
                group[key] = cfg.nesterov and cfg.momentum > 0
            elif key == "betas":
                group[key] = tuple(cfg.betas)
            else:
                group[key] = getattr(cfg, key)
        for key, value in cfg.kwargs.items():  # a torch.optim class's own arguments, as its groups hold them
            if key in group:
                group[key] = tuple(value) if isinstance(value, list) else value
    scheduler.rebase(initial_lrs)  # each group's own base LR, the schedule where it stands
