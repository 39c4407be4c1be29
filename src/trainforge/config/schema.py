"""The config tree: one section per component, each a pydantic model that refuses unknown keys;
cross-field checks live in the root's validators. ``loading.py`` builds it from files and flags."""

from __future__ import annotations

import math
import re
import stat
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, Field, ValidationInfo, field_validator, model_validator

from trainforge.config.data import DataSection, DigitsData, TabularData, float_targets_hint
from trainforge.config.network import MAX_ENV_VARS, env_problem, env_value, worker_variables
from trainforge.config.safeyaml import MAX_DEPTH
from trainforge.config.section import (
    MAX_BATCH,
    MAX_COUNT,
    MAX_EPOCHS,
    MAX_SECONDS,
    MAX_STEPS,
    MAX_WORKERS,
    Count,
    PositiveFloat,
    Section,
    Steps,
    Workers,
)

ENV_PREFIX = "TRAINFORGE_"


def _plain(value: Any, key: str = "", depth: int = 0) -> None:
    """Free-form values (model.kwargs, tune.scheduler_params) hold only what YAML and JSON share."""
    where = key or "value"
    if depth > MAX_DEPTH:
        raise ValueError(f"nested deeper than {MAX_DEPTH} levels")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where} = {value}: numbers must be finite")
    if isinstance(value, dict):
        for name, item in value.items():
            if not isinstance(name, str):
                raise ValueError(f"{where}: keys must be strings, got {name!r}")
            _plain(item, f"{key}.{name}" if key else name, depth + 1)
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _plain(item, f"{where}[{index}]", depth + 1)
    elif value is not None and not isinstance(value, (str, int, float)):
        raise ValueError(f"{where}: {type(value).__name__} is not allowed; use strings, numbers, booleans, lists, maps")


def _check_plain(value: dict[str, Any]) -> dict[str, Any]:
    _plain(value)
    return value


PlainDict = Annotated[dict[str, Any], AfterValidator(_check_plain)]


def _one_or_more(value: Any) -> Any:
    """A single glob where a list of them goes (``--set model.freeze=encoder.*``)."""
    return [value] if isinstance(value, str) else value


# fnmatch-style patterns over parameter names (``encoder.*``, ``*.bias``): model.freeze, optim.param_groups
Glob = Annotated[str, Field(min_length=1, max_length=500)]
Globs = Annotated[list[Glob], BeforeValidator(_one_or_more), Field(max_length=256)]


class RunConfig(Section):
    name: str = "run"
    output_dir: str = "runs"

    @field_validator("name")
    @classmethod
    def _safe_name(cls, value: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", value):
            raise ValueError("must be 1-128 characters of letters, digits, '.', '_' or '-'")
        return value


class LoraConfig(Section):
    """``model.lora``: low-rank adapters by PEFT (models/lora.py); only they train and are saved."""

    r: Annotated[int, Field(ge=1, le=4096)] = 8
    alpha: Annotated[int, Field(ge=1, le=1 << 20)] = 16  # the adapters' output is scaled by alpha / r
    dropout: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.0
    # Module names (or their last parts) to adapt, e.g. [q_proj, v_proj]; None: PEFT's choice for
    # the transformers model types it knows (a factory's model must name them).
    target_modules: (
        Annotated[list[Annotated[str, Field(min_length=1, max_length=200)]], Field(min_length=1, max_length=256)] | None
    ) = None


class ModelConfig(Section):
    name: str | None = None
    factory: str | None = None
    kwargs: PlainDict = Field(default_factory=dict)
    # None: classification for image data, causal_lm for token data, regression for float targets;
    # masked_lm: BERT's objective; custom: the model's own training_step / validation_step (models/tasks.py)
    # hf: the batch as keyword arguments with labels, the loss the model returns (models/hf_task.py)
    task: Literal["classification", "causal_lm", "masked_lm", "regression", "custom", "hf"] | None = None
    loss: Literal["mse", "l1"] | None = None  # regression's loss; None: mse
    # Weights read before the first step (models/pretrained.py): a Hugging Face directory, a
    # .safetensors file, or a trainforge run or checkpoint directory; paths only, nothing downloaded.
    pretrained: Annotated[str, Field(min_length=1, max_length=4096)] | None = None
    pretrained_strict: bool = True  # false: load the tensors that match, list the rest
    # parameters by name held fixed (worker/params.py): not trained, not in the optimizer
    freeze: Globs = Field(default_factory=list)
    lora: LoraConfig | None = None  # low-rank adapters (models/lora.py); the base weights stay fixed

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        if (self.name is None) == (self.factory is None):
            raise ValueError("give exactly one of model.name (a built-in) or model.factory ('pkg.module:function')")
        if self.factory is not None and not re.fullmatch(r"[\w.]+:[\w.]+", self.factory):
            raise ValueError(f"model.factory must look like 'package.module:function', got {self.factory!r}")
        return self

    @model_validator(mode="after")
    def _loss_of_regression(self) -> ModelConfig:
        if self.loss is not None and self.task not in ("regression", None):
            raise ValueError(f"model.loss needs model.task: regression (model.task {self.task} has its own loss)")
        return self


class EmaConfig(Section):
    """``train.ema``: an exponential moving average of the weights (worker/ema.py)."""

    decay: Annotated[float, Field(gt=0.0, lt=1.0)] = 0.999
    every_n_steps: Steps = 1  # update the average every this many optimizer steps
    evaluate: bool = True  # also validate with the averaged weights (val_ema/...)


class EarlyStoppingConfig(Section):
    """``train.early_stopping``: end the run when a validation metric stops improving
    (worker/early_stopping.py), counted in validation passes."""

    metric: Annotated[str, Field(max_length=200)]  # a validation metric: val/loss, val/accuracy, val_ema/loss
    mode: Literal["min", "max"] = "min"
    patience: Annotated[int, Field(ge=1, le=MAX_COUNT)] = 3  # validations without improvement before the stop
    min_delta: Annotated[float, Field(ge=0.0)] = 0.0  # an improvement is better than the best by more than this
    restore_best: bool = False  # model.safetensors from the checkpoint of the best validation

    @field_validator("metric")
    @classmethod
    def _validation_metric(cls, value: str) -> str:
        if not re.fullmatch(r"val(_\w+)?/\S+", value):
            raise ValueError(f"must name a validation metric (val/loss, val/accuracy, val_ema/loss), got {value!r}")
        return value


class AnomalyConfig(Section):
    """``train.anomaly``: a non-finite loss or gradient, or a loss spike, is re-run from the same
    state and batch to tell a data fault from a hardware fault, recorded, and skipped or rolled
    back (worker/anomaly.py)."""

    spike_zscore: Annotated[float, Field(gt=0.0, le=1e6)] = 6.0  # a spike: above mean + this x std of the window
    window: Annotated[int, Field(ge=2, le=10_000)] = 50  # the accepted steps' losses the spike rule looks at
    action: Literal["skip", "rollback"] = "skip"
    max_rollbacks: Annotated[int, Field(ge=0, le=MAX_COUNT)] = 3  # rollbacks before the run fails
    lr_factor: Annotated[float, Field(gt=0.0, le=1.0)] = 0.5  # the LR after each rollback, times this

    @model_validator(mode="after")
    def _rollback_keys_roll_back(self) -> AnomalyConfig:
        # Compared with the defaults, not "was given": a resolved config carries every key.
        for key in ("max_rollbacks", "lr_factor"):
            if self.action == "skip" and getattr(self, key) != AnomalyConfig.model_fields[key].default:
                raise ValueError(f"train.anomaly.{key} applies to action: rollback (this one skips)")
        return self


def _callback_entry(value: Any) -> Any:
    """``"pkg.mod:Class"`` is ``{path: "pkg.mod:Class"}``."""
    return {"path": value} if isinstance(value, str) else value


class CallbackConfig(Section):
    """An entry of ``callbacks``: the user's class, built on every worker with ``kwargs``
    (worker/callbacks.py)."""

    path: Annotated[str, Field(max_length=200)]
    kwargs: PlainDict = Field(default_factory=dict)

    @field_validator("path")
    @classmethod
    def _class_path(cls, value: str) -> str:
        if not re.fullmatch(r"[\w.]+:[\w.]+", value):
            raise ValueError(f"must look like 'package.module:Class', got {value!r}")
        return value


Callback = Annotated[CallbackConfig, BeforeValidator(_callback_entry)]


class TrainConfig(Section):
    max_steps: Steps | None = None
    epochs: Annotated[int, Field(ge=1, le=MAX_EPOCHS)] | None = None
    # Per worker, per micro-batch; ``auto``: the largest micro-batch that fits (worker/autobatch.py).
    batch_size: Annotated[int, Field(ge=1, le=MAX_BATCH)] | Literal["auto"] = 32
    grad_accum_steps: Count = 1
    # Samples per optimizer step over all data-parallel workers, whatever their number: the workers
    # derive grad_accum_steps from it (and under ``auto`` the micro-batch), so a resume on another
    # worker count reads the same samples per step (worker/components/data.py).
    global_batch_size: Annotated[int, Field(ge=1, le=MAX_BATCH)] | None = None
    memory_limit_gb: Annotated[float, Field(gt=0, le=1 << 20)] = 4.0  # per worker, for auto on CPU
    grad_clip_norm: PositiveFloat | None = None
    log_every_n_steps: Steps = 10
    report_min_interval_s: Annotated[float, Field(ge=0.0, le=MAX_SECONDS)] = 1.0
    eval_every_n_steps: Steps | None = None
    sync_batchnorm: bool = False
    threads_per_worker: Annotated[int, Field(ge=1, le=1024)] = 1
    # Workers keep the large blocks they free for the next step instead of handing them back to the
    # kernel and faulting them in again (glibc's mmap and trim thresholds; worker/allocator.py).
    reuse_freed_memory: bool = True
    ema: EmaConfig | None = None
    early_stopping: EarlyStoppingConfig | None = None
    anomaly: AnomalyConfig | None = None  # loss spikes and NaNs: attributed, skipped or rolled back

    @model_validator(mode="after")
    def _has_length(self) -> TrainConfig:
        if self.max_steps is None and self.epochs is None:
            raise ValueError("set train.max_steps or train.epochs (or both: training stops at whichever comes first)")
        auto = self.batch_size == "auto"
        if auto and self.global_batch_size is None:
            raise ValueError("train.global_batch_size is required with train.batch_size: auto (the batch to hold)")
        if auto and self.grad_accum_steps != 1:
            raise ValueError("train.grad_accum_steps is chosen by train.batch_size: auto; leave it out")
        if self.global_batch_size is not None and self.grad_accum_steps != 1:
            raise ValueError(
                "train.grad_accum_steps follows from train.global_batch_size (global_batch_size / (batch_size x "
                "data-parallel workers)); leave it out"
            )
        return self

    @property
    def auto_batch(self) -> bool:
        return self.batch_size == "auto"

    def split(self, replicas: int, workers: str) -> tuple[int, int]:
        """(micro-batch, accumulation steps) of each of ``replicas`` data-parallel workers: as set, or
        derived from ``global_batch_size`` (under ``auto``, a worker's whole share in one micro-batch
        until worker/autobatch.py splits it). ValueError in one line when the global batch does not
        split into equal shares; ``workers`` says where the count comes from."""
        global_batch = self.global_batch_size
        if global_batch is None:
            return int(self.batch_size), self.grad_accum_steps
        share = "every data-parallel worker takes an equal share"
        if self.batch_size == "auto":
            if global_batch % replicas:
                raise ValueError(f"train.global_batch_size {global_batch} must be divisible by {workers} ({share})")
            return global_batch // replicas, 1
        per_step = self.batch_size * replicas
        if global_batch % per_step:
            raise ValueError(
                f"train.global_batch_size {global_batch} must be divisible by train.batch_size {self.batch_size} x "
                f"{workers} = {per_step} ({share} of whole micro-batches)"
            )
        return self.batch_size, global_batch // per_step


class ParamGroupConfig(Section):
    """An entry of ``optim.param_groups``: the parameters its globs name, with their own settings."""

    params: Annotated[Globs, Field(min_length=1)]
    lr: Annotated[float, Field(ge=0, le=1e3)] | None = None  # None: optim.lr (both scaled by lr_scaling)
    # None: optim.weight_decay on matrices and kernels, none on biases and norms, as for the rest
    weight_decay: Annotated[float, Field(ge=0.0, le=1e3)] | None = None


OWN_OPTIMIZERS = ("sgd", "adam", "adamw")  # trainforge's names: its keys (momentum, betas, eps) set them
OPTIMIZER_KEYS = {"sgd": ("momentum", "nesterov"), "adam": ("betas", "eps"), "adamw": ("betas", "eps")}
COMMON_OPTIMIZER_KEYS = ("params", "lr", "weight_decay")  # optim.lr and optim.weight_decay, never in optim.kwargs


class OptimConfig(Section):
    # sgd, adam, adamw (with the keys below), or any torch.optim class by its name (Adadelta,
    # RMSprop, SGD, ...: its own defaults, its other arguments in optim.kwargs; worker/optim.py)
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")] = "adamw"
    kwargs: PlainDict = Field(default_factory=dict)  # the optimizer's other keyword arguments
    # "pkg.module:function": the user's optimizer, built from the parameter groups (worker/optim.py)
    factory: Annotated[str, Field(pattern=r"^[\w.]+:[\w.]+$", max_length=200)] | None = None
    lr: Annotated[float, Field(gt=0, le=1e3)] = 1e-3
    weight_decay: Annotated[float, Field(ge=0.0, le=1e3)] = 0.0
    momentum: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.9
    nesterov: bool = False
    betas: tuple[Annotated[float, Field(ge=0.0, lt=1.0)], Annotated[float, Field(ge=0.0, lt=1.0)]] = (0.9, 0.999)
    eps: Annotated[float, Field(gt=0, le=1.0)] = 1e-8
    lr_scaling: Literal["none", "linear"] = "none"
    base_batch_size: Annotated[int, Field(ge=1, le=MAX_BATCH)] = 256
    # per-group settings by parameter name (worker/optim.py); a parameter takes the first entry that matches
    param_groups: Annotated[list[ParamGroupConfig], Field(max_length=64)] = Field(default_factory=list)

    @model_validator(mode="after")
    def _name_or_factory(self) -> OptimConfig:
        # Not "name was given": a resolved config (config.yaml, a worker's payload) carries the
        # default name beside the factory and must validate again.
        if self.factory is not None and self.name != OptimConfig.model_fields["name"].default:
            raise ValueError("give one of optim.name (a torch.optim class) or optim.factory ('pkg.module:function')")
        return self

    @model_validator(mode="after")
    def _kwargs_not_common(self) -> OptimConfig:
        common = sorted(set(self.kwargs) & set(COMMON_OPTIMIZER_KEYS))
        if common:
            raise ValueError(
                f"optim.kwargs {common}: set optim.lr and optim.weight_decay instead (LR scaling and Tune read them)"
            )
        own = sorted(set(self.kwargs) & set(OPTIMIZER_KEYS.get(self.name, ())))
        if own:
            keys = ", ".join(f"optim.{key}" for key in own)
            raise ValueError(f"optim.kwargs {own}: with optim.name {self.name}, set {keys} instead")
        return self


SCHEDULES = ("constant", "step", "cosine", "linear")  # trainforge's own, counted in optimizer steps
SCHEDULE_KEYS = ("step_size", "gamma", "min_lr_ratio")  # their keys; a torch class takes schedule.kwargs
PLATEAU = "ReduceLROnPlateau"  # the torch class that steps on a validation metric (schedule.monitor)


class ScheduleConfig(Section):
    # constant, step, cosine, linear (with the keys below), or any torch.optim.lr_scheduler class
    # by its name (StepLR, OneCycleLR, ...: its arguments in schedule.kwargs; worker/schedule.py)
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")] = "constant"
    kwargs: PlainDict = Field(default_factory=dict)  # a torch class's keyword arguments
    interval: Literal["step", "epoch"] = "step"  # when a torch class steps: each optimizer step or epoch end
    warmup_steps: Annotated[int, Field(ge=0, le=MAX_STEPS)] = 0
    # the same warm-up in epochs (converted with the run's steps per epoch); give one of the two
    warmup_epochs: Annotated[float, Field(ge=0.0, le=MAX_EPOCHS)] | None = None
    # ReduceLROnPlateau's validation metric, as reports name it (val/loss; val_loss also matches)
    monitor: Annotated[str, Field(max_length=200)] | None = None
    step_size: Steps = 1000
    gamma: Annotated[float, Field(gt=0, le=1e3)] = 0.1
    min_lr_ratio: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0

    @field_validator("monitor")
    @classmethod
    def _validation_metric(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"val[A-Za-z0-9_]*[/_][\w.-]+", value):
            raise ValueError(f"{value!r} is not a validation metric: name one as reports do (val/loss, val/accuracy)")
        return value

    @model_validator(mode="after")
    def _one_warmup(self) -> ScheduleConfig:
        if self.warmup_epochs is not None and self.warmup_steps:
            raise ValueError("give one of schedule.warmup_steps or schedule.warmup_epochs")
        return self

    @model_validator(mode="after")
    def _keys_of_the_name(self) -> ScheduleConfig:
        """Each key where the named schedule reads it; nothing set that it would ignore."""
        if self.name in SCHEDULES:
            if self.kwargs:
                keys = ", ".join(f"schedule.{key}" for key in SCHEDULE_KEYS)
                raise ValueError(
                    f"schedule.kwargs is for a torch.optim.lr_scheduler class; schedule.name {self.name} takes {keys}"
                )
            if self.interval != "step":
                raise ValueError(
                    f"schedule.interval epoch needs a torch.optim.lr_scheduler class (StepLR, ...): schedule.name "
                    f"{self.name} counts optimizer steps"
                )
        else:
            # Not left at their defaults (a resolved config holds every key, so being set says nothing).
            own = [key for key in SCHEDULE_KEYS if getattr(self, key) != type(self).model_fields[key].default]
            if own:
                raise ValueError(
                    f"schedule {own} are for constant/step/cosine/linear; {self.name}'s arguments go in schedule.kwargs"
                )
        if self.name == PLATEAU:
            if self.monitor is None:
                raise ValueError(f"schedule.name {PLATEAU} needs schedule.monitor (a validation metric: val/loss, ...)")
            if self.interval != "step":
                raise ValueError(
                    f"{PLATEAU} steps after each validation (schedule.monitor): leave schedule.interval out"
                )
        elif self.monitor is not None:
            raise ValueError(f"schedule.monitor is read by {PLATEAU} only, not by schedule.name {self.name}")
        return self


class ScalingConfig(Section):
    num_workers: Workers | tuple[Workers, Workers] = 1
    use_gpu: bool = False
    resources_per_worker: dict[str, Annotated[float, Field(ge=0.0)]] | None = None
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    # Every worker's environment (config/network.py): a preset of NCCL variables per interconnect,
    # then scaling.env over it.
    network_profile: Literal["nvlink", "infiniband", "ethernet", "cloud"] | None = None
    env: Annotated[dict[str, str], Field(max_length=MAX_ENV_VARS)] = Field(default_factory=dict)
    # Keep this driver process's worker groups warm between its runs (driver/warm.py): a second
    # trainforge.fit of the same shape starts on workers that have torch and the process group ready.
    reuse_workers: bool = False

    @field_validator("env", mode="before")
    @classmethod
    def _env(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            return value  # pydantic says what it wanted
        checked = {}
        for name, item in value.items():
            problem = env_problem(str(name))
            if problem:
                raise ValueError(f"{name} {problem}")
            checked[str(name)] = env_value(str(name), item)
        return checked

    @property
    def worker_env(self) -> dict[str, str]:
        """What trainforge sets on every worker from the config: the profile's, then ``env``."""
        return worker_variables(self.network_profile, self.env)

    @field_validator("num_workers")
    @classmethod
    def _min_le_max(cls, value: int | tuple[int, int]) -> int | tuple[int, int]:
        if isinstance(value, tuple) and value[0] > value[1]:
            raise ValueError(f"[min, max] needs min <= max, got {list(value)}")
        return value

    @property
    def max_workers(self) -> int:
        return self.num_workers[1] if isinstance(self.num_workers, tuple) else self.num_workers

    @property
    def min_workers(self) -> int:
        return self.num_workers[0] if isinstance(self.num_workers, tuple) else self.num_workers


class FSDPConfig(Section):
    """``parallel.fsdp``: how FSDP2 (``fully_shard``) shards the model."""

    wrap: Annotated[list[Annotated[str, Field(min_length=1, max_length=200)]], Field(max_length=64)] | None = None
    reshard_after_forward: bool = True  # free the gathered parameters after each block's forward
    mixed_precision: Literal["none", "bf16"] = "none"  # bf16: bf16 parameters in compute, fp32 gradient reduce
    cpu_offload: bool = False  # sharded parameters, gradients and optimizer state live in host memory
    # HSDP: the data-parallel workers form a (replicate x shard) mesh; parameters are sharded within
    # groups of (data-parallel workers / replicate) consecutive workers and replicated across groups.
    replicate: Annotated[int, Field(ge=1, le=1024)] = 1


class PowerSGDConfig(Section):
    """``parallel.powersgd``: PowerSGD gradient compression (torch's ``PowerSGDState``)."""

    rank: Annotated[int, Field(ge=1, le=1024)] = 1  # matrix_approximation_rank
    # start_powerSGD_iter: plain all-reduce for the first steps (DDP rebuilds its buckets after
    # the first; torch needs at least 2).
    warmup_steps: Annotated[int, Field(ge=2, le=MAX_STEPS)] = 1000


class SyncConfig(Section):
    """``parallel.sync``: local SGD / DiLoCo. Workers step without gradient communication and
    meet every ``every_n_steps`` steps (worker/sync.py, docs/parallelism.md)."""

    every_n_steps: Steps
    outer_optimizer: Literal["sgd", "nesterov"] = "sgd"
    outer_lr: Annotated[float, Field(gt=0, le=10.0)] = 1.0
    momentum: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.9  # nesterov only (DiLoCo's 0.9)


class PipelineConfig(Section):
    """``parallel.pipeline``: a built-in decoder cut at block boundaries into ``stages`` x
    ``virtual_stages`` parts, each worker of a pipeline holding ``virtual_stages`` of them (one,
    except under interleaved_1f1b), run by a torch.distributed.pipelining schedule (worker/pipeline.py)."""

    stages: Annotated[int, Field(ge=2, le=64)]
    schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = "1f1b"
    microbatches: Annotated[int, Field(ge=1, le=1024)] = 1  # pipeline micro-batches per training micro-batch
    # Parts per worker under interleaved_1f1b (Megatron's virtual pipeline stages): worker r of a
    # pipeline holds parts r, r + stages, r + 2 x stages, ... (default 2 there; 1 for gpipe and 1f1b).
    virtual_stages: Annotated[int, Field(ge=1, le=16)] | None = None
    # The blocks of each part (default: equal counts; embeddings on the first, norm and head on the last).
    split: Annotated[list[Annotated[int, Field(ge=1)]], Field(min_length=2, max_length=1024)] | None = None

    @property
    def per_worker(self) -> int:
        """Parts (stages of the model) each worker of the pipeline holds."""
        if self.virtual_stages is not None:
            return self.virtual_stages
        return 2 if self.schedule == "interleaved_1f1b" else 1

    @property
    def parts(self) -> int:
        """The model's stages: ``stages`` workers x ``per_worker`` each."""
        return self.stages * self.per_worker

    @model_validator(mode="after")
    def _split_stages(self) -> PipelineConfig:
        if self.virtual_stages is not None and self.virtual_stages > 1 and self.schedule != "interleaved_1f1b":
            raise ValueError(
                f"virtual_stages {self.virtual_stages} needs schedule interleaved_1f1b "
                f"({self.schedule} runs one stage per worker)"
            )
        if self.split is not None and len(self.split) != self.parts:
            per = f" ({self.stages} x virtual_stages {self.per_worker})" if self.per_worker > 1 else ""
            raise ValueError(f"split {self.split} must give {self.parts} block counts, one per stage{per}")
        if self.schedule == "interleaved_1f1b":
            rounds = max(1, self.microbatches // self.stages)
            if self.microbatches % rounds:
                raise ValueError(
                    f"microbatches {self.microbatches} under interleaved_1f1b over {self.stages} stages must be a "
                    f"multiple of {rounds} (microbatches // stages), or fewer than the stages"
                )
        return self


class ParallelConfig(Section):
    """How the model is spread over the workers, and the memory/speed switches of its blocks."""

    strategy: Literal["ddp", "fsdp"] = "ddp"  # the data-parallel dimension
    fsdp: FSDPConfig = Field(default_factory=FSDPConfig)
    # Tensor parallel: groups of this many workers split every block's matrices; the workers form a
    # (data-parallel x tensor-parallel) mesh, and the data-parallel dimension is ``strategy``.
    tensor_parallel: Annotated[int, Field(ge=1, le=64)] = 1
    tp_plan: str | None = None  # "pkg.module:function": the user's own plan (docs/parallelism.md)
    activation_checkpointing: Literal["none", "full", "every_n"] = "none"
    activation_checkpointing_every_n: Annotated[int, Field(ge=1, le=1024)] = 2
    compile: bool = False
    # Convolution weights and image batches channels-last (NHWC): PyTorch's convolutions run faster
    # that way. auto: on for the built-in CNNs under plain DDP (worker/blocks.channels_last_wanted).
    channels_last: bool | Literal["auto"] = "auto"
    # DDP communication (worker/compression.py): the gradient all-reduce's hook, bucket size, graph.
    grad_compression: Literal["none", "bf16", "fp16", "powersgd"] = "none"
    powersgd: PowerSGDConfig = Field(default_factory=PowerSGDConfig)
    bucket_cap_mb: Annotated[float, Field(gt=0, le=1 << 16)] | None = None  # None: DDP's default, 25
    static_graph: bool = False
    sync: SyncConfig | None = None  # local SGD / DiLoCo instead of a gradient all-reduce every step
    pipeline: PipelineConfig | None = None  # the workers form a (pipeline x data-parallel) mesh

    @property
    def stages(self) -> int:
        """Pipeline stages (1 without ``pipeline``): with tensor_parallel, the workers per batch."""
        return self.pipeline.stages if self.pipeline is not None else 1

    @property
    def plain_ddp(self) -> bool:
        """Whole models replicated: DDP, no tensor parallelism, no pipeline."""
        return self.strategy == "ddp" and self.tensor_parallel == 1 and self.pipeline is None

    @model_validator(mode="after")
    def _communication(self) -> ParallelConfig:
        ddp_only = {
            "parallel.grad_compression": self.grad_compression != "none",
            "parallel.bucket_cap_mb": self.bucket_cap_mb is not None,
            "parallel.static_graph": self.static_graph,
            "parallel.sync": self.sync is not None,
        }
        for key, used in ddp_only.items():
            if used and self.strategy != "ddp":
                raise ValueError(f"{key} needs parallel.strategy: ddp (fsdp has no DDP gradient all-reduce)")
            if used and self.tensor_parallel > 1:
                raise ValueError(f"{key} needs parallel.tensor_parallel: 1 (tensor-parallel replicas are not DDP)")
        if self.sync is not None and self.grad_compression != "none":
            raise ValueError(
                "parallel.sync and parallel.grad_compression exclude each other (sync has no gradient all-reduce)"
            )
        if self.sync is not None and (self.bucket_cap_mb is not None or self.static_graph):
            raise ValueError(
                "parallel.bucket_cap_mb and parallel.static_graph are DDP's options; parallel.sync does not use DDP"
            )
        return self

    @field_validator("tp_plan")
    @classmethod
    def _plan_path(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"[\w.]+:[\w.]+", value):
            raise ValueError(f"must look like 'package.module:function', got {value!r}")
        return value


class EncryptionConfig(Section):
    """``checkpoint.encryption``: every checkpoint file AES-256-GCM encrypted with the key (32 bytes,
    base64 or hex) in the environment variable ``key_env`` (checkpoint/crypto.py)."""

    key_env: Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")]


class CheckpointConfig(Section):
    every_n_steps: Steps | None = None
    every_n_minutes: Annotated[float, Field(gt=0, le=MAX_SECONDS / 60)] | None = None
    at_epoch_end: bool = False
    keep_last: Count = 3
    keep_best_metric: str | None = None
    keep_best_mode: Literal["min", "max"] = "min"
    storage_path: str | None = None
    on_save_error: Literal["continue", "fail"] = "continue"
    resume: str = "auto"
    encryption: EncryptionConfig | None = None
    # S3 server-side encryption of every object a checkpoint writes (checkpoint/sse.py)
    s3_sse: Literal["aws:kms", "AES256"] | None = None
    s3_sse_kms_key_id: Annotated[str, Field(min_length=1, max_length=2048)] | None = None

    @model_validator(mode="after")
    def _sse(self) -> CheckpointConfig:
        if self.s3_sse_kms_key_id is not None and self.s3_sse != "aws:kms":
            raise ValueError("checkpoint.s3_sse_kms_key_id needs checkpoint.s3_sse: aws:kms")
        if self.s3_sse is not None and not (self.storage_path or "").startswith("s3://"):
            raise ValueError("checkpoint.s3_sse needs an s3:// checkpoint.storage_path")
        return self

    @field_validator("resume")
    @classmethod
    def _resume_value(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must be auto, none, or the path of a checkpoint directory")
        return value


class HangConfig(Section):
    """When a step is a hang (worker/watchdog.py) and what the driver does about it (driver/hangs.py):
    after ``warmup_steps`` steps, a step longer than ``multiple`` x the p99 of the run's own step
    times, and at least ``floor_s``; ``failure.collective_timeout_s`` stays the ceiling."""

    enabled: bool = True
    multiple: Annotated[float, Field(ge=1.5, le=10_000.0)] = 10.0
    floor_s: Annotated[float, Field(ge=0.5, le=MAX_SECONDS)] = 10.0
    warmup_steps: Annotated[int, Field(ge=1, le=1_000_000)] = 10
    kill: bool = True  # kill the ranks that did not arrive (Ray Train restarts the group); false: diagnose only


class PreemptionConfig(Section):
    """``failure.preemption``: a cloud's notice on each node's metadata endpoint, turned into Ray's
    preemption drain (worker/preemption.py); the run then checkpoints at once."""

    notice: Literal["off", "aws", "gcp", "azure"] = "off"
    url: str | None = None  # the endpoint's base instead of the provider's; {node_id}, {node_ip} filled in
    poll_s: Annotated[float, Field(ge=0.1, le=600.0)] = 2.0
    window_s: Annotated[float, Field(ge=1.0, le=3600.0)] = 30.0  # the deadline when a notice gives none

    @field_validator("url")
    @classmethod
    def _http(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError("an http:// or https:// address (the metadata endpoint's base)")
        return value


class StragglerConfig(Section):
    """When a rank is a straggler (worker/straggler.py): its own time per step (data wait and
    forward) above ``threshold`` x the median of the other ranks' over ``window_steps``
    consecutive steps; named on the console with its node, then ``action``."""

    threshold: Annotated[float, Field(gt=1.0, le=1000.0)] = 1.5
    window_steps: Annotated[int, Field(ge=1, le=MAX_STEPS)] = 50
    action: Literal["report", "restart", "exclude"] = "report"  # exclude: an elastic run goes on without its node


class FailureConfig(Section):
    max_failures: Annotated[int, Field(ge=-1, le=MAX_COUNT)] = 3
    # What a failed worker costs: the whole group restarted (Ray Train's default), or only the failed
    # worker replaced while the others keep their processes and rejoin (driver/replace.py).
    replace: Literal["group", "worker"] = "group"
    collective_timeout_s: Annotated[float, Field(ge=1.0, le=MAX_SECONDS)] = 300.0  # whole seconds reach gloo/NCCL: >= 1
    hang: HangConfig = Field(default_factory=HangConfig)
    straggler: StragglerConfig | None = Field(default_factory=StragglerConfig)  # null: scores only, nobody named
    preemption: PreemptionConfig = Field(default_factory=PreemptionConfig)


def unsafe_mode(mode: int, *, private: bool) -> str | None:
    """What is wrong with a TLS file's permission bits, or None: the one rule for every key and
    certificate trainforge reads (``cluster.tls``, ``RAY_TLS_*``, ``certs create --ca-from``'s
    ca.key). A private key only its owner and group may read (a Kubernetes Secret mounted 0440 for
    the pod's fsGroup is fine); no file that every user may replace (a CA they chose, a key of theirs)."""
    shown = f"mode {stat.S_IMODE(mode):04o}"
    if private and mode & stat.S_IROTH:
        return f"the private key is readable by every user ({shown}); chmod 600 it"
    if mode & stat.S_IWOTH:
        return f"writable by every user ({shown}): anyone could replace it; chmod o-w it"
    return None


def _tls_file(value: str, key: str, *, private: bool = False) -> str:
    """A file Ray reads at start-up, as an absolute path (Ray's processes run elsewhere): a regular
    file (a link to one, as a Kubernetes Secret mounts it, is fine) whose mode ``unsafe_mode`` passes.
    What is inside is checked before Ray starts (driver/tls_files.py)."""
    path = Path(value).expanduser().absolute()
    try:
        info = path.stat()
    except OSError as err:
        raise ValueError(f"cluster.tls.{key} {value}: {err.strerror or err}") from None
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"cluster.tls.{key} {value}: not a regular file")
    problem = unsafe_mode(info.st_mode, private=private)
    if problem is not None:
        raise ValueError(f"cluster.tls.{key} {value}: {problem}")
    return str(path)


class TlsConfig(Section):
    """Ray's mutual TLS between every process of the cluster (``trainforge certs create`` makes
    these files): given to Ray as RAY_USE_TLS, RAY_TLS_CA_CERT, RAY_TLS_SERVER_CERT and
    RAY_TLS_SERVER_KEY before Ray is imported (driver/tls.py). The CA also verifies the Jobs API's
    https:// address for ``submit``."""

    ca: str
    cert: str
    key: str
    # The run checkpoints and stops (resumable) this long before the first of its certificates
    # expires (driver/tls_watch.py); 0: it trains on to the expiry, and only a restart fails.
    stop_before_expiry_s: Annotated[float, Field(ge=0.0, le=MAX_SECONDS)] = 900.0

    @field_validator("ca", "cert")
    @classmethod
    def _certificate(cls, value: str, info: ValidationInfo) -> str:
        return _tls_file(value, str(info.field_name))

    @field_validator("key")
    @classmethod
    def _private_key(cls, value: str) -> str:
        return _tls_file(value, "key", private=True)


class ClusterConfig(Section):
    address: str | None = None
    tls: TlsConfig | None = None  # None: plain gRPC, unless RAY_USE_TLS is set in the environment
    # Where a local Ray (no address) listens: 127.0.0.1 keeps GCS, raylet, object manager, workers
    # and the metrics agent on loopback; 0.0.0.0 is Ray's own default (every interface).
    bind_address: Literal["127.0.0.1", "0.0.0.0"] = "127.0.0.1"
    num_cpus: Annotated[int, Field(ge=1, le=1 << 20)] | None = None
    report_poll_interval_s: Annotated[float, Field(gt=0, le=60.0)] = 0.2


class TrackingConfig(Section):
    """Where the driver records a run besides its run directory: MLflow, one run per training job
    (tracking/, observers/mlflow.py), and TensorBoard event files (observers/tensorboard.py)."""

    enabled: bool = True  # MLflow
    tensorboard: bool = False  # TensorBoard event files under <run dir>/tensorboard/, independent of enabled
    uri: str | None = None  # None: a local store under run.output_dir, so no server is needed
    experiment: str = "trainforge"
    required: bool = False  # True: unreachable at the start fails the run; an incomplete record fails it at the end
    system_metrics: bool = True  # per-node CPU, memory, network, disk (psutil) and GPU (NVML)
    parent_run_id: str | None = None  # nest this run under another MLflow run (a search's trials)
    flush_timeout_s: Annotated[float, Field(ge=0.0, le=MAX_SECONDS)] = (
        30.0  # at the end, wait at most this long for MLflow
    )
    max_buffered_points: Annotated[int, Field(ge=1, le=10**8)] = (
        100_000  # metric points kept while the server is away; oldest dropped
    )
    # Log the final model as an MLflow model and register a new version under this name (tracking/registry.py)
    register_model: str | None = None

    @field_validator("register_model")
    @classmethod
    def _model_name(cls, value: str | None) -> str | None:
        """MLflow's rules for registered model names (mlflow.utils.validation._validate_model_name),
        plus its database's 256 characters, so a bad name fails before training, not after it."""
        if value is None:
            return None
        if not value.strip() or len(value) > 256:
            raise ValueError("an MLflow model name is 1-256 characters, not all blank")
        if "/" in value or ":" in value or not value.isprintable():
            raise ValueError("an MLflow model name may not contain '/', ':' or control characters")
        if value in (".", "..") or value.startswith(".."):
            raise ValueError("an MLflow model name may not be '.' or start with '..'")
        return value

    @model_validator(mode="after")
    def _register_needs_tracking(self) -> TrackingConfig:
        if self.register_model is not None and not self.enabled:
            raise ValueError("tracking.register_model needs tracking.enabled: true (the model is registered in MLflow)")
        return self


class MetricsConfig(Section):
    """Prometheus export of training metrics through Ray's metrics agent on every node (metrics/)."""

    enabled: bool = True
    # How often every process of a local Ray pushes its metrics to the node's agent (Ray's
    # metrics_report_interval_ms; Ray floors it at 1 s). None: Ray's default, 10 s. A cluster sets
    # it at `ray start` (RAY_metrics_report_interval_ms); setting it for one is refused at connect.
    export_interval_s: Annotated[float, Field(ge=1.0, le=3600.0)] | None = None
    # Time DDP's gradient all-reduce through a Python communication hook (metrics/worker/comm.py); false
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
    num_trials: Count | None = None  # None: 8, or every grid point once for search grid
    max_concurrent: Workers | None = None  # None: what the cluster's free resources allow
    workers_per_trial: Workers = 1
    search: Literal["random", "grid", "optuna"] = "random"
    scheduler: Literal["none", "asha", "pbt", "median"] = "none"
    scheduler_params: PlainDict = Field(default_factory=dict)  # a section per scheduler: {asha: {...}}
    time_budget_s: Annotated[float, Field(gt=0, le=366 * 24 * 3600.0)] | None = None
    # Trials lease warm worker groups from a pool the search keeps (driver/warm.py, docs/tune.md).
    reuse_workers: bool = True


Price = Annotated[float, Field(ge=0.0, le=1e6)]


class CostConfig(Section):
    """``cost``: what the run's hardware costs per hour, to show cost so far and projected to the end.

    Off while no price is set. Billed: workers x (GPUs or CPUs per worker, from ``scaling``) x wall
    hours (``trainforge.driver.cost``); docs/configuration.md.
    """

    price_per_gpu_hour: Price | None = None  # per GPU, with scaling.use_gpu
    price_per_cpu_hour: Price | None = None  # per CPU (worker CPUs from scaling.resources_per_worker, else 1)
    currency: str = "USD"

    @field_validator("currency")
    @classmethod
    def _currency_code(cls, value: str) -> str:
        if not re.fullmatch(r"[A-Z]{3}", value):
            raise ValueError("must be a 3-letter ISO 4217 currency code in capitals, e.g. USD, EUR, GBP")
        return value

    @property
    def enabled(self) -> bool:
        return self.price_per_gpu_hour is not None or self.price_per_cpu_hour is not None


class ProfileConfig(Section):
    """``profile``: a torch.profiler trace of optimizer steps START..END (1-based, inclusive) on the
    listed ranks, with a top-operators table and the communication share (worker/profiling.py)."""

    steps: tuple[Steps, Steps]
    ranks: Annotated[list[Annotated[int, Field(ge=0, lt=MAX_WORKERS)]], Field(min_length=1, max_length=64)] = Field(
        default_factory=lambda: [0]
    )

    @field_validator("steps")
    @classmethod
    def _start_le_end(cls, value: tuple[int, int]) -> tuple[int, int]:
        if value[0] > value[1]:
            raise ValueError(f"[START, END] needs START <= END, got {list(value)}")
        return value


class Config(Section):
    """The whole run: one section per component plus a few run-wide scalars."""

    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig
    data: DataSection = Field(default_factory=DigitsData)  # the section of the source data.name names
    train: TrainConfig
    optim: OptimConfig = Field(default_factory=OptimConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    scaling: ScalingConfig = Field(default_factory=ScalingConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    failure: FailureConfig = Field(default_factory=FailureConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    tune: TuneConfig = Field(default_factory=TuneConfig)
    cost: CostConfig = Field(default_factory=CostConfig)
    profile: ProfileConfig | None = None
    callbacks: Annotated[list[Callback], Field(max_length=64)] = Field(default_factory=list)
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    seed: Annotated[int, Field(ge=0, le=2**32 - 1)] = 0
    deterministic: bool = False

    @model_validator(mode="after")
    def _cross_checks(self) -> Config:
        if self.precision == "fp16" and not self.scaling.use_gpu:
            raise ValueError("precision fp16 needs scaling.use_gpu: true (on CPU use bf16)")
        if self.train.sync_batchnorm and not self.scaling.use_gpu:
            raise ValueError("train.sync_batchnorm needs scaling.use_gpu: true (PyTorch's SyncBatchNorm is GPU-only)")
        workers, global_batch = self.scaling.num_workers, self.train.global_batch_size
        # An elastic [min, max] is checked by the workers, against the count they start with.
        if global_batch is not None and isinstance(workers, int):
            # A tensor-parallel group, and the stages of a pipeline, read one batch.
            replicas = max(1, workers // (self.parallel.tensor_parallel * self.parallel.stages))
            of = f"scaling.num_workers {workers}" + (
                f" / parallel.tensor_parallel {self.parallel.tensor_parallel}" if replicas != workers else ""
            )
            self.train.split(replicas, of)
        if self.parallel.fsdp.cpu_offload and self.parallel.strategy != "fsdp":
            raise ValueError("parallel.fsdp.cpu_offload needs parallel.strategy: fsdp")
        if self.parallel.fsdp.cpu_offload and not self.scaling.use_gpu:
            raise ValueError("parallel.fsdp.cpu_offload needs scaling.use_gpu: true (it moves shards off the GPU)")
        if self.parallel.fsdp.mixed_precision != "none" and self.parallel.strategy != "fsdp":
            raise ValueError(
                "parallel.fsdp.mixed_precision needs parallel.strategy: fsdp (for ddp use precision: bf16)"
            )
        tp = self.parallel.tensor_parallel
        if tp > 1 and isinstance(self.scaling.num_workers, tuple):
            raise ValueError(
                "parallel.tensor_parallel needs a fixed scaling.num_workers (an elastic [min, max] could pick "
                "a world size that tensor-parallel groups do not divide)"
            )
        if tp > 1 and self.scaling.max_workers % tp:
            raise ValueError(
                f"parallel.tensor_parallel {tp} must divide scaling.num_workers {self.scaling.max_workers}: "
                f"workers form groups of {tp} (e.g. num_workers {tp * max(1, self.scaling.max_workers // tp)})"
            )
        self._check_replicate()
        if self.parallel.tp_plan is not None and tp == 1:
            raise ValueError("parallel.tp_plan needs parallel.tensor_parallel > 1")
        if self.parallel.fsdp.mixed_precision != "none" and self.precision != "fp32":
            raise ValueError(
                "parallel.fsdp.mixed_precision and precision both set compute precision; "
                "use one (mixed_precision: bf16 with precision: fp32, or mixed_precision: none)"
            )
        return self

    def _check_replicate(self) -> None:
        """parallel.fsdp.replicate groups the data-parallel workers: it must divide their count."""
        replicate, tp = self.parallel.fsdp.replicate, self.parallel.tensor_parallel
        if replicate == 1:
            return
        if self.parallel.strategy != "fsdp":
            raise ValueError("parallel.fsdp.replicate needs parallel.strategy: fsdp (HSDP shards within groups)")
        if isinstance(self.scaling.num_workers, tuple):
            raise ValueError(
                "parallel.fsdp.replicate needs a fixed scaling.num_workers (an elastic [min, max] could pick "
                "a world size that the replica groups do not divide)"
            )
        stages = self.parallel.stages
        data_workers = self.scaling.num_workers // tp // stages
        if data_workers % replicate:
            of = f"scaling.num_workers {data_workers}"
            if tp > 1 or stages > 1:
                over = (f" / tensor_parallel {tp}" if tp > 1 else "") + (
                    f" / pipeline.stages {stages}" if stages > 1 else ""
                )
                of = f"the data-parallel workers (scaling.num_workers {self.scaling.num_workers}{over})"
            raise ValueError(f"parallel.fsdp.replicate {replicate} must divide {of}: replicas are groups of equal size")

    @model_validator(mode="after")
    def _pipeline_fits(self) -> Config:
        """What ``parallel.pipeline`` runs with: fixed workers its stages divide, micro-batches that
        divide ``train.batch_size``, a built-in decoder, and none of what it does not support yet."""
        pipeline, parallel = self.parallel.pipeline, self.parallel
        if pipeline is None:
            return self
        workers, batch = self.scaling.num_workers, self.train.batch_size
        if isinstance(workers, tuple) or workers % pipeline.stages:
            raise ValueError(
                f"parallel.pipeline.stages {pipeline.stages} must divide a fixed scaling.num_workers "
                f"(it is {list(workers) if isinstance(workers, tuple) else workers})"
            )
        tp = parallel.tensor_parallel
        if workers % (pipeline.stages * tp):
            raise ValueError(
                f"parallel.pipeline.stages {pipeline.stages} x parallel.tensor_parallel {tp} must divide "
                f"scaling.num_workers {workers} (each stage is split over a group of {tp})"
            )
        if not isinstance(batch, int) or batch % pipeline.microbatches:
            raise ValueError(
                f"parallel.pipeline.microbatches {pipeline.microbatches} must divide train.batch_size "
                f"(the per-replica micro-batch; it is {batch})"
            )
        if not (self.model.name or "").startswith(("llama_", "gpt2_")):
            raise ValueError(
                f"parallel.pipeline splits the built-in decoders (llama_*, gpt2_*) only; model is {self.model.name}"
            )
        unsupported = {
            # FSDP shards each stage over its data-parallel group (HSDP: within its replica groups);
            # host offload is not run with stages yet.
            "parallel.fsdp.cpu_offload": parallel.strategy == "fsdp" and parallel.fsdp.cpu_offload,
            "parallel.fsdp.wrap": parallel.strategy == "fsdp" and parallel.fsdp.wrap is not None,
            "parallel.grad_compression": parallel.grad_compression != "none",
            "parallel.bucket_cap_mb": parallel.bucket_cap_mb is not None,
            "parallel.static_graph": parallel.static_graph,
            "parallel.sync": parallel.sync is not None,
            "parallel.compile": parallel.compile,
            f"model.task {self.model.task}": self.model.task not in (None, "causal_lm"),
            "model.lora": self.model.lora is not None,
            "model.pretrained": self.model.pretrained is not None,
            "train.anomaly": self.train.anomaly is not None,
            "precision fp16": self.precision == "fp16",  # its grad scaler's skip would have to agree across stages
        }
        for key, used in unsupported.items():
            if used:
                raise ValueError(f"parallel.pipeline does not run with {key} yet")
        return self

    @model_validator(mode="after")
    def _task_fits_targets(self) -> Config:
        """Float targets go with model.task regression and regression with float targets, where the
        data section says which it gives (a factory's data says so once built: models/tasks.py)."""
        task, floats = self.model.task, self.data.float_targets
        if self.model.loss is not None and task is None and floats is False:
            raise ValueError("model.loss needs model.task: regression (and data with float targets)")
        if task == "regression" and floats is False:
            raise ValueError(f"model.task regression needs float targets: {float_targets_hint(self.data)}")
        if task not in ("regression", "custom", "hf", None) and floats:
            where = "data.target names" if isinstance(self.data, TabularData) else "data.kind regression gives"
            raise ValueError(f"{where} float targets, which model.task {task} cannot learn: set model.task: regression")
        return self

    @model_validator(mode="after")
    def _early_stopping_validates(self) -> Config:
        """``train.early_stopping`` counts validation passes: it needs validation data and passes
        during training (an eval cadence or epoch ends)."""
        train = self.train
        if train.early_stopping is None:
            return self
        data = self.data
        fraction = getattr(data, "val_fraction", None)
        fixed_split = "val_fraction" in getattr(data, "unread", ())
        if fraction == 0 and not fixed_split and not getattr(data, "val_path", None):
            raise ValueError(
                "train.early_stopping needs validation data: data.val_fraction is 0 (set it above 0, or give "
                "validation data)"
            )
        if train.eval_every_n_steps is None and train.epochs is None:
            raise ValueError(
                "train.early_stopping needs validations during training: set train.eval_every_n_steps "
                "(or train.epochs: each epoch ends with one)"
            )
        return self

    @model_validator(mode="after")
    def _profile_ranks(self) -> Config:
        if self.profile is not None:
            workers = self.scaling.max_workers
            outside = [rank for rank in self.profile.ranks if rank >= workers]
            if outside:
                raise ValueError(
                    f"profile.ranks {outside} are outside the {workers} worker(s) of scaling.num_workers "
                    f"(ranks 0..{workers - 1})"
                )
        return self

    @model_validator(mode="after")
    def _exclude_is_elastic(self) -> Config:
        """``failure.straggler.action: exclude`` continues on the nodes left: an elastic run only."""
        straggler = self.failure.straggler
        if straggler is not None and straggler.action == "exclude" and not isinstance(self.scaling.num_workers, tuple):
            raise ValueError(
                "failure.straggler.action exclude needs an elastic scaling.num_workers [min, max] (the run "
                f"continues on the nodes left); it is {self.scaling.num_workers}: use report or restart"
            )
        return self

    @model_validator(mode="after")
    def _replace_worker_limits(self) -> Config:
        """``failure.replace: worker`` is Ray Train's replica-group replacement, which Ray (2.60) does
        for a fixed-size group and without its preemption watcher (driver/replace.py)."""
        if self.failure.replace != "worker":
            return self
        if isinstance(self.scaling.num_workers, tuple):
            raise ValueError(
                "failure.replace worker needs a fixed scaling.num_workers (Ray Train replaces a worker of a "
                f"fixed-size group only); it is {list(self.scaling.num_workers)}: use failure.replace: group"
            )
        if self.failure.preemption.notice != "off":
            raise ValueError(
                f"failure.preemption.notice {self.failure.preemption.notice} needs failure.replace: group "
                "(Ray Train's preemption watcher, which tells the workers, does not run for replaced workers)"
            )
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
