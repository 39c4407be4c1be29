"""``train.ema``: an exponential moving average of the weights, a stateful component (``ema``).

Every ``every_n_steps`` optimizer steps each floating-point weight (parameters and buffers, by
name) moves toward the model's: ``ema = decay * ema + (1 - decay) * weight``; integer buffers
(BatchNorm's batch count) are copied. The average lives where the weights do: whole tensors under
``ddp``, DTensor shards under ``fsdp`` and tensor parallelism, so a checkpoint saves and reshards it
like the model. With ``evaluate`` every validation pass also runs with the averaged weights
swapped in (``val_ema/loss``, ...). A finished run writes ``model_ema.safetensors`` beside
``model.safetensors``, loadable into the module the factory returns.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Annotated, Any, ClassVar

import torch
from pydantic import BaseModel, Field
from torch import nn

from trainforge.checkpoint.schema import MAX_STEP
from trainforge.checkpoint.state import State, is_dtensor
from trainforge.config import EmaConfig
from trainforge.worker.components.base import Component, Restore, StateSchema
from trainforge.worker.plan import ParallelPlan, local

if TYPE_CHECKING:
    from trainforge.worker.build import WorkerRun


class EmaState(StateSchema):
    updates: Annotated[int, Field(ge=0, le=MAX_STEP)]  # averaging steps taken


class Ema(Component):
    """The averaged weights and how many updates made them."""

    name: ClassVar[str] = "ema"
    schema: ClassVar[type[BaseModel]] = EmaState
    export: ClassVar[str | None] = "model_ema.safetensors"

    def __init__(self, cfg: EmaConfig, plan: ParallelPlan, model: nn.Module) -> None:
        self.cfg = cfg
        self.plan = plan
        module = plan.eval_model(model)  # the names of the plain module: those of model.safetensors
        self.weights: dict[str, torch.Tensor] = dict(module.named_parameters())
        self.weights.update(module.named_buffers())
        with torch.no_grad():
            self.average = {name: tensor.detach().clone() for name, tensor in self.weights.items()}
        self.updates = 0

    @classmethod
    def from_run(cls, run: WorkerRun) -> Ema | None:
        ema = run.config.train.ema
        return cls(ema, run.plan, run.model) if ema is not None else None

    @torch.no_grad()
    def after_step(self, step: int) -> None:
        if step % self.cfg.every_n_steps:
            return
        moving = [name for name, tensor in self.weights.items() if tensor.is_floating_point()]
        if moving:
            torch._foreach_lerp_(
                [local(self.average[name]) for name in moving],
                [local(self.weights[name].detach()) for name in moving],
                1.0 - self.cfg.decay,
            )
        for name, tensor in self.weights.items():
            if not tensor.is_floating_point():
                local(self.average[name]).copy_(local(tensor))
        self.updates += 1

    def state_dict(self) -> State:
        return State({"updates": self.updates}, dict(self.average))

    def load_state_dict(self, state: State, restore: Restore) -> None:
        saved = EmaState.model_validate(state.values)
        if state.tensors is None or set(state.tensors) != set(self.average):
            raise ValueError("the checkpoint's averaged weights are not this model's")
        with torch.no_grad():
            for name, average in self.average.items():
                loaded = state.tensors[name]
                if is_dtensor(average) and not is_dtensor(loaded):
                    # whole tensors (a ddp checkpoint) into shards: each rank keeps its slice
                    from torch.distributed.tensor import distribute_tensor

                    loaded = distribute_tensor(loaded.to(average.device), average.device_mesh, average.placements)
                local(average).copy_(local(loaded))
        self.updates = saved.updates

    def missing(self, restore: Restore) -> None:
        """A checkpoint of a run without ``train.ema``: the average starts at the restored weights."""
        with torch.no_grad():
            for name, average in self.average.items():
                local(average).copy_(local(self.weights[name]))
        restore.notes.append("train.ema: the checkpoint holds no averaged weights; the average starts here")

    def full_weights(self) -> dict[str, torch.Tensor]:
        """Rank 0: the whole averaged weights (gathered from the shards, or the stages, of a sharded
        or pipelined plan)."""
        return self.plan.gathered(self.average)

    def evaluations(self) -> Iterator[tuple[str, contextlib.AbstractContextManager[Any]]]:
        if self.cfg.evaluate:
            yield "ema", self.swapped()

    @contextlib.contextmanager
    def swapped(self) -> Iterator[None]:
        """The averaged weights in the model for the duration; the trained ones back afterwards."""
        with torch.no_grad():
            kept = {name: local(tensor).clone() for name, tensor in self.weights.items()}
            for name, tensor in self.weights.items():
                local(tensor).copy_(local(self.average[name]))
        try:
            yield
        finally:
            with torch.no_grad():
                for name, tensor in self.weights.items():
                    local(tensor).copy_(kept[name])
