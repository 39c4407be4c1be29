"""A worker's stateful components besides the model: each is built from its own config section
and has ``state_dict()`` / ``load_state_dict()``, so that checkpointing saves
``{component: state}`` and restore hands each its part back, without reaching inside.

* :class:`DataSource` (``data``): where the rank's batches come from; its state is where it stands
  in the data (epoch, samples consumed in the epoch), re-split when the number of workers changed.
* :class:`Optimization` (``optim``, ``schedule``, ``precision``): optimizer, LR schedule and loss
  scaler. Its state here is the schedule's and the scaler's; the optimizer's tensors travel with
  the model's, whole or sharded as the parallel plan (``worker/plan.py``) decides.
* :class:`RngState`: this process's random number generators (Python, NumPy, torch, CUDA).

Progress (global step, samples seen) is :class:`trainforge.checkpoint.state.Progress`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import DataLoader

from trainforge.checkpoint.state import Progress, capture_rng, restore_rng
from trainforge.config import Config
from trainforge.data import ResumableDistributedSampler, build_datasets, make_loader
from trainforge.data.spec import DataSpec
from trainforge.errors import DataError


@dataclass
class DataSource:
    """One rank's training and validation data. The same (epoch, position) gives the same next
    batch, on any restart: the position is all a checkpoint needs to resume mid-epoch."""

    train_set: Any
    val_set: Any
    spec: DataSpec
    sampler: ResumableDistributedSampler
    steps_per_epoch: int
    config: Config
    rank: int
    world: int
    pin_memory: bool
    # Where the source stands is kept in the run's Progress (one record for checkpoints and
    # reports): ``epoch`` and ``epoch_position``, the samples this rank consumed in the epoch.
    progress: Progress = field(default_factory=Progress)

    @classmethod
    def build(cls, config: Config, rank: int, world: int, *, pin_memory: bool) -> DataSource:
        train_set, val_set, spec = build_datasets(config.data, config.seed)
        sampler = ResumableDistributedSampler(len(train_set), world, rank, config.data.shuffle, config.seed, even=True)
        per_step = config.train.batch_size * config.train.grad_accum_steps
        steps_per_epoch = sampler.per_rank_size() // per_step
        if steps_per_epoch == 0:
            raise DataError(
                f"train.batch_size x train.grad_accum_steps = {per_step} exceeds the {sampler.per_rank_size()} "
                f"training samples each of {world} workers gets; lower the batch size or use fewer workers"
            )
        return cls(train_set, val_set, spec, sampler, steps_per_epoch, config, rank, world, pin_memory)

    @property
    def samples_per_step(self) -> int:
        return self.config.train.batch_size * self.config.train.grad_accum_steps

    @property
    def epoch_samples(self) -> int:
        """Samples this rank consumes in a full epoch (whole steps only)."""
        return self.steps_per_epoch * self.samples_per_step

    @property
    def epoch(self) -> int:
        return self.progress.epoch

    @property
    def position(self) -> int:
        return self.progress.epoch_position

    def batches(self) -> Iterator[Sequence[torch.Tensor]]:
        """The training batches from the current position to the end of the epoch."""
        self.sampler.set_epoch(self.epoch)
        self.sampler.set_start(self.position)
        cfg = self.config
        loader = make_loader(
            self.train_set,
            self.sampler,
            cfg.train.batch_size,
            num_workers=cfg.data.num_workers,
            pin_memory=self.pin_memory,
            drop_last=True,
            seed=cfg.seed,
            epoch=self.epoch,
            rank=self.rank,
        )
        return iter(loader)

    def val_batches(self) -> DataLoader[Any] | None:
        """This rank's disjoint share of the validation set, every sample once over all ranks."""
        if self.val_set is None:
            return None
        cfg = self.config
        sampler = ResumableDistributedSampler(len(self.val_set), self.world, self.rank, False, cfg.seed, even=False)
        return make_loader(
            self.val_set,
            sampler,
            cfg.train.batch_size,
            num_workers=cfg.data.num_workers,
            pin_memory=self.pin_memory,
            drop_last=False,
            seed=cfg.seed,
            epoch=0,
            rank=self.rank,
        )

    def advance(self) -> None:
        """One optimizer step's samples consumed."""
        self.progress.epoch_position += self.samples_per_step

    @property
    def epoch_done(self) -> bool:
        return self.position >= self.epoch_samples

    def finish_epoch(self) -> None:
        """The rest of the epoch is skipped (a loader that ran dry early)."""
        self.progress.epoch_position = self.epoch_samples

    def next_epoch(self) -> None:
        self.progress.epoch += 1
        self.progress.epoch_position = 0

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "world_size": self.world}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Where the checkpoint stood; written by another number of workers, the same global
        position split over this many (whole steps; exactness is then not promised)."""
        position, writers = int(state["position"]), int(state.get("world_size", self.world))
        if writers != self.world:
            position = position * writers // self.world // self.samples_per_step * self.samples_per_step
        self.progress.epoch = int(state["epoch"])
        self.progress.epoch_position = position


@dataclass
class Optimization:
    """Optimizer, LR schedule and grad scaler of one worker."""

    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def state_dict(self) -> dict[str, Any]:
        """The schedule's position and the scaler's state (JSON-able; lambdas are code, not state)."""
        schedule = {k: v for k, v in self.scheduler.state_dict().items() if k != "lr_lambdas"}
        return {"scheduler": schedule, "scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        groups = len(self.optimizer.param_groups)
        self.scheduler.load_state_dict({**state["scheduler"], "lr_lambdas": [None] * groups})
        self.scaler.load_state_dict(state["scaler"])


class RngState:
    """This process's random number generators."""

    def state_dict(self) -> dict[str, Any]:
        return capture_rng()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        restore_rng(state)
