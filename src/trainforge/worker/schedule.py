"""The LR schedule: trainforge's own (constant, step, cosine, linear: a ``LambdaLR`` over optimizer
steps) or any ``torch.optim.lr_scheduler`` class by its name, behind one :class:`LRSchedule` that the
loop tells what happened (an optimizer step, an epoch's end, a validation) and that decides whether
its scheduler steps.

A torch class runs after the warm-up (``schedule.warmup_steps`` / ``warmup_epochs``): during it the
LR rises linearly to the class's starting LR and the class is not stepped; its clock (steps or
epochs, ``schedule.interval``) starts once the warm-up is over, as torch's ``SequentialLR`` starts
its second scheduler. ``ReduceLROnPlateau`` steps after each validation with the value of
``schedule.monitor``, which validation all-reduces: every rank reduces at the same validation.
"""

from __future__ import annotations

import difflib
import inspect
import math
from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR, LRScheduler, ReduceLROnPlateau

from trainforge.config import OptimConfig, ScheduleConfig
from trainforge.config.factories import one_line
from trainforge.config.schema import SCHEDULES
from trainforge.errors import ConfigError
from trainforge.worker.optim import build_optimizer, lr_multiplier

REFUSED = {
    "LambdaLR": "it takes Python functions (lr_lambda); use a named schedule or another class",
    "MultiplicativeLR": "it takes a Python function (lr_lambda)",
    "SequentialLR": "it takes other schedulers; a warm-up in front is schedule.warmup_steps or warmup_epochs",
    "ChainedScheduler": "it takes other schedulers",
}
OWN_ARGUMENTS = ("self", "optimizer", "last_epoch", "verbose")  # trainforge's: the optimizer and the position
# Classes whose LRs come from schedule.kwargs, not optim.lr (a changed optim.lr does not move them).
LR_FROM_KWARGS = {"OneCycleLR": "max_lr", "CyclicLR": "base_lr and max_lr"}


def scheduler_names() -> list[str]:
    """The torch.optim.lr_scheduler classes trainforge can build by name."""
    module = torch.optim.lr_scheduler
    classes = (getattr(module, name) for name in dir(module))
    return sorted(
        cls.__name__
        for cls in classes
        if isinstance(cls, type)
        and issubclass(cls, LRScheduler)
        and not cls.__name__.startswith("_")
        and cls is not LRScheduler
        and cls.__name__ not in REFUSED
    )


def scheduler_class(name: str) -> type[LRScheduler] | None:
    """The torch class ``schedule.name`` names; None for trainforge's own; a ConfigError naming the
    closest name for anything else."""
    if name in SCHEDULES:
        return None
    found = None if name.startswith("_") else getattr(torch.optim.lr_scheduler, name, None)
    if name in REFUSED:
        raise ConfigError(f"schedule.name {name!r} is not supported: {REFUSED[name]}")
    if not (isinstance(found, type) and issubclass(found, LRScheduler)) or found is LRScheduler:
        names = [*SCHEDULES, *scheduler_names()]
        by_lower = {known.lower(): known for known in names}
        close = difflib.get_close_matches(name.lower(), list(by_lower), n=1, cutoff=0.6)
        hint = f"; did you mean {by_lower[close[0]]!r}?" if close else ""
        raise ConfigError(
            f"schedule.name {name!r} is not an LR schedule{hint} (one of constant, step, cosine, linear, or a "
            f"torch.optim.lr_scheduler class: {', '.join(scheduler_names())})"
        )
    return found


def check_schedule(cfg: ScheduleConfig, optim: OptimConfig | None = None) -> type[LRScheduler] | None:
    """``schedule.name`` and ``schedule.kwargs`` checked against the class's arguments (one line
    naming the closest), before Ray starts (driver/run.preflight) and on every worker. With
    ``optim`` (not a factory's), the class is also built once over a one-layer model with that
    optimizer, so what its constructor refuses (a wrong type, no momentum to cycle) fails here."""
    found = scheduler_class(cfg.name)
    if found is None:
        return None
    parameters = inspect.signature(found.__init__).parameters
    takes = [name for name in parameters if name not in OWN_ARGUMENTS]
    ours = sorted(set(cfg.kwargs) & set(OWN_ARGUMENTS))
    if ours:
        raise ConfigError(f"schedule.kwargs {ours}: trainforge passes the optimizer and restores the position itself")
    for key in sorted(set(cfg.kwargs) - set(takes)):
        close = difflib.get_close_matches(key, takes, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(
            f"schedule.kwargs {key!r} is not an argument of torch.optim.lr_scheduler.{found.__name__}{hint} "
            f"(it takes {', '.join(takes)})"
        )
    filled = filled_arguments(found.__name__, cfg.kwargs, 10)
    needed = [
        name
        for name in takes
        if parameters[name].default is inspect.Parameter.empty and name not in cfg.kwargs and name not in filled
    ]
    if needed:
        raise ConfigError(f"schedule.kwargs needs {', '.join(needed)} for torch.optim.lr_scheduler.{found.__name__}")
    if optim is not None and optim.factory is None:
        try:
            probe = build_optimizer(optim.model_copy(update={"param_groups": []}), nn.Linear(2, 2), optim.lr)
        except Exception:  # the optimizer's own problem, said where it is built
            return found
        arguments = {**filled, **cfg.kwargs}
        try:
            found(probe, **arguments)
        except Exception as err:  # the class's own check of its arguments, in its words
            shown = ", ".join(f"{k}={v!r}" for k, v in cfg.kwargs.items())
            raise ConfigError(
                f"schedule.kwargs: torch.optim.lr_scheduler.{found.__name__}({shown}) with optim.name {optim.name} "
                f"raised {type(err).__name__}: {one_line(str(err))}"
            ) from None
    return found


def lr_search_problem(key: str, cfg: ScheduleConfig) -> str | None:
    """Why a search over ``key`` would change nothing under this schedule (OneCycleLR and CyclicLR
    take their LRs from schedule.kwargs, not optim.lr); None when it would."""
    if key == "optim.lr" and cfg.name in LR_FROM_KWARGS:
        return f"schedule.name {cfg.name} sets the LR from schedule.kwargs {LR_FROM_KWARGS[cfg.name]}: search those"
    return None


def filled_arguments(name: str, kwargs: Mapping[str, Any], intervals: int) -> dict[str, Any]:
    """A class's length left out of schedule.kwargs, filled with the run's: the steps or epochs
    (``intervals``) the class is stepped after the warm-up."""
    if name == "CosineAnnealingLR" and "T_max" not in kwargs:
        return {"T_max": intervals}
    if name == "OneCycleLR" and "total_steps" not in kwargs and "epochs" not in kwargs:
        return {"total_steps": intervals}
    return {}


def warmup_steps(cfg: ScheduleConfig, steps_per_epoch: int) -> int:
    """The warm-up in optimizer steps: schedule.warmup_steps, or warmup_epochs' worth of steps."""
    if cfg.warmup_epochs is not None:
        return round(cfg.warmup_epochs * steps_per_epoch)
    return cfg.warmup_steps


def intervals_after_warmup(cfg: ScheduleConfig, total_steps: int, steps_per_epoch: int) -> int:
    """How often a torch class is stepped in the run: after each optimizer step past the warm-up,
    or at each epoch end past it (at least once, for the classes that divide by it)."""
    warmup = warmup_steps(cfg, steps_per_epoch)
    if cfg.interval == "epoch":
        return max(1, total_steps // steps_per_epoch - warmup // steps_per_epoch)
    return max(1, total_steps - warmup)


def build_scheduler(
    cfg: ScheduleConfig, optimizer: torch.optim.Optimizer, total_steps: int, steps_per_epoch: int = 1
) -> LRSchedule:
    """The run's LR schedule over ``optimizer`` (its LRs set to the schedule's first)."""
    warmup = warmup_steps(cfg, steps_per_epoch)
    found = scheduler_class(cfg.name)
    if found is None:  # trainforge's own: the warm-up is in the multiplier, stepped per optimizer step
        own = cfg.model_copy(update={"warmup_steps": warmup, "warmup_epochs": None})
        return LRSchedule(LambdaLR(optimizer, lr_multiplier(own, total_steps)), optimizer)
    check_schedule(cfg)  # as build_optimizer checks optim.name: one line, not a TypeError, wherever it runs
    filled = filled_arguments(found.__name__, cfg.kwargs, intervals_after_warmup(cfg, total_steps, steps_per_epoch))
    scheduler = found(optimizer, **{**filled, **cfg.kwargs})
    return LRSchedule(scheduler, optimizer, warmup_steps=warmup, interval=cfg.interval, monitor=cfg.monitor)


def monitored(metrics: Mapping[str, float], name: str) -> float:
    """The value of ``name`` (``val/loss``; the console's ``val_loss`` also matches) in a
    validation's metrics; a ConfigError naming the ones there are when it has none."""
    if name in metrics:
        return metrics[name]
    slashed = name.replace("_", "/", 1)
    if "/" not in name and slashed in metrics:
        return metrics[slashed]
    raise ConfigError(
        f"schedule.monitor {name!r} is not a metric of this run's validation: it reports {', '.join(sorted(metrics))}"
    )


class LRSchedule:
    """A torch LR scheduler with trainforge's warm-up, interval and monitor around it.

    ``step()`` after each optimizer step, ``epoch_end()`` at the end of each epoch, ``validated()``
    after each validation; it steps its scheduler at the ones its config asks for, past the warm-up.
    """

    def __init__(
        self,
        scheduler: LRScheduler,
        optimizer: torch.optim.Optimizer,
        *,
        warmup_steps: int = 0,
        interval: str = "step",
        monitor: str | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.optimizer = optimizer
        self.warmup_steps = warmup_steps
        self.interval = interval
        self.monitor = monitor
        self.steps = 0  # optimizer steps taken
        for group in optimizer.param_groups:  # ReduceLROnPlateau keeps none: a changed optim.lr rebases on it
            group.setdefault("initial_lr", group["lr"])
        self._warm()

    @property
    def own(self) -> bool:
        """trainforge's own schedule (constant, step, cosine, linear), whose state is LambdaLR's."""
        return isinstance(self.scheduler, LambdaLR)

    @property
    def plateau(self) -> bool:
        return isinstance(self.scheduler, ReduceLROnPlateau)

    @property
    def past_warmup(self) -> bool:
        return self.steps > self.warmup_steps

    def step(self) -> None:
        """One optimizer step taken."""
        self.steps += 1
        if self.steps <= self.warmup_steps:
            self._warm()
        elif self.interval == "step" and not self.plateau:
            self.scheduler.step()

    def epoch_end(self) -> None:
        """An epoch ended (every rank at the same step)."""
        if self.interval == "epoch" and not self.plateau and self.past_warmup:
            self.scheduler.step()

    def validated(self, metrics: Mapping[str, float]) -> None:
        """A validation's metrics (all-reduced: the same on every rank)."""
        if not self.plateau or not metrics:
            return
        assert self.monitor is not None, "ReduceLROnPlateau is built with schedule.monitor"
        value = monitored(metrics, self.monitor)
        if self.past_warmup:
            cast(ReduceLROnPlateau, self.scheduler).step(value)

    def _warm(self) -> None:
        """The LR of the next step during the warm-up: the scheduler's own, times (steps + 1) / warm-up
        (at the warm-up's end the scheduler's own, whose clock starts then)."""
        if not self.warmup_steps:
            return
        factor = min(1.0, (self.steps + 1) / self.warmup_steps)
        for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr(), strict=True):
            group["lr"] = lr * factor

    def rebase(self, initial_lrs: Sequence[float]) -> None:
        """Each group's base LR set to ``initial_lrs`` (this run's, on a restored schedule): the
        schedule's LRs move with it, where it has come to stays. A class whose LRs come from
        schedule.kwargs (OneCycleLR, CyclicLR) keeps them."""
        groups = self.optimizer.param_groups
        if self.own:
            lambdas = getattr(self.scheduler, "lr_lambdas")  # noqa: B009 (LambdaLR's, untyped)
            factor = lambdas[0](self.scheduler.last_epoch) if self.scheduler.last_epoch >= 0 else 1.0
            for group, initial in zip(groups, initial_lrs, strict=True):
                group["initial_lr"] = initial
                group["lr"] = initial * factor
            self.scheduler.base_lrs = list(initial_lrs)  # each group's own
            self.scheduler._last_lr = [group["lr"] for group in groups]  # what get_last_lr() reports
            return
        if type(self.scheduler).__name__ in LR_FROM_KWARGS:
            return
        last = list(self.scheduler.get_last_lr())
        for index, (group, initial) in enumerate(zip(groups, initial_lrs, strict=True)):
            before = float(group["initial_lr"])
            last[index] = last[index] * initial / before if before > 0 else initial
            group["initial_lr"] = initial
            group["lr"] = last[index]
        if hasattr(self.scheduler, "base_lrs"):
            self.scheduler.base_lrs = list(initial_lrs)
        self.scheduler._last_lr = last
        self._warm()

    def state_dict(self) -> dict[str, Any]:
        """trainforge's own: LambdaLR's state (its functions are code, not state); a torch class:
        its name, the steps taken and its state_dict."""
        state = {k: v for k, v in self.scheduler.state_dict().items() if k != "lr_lambdas"}
        if self.own:
            return state
        return {"scheduler": type(self.scheduler).__name__, "steps": self.steps, "state": plain(state)}

    def load_state_dict(self, saved: Mapping[str, Any], step: int, *, keep_arguments: bool = False) -> str | None:
        """Back to a checkpoint's position (``step``: its global step). A checkpoint of another
        schedule leaves this one at its start, past any warm-up, and says so (the returned note).
        ``keep_arguments``: this run's config differs from the checkpoint's, so the values that are
        the class's arguments stay this run's."""
        groups = len(self.optimizer.param_groups)
        saved_name = saved.get("scheduler", "LambdaLR")
        name = type(self.scheduler).__name__
        if saved_name != name:
            self.steps = step
            if self.own:
                self._jump(step)
            return f"the checkpoint's schedule was {saved_name}; this run's {name} starts from its beginning at {step}"
        if self.own:
            if len(saved["base_lrs"]) != groups:
                raise ValueError(f"the schedule has {len(saved['base_lrs'])} parameter groups, this optimizer {groups}")
            self.scheduler.load_state_dict({**saved, "lr_lambdas": [None] * groups})
            self.steps = self.scheduler.last_epoch
            return None
        fresh = self.scheduler.state_dict()
        state = conform(saved["state"], fresh, name)
        if keep_arguments:
            for argument in inspect.signature(type(self.scheduler).__init__).parameters:
                for key in (argument, f"{argument}s"):  # min_lr -> min_lrs, max_lr -> max_lrs
                    if key in fresh and key not in ("last_epoch", "base_lrs"):
                        state[key] = fresh[key]
        self.scheduler.load_state_dict(state)
        self.steps = int(saved["steps"])
        lrs = self.scheduler.get_last_lr()
        if len(lrs) != groups:
            raise ValueError(f"the schedule has {len(lrs)} parameter groups, this optimizer {groups}")
        for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        self._warm()
        return None

    def _jump(self, step: int) -> None:
        """trainforge's own schedule at ``step`` (a checkpoint of another schedule was restored)."""
        lambdas = getattr(self.scheduler, "lr_lambdas")  # noqa: B009 (LambdaLR's, untyped)
        self.scheduler.last_epoch = step
        for group, base in zip(self.optimizer.param_groups, self.scheduler.base_lrs, strict=True):
            group["lr"] = base * lambdas[0](step)
        self.scheduler._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])


def plain(value: Any) -> Any:
    """A scheduler's state as JSON holds it: tuples as lists, a Counter's keys as strings."""
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def conform(saved: Any, fresh: Any, where: str) -> Any:
    """A checkpoint's scheduler state in the types of this run's fresh one (``fresh``): the same
    keys, the same kinds of value (a number for a number), a Counter's integer keys back, lists
    per parameter group as long as this run's. A ValueError says where it differs."""
    if isinstance(fresh, Mapping):
        if not isinstance(saved, Mapping):
            raise ValueError(f"schedule state {where}: {type(saved).__name__} where a table goes")
        if all(isinstance(k, str) for k in fresh) and set(saved) != set(fresh):
            raise ValueError(f"schedule state {where}: keys {sorted(saved)}, this run's scheduler has {sorted(fresh)}")
        keyed = {(int(k) if not all(isinstance(f, str) for f in fresh) else k): v for k, v in saved.items()}
        table = {k: conform(v, fresh.get(k), f"{where}.{k}") for k, v in keyed.items()}
        return type(fresh)(table) if isinstance(fresh, dict) else table  # a dict, or MultiStepLR's Counter
    if isinstance(fresh, (list, tuple)):
        if not isinstance(saved, list):
            raise ValueError(f"schedule state {where}: {type(saved).__name__} where a list goes")
        if len(saved) != len(fresh):  # one per parameter group, or per phase: as many as this run's
            raise ValueError(f"schedule state {where}: {len(saved)} values, this run's scheduler has {len(fresh)}")
        items = [conform(v, fresh[i] if i < len(fresh) else None, f"{where}[{i}]") for i, v in enumerate(saved)]
        return type(fresh)(items)
    if fresh is None or saved is None:
        return saved
    for kind in (bool, str):
        if isinstance(fresh, kind) != isinstance(saved, kind):
            raise ValueError(f"schedule state {where}: {saved!r} where a {type(fresh).__name__} goes")
    if isinstance(fresh, (int, float)) and not isinstance(saved, (int, float)):
        raise ValueError(f"schedule state {where}: {saved!r} where a number goes")
    if isinstance(saved, float) and math.isnan(saved) and not (isinstance(fresh, float) and math.isnan(fresh)):
        raise ValueError(f"schedule state {where}: NaN")
    return saved
