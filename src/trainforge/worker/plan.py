"""The parallel plan: how the model is spread over the workers, behind one interface.

``ddp`` keeps a whole replica on every worker and all-reduces gradients; ``fsdp`` shards
parameters, gradients and optimizer state with PyTorch's ``fully_shard`` (FSDP2, DTensor), one
unit per repeated block plus the root. The step, evaluation and checkpointing ask the plan (to
skip a gradient sync, for the global gradient norm, for full or sharded state) and never look
at the wrapper themselves.

Both plans first apply the block switches of ``parallel``: activation checkpointing, compile,
channels-last. None of them changes a parameter's name, so checkpoints move between strategies.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from trainforge.config import ParallelConfig
from trainforge.worker.blocks import apply_activation_checkpointing, compile_blocks, repeated_blocks, to_channels_last
from trainforge.worker.parallel import world_size

log = logging.getLogger("trainforge.worker")

Scaler = torch.amp.GradScaler


@dataclass
class ParallelPlan:
    """Wraps the model for data parallelism and answers the questions that depend on how."""

    cfg: ParallelConfig
    device: torch.device
    sync_batchnorm: bool = False
    notes: list[str] = field(default_factory=list)  # what the plan did, for the run's log
    name = "ddp"
    sharded = False

    def wrap(self, model: nn.Module) -> nn.Module:
        """Switches, then the strategy's wrapper; the same parameter names before and after."""
        model = model.to(self.device)
        found = repeated_blocks(model, self.cfg.fsdp.wrap)
        if self.cfg.activation_checkpointing != "none":
            count = apply_activation_checkpointing(
                found, self.cfg.activation_checkpointing, self.cfg.activation_checkpointing_every_n
            )
            self.notes.append(f"activation checkpointing on {count} of {len(found)} blocks")
        if self.cfg.channels_last and to_channels_last(model):
            self.notes.append("channels-last memory format")
        if self.cfg.compile:
            compile_blocks(found, model)
            self.notes.append(f"compiled {len(found) or 1} {'blocks' if found else 'module'}")
        if world_size() == 1:
            return model
        if self.sync_batchnorm:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        return self._wrap(model, found)

    def _wrap(self, model: nn.Module, found: list[nn.Module]) -> nn.Module:
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        # DDP broadcasts rank 0's parameters and buffers here, so every rank starts identical.
        return DistributedDataParallel(model, device_ids=device_ids)

    def make_scaler(self, enabled: bool) -> Scaler:
        """Loss scaling (fp16 only): the found-inf decision must be the same on every rank."""
        return torch.amp.GradScaler(self.device.type, enabled=enabled)

    def gradient_sync(self, model: nn.Module, sync: bool) -> contextlib.AbstractContextManager[object]:
        """Context for one micro-batch's backward: without gradient communication unless ``sync``."""
        if isinstance(model, DistributedDataParallel) and not sync:
            return model.no_sync()
        return contextlib.nullcontext()

    def grad_norm(self, params: list[nn.Parameter], clip: float | None) -> torch.Tensor:
        """The global gradient norm (clipping to ``clip`` first when set), a plain tensor that is
        the same on every rank: gradients are identical (ddp) or it is reduced over shards (fsdp)."""
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return torch.zeros((), device=self.device)
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(params, clip)
        else:
            norm = torch.nn.utils.get_total_norm(grads)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    def eval_model(self, model: nn.Module) -> nn.Module:
        """The module evaluation runs: the plain one (no DDP hooks; ranks may run different counts)."""
        return model.module if isinstance(model, DistributedDataParallel) else model

    @property
    def eval_in_lockstep(self) -> bool:
        """Whether every rank must run the same number of evaluation forwards (they communicate)."""
        return False

    # -- state -------------------------------------------------------------------------------

    def full_model_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The full weights by parameter name; with fsdp gathered to rank 0 (empty elsewhere)."""
        return dict(self.eval_model(model).state_dict())

    def load_full_model_state(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Full weights (every rank holds all of them) into this model, strictly."""
        self.eval_model(model).load_state_dict(state, strict=True)

    def sharded_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """``{"model": ..., "optim": ...}`` keyed by parameter name, the form torch.distributed.checkpoint
        saves and loads: DTensor shards under fsdp, whole tensors under ddp (which DCP then reshards)."""
        return {
            "model": get_model_state_dict(model),
            "optim": get_optimizer_state_dict(model, optimizer),
        }

    def load_sharded_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """What ``sharded_state`` gave, filled by torch.distributed.checkpoint (``optim`` may be absent)."""
        set_model_state_dict(model, state["model"])
        if "optim" in state:
            set_optimizer_state_dict(model, optimizer, state["optim"])

    def load_full_optimizer_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        """An optimizer state dict saved by a whole (unsharded) optimizer, keyed by index."""
        optimizer.load_state_dict(state)

    def tensor_bytes(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Bytes of tensor storage this rank holds for parameters, gradients and optimizer state."""
        params = grads = optim = 0
        for param in model.parameters():
            params += local(param).nbytes
            if param.grad is not None:
                grads += local(param.grad).nbytes
        for state in optimizer.state.values():
            optim += sum(local(v).nbytes for v in state.values() if isinstance(v, torch.Tensor))
        return {"params": params, "grads": grads, "optimizer": optim}

    def describe(self) -> str:
        return self.name


class FSDPPlan(ParallelPlan):
    """FSDP2: every repeated block is a unit (its parameters gathered just for its forward and
    backward), the root holds the rest; gradients are reduce-scattered, so each rank keeps and
    updates only its shard of parameters, gradients and optimizer state."""

    name = "fsdp"
    sharded = True

    def _wrap(self, model: nn.Module, found: list[nn.Module]) -> nn.Module:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        fsdp = self.cfg.fsdp
        options: dict[str, Any] = {"reshard_after_forward": fsdp.reshard_after_forward}
        if fsdp.mixed_precision == "bf16":
            options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if fsdp.cpu_offload:
            options["offload_policy"] = CPUOffloadPolicy()
        for block in found:
            fully_shard(block, **options)
        # Same seed on every rank built the same weights; each rank keeps its slice of them.
        fully_shard(model, **options)
        self.notes.append(f"fsdp: {len(found)} block units + root over {world_size()} ranks")
        return model

    def make_scaler(self, enabled: bool) -> Scaler:
        if not enabled:
            return super().make_scaler(enabled)
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        # Each rank sees only its shard's gradients: the found-inf flag is all-reduced.
        return ShardedGradScaler(self.device.type)

    def gradient_sync(self, model: nn.Module, sync: bool) -> contextlib.AbstractContextManager[object]:
        from torch.distributed.fsdp import FSDPModule

        if isinstance(model, FSDPModule):
            model.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()

    def eval_model(self, model: nn.Module) -> nn.Module:
        return model  # forwards gather parameters: every rank runs each one

    @property
    def eval_in_lockstep(self) -> bool:
        return world_size() > 1

    def full_model_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return cast(dict[str, torch.Tensor], get_model_state_dict(model, options=options))

    def load_full_model_state(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        set_model_state_dict(model, cast(Any, state), options=StateDictOptions(full_state_dict=True, strict=True))

    def load_full_optimizer_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        # Saved by a whole optimizer: parameters are numbered in the optimizer's own order, which
        # the same config builds the same way; name them, and let the state-dict API shard them.
        names = {id(p): n for n, p in model.named_parameters()}
        order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
        by_index = dict(enumerate(order))
        named = {
            "state": {by_index[int(i)]: s for i, s in state["state"].items()},
            "param_groups": [{**g, "params": [by_index[int(i)] for i in g["params"]]} for g in state["param_groups"]],
        }
        set_optimizer_state_dict(model, optimizer, cast(Any, named), options=StateDictOptions(full_state_dict=True))

    def describe(self) -> str:
        fsdp = self.cfg.fsdp
        extras = [f"reshard_after_forward={fsdp.reshard_after_forward}"]
        if fsdp.mixed_precision != "none":
            extras.append(f"mixed_precision={fsdp.mixed_precision}")
        if fsdp.cpu_offload:
            extras.append("cpu_offload")
        return f"fsdp ({', '.join(extras)})"


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: the local shard of a DTensor, else the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def build_plan(cfg: ParallelConfig, device: torch.device, *, sync_batchnorm: bool) -> ParallelPlan:
    kind = FSDPPlan if cfg.strategy == "fsdp" else ParallelPlan
    return kind(cfg, device, sync_batchnorm)


def all_reduce_max(value: int, device: torch.device) -> int:
    """The largest of every rank's ``value``."""
    if world_size() == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


def parameters_of(model: nn.Module) -> Iterable[nn.Parameter]:
    return (p for p in model.parameters() if p.requires_grad)
