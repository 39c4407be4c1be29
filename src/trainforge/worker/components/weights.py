"""The model's weights and the optimizer's state: whole or sharded, as the parallel plan holds them.

Under ``ddp`` their state is whole tensors (rank 0 writes ``model.safetensors`` and
``optimizer.pt``); under ``fsdp`` or tensor parallelism it is DTensor shards (every rank writes its
own through torch.distributed.checkpoint). Either loads into either plan: shards are resharded by
DCP, whole tensors sharded by the state-dict API (``worker/plan.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
from pydantic import BaseModel
from torch import nn

from trainforge.checkpoint.state import State
from trainforge.config import OptimConfig
from trainforge.worker.components.base import Component, Restore, StateSchema
from trainforge.worker.optim import optimizer_kind

if TYPE_CHECKING:
    from trainforge.worker.build import WorkerRun
    from trainforge.worker.plan import ParallelPlan


class ModelWeights(Component):
    """The model's parameters and buffers by name; exported as the run's ``model.safetensors``."""

    name: ClassVar[str] = "model"
    export: ClassVar[str | None] = "model.safetensors"

    def __init__(self, plan: ParallelPlan, model: nn.Module) -> None:
        self.plan = plan
        self.model = model

    @classmethod
    def from_run(cls, run: WorkerRun) -> ModelWeights:
        return cls(run.plan, run.model)

    def state_dict(self) -> State:
        return State(tensors=self.plan.model_state(self.model))

    def load_state_dict(self, state: State, restore: Restore) -> None:
        if state.tensors is None:
            raise ValueError("the checkpoint holds no model weights")
        if restore.sharded:
            self.plan.load_model_state(self.model, state.tensors)
        else:
            self.plan.load_full_model_state(self.model, with_tied(state.tensors, self.plan.eval_model(self.model)))

    def template(self, state: State, restore: Restore) -> Any:
        return self.plan.model_template(self.model)

    def full_weights(self) -> dict[str, torch.Tensor]:
        return self.plan.full_model_state(self.model)


def with_tied(weights: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """Weights as safetensors stores them (tied weights once) with every name of a tied weight filled in."""
    weights = dict(weights)
    canonical: dict[int, str] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        first = canonical.setdefault(id(tensor), name)
        if name not in weights and first in weights:
            weights[name] = weights[first]
        elif first not in weights and name in weights:
            weights[first] = weights[name]
    return weights


class OptimizerMeta(StateSchema):
    name: str | None = None  # the optimizer that wrote the moments (format 2: read from its config)


class OptimizerState(Component):
    """The optimizer's moments and parameter groups. Moments of another kind of optimizer (a
    checkpoint of SGD loaded into AdamW) cannot be used and are left out, with a note."""

    name: ClassVar[str] = "optimizer"
    schema: ClassVar[type[BaseModel]] = OptimizerMeta

    def __init__(self, plan: ParallelPlan, model: nn.Module, optimizer: torch.optim.Optimizer, cfg: OptimConfig):
        self.plan = plan
        self.model = model
        self.optimizer = optimizer
        self.kind = optimizer_kind(cfg)

    @classmethod
    def from_run(cls, run: WorkerRun) -> OptimizerState:
        return cls(run.plan, run.model, run.runner.optimizer, run.config.optim)

    def state_dict(self) -> State:
        return State({"name": self.kind}, self.plan.optimizer_state(self.model, self.optimizer))

    def _usable(self, state: State) -> bool:
        saved = OptimizerMeta.model_validate(state.values).name
        return saved is None or saved == self.kind

    def template(self, state: State, restore: Restore) -> Any:
        return self.plan.optimizer_template(self.model, self.optimizer) if self._usable(state) else None

    def load_state_dict(self, state: State, restore: Restore) -> None:
        if not self._usable(state):
            saved = state.values["name"]
            restore.notes.append(f"optimizer state not restored: the checkpoint used {saved}, this run {self.kind}")
            return
        if state.tensors is None:
            raise ValueError("the checkpoint holds no optimizer state")
        if restore.sharded:
            self.plan.load_optimizer_state(self.model, self.optimizer, state.tensors)
        else:
            self.plan.load_full_optimizer_state(self.model, self.optimizer, state.tensors)
