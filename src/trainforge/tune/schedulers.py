"""Search algorithms and trial schedulers built from the ``tune`` config section.

Every scheduler measures time in optimizer steps: the trials report ``step`` and it is Tune's
time attribute, so a grace period of 100 means 100 optimizer steps, whatever a step costs.
Scheduler parameters are checked here, by name, so a typo is a one-line error, not a silent default.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trainforge.config import Config
from trainforge.errors import ConfigError
from trainforge.tune.space import SearchSpace

TIME_ATTR = "step"
DEFAULT_TRIALS = 8


@dataclass(frozen=True)
class Param:
    """A scheduler parameter: its type, its default given the step budget, what values it takes."""

    kind: type
    default: Callable[[int], Any]
    valid: Callable[[Any], bool] = lambda value: value > 0
    allowed: str = "a positive number"


def _steps(fraction: int) -> Callable[[int], int]:
    return lambda max_t: max(1, max_t // fraction)


PARAMS: dict[str, dict[str, Param]] = {
    "none": {},
    "asha": {
        "max_t": Param(int, lambda max_t: max_t),
        "grace_period": Param(int, _steps(9)),
        "reduction_factor": Param(float, lambda max_t: 3.0, lambda v: v > 1, "a number > 1"),
        "brackets": Param(int, lambda max_t: 1),
    },
    "median": {
        "grace_period": Param(int, _steps(5)),
        "min_samples_required": Param(int, lambda max_t: 3),
    },
    "pbt": {
        "perturbation_interval": Param(int, _steps(5)),
        "burn_in_period": Param(int, lambda max_t: 0, lambda v: v >= 0, "a number >= 0"),
        "quantile_fraction": Param(float, lambda max_t: 0.25, lambda v: 0 < v <= 0.5, "in (0, 0.5]"),
        "resample_probability": Param(float, lambda max_t: 0.25, lambda v: 0 <= v <= 1, "in [0, 1]"),
        # True: every trial waits at each perturbation step for the others (PBT's synchronous mode).
        "synch": Param(bool, lambda max_t: False, lambda v: isinstance(v, bool), "true or false"),
    },
}


@dataclass(frozen=True)
class SearchSettings:
    """What the search runs: metric, trial count, step budget, and the scheduler's parameters."""

    metric: str
    mode: str
    search: str
    scheduler: str
    num_samples: int  # Tune's num_samples: trials, or repeats of the grid for search grid
    num_trials: int
    budget_steps: int | None  # each trial's train.max_steps, when set
    scheduler_params: dict[str, Any]
    seed: int
    checkpoint_every: int | None = None  # PBT: trials checkpoint at every perturbation step

    @property
    def enumerate_grid(self) -> bool:
        return self.search == "grid"


def default_metric(config: Config) -> str:
    """val/loss where the data has a validation split, else train/loss."""
    data = config.data
    if data.name in ("synthetic", "imagefolder") and data.val_fraction == 0:
        return "train/loss"
    return "val/loss"


def make_settings(config: Config, space: SearchSpace) -> SearchSettings:
    tune = config.tune
    if tune.search == "grid" and not space.has_grid:
        raise ConfigError("tune.search grid needs at least one {grid: [...]} domain in the space file")
    if tune.search == "grid":
        points = space.grid_points
        wanted = tune.num_trials or points
        if wanted % points:
            raise ConfigError(
                f"tune.num_trials {wanted}: search grid runs each of the {points} grid points the same number of "
                f"times, so num_trials must be a multiple of {points} (or unset)"
            )
        num_samples, num_trials = wanted // points, wanted
    else:
        num_samples = num_trials = tune.num_trials or DEFAULT_TRIALS
    if tune.scheduler == "pbt" and tune.search == "optuna":
        raise ConfigError("tune.scheduler pbt explores by mutating its own trials: use tune.search random or grid")
    budget = config.train.max_steps
    params = scheduler_params(tune.scheduler, tune.scheduler_params, budget)
    return SearchSettings(
        checkpoint_every=pbt_checkpoint_every(config, params) if tune.scheduler == "pbt" else None,
        metric=tune.metric or default_metric(config),
        mode=tune.mode,
        search=tune.search,
        scheduler=tune.scheduler,
        num_samples=num_samples,
        num_trials=num_trials,
        budget_steps=budget,
        scheduler_params=params,
        seed=config.seed,
    )


def pbt_checkpoint_every(config: Config, params: dict[str, Any]) -> int:
    """PBT hands a trial's checkpoint at a perturbation step to the trials it exploits, so trials
    save at every perturbation step: checkpoint.every_n_steps divides the interval (default: equals it)."""
    interval = int(params["perturbation_interval"])
    every = config.checkpoint.every_n_steps
    if every is None:
        return interval
    if interval % every:
        raise ConfigError(
            f"tune.scheduler_params.pbt.perturbation_interval {interval} must be a multiple of "
            f"checkpoint.every_n_steps {every}: PBT exploits the checkpoints taken at its perturbation steps"
        )
    return every


def scheduler_params(scheduler: str, given: dict[str, Any], budget: int | None) -> dict[str, Any]:
    """The chosen scheduler's parameters, defaulted from the step budget. ``given`` holds a section
    per scheduler (``{asha: {grace_period: 50}, pbt: {...}}``), so that switching scheduler (e.g.
    ``--scheduler none`` to compare) leaves the others' settings in the file; every section is checked."""
    for name, section in given.items():
        if name not in PARAMS or name == "none":
            options = [k for k in PARAMS if k != "none"]
            hint = difflib.get_close_matches(str(name), options, n=1)
            suggestion = f" — did you mean {hint[0]}?" if hint else ""
            raise ConfigError(
                f"tune.scheduler_params.{name}: not a scheduler{suggestion}; sections are {', '.join(options)}"
            )
        if not isinstance(section, dict):
            raise ConfigError(
                f"tune.scheduler_params.{name} must be a mapping of parameters, e.g. {{grace_period: 50}}"
            )
        if name != scheduler:
            check_params(name, section, budget or 1)
    chosen = given.get(scheduler, {})
    max_t = chosen.get("max_t", budget)
    if PARAMS[scheduler] and max_t is None:
        raise ConfigError(
            f"tune.scheduler {scheduler} needs a step budget: set train.max_steps (or tune.scheduler_params.asha.max_t)"
        )
    return check_params(scheduler, chosen, int(max_t or 0))


def check_params(scheduler: str, given: dict[str, Any], max_t: int) -> dict[str, Any]:
    """One scheduler's parameters: the given ones checked by name and value, the rest defaulted."""
    known = PARAMS[scheduler]
    where = f"tune.scheduler_params.{scheduler}"
    for name in given:
        if name not in known:
            hint = [k for k in known if k.startswith(name)] or difflib.get_close_matches(name, list(known), n=1)
            allowed = f" — did you mean {hint[0]}?" if hint else f"; {scheduler} takes {', '.join(known)}"
            raise ConfigError(f"{where}.{name} is not a parameter of {scheduler}{allowed}")
    params: dict[str, Any] = {}
    for name, param in known.items():
        value = given.get(name, param.default(int(given.get("max_t", max_t))))
        numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
        if (
            (param.kind is bool) != isinstance(value, bool)
            or not (numeric or param.kind is bool)
            or not param.valid(value)
        ):
            raise ConfigError(f"{where}.{name} = {value!r}: must be {param.allowed}")
        params[name] = param.kind(value)
    if scheduler == "asha" and params["grace_period"] > params["max_t"]:
        raise ConfigError(
            f"{where}.grace_period {params['grace_period']} exceeds the budget of {params['max_t']} steps"
        )
    return params


def build_search_alg(settings: SearchSettings, max_concurrent: int) -> Any:
    """Random and grid: Tune's variant generator, seeded; optuna: TPE, seeded. Each caps the trials
    running at once itself (Tune's TuneConfig cap does not apply to a variant generator)."""
    if settings.search == "optuna":
        from optuna.samplers import TPESampler
        from ray.tune.search import ConcurrencyLimiter
        from ray.tune.search.optuna import OptunaSearch

        return ConcurrencyLimiter(OptunaSearch(sampler=TPESampler(seed=settings.seed)), max_concurrent=max_concurrent)
    from ray.tune.search.basic_variant import BasicVariantGenerator

    return BasicVariantGenerator(random_state=settings.seed, max_concurrent=max_concurrent)


def build_scheduler(settings: SearchSettings, space: SearchSpace) -> Any:
    from ray.tune.schedulers import (
        AsyncHyperBandScheduler,
        FIFOScheduler,
        MedianStoppingRule,
        PopulationBasedTraining,
    )

    # metric and mode reach the scheduler and searcher from Tune's TuneConfig (set in one place).
    params: dict[str, Any] = settings.scheduler_params
    common: dict[str, Any] = {"time_attr": TIME_ATTR}
    if settings.scheduler == "asha":
        return AsyncHyperBandScheduler(**common, **params)
    if settings.scheduler == "median":
        return MedianStoppingRule(**common, **params)
    if settings.scheduler == "pbt":
        return PopulationBasedTraining(
            **common,
            **params,
            hyperparam_mutations=space.mutations(),
            custom_explore_fn=space.clamp,
        )
    return FIFOScheduler()
