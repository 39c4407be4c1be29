"""The small components of a worker's training state: progress, LR schedule, loss scaler, RNG.

* :class:`Progress` (``progress``): optimizer steps taken and samples seen by all workers.
* :class:`Schedule` (``schedule``): the LR schedule's position; when the checkpoint was written
  under other optimizer or schedule settings (another run's checkpoint: a PBT exploit, a
  fine-tune), this run's own values are put back on top (``worker/optim.apply_hyperparameters``).
* :class:`Scaler` (``scaler``): the fp16 loss scaler (empty when it is off).
* :class:`Rng` (``rng``): every rank's own Python, NumPy, torch and CUDA generators; restored only
  onto the ranks that wrote them (another worker count cannot continue the same draws).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, ClassVar

import torch
from pydantic import BaseModel, Field, JsonValue, StrictFloat, StrictInt, StrictStr, field_validator, model_validator

from trainforge.checkpoint.schema import MAX_STEP, NonNegative, Number, Schema, UInt32
from trainforge.checkpoint.state import State, capture_rng, restore_rng
from trainforge.config import OptimConfig, ScheduleConfig
from trainforge.worker.components.base import Component, Restore, StateSchema
from trainforge.worker.optim import apply_hyperparameters, effective_lr, hyperparameters_differ, names_by_parameter
from trainforge.worker.schedule import LRSchedule

if TYPE_CHECKING:
    from trainforge.worker.build import WorkerRun

Step = Annotated[int, Field(ge=0, le=MAX_STEP)]
Count = Annotated[int, Field(ge=0, le=2**62)]
# A learning rate or loss scale read back: finite and not negative (NaN would train on NaN).
Rate = Annotated[float, Field(ge=0, allow_inf_nan=False)]


class RngState(Schema):
    """One rank's generators, as ``state.capture_rng`` writes them: the ``rng`` component's own state."""

    python: tuple[
        Annotated[StrictInt, Field(ge=0)],
        Annotated[list[UInt32], Field(min_length=625, max_length=625)],
        StrictFloat | None,
    ]
    numpy: tuple[
        StrictStr, Annotated[list[UInt32], Field(min_length=624, max_length=624)], NonNegative, StrictInt, Number
    ]
    torch: StrictStr
    cuda: list[StrictStr] | None = None

    @field_validator("torch")
    @classmethod
    def _base64(cls, value: str) -> str:
        try:
            base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError("is not base64") from None
        return value


class ProgressState(StateSchema):
    global_step: Step
    samples_seen: Count


@dataclass
class Progress(Component):
    """How far training has come, over all workers."""

    name: ClassVar[str] = "progress"
    schema: ClassVar[type[BaseModel]] = ProgressState

    global_step: int = 0
    samples_seen: int = 0

    @classmethod
    def from_run(cls, run: WorkerRun) -> Progress:
        return cls()

    def state_dict(self) -> State:
        return State({"global_step": self.global_step, "samples_seen": self.samples_seen})

    def load_state_dict(self, state: State, restore: Restore) -> None:
        saved = ProgressState.model_validate(state.values)
        self.global_step, self.samples_seen = saved.global_step, saved.samples_seen


class ScheduleState(StateSchema):
    """trainforge's own schedule (constant, step, cosine, linear): LambdaLR's state, its functions
    (code, not state) left out. A torch.optim.lr_scheduler class: its name, the optimizer steps
    taken and its state_dict as JSON, checked key by key against this run's scheduler as it loads."""

    last_epoch: Annotated[int, Field(ge=-1, le=MAX_STEP)] | None = None
    base_lrs: Annotated[list[Rate], Field(max_length=4096)] | None = None
    step_count: Annotated[int | None, Field(ge=0, le=MAX_STEP + 1, alias="_step_count")] = None
    last_lr: Annotated[list[Rate] | None, Field(max_length=4096, alias="_last_lr")] = None
    is_initial: Annotated[bool | None, Field(alias="_is_initial")] = None
    get_lr_called: Annotated[bool | None, Field(alias="_get_lr_called_within_step")] = None
    verbose: bool | None = None
    scheduler: Annotated[StrictStr, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")] | None = None
    steps: Step | None = None
    state: dict[str, JsonValue] | None = None

    @field_validator("state")
    @classmethod
    def _bounded(cls, value: dict[str, JsonValue] | None) -> dict[str, JsonValue] | None:
        if value is not None and json_size(value) > MAX_SCHEDULER_VALUES:
            raise ValueError(f"holds more than {MAX_SCHEDULER_VALUES} values")
        return value

    @model_validator(mode="after")
    def _one_kind(self) -> ScheduleState:
        if self.scheduler is None:
            if self.last_epoch is None or self.base_lrs is None:
                raise ValueError("needs last_epoch and base_lrs (trainforge's own schedule) or scheduler, steps, state")
            if self.steps is not None or self.state is not None:
                raise ValueError("steps and state go with a scheduler's name")
        elif self.steps is None or self.state is None:
            raise ValueError(f"scheduler {self.scheduler} needs steps and state")
        elif self.last_epoch is not None or self.base_lrs is not None:
            raise ValueError("last_epoch and base_lrs of a torch scheduler go in its state")
        return self


# A scheduler's state is a few numbers per parameter group (OneCycleLR's phases, MultiStepLR's milestones).
MAX_SCHEDULER_VALUES = 1 << 16


def json_size(value: JsonValue) -> int:
    """The values in a JSON value, containers included."""
    if isinstance(value, dict):
        return 1 + sum(json_size(item) for item in value.values())
    if isinstance(value, list):
        return 1 + sum(json_size(item) for item in value)
    return 1


class Schedule(Component):
    """The LR schedule of a worker's optimizer (worker/schedule.py), with this run's hyperparameters
    re-applied when the checkpoint's config set others."""

    name: ClassVar[str] = "schedule"
    schema: ClassVar[type[BaseModel]] = ScheduleState

    def __init__(
        self,
        schedule: LRSchedule,
        optimizer: torch.optim.Optimizer,
        optim: OptimConfig,
        config: ScheduleConfig,
        lr: float,
        names: Mapping[int, Sequence[str]] | None = None,
    ) -> None:
        self.schedule = schedule
        self.optimizer = optimizer
        self.optim = optim
        self.config = config
        self.lr = lr  # this run's base LR (after linear scaling): what a foreign checkpoint gets
        self.names = names  # each parameter's names by id: which optim.param_groups entry it is in

    @classmethod
    def from_run(cls, run: WorkerRun) -> Schedule:
        cfg, runner = run.config, run.runner
        lr = effective_lr(cfg.optim, run.data.samples_per_step * run.data_world)
        names = names_by_parameter(run.plan.named_parameters(run.model))
        return cls(runner.scheduler, runner.optimizer, cfg.optim, cfg.schedule, lr, names)

    def state_dict(self) -> State:
        return State(self.schedule.state_dict())

    def load_state_dict(self, state: State, restore: Restore) -> None:
        saved = ScheduleState.model_validate(state.values).model_dump(by_alias=True, exclude_none=True)
        differ = bool(restore.config) and hyperparameters_differ(restore.config, self.optim, self.config)
        note = self.schedule.load_state_dict(saved, restore.step, keep_arguments=differ)
        if note:
            restore.notes.append(note)
        if differ:
            apply_hyperparameters(self.optimizer, self.schedule, self.optim, self.lr, self.names)
            lr = self.optimizer.param_groups[0]["lr"]
            restore.notes.append(f"optimizer hyperparameters from this run's config (lr now {lr:.4g})")

    @property
    def current_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])


class ScalerState(StateSchema):
    """The fp16 loss scaler's state (empty when the scaler is off)."""

    scale: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None
    growth_factor: Annotated[float, Field(gt=1, le=1e6, allow_inf_nan=False)] | None = None
    backoff_factor: Annotated[float, Field(gt=0, lt=1)] | None = None
    growth_interval: Annotated[int, Field(ge=1, le=MAX_STEP)] | None = None
    growth_tracker: Annotated[int | None, Field(ge=0, le=MAX_STEP, alias="_growth_tracker")] = None


class Scaler(Component):
    name: ClassVar[str] = "scaler"
    schema: ClassVar[type[BaseModel]] = ScalerState

    def __init__(self, scaler: torch.amp.GradScaler) -> None:
        self.scaler = scaler

    @classmethod
    def from_run(cls, run: WorkerRun) -> Scaler:
        return cls(run.runner.scaler)

    def state_dict(self) -> State:
        return State(dict(self.scaler.state_dict()))

    def load_state_dict(self, state: State, restore: Restore) -> None:
        saved = ScalerState.model_validate(state.values)
        self.scaler.load_state_dict(saved.model_dump(by_alias=True, exclude_none=True))


class Rng(Component):
    """This process's random number generators, each rank its own."""

    name: ClassVar[str] = "rng"
    rank_schema: ClassVar[type[BaseModel]] = RngState

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank

    @classmethod
    def from_run(cls, run: WorkerRun) -> Rng:
        return cls(run.rank)

    def state_dict(self) -> State:
        return State(rank_values=capture_rng())

    def load_state_dict(self, state: State, restore: Restore) -> None:
        if state.rank_values is not None:
            RngState.model_validate(state.rank_values)
            restore_rng(state.rank_values)
