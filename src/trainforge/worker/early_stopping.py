"""``train.early_stopping``: end the run when a validation metric stops improving (component
``early_stopping``).

Counted in validation passes: each pass during training (the eval cadence, or each epoch's end)
is one count, and the final pass of a run that goes to its end one more; a pass whose ``metric``
is better than the best so far by more than ``min_delta`` (lower under ``mode: min``, higher under
``max``) resets the count, any other (NaN included) adds one. When ``patience`` passes in a row
did not improve, the run ends after that step as a finished run (exit 0), its summary.json with
``stopped_early: {step, best_step, best, metric}``. Validation metrics are all-reduced, so every
rank takes the same decision without a collective of its own.

``restore_best``: each pass that improves checkpoints the run at its step (and rotation keeps that
checkpoint), so the driver writes ``model.safetensors`` from the best pass's checkpoint.

The state (the best value, its step, the count) is checkpointed: a resume continues the count
exactly, and a re-run of an early-stopped run's directory ends at once. A checkpoint of another run
(``checkpoint.resume`` set to it) or of other settings (metric, mode) starts the count afresh.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Annotated, Any, ClassVar

from pydantic import BaseModel, Field

from trainforge.checkpoint.schema import MAX_STEP
from trainforge.checkpoint.state import State
from trainforge.config import EarlyStoppingConfig
from trainforge.errors import ConfigError
from trainforge.worker.components.base import Component, Restore, StateSchema

if TYPE_CHECKING:
    from trainforge.worker.build import WorkerRun

Step = Annotated[int, Field(ge=0, le=MAX_STEP)]


class MetricMissing(ConfigError):
    """``train.early_stopping.metric`` is not among the validation metrics: raised on every rank at
    the same pass (the metrics are all-reduced), so the run ends with it rather than retrying."""


class EarlyStoppingState(StateSchema):
    metric: Annotated[str, Field(max_length=200)]
    mode: Annotated[str, Field(pattern=r"^(min|max)$")]
    best: Annotated[float, Field(allow_inf_nan=False)] | None = None
    best_step: Step | None = None
    bad: Annotated[int, Field(ge=0, le=2**62)] = 0  # passes since the best without improvement
    last_step: Step | None = None  # the step of the last pass counted


class EarlyStopping(Component):
    """The best value of the metric so far and how many passes have not improved on it."""

    name: ClassVar[str] = "early_stopping"
    schema: ClassVar[type[BaseModel]] = EarlyStoppingState

    def __init__(self, cfg: EarlyStoppingConfig, run_name: str) -> None:
        self.cfg = cfg
        self.run_name = run_name
        self.best: float | None = None
        self.best_step: int | None = None
        self.bad = 0
        self.last_step: int | None = None

    @classmethod
    def from_run(cls, run: WorkerRun) -> EarlyStopping | None:
        cfg = run.config.train.early_stopping
        if cfg is None:
            return None
        if run.val_set is None:
            raise ConfigError("train.early_stopping needs validation data, and this run's data has none")
        return cls(cfg, run.config.run.name)

    @property
    def exhausted(self) -> bool:
        """Patience ran out: the run ends."""
        return self.bad >= self.cfg.patience

    @property
    def reason(self) -> str:
        best = f"{self.best:.6g} at step {self.best_step}" if self.best is not None else "no finite value"
        return (
            f"train.early_stopping: {self.cfg.metric} did not improve for {self.bad} validation(s) "
            f"(patience {self.cfg.patience}; best {best})"
        )

    def observe(self, step: int, metrics: dict[str, float]) -> bool | None:
        """Count one validation pass at ``step``; whether it improved on the best (None: a pass at a
        step already counted, such as the final pass right after one of the cadence)."""
        if step == self.last_step:
            return None
        metric = self.cfg.metric
        if metric not in metrics:
            known = ", ".join(sorted(metrics)) or "none"
            raise MetricMissing(
                f"train.early_stopping.metric {metric!r} is not one of this run's validation metrics ({known})"
            )
        self.last_step = step
        value = float(metrics[metric])
        if math.isfinite(value) and self.improves(value):
            self.best, self.best_step, self.bad = value, step, 0
            return True
        self.bad += 1
        return False

    def improves(self, value: float) -> bool:
        if self.best is None:
            return True
        if self.cfg.mode == "min":
            return value < self.best - self.cfg.min_delta
        return value > self.best + self.cfg.min_delta

    def state_dict(self) -> State:
        return State(
            {
                "metric": self.cfg.metric,
                "mode": self.cfg.mode,
                "best": self.best,
                "best_step": self.best_step,
                "bad": self.bad,
                "last_step": self.last_step,
            }
        )

    def load_state_dict(self, state: State, restore: Restore) -> None:
        saved = EarlyStoppingState.model_validate(state.values)
        theirs: Any = restore.config.get("run", {}).get("name") if restore.config else None
        if theirs != self.run_name or (saved.metric, saved.mode) != (self.cfg.metric, self.cfg.mode):
            restore.notes.append(
                "train.early_stopping: the checkpoint counted for another run or metric; the count starts here"
            )
            return
        self.best, self.best_step, self.bad, self.last_step = saved.best, saved.best_step, saved.bad, saved.last_step
