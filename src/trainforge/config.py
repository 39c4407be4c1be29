"""One typed config tree, a section per component.

Layers, later ones win: the YAML file (or a dict), then ``--set key=value`` overrides, then
``TRAINFORGE_SECTION__KEY`` environment variables. Every error names the key and what is allowed.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from trainforge.errors import ConfigError

ENV_PREFIX = "TRAINFORGE_"

PositiveInt = Annotated[int, Field(ge=1)]
NonNegInt = Annotated[int, Field(ge=0)]
PositiveFloat = Annotated[float, Field(gt=0)]


class Section(BaseModel):
    """Base for every config section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RunConfig(Section):
    name: str = "run"
    output_dir: str = "runs"

    @field_validator("name")
    @classmethod
    def _safe_name(cls, value: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", value):
            raise ValueError("must be 1-128 characters of letters, digits, '.', '_' or '-'")
        return value


class ModelConfig(Section):
    name: str | None = None
    factory: str | None = None
    kwargs: dict[str, Any] = Field(default_factory=dict)
    task: Literal["classification", "causal_lm"] | None = None

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        if (self.name is None) == (self.factory is None):
            raise ValueError("give exactly one of model.name (a built-in) or model.factory ('pkg.module:function')")
        if self.factory is not None and not re.fullmatch(r"[\w.]+:[\w.]+", self.factory):
            raise ValueError(f"model.factory must look like 'package.module:function', got {self.factory!r}")
        return self


class DataConfig(Section):
    name: str = "digits"
    path: str | None = None
    kind: Literal["image", "tokens"] = "image"
    input_shape: list[PositiveInt] = Field(default_factory=lambda: [3, 32, 32])
    num_classes: Annotated[int, Field(ge=2)] = 10
    num_samples: PositiveInt = 1024
    seq_len: Annotated[int, Field(ge=2)] = 64
    vocab_size: Annotated[int, Field(ge=2)] = 1000
    val_fraction: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.2
    image_size: PositiveInt | None = None
    num_workers: NonNegInt = 0
    pin_memory: bool | None = None
    shuffle: bool = True


class TrainConfig(Section):
    max_steps: PositiveInt | None = None
    epochs: PositiveInt | None = None
    batch_size: PositiveInt = 32
    grad_accum_steps: PositiveInt = 1
    grad_clip_norm: PositiveFloat | None = None
    log_every_n_steps: PositiveInt = 10
    report_min_interval_s: Annotated[float, Field(ge=0.0)] = 1.0
    eval_every_n_steps: PositiveInt | None = None
    sync_batchnorm: bool = False
    threads_per_worker: PositiveInt = 1

    @model_validator(mode="after")
    def _has_length(self) -> TrainConfig:
        if self.max_steps is None and self.epochs is None:
            raise ValueError("set train.max_steps or train.epochs (or both: training stops at whichever comes first)")
        return self


class OptimConfig(Section):
    name: Literal["sgd", "adam", "adamw"] = "adamw"
    lr: PositiveFloat = 1e-3
    weight_decay: Annotated[float, Field(ge=0.0)] = 0.0
    momentum: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.9
    nesterov: bool = False
    betas: tuple[Annotated[float, Field(ge=0.0, lt=1.0)], Annotated[float, Field(ge=0.0, lt=1.0)]] = (0.9, 0.999)
    eps: PositiveFloat = 1e-8
    lr_scaling: Literal["none", "linear"] = "none"
    base_batch_size: PositiveInt = 256


class ScheduleConfig(Section):
    name: Literal["constant", "step", "cosine", "linear"] = "constant"
    warmup_steps: NonNegInt = 0
    step_size: PositiveInt = 1000
    gamma: PositiveFloat = 0.1
    min_lr_ratio: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0


class ScalingConfig(Section):
    num_workers: PositiveInt | tuple[PositiveInt, PositiveInt] = 1
    use_gpu: bool = False
    resources_per_worker: dict[str, Annotated[float, Field(ge=0.0)]] | None = None
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"

    @field_validator("num_workers")
    @classmethod
    def _min_le_max(cls, value: int | tuple[int, int]) -> int | tuple[int, int]:
        if isinstance(value, tuple) and value[0] > value[1]:
            raise ValueError(f"[min, max] needs min <= max, got {list(value)}")
        return value

    @property
    def max_workers(self) -> int:
        return self.num_workers[1] if isinstance(self.num_workers, tuple) else self.num_workers


class CheckpointConfig(Section):
    every_n_steps: PositiveInt | None = None
    every_n_minutes: PositiveFloat | None = None
    at_epoch_end: bool = False
    keep_last: PositiveInt = 3
    keep_best_metric: str | None = None
    keep_best_mode: Literal["min", "max"] = "min"
    storage_path: str | None = None
    on_save_error: Literal["continue", "fail"] = "continue"
    resume: str = "auto"

    @field_validator("resume")
    @classmethod
    def _resume_value(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must be auto, none, or the path of a checkpoint directory")
        return value


class FailureConfig(Section):
    max_failures: Annotated[int, Field(ge=-1)] = 3
    collective_timeout_s: Annotated[float, Field(ge=1.0)] = 300.0  # whole seconds reach gloo/NCCL: >= 1


class ClusterConfig(Section):
    address: str | None = None
    num_cpus: PositiveInt | None = None
    report_poll_interval_s: PositiveFloat = 0.2


class TrackingConfig(Section):
    """MLflow: one run per training job, logged from the driver (tracking/)."""

    enabled: bool = True
    uri: str | None = None  # None: a local store under run.output_dir, so no server is needed
    experiment: str = "trainforge"
    required: bool = False  # True: unreachable at the start fails the run; an incomplete record fails it at the end
    system_metrics: bool = True  # per-node CPU, memory, network, disk (psutil) and GPU (NVML)
    parent_run_id: str | None = None  # nest this run under another MLflow run (a search's trials)
    flush_timeout_s: Annotated[float, Field(ge=0.0)] = 30.0  # at the end, wait at most this long for MLflow
    max_buffered_points: PositiveInt = 100_000  # metric points kept while the server is away; oldest dropped


class MetricsConfig(Section):
    """Prometheus export of training metrics through Ray's metrics agent on every node (metrics/)."""

    enabled: bool = True
    # How often every process of a local Ray pushes its metrics to the node's agent (Ray's
    # metrics_report_interval_ms; Ray floors it at 1 s). None: Ray's default, 10 s. A cluster sets
    # it at `ray start` (RAY_metrics_report_interval_ms); setting it for one is refused at connect.
    export_interval_s: Annotated[float, Field(ge=1.0)] | None = None
    # Time DDP's gradient all-reduce through a Python communication hook (metrics/comm.py); false
    # keeps DDP's built-in C++ all-reduce and exports no communication metrics.
    comm_timing: bool = True
    trial: str | None = None  # label `trial` on every series; `trainforge tune` sets it to the trial id


class TuneConfig(Section):
    """Hyperparameter search (``trainforge tune``); the search space comes from ``--space``.

    Scheduler parameters that measure time (grace period, perturbation interval, max_t) are in
    optimizer steps: the trials' ``step`` is Tune's time attribute.
    """

    metric: str | None = None  # None: val/loss where there is validation data, else train/loss
    mode: Literal["min", "max"] = "min"
    num_trials: PositiveInt | None = None  # None: 8, or every grid point once for search grid
    max_concurrent: PositiveInt | None = None  # None: what the cluster's free resources allow
    workers_per_trial: PositiveInt = 1
    search: Literal["random", "grid", "optuna"] = "random"
    scheduler: Literal["none", "asha", "pbt", "median"] = "none"
    scheduler_params: dict[str, Any] = Field(default_factory=dict)  # a section per scheduler: {asha: {...}}
    time_budget_s: PositiveFloat | None = None


class Config(Section):
    """The whole run: one section per component plus a few run-wide scalars."""

    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainConfig
    optim: OptimConfig = Field(default_factory=OptimConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    scaling: ScalingConfig = Field(default_factory=ScalingConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    failure: FailureConfig = Field(default_factory=FailureConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    tune: TuneConfig = Field(default_factory=TuneConfig)
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    seed: NonNegInt = 0
    deterministic: bool = False

    @model_validator(mode="after")
    def _cross_checks(self) -> Config:
        if self.precision == "fp16" and not self.scaling.use_gpu:
            raise ValueError("precision fp16 needs scaling.use_gpu: true (on CPU use bf16)")
        if self.train.sync_batchnorm and not self.scaling.use_gpu:
            raise ValueError("train.sync_batchnorm needs scaling.use_gpu: true (PyTorch's SyncBatchNorm is GPU-only)")
        return self

    @property
    def run_dir(self) -> Path:
        return Path(self.run.output_dir).expanduser().resolve() / self.run.name

    @property
    def storage_path(self) -> str:
        """Where Ray Train persists checkpoints: a directory or an ``s3://`` URI."""
        if self.checkpoint.storage_path:
            path = self.checkpoint.storage_path
            return path if "://" in path else str(Path(path).expanduser().resolve())
        return str(Path(self.run.output_dir).expanduser().resolve())

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


# ---------------------------------------------------------------------------------------------
# Loading: file -> overrides -> environment -> validation with readable errors


def load_config(
    source: str | os.PathLike[str] | Mapping[str, Any] | Config,
    overrides: Iterable[str] = (),
    env: Mapping[str, str] | None = None,
) -> Config:
    """Build a validated Config from a YAML path, a dict or a Config, then apply the layers."""
    if isinstance(source, Config):
        raw: dict[str, Any] = source.to_dict()
    elif isinstance(source, Mapping):
        raw = _deep_copy(source)
    else:
        raw = read_yaml(Path(source))
    for item in overrides:
        key, value = parse_override(item)
        set_dotted(raw, key, value, origin=f"--set {item}")
    for key, value in env_overrides(os.environ if env is None else env).items():
        set_dotted(raw, key, value, origin=f"environment {ENV_PREFIX}{key.upper().replace('.', '__')}")
    return validate(raw)


def read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"config file {path} is not valid YAML{where}: {getattr(err, 'problem', err)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections, got {type(data).__name__}")
    return data


def parse_override(item: str) -> tuple[str, Any]:
    """``train.batch_size=64`` -> ("train.batch_size", 64); the value is parsed as YAML."""
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*", key):
        raise ConfigError(f"--set {item!r}: expected key=value with a dotted key, e.g. train.batch_size=64")
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        value = text
    return key, value


def env_overrides(env: Mapping[str, str]) -> dict[str, Any]:
    """``TRAINFORGE_TRAIN__BATCH_SIZE=64`` -> {"train.batch_size": 64}; ``__`` separates levels."""
    found: dict[str, Any] = {}
    for name, text in env.items():
        if not name.startswith(ENV_PREFIX) or "__" not in name:
            continue
        key = name[len(ENV_PREFIX) :].lower().replace("__", ".")
        try:
            found[key] = yaml.safe_load(text) if text.strip() else ""
        except yaml.YAMLError:
            found[key] = text
    return found


def set_dotted(raw: dict[str, Any], key: str, value: Any, origin: str) -> None:
    node = raw
    parts = key.split(".")
    for depth, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"{origin}: {'.'.join(parts[: depth + 1])} is a value, not a section")
        node = child
    node[parts[-1]] = value


def validate(raw: Mapping[str, Any]) -> Config:
    try:
        return Config.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(describe_validation_error(err)) from None


def describe_validation_error(err: ValidationError) -> str:
    """Turn pydantic's report into one line per problem that names the key and what is allowed."""
    lines = [_describe_one(e) for e in err.errors()]
    return "; ".join(dict.fromkeys(lines))


def _describe_one(error: Mapping[str, Any]) -> str:
    loc = [str(p) for p in error["loc"] if not _is_union_tag(p)]
    key = ".".join(loc) or "config"
    kind = error["type"]
    if kind == "extra_forbidden":
        hint = _suggest(loc)
        return f"unknown key {key}" + (f" — did you mean {hint}?" if hint else "")
    if kind == "missing":
        return f"missing key {key}"
    given = error.get("input")
    msg = str(error["msg"]).removeprefix("Value error, ")
    shown = "" if isinstance(given, dict) else f" = {given!r}"
    return f"{key}{shown}: {msg}"


def _is_union_tag(part: Any) -> bool:
    text = str(part)
    return text in {"int", "float", "str", "bool", "tuple[int,int]", "list[int]"} or text.startswith(
        ("tuple[", "dict[", "list[", "constrained-", "function-")
    )


def _suggest(loc: list[str]) -> str | None:
    """The closest valid key at the same level as an unknown one."""
    model: type[BaseModel] = Config
    for part in loc[:-1]:
        field = model.model_fields.get(part)
        annotation = field.annotation if field else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        model = annotation
    match = difflib.get_close_matches(loc[-1], list(model.model_fields), n=1, cutoff=0.6)
    return ".".join([*loc[:-1], match[0]]) if match else None


def _deep_copy(data: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, Mapping) else v for k, v in data.items()}


def to_yaml(config: Config) -> str:
    return yaml.safe_dump(config.to_dict(), sort_keys=False)
