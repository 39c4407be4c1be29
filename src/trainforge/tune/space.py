"""The search space file: config keys mapped to domains, checked against the config schema.

A space file is a flat YAML mapping from a dotted config key to one domain::

    optim.lr: {loguniform: [1.0e-5, 0.1]}
    optim.weight_decay: {uniform: [0, 0.1]}
    train.batch_size: {choice: [32, 64, 128]}
    optim.name: {grid: [sgd, adamw]}
    schedule.warmup_steps: {randint: [0, 1000]}     # hi excluded, like range()
    optim.momentum: {quniform: [0.8, 0.99, 0.01]}

Every problem (unknown key, unknown domain, wrong arity, lo >= hi, empty list, a value the config
schema rejects) is one ConfigError naming the key, so a bad space fails before Ray starts. Ray is
imported only when the domains are turned into Tune's objects.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from trainforge.config import Config, describe_validation_error, set_dotted
from trainforge.config.safeyaml import read_yaml_file
from trainforge.errors import ConfigError

# kind -> (number of arguments, what they are); "list" takes any non-empty list.
RANGES = {
    "loguniform": (2, "[lo, hi] with 0 < lo < hi"),
    "uniform": (2, "[lo, hi] with lo < hi"),
    "quniform": (3, "[lo, hi, q] with lo < hi and q > 0"),
    "randint": (2, "[lo, hi] integers with lo < hi (hi excluded)"),
}
LISTS = ("choice", "grid")
KINDS = (*RANGES, *LISTS)

# Keys a trial's identity or placement depends on: set by the search itself, never sampled.
NOT_TUNABLE = {
    "run": "the search names each trial's run itself",
    "tune": "it configures the search",
    "cluster": "every trial shares the search's cluster",
    "scaling.num_workers": "use tune.workers_per_trial",
    "checkpoint.resume": "each trial resumes from its own checkpoints",
    "checkpoint.storage_path": "every trial stores under the search's storage",
}


@dataclass(frozen=True)
class Domain:
    """One tuned key and the values it may take."""

    key: str
    kind: str
    args: tuple[Any, ...]

    @property
    def is_grid(self) -> bool:
        return self.kind == "grid"

    @property
    def categorical(self) -> bool:
        return self.kind in LISTS

    @property
    def log_scale(self) -> bool:
        return self.kind == "loguniform"

    def tune_domain(self, *, enumerate_grid: bool) -> Any:
        """Tune's object for this domain; a grid is a plain choice unless the search enumerates it."""
        from ray import tune

        lo_hi = self.args[:2]
        if self.kind == "loguniform":
            return tune.loguniform(*lo_hi)
        if self.kind == "uniform":
            return tune.uniform(*lo_hi)
        if self.kind == "quniform":
            return tune.quniform(*self.args)
        if self.kind == "randint":
            return tune.randint(*lo_hi)
        if self.is_grid and enumerate_grid:
            return tune.grid_search(list(self.args))
        return tune.choice(list(self.args))

    def mutation(self) -> Any:
        """What PBT perturbs: a list is shifted along or resampled, a range multiplied or resampled."""
        return list(self.args) if self.categorical else self.tune_domain(enumerate_grid=False)

    def clamp(self, value: Any) -> Any:
        """A perturbed value brought back inside the domain (PBT multiplies ranges by 0.8 or 1.2)."""
        if self.categorical:
            return value
        lo, hi = self.args[0], self.args[1]
        if self.kind == "randint":
            return int(min(max(round(value), lo), hi - 1))
        clamped = float(min(max(value, lo), hi))
        if self.kind == "quniform":
            q = self.args[2]
            clamped = min(max(round(clamped / q) * q, lo), hi)
        return clamped

    def describe(self) -> str:
        return f"{self.kind} {list(self.args)}"


@dataclass(frozen=True)
class SearchSpace:
    """The domains of a space file, in file order."""

    domains: tuple[Domain, ...]
    source: str = "space"

    @property
    def keys(self) -> list[str]:
        return [d.key for d in self.domains]

    def __getitem__(self, key: str) -> Domain:
        for domain in self.domains:
            if domain.key == key:
                return domain
        raise KeyError(key)

    @property
    def grid_points(self) -> int:
        return math.prod(len(d.args) for d in self.domains if d.is_grid)

    @property
    def has_grid(self) -> bool:
        return any(d.is_grid for d in self.domains)

    def param_space(self, *, enumerate_grid: bool) -> dict[str, Any]:
        """Tune's ``param_space``: flat dotted keys, as trials receive them."""
        return {d.key: d.tune_domain(enumerate_grid=enumerate_grid) for d in self.domains}

    def mutations(self) -> dict[str, Any]:
        return {d.key: d.mutation() for d in self.domains}

    def clamp(self, params: Mapping[str, Any]) -> dict[str, Any]:
        return {k: self[k].clamp(v) if k in self.keys else v for k, v in params.items()}


def apply_params(raw: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a config dict with sampled values set at their dotted keys."""
    copied = yaml.safe_load(yaml.safe_dump(dict(raw)))
    for key, value in params.items():
        set_dotted(copied, key, value, origin=f"search space key {key}")
    return copied


def load_space(path: str | Path, base: Config) -> SearchSpace:
    """Read and check a space file against the run config it will be applied to."""
    path = Path(path)
    data = read_yaml_file(path, "space file")  # bounded: size, depth, aliases, duplicate keys
    return parse_space(data, base, source=str(path))


def parse_space(data: Any, base: Config, *, source: str = "space") -> SearchSpace:
    if not isinstance(data, Mapping) or not data:
        raise ConfigError(f"{source}: expected a mapping of config keys to domains, e.g. optim.lr: {{uniform: [0, 1]}}")
    raw = base.to_dict()
    domains = []
    for key, spec in data.items():
        key = str(key)
        check_key(key, source)
        domain = parse_domain(key, spec, source)
        check_values(domain, raw, source)
        domains.append(domain)
    return SearchSpace(tuple(domains), source)


def check_key(key: str, source: str) -> None:
    """The key names a settable config value (or an entry of a dict-valued key, e.g. model.kwargs.hidden)."""
    for prefix, why in NOT_TUNABLE.items():
        if key == prefix or key.startswith(prefix + "."):
            raise ConfigError(f"{source}: {key} cannot be tuned ({why})")
    model: type[BaseModel] = Config
    parts = key.split(".")
    for depth, part in enumerate(parts):
        field = model.model_fields.get(part)
        if field is None:
            hint = difflib.get_close_matches(key, config_keys(), n=1, cutoff=0.6)
            suggestion = f" — did you mean {hint[0]}?" if hint else ""
            raise ConfigError(f"{source}: unknown config key {key}{suggestion}")
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            if depth == len(parts) - 1:
                example = next(iter(annotation.model_fields))
                raise ConfigError(f"{source}: {key} is a section; name one of its keys, e.g. {key}.{example}")
            model = annotation
            continue
        if depth < len(parts) - 1 and not _is_mapping(annotation):
            raise ConfigError(f"{source}: {'.'.join(parts[: depth + 1])} is a value, not a section (in {key})")
        return


def _is_mapping(annotation: Any) -> bool:
    return getattr(annotation, "__origin__", None) is dict or "dict[" in str(annotation)


def config_keys() -> list[str]:
    """Every dotted key of the config schema (for did-you-mean)."""
    keys: list[str] = []

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            annotation = field.annotation
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                walk(annotation, f"{prefix}{name}.")
            else:
                keys.append(f"{prefix}{name}")

    walk(Config, "")
    return keys


def parse_domain(key: str, spec: Any, source: str) -> Domain:
    where = f"{source}: {key}"
    if not isinstance(spec, Mapping) or len(spec) != 1:
        raise ConfigError(f"{where}: expected one domain such as {{uniform: [lo, hi]}}; domains are {', '.join(KINDS)}")
    kind, args = next(iter(spec.items()))
    if kind not in KINDS:
        hint = difflib.get_close_matches(str(kind), KINDS, n=1, cutoff=0.5)
        suggestion = f" — did you mean {hint[0]}?" if hint else f"; domains are {', '.join(KINDS)}"
        raise ConfigError(f"{where}: unknown domain {kind!r}{suggestion}")
    if not isinstance(args, list):
        raise ConfigError(f"{where}: {kind} takes a list, got {args!r}")
    if kind in LISTS:
        if not args:
            raise ConfigError(f"{where}: {kind} needs at least one value, got an empty list")
        return Domain(key, kind, tuple(args))
    arity, shape = RANGES[kind]
    numbers = all(isinstance(a, (int, float)) and not isinstance(a, bool) for a in args)
    if len(args) != arity or not numbers:
        raise ConfigError(f"{where}: {kind} takes {shape}, got {args}")
    lo, hi = args[0], args[1]
    if kind == "randint" and not all(isinstance(a, int) for a in args):
        raise ConfigError(f"{where}: randint takes {shape}, got {args}")
    if not lo < hi or (kind == "loguniform" and lo <= 0) or (kind == "quniform" and args[2] <= 0):
        raise ConfigError(f"{where}: {kind} takes {shape}, got {args}")
    return Domain(key, kind, tuple(args))


def check_values(domain: Domain, raw: dict[str, Any], source: str) -> None:
    """Every value the domain can produce must pass the config schema: the list's values, a range's
    ends, and for continuous ranges a fractional value (an integer key needs randint or choice)."""
    if domain.categorical:
        probes = list(domain.args)
    elif domain.kind == "randint":
        probes = [domain.args[0], domain.args[1] - 1]
    else:
        lo, hi = domain.args[0], domain.args[1]
        probes = [lo, hi]
        if domain.kind != "quniform":
            probes.append(lo + (hi - lo) * 0.37)
    for value in probes:
        candidate = apply_params(raw, {domain.key: value})
        try:
            config = Config.model_validate(candidate)
        except ValidationError as err:
            detail = describe_validation_error(err)
            raise ConfigError(
                f"{source}: {domain.key} {domain.describe()}: value {value!r} is rejected: {detail}"
            ) from None
        if domain.key.startswith("optim."):  # a torch.optim class by name, and its kwargs
            from trainforge.worker.optim import check_optimizer

            try:
                check_optimizer(config.optim)
            except ConfigError as err:
                raise ConfigError(
                    f"{source}: {domain.key} {domain.describe()}: value {value!r} is rejected: {err}"
                ) from None
        if domain.key.startswith(("schedule.", "optim.")):  # a torch lr_scheduler class by name, its kwargs
            from trainforge.worker.schedule import check_schedule, lr_search_problem

            try:
                check_schedule(config.schedule, config.optim)
                problem = lr_search_problem(domain.key, config.schedule)
            except ConfigError as err:
                problem = str(err)
            if problem:
                raise ConfigError(
                    f"{source}: {domain.key} {domain.describe()}: value {value!r} is rejected: {problem}"
                ) from None
