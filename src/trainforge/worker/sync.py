"""Local SGD and DiLoCo (``parallel.sync``): workers train on their own and meet every H steps.

Between sync points every worker takes ordinary optimizer steps (the config's ``optim``, its own
moments) on its own batches, with no gradient communication: the model is not wrapped in DDP.
Every ``every_n_steps`` steps the workers all-reduce their parameters (one flat buffer per dtype):

* ``outer_optimizer: sgd`` with ``outer_lr: 1.0`` is local SGD: every worker takes the mean;
* otherwise (DiLoCo) the *outer gradient* is ``anchor - mean``, where the anchor is the model all
  workers started the round from; the outer optimizer (SGD, or SGD with Nesterov momentum
  ``momentum``) steps the anchor with it, and every worker continues from the new anchor.

Floating-point buffers (BatchNorm statistics) are averaged at each sync point. A finished run
syncs once more at its end when steps are pending, so its final model is one model.

Checkpoints can fall between sync points, where the workers' models and inner optimizer states
differ: the ``sync`` component's state is the anchor and the outer optimizer's state (the same on
every rank), the step of the last sync, and each rank's own model and optimizer state (written by
each rank, ``ranks/<rank>/sync.pt``). A run restarted from it with the same number of workers
continues bit-identically (docs/checkpoints.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, ClassVar

import torch
import torch.distributed as dist
from pydantic import BaseModel, Field
from torch import nn

from trainforge.checkpoint.schema import MAX_STEP
from trainforge.checkpoint.state import State
from trainforge.config import SyncConfig
from trainforge.worker.collectives import world_size
from trainforge.worker.components.base import Component, Restore, StateSchema

if TYPE_CHECKING:
    from trainforge.worker.build import WorkerRun


class SyncState(StateSchema):
    last_sync: Annotated[int, Field(ge=0, le=MAX_STEP)]
    every_n_steps: Annotated[int, Field(ge=1, le=MAX_STEP)]


class LocalSync(Component):
    """The anchor model, the outer optimizer and when the workers last met."""

    name: ClassVar[str] = "sync"
    schema: ClassVar[type[BaseModel]] = SyncState

    def __init__(self, cfg: SyncConfig, model: nn.Module, optimizer: torch.optim.Optimizer, rank: int) -> None:
        self.cfg = cfg
        self.model = model
        self.optimizer = optimizer  # the inner one: its state is each rank's own
        self.rank = rank
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.anchor = [p.detach().clone() for p in self.params]
        self.outer: torch.optim.SGD | None = None
        if not self.averaging:
            nesterov = cfg.outer_optimizer == "nesterov"
            momentum = cfg.momentum if nesterov else 0.0
            self.outer = torch.optim.SGD(self.anchor, lr=cfg.outer_lr, momentum=momentum, nesterov=nesterov)
        self.last_sync = 0

    @classmethod
    def from_run(cls, run: WorkerRun) -> LocalSync | None:
        cfg = run.config.parallel.sync
        return cls(cfg, run.model, run.runner.optimizer, run.rank) if cfg is not None else None

    @property
    def averaging(self) -> bool:
        """Plain local SGD: the new model is the workers' mean, exactly (no anchor arithmetic)."""
        return self.cfg.outer_optimizer == "sgd" and self.cfg.outer_lr == 1.0

    def after_step(self, step: int) -> None:
        """Every rank, after each optimizer step: sync when ``step`` is a sync point."""
        if step % self.cfg.every_n_steps == 0:
            self.sync(step)

    def finish(self, step: int) -> bool:
        """At the end of a finished run: one last sync if steps were taken since the last one."""
        if step == self.last_sync:
            return False
        self.sync(step)
        return True

    @torch.no_grad()
    def sync(self, step: int) -> None:
        mean = mean_over_ranks([p.detach() for p in self.params])
        if self.averaging:
            for param, anchor, avg in zip(self.params, self.anchor, mean, strict=True):
                param.copy_(avg)
                anchor.copy_(avg)
        else:
            assert self.outer is not None
            for anchor, avg in zip(self.anchor, mean, strict=True):
                anchor.grad = anchor - avg  # the outer gradient: where the round moved, negated
            self.outer.step()
            self.outer.zero_grad(set_to_none=True)
            for param, anchor in zip(self.params, self.anchor, strict=True):
                param.copy_(anchor)
        buffers = [b for b in self.model.buffers() if b.is_floating_point()]
        for buffer, avg in zip(buffers, mean_over_ranks(buffers), strict=True):
            buffer.copy_(avg)
        self.last_sync = step

    # -- checkpoint --------------------------------------------------------------------------

    def state_dict(self) -> State:
        return State(
            {"last_sync": self.last_sync, "every_n_steps": self.cfg.every_n_steps},
            {
                "anchor": dict(zip(self.names, self.anchor, strict=True)),
                "outer": self.outer.state_dict() if self.outer is not None else {},
            },
            rank_tensors={"model": dict(self.model.state_dict()), "optim": self.optimizer.state_dict()},
        )

    def load_state_dict(self, state: State, restore: Restore) -> None:
        """After the model and optimizer were restored: this rank's own state, the anchor and the
        outer optimizer; without this rank's own (written by another number of workers), the
        restored model becomes the anchor."""
        saved = SyncState.model_validate(state.values)
        if state.rank_tensors is None or state.tensors is None:
            self.reset(restore.step)
            restore.notes.append(
                f"parallel.sync: the checkpoint's local state is of {restore.world} workers; "
                "the restored model is the anchor"
            )
            return
        self.model.load_state_dict(state.rank_tensors["model"], strict=True)
        self.optimizer.load_state_dict(state.rank_tensors["optim"])
        with torch.no_grad():
            for name, anchor in zip(self.names, self.anchor, strict=True):
                anchor.copy_(state.tensors["anchor"][name])
        if self.outer is not None and state.tensors["outer"]:
            self.outer.load_state_dict(state.tensors["outer"])
        self.last_sync = saved.last_sync

    def missing(self, restore: Restore) -> None:
        self.reset(restore.step)
        restore.notes.append("parallel.sync: the checkpoint has no local-sync state; the restored model is the anchor")

    @torch.no_grad()
    def reset(self, step: int) -> None:
        """The current model is the anchor, the outer optimizer starts afresh, and this is a sync point."""
        for param, anchor in zip(self.params, self.anchor, strict=True):
            anchor.copy_(param)
        if self.outer is not None:
            self.outer.state.clear()
        self.last_sync = step


def mean_over_ranks(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's mean over the ranks, in one all-reduce per dtype (new tensors)."""
    world = world_size()
    means = [t.detach().clone() for t in tensors]
    if world == 1 or not means:
        return means
    for dtype in sorted({t.dtype for t in means}, key=str):
        same = [t for t in means if t.dtype == dtype]
        flat = torch.cat([t.reshape(-1) for t in same])
        dist.all_reduce(flat)
        flat /= world
        offset = 0
        for tensor in same:
            tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()
    return means
