"""``train.anomaly``: a step whose loss or gradient is not finite, or whose loss spikes, is re-run
from the same state and batch to say whose fault it is, then skipped or rolled back.

The guard (component ``anomaly``) looks at every step between the backward and the optimizer
step (``worker/step.py``), when the weights have not moved yet: the loss is the mean over ranks
(one all-reduce) and the gradient norm is global, so every rank takes the same decision. A step
is anomalous when its loss or gradient norm is not finite (under fp16 a non-finite gradient is
the loss scaler's business, not an anomaly) or, once ``window`` accepted steps are known, when its
loss is above their mean + ``spike_zscore`` x their standard deviation. It is then computed once
more from the same weights, the same micro-batches and the same random state: the same verdict
again blames the data, a different one the hardware or a race. The step is dropped either way
(no optimizer step); under ``action: rollback`` the loop then goes back to the newest checkpoint
(``worker/rollback.py``). The window, the counts and the rollbacks are checkpointed, so a
restarted group carries on with them.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, ClassVar, Literal, cast

import torch
from pydantic import BaseModel, Field

from trainforge.checkpoint.state import State
from trainforge.config import AnomalyConfig
from trainforge.protocol import Anomaly
from trainforge.worker import collectives
from trainforge.worker.components.base import Component, Restore, StateSchema

if TYPE_CHECKING:
    from trainforge.worker.build import WorkerRun
    from trainforge.worker.components.data import DataSource

Count = Annotated[int, Field(ge=0, le=2**62)]
FiniteLoss = Annotated[float, Field(allow_inf_nan=False)]
Scale = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]

NONFINITE = "nonfinite"
SPREAD_FLOOR = 1e-6  # of the window's mean: the least standard deviation the spike rule assumes
SPIKE = "spike"


class AnomalyState(StateSchema):
    losses: Annotated[list[FiniteLoss], Field(max_length=10_000)]
    skipped: Count
    rolled_back: Count
    data: Count
    not_data: Count
    lr_scale: Scale  # the product of lr_factor over the rollbacks this state's LR holds


class AnomalyLimit(Exception):
    """Raised on every rank at the same step: ``train.anomaly.max_rollbacks`` is spent."""


@dataclass(frozen=True)
class Finding:
    """An anomalous step and its re-run, as every rank saw them (all-reduced)."""

    anomaly: str  # nonfinite or spike
    loss: float
    grad_norm: float
    rerun_loss: float
    rerun_grad_norm: float
    reproduced: bool  # the re-run gave the same verdict

    @property
    def attribution(self) -> Literal["data", "not_data"]:
        return "data" if self.reproduced else "not_data"

    def event(
        self, step: int, samples: tuple[int, ...], checkpoint: str | None = None, lr: float | None = None
    ) -> Anomaly:
        """The run's record of it: skipped, or (``checkpoint``) rolled back there with the LR now ``lr``."""
        anomaly: Literal["nonfinite", "spike"] = "nonfinite" if self.anomaly == NONFINITE else "spike"
        return Anomaly(
            step,
            anomaly,
            self.attribution,
            "skipped" if checkpoint is None else "rolled_back",
            finite_or_none(self.loss),
            finite_or_none(self.rerun_loss),
            finite_or_none(self.grad_norm),
            samples,
            checkpoint,
            lr,
        )


def finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


# The re-run of a step: its loss (this rank's, averaged over micro-batches) and global gradient norm.
Rerun = Callable[[], tuple[torch.Tensor, torch.Tensor]]


class AnomalyGuard(Component):
    """The spike window, the verdict on each step, and the counts summary.json reports."""

    name: ClassVar[str] = "anomaly"
    schema: ClassVar[type[BaseModel]] = AnomalyState

    def __init__(self, cfg: AnomalyConfig, device: torch.device, *, grads_count: bool = True) -> None:
        self.cfg = cfg
        self.device = device
        self.grads_count = grads_count  # False under fp16: the loss scaler skips overflowing steps itself
        self.losses: deque[float] = deque(maxlen=cfg.window)
        self.skipped = self.rolled_back = self.data = self.not_data = 0
        self.lr_scale = 1.0

    @classmethod
    def from_run(cls, run: WorkerRun) -> AnomalyGuard | None:
        cfg = run.config.train.anomaly
        if cfg is None:
            return None
        return cls(cfg, run.device, grads_count=not run.runner.scaler.is_enabled())

    def verdict(self, loss: float, grad_norm: float) -> str | None:
        """nonfinite, spike or None for a step's (all-reduced) loss and gradient norm."""
        if not math.isfinite(loss) or (self.grads_count and not math.isfinite(grad_norm)):
            return NONFINITE
        if len(self.losses) < self.cfg.window:
            return None
        mean = sum(self.losses) / len(self.losses)
        std = math.sqrt(sum((x - mean) ** 2 for x in self.losses) / len(self.losses))
        # A window of equal losses (std 0) would make any rounding a spike: float32's resolution is the floor.
        spread = max(std, SPREAD_FLOOR * abs(mean))
        return SPIKE if loss > mean + self.cfg.spike_zscore * spread else None

    def agreed(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> tuple[float, float]:
        """The loss as the mean over ranks (not finite if any rank's is) and the gradient norm (the
        same on every rank): one all-reduce and a host sync."""
        both = torch.stack([loss.detach().double(), grad_norm.detach().double().to(loss.device)])
        summed = collectives.all_reduce_sum(both.to(self.device), self.device)
        world = collectives.world_size()
        return float(summed[0].item()) / world, float(summed[1].item()) / world

    def check(self, loss: torch.Tensor, grad_norm: torch.Tensor, rerun: Rerun) -> Finding | None:
        """A step's verdict (every rank the same); for an anomalous step, its re-run's too. An
        accepted step's loss joins the window."""
        first_loss, first_norm = self.agreed(loss, grad_norm)
        found = self.verdict(first_loss, first_norm)
        if found is None:
            self.losses.append(first_loss)
            return None
        again_loss, again_norm = self.agreed(*rerun())
        again = self.verdict(again_loss, again_norm)
        finding = Finding(found, first_loss, first_norm, again_loss, again_norm, reproduced=again == found)
        if finding.reproduced:
            self.data += 1
        else:
            self.not_data += 1
        return finding

    def figures(self) -> dict[str, float]:
        """Counts since the run began, for every report (summary.json's ``anomalies``)."""
        return {
            "anomaly/skipped": self.skipped,
            "anomaly/rolled_back": self.rolled_back,
            "anomaly/data": self.data,
            "anomaly/not_data": self.not_data,
        }

    def counts(self) -> tuple[int, int, int, int]:
        return self.skipped, self.rolled_back, self.data, self.not_data

    def set_counts(self, counts: tuple[int, int, int, int]) -> None:
        self.skipped, self.rolled_back, self.data, self.not_data = counts

    def state_dict(self) -> State:
        return State(
            {
                "losses": list(self.losses),
                "skipped": self.skipped,
                "rolled_back": self.rolled_back,
                "data": self.data,
                "not_data": self.not_data,
                "lr_scale": self.lr_scale,
            }
        )

    def load_state_dict(self, state: State, restore: Restore) -> None:
        saved = AnomalyState.model_validate(state.values)
        self.losses = deque(saved.losses, maxlen=self.cfg.window)
        self.set_counts((saved.skipped, saved.rolled_back, saved.data, saved.not_data))
        self.lr_scale = saved.lr_scale

    def missing(self, restore: Restore) -> None:
        """A checkpoint written without train.anomaly: its LR is unscaled and its window unknown."""
        self.losses.clear()
        self.lr_scale = 1.0


def batch_samples(data: DataSource) -> tuple[int, ...]:
    """The sample indices of the step the data source stands at, every rank's in rank order (one
    all-gather, on an anomaly only); empty for a streamed source, whose rows have no index."""
    mine: list[int] = []
    if data.sampler is not None:  # its epoch is the source's: set when the epoch's batches began
        mine = data.sampler.epoch_indices()[data.position : data.position + data.samples_per_step]
    gathered = cast(list[list[int]], collectives.all_gather_objects(mine))
    # The ranks of a tensor-parallel group read the same batch: each sample once (an epoch's order
    # is a permutation, so nothing else repeats).
    return tuple(dict.fromkeys(int(index) for indices in gathered for index in indices))
