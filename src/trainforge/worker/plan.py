"""The parallel plan: how the model is spread over the workers, behind one interface.

``ddp`` keeps a whole replica on every worker and all-reduces gradients; ``fsdp`` shards
parameters, gradients and optimizer state with PyTorch's ``fully_shard`` (FSDP2, DTensor), one
unit per repeated block plus the root. The step, evaluation and checkpointing ask the plan (to
skip a gradient sync, for the global gradient norm, for full or sharded state) and never look
at the wrapper themselves.

With ``parallel.tensor_parallel: N`` the workers form a (data-parallel x tensor-parallel) mesh:
each block's matrices are split over a group of N workers first (``worker/tp.py``), then the
data-parallel dimension is the strategy's (``fully_shard`` over the mesh's ``dp`` dimension, or
for ddp a gradient all-reduce over it).

Every plan also applies the block switches of ``parallel``: activation checkpointing, compile,
channels-last. None of them changes a parameter's name, so checkpoints move between strategies.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

# torch.distributed.checkpoint's state-dict API and DTensor are imported where a sharded plan uses them:
# importing them costs every worker's start (and a replaced worker's) about 0.5 s.
from trainforge.checkpoint.state import is_dtensor
from trainforge.config import ParallelConfig
from trainforge.errors import ConfigError
from trainforge.models import Task
from trainforge.worker.blocks import apply_activation_checkpointing, compile_blocks, repeated_blocks, to_channels_last
from trainforge.worker.collectives import world_size
from trainforge.worker.compression import Compression, compress, ddp_options
from trainforge.worker.tp import Layout, apply_tensor_parallel

log = logging.getLogger("trainforge.worker")

Scaler = torch.amp.GradScaler


@dataclass
class ParallelPlan:
    """Wraps the model for data parallelism and answers the questions that depend on how."""

    cfg: ParallelConfig
    device: torch.device
    sync_batchnorm: bool = False
    notes: list[str] = field(default_factory=list)  # what the plan did, for the run's log
    layout: Layout = field(default_factory=lambda: Layout(0, 1))
    mesh: Any = None  # the ("dp", "tp") DeviceMesh with tensor parallelism; ("replicate", "shard"[, "tp"]) under HSDP
    compression: Compression | None = None  # parallel.grad_compression's DDP hook (worker/compression.py)
    adapters_only: bool = False  # model.lora: weights saved and restored are the trainable adapters only
    name = "ddp"
    pipelined = False  # the plan runs each micro-batch's forward and backward itself (worker/pipeline.py)

    @property
    def sharded(self) -> bool:
        """Whether parameters are DTensors (shards): checkpoints are then written per rank."""
        return self.layout.tp > 1

    @property
    def replicate(self) -> int:
        """HSDP's replica groups (``parallel.fsdp.replicate``); 1 but under fsdp."""
        return 1

    @property
    def layout_name(self) -> str:
        """``ddp``, ``fsdp``, ``hsdp 2x2``, ``fsdp x tp2``: what a checkpoint records and a resume compares."""
        name = self.name
        if self.replicate > 1:
            name = f"hsdp {self.replicate}x{self.layout.dp // self.replicate}"
        return name + (f" x tp{self.layout.tp}" if self.layout.tp > 1 else "")

    def wrap(self, model: nn.Module) -> nn.Module:
        """Tensor parallel, switches, then the strategy's wrapper; the same parameter names before and after."""
        if any(p.is_meta for p in model.parameters()):  # built for pretrained weights: only buffers have memory
            model._apply(lambda t: t if t.is_meta else t.to(self.device))
        else:
            model = model.to(self.device)
        found = repeated_blocks(model, self.cfg.fsdp.wrap)
        hsdp = self.replicate > 1 and world_size() > 1  # one process (evaluate) holds the whole model
        if hsdp and self.layout.dp % self.replicate:  # checked before Ray starts for the configured count
            raise ConfigError(
                f"parallel.fsdp.replicate {self.replicate} must divide the {self.layout.dp} data-parallel "
                "workers this run started with"
            )
        if self.layout.tp > 1 or hsdp:
            self.mesh = self.layout.device_mesh(self.device, self.replicate)
        if self.layout.tp > 1:
            count = apply_tensor_parallel(model, self.mesh["tp"], self.cfg.tp_plan)
            self.notes.append(f"tensor parallel: {count} modules split over groups of {self.layout.tp}")
        if self.cfg.activation_checkpointing != "none":
            count = apply_activation_checkpointing(
                found, self.cfg.activation_checkpointing, self.cfg.activation_checkpointing_every_n
            )
            self.notes.append(f"activation checkpointing on {count} of {len(found)} blocks")
        if self.cfg.channels_last is True and to_channels_last(model):  # auto: resolved by worker/build.py
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
        if self.layout.tp > 1:
            # DDP cannot take DTensor parameters: gradients are all-reduced over the data-parallel
            # dimension by gradient_sync; replicas start identical (same seed, same split).
            self.notes.append(f"ddp over {self.layout.dp} tensor-parallel groups")
            return model
        if self.cfg.sync is not None:
            # Local SGD / DiLoCo (worker/sync.py): no gradient all-reduce; replicas start identical
            # (same seed), and meet every parallel.sync.every_n_steps steps.
            self.notes.append(f"local steps, parameters synchronised every {self.cfg.sync.every_n_steps} steps")
            return model
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        # DDP broadcasts rank 0's parameters and buffers here, so every rank starts identical.
        ddp = DistributedDataParallel(model, device_ids=device_ids, **ddp_options(self.cfg))
        self.compression = compress(ddp, self.cfg)
        if self.compression is not None:
            self.notes.append(self.compression.describe())
        return ddp

    def make_scaler(self, enabled: bool) -> Scaler:
        """Loss scaling (fp16 only): the found-inf decision must be the same on every rank."""
        return torch.amp.GradScaler(self.device.type, enabled=enabled)

    def gradient_sync(self, model: nn.Module, sync: bool) -> contextlib.AbstractContextManager[object]:
        """Context for one micro-batch's backward: without gradient communication unless ``sync``."""
        if isinstance(model, DistributedDataParallel) and not sync:
            return model.no_sync()
        if sync and self.layout.tp > 1 and self.layout.dp > 1:
            return self._all_reduce_after(model)
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def _all_reduce_after(self, model: nn.Module) -> Iterator[None]:
        """DDP's job for tensor-parallel replicas: after the backward, the gradients' mean over the
        data-parallel dimension, flattened into one buffer per dtype (one collective each)."""
        yield
        group = self.mesh["dp"].get_group()
        grads = [local(p.grad) for p in parameters_of(model) if p.grad is not None]
        for dtype in sorted({g.dtype for g in grads}, key=str):
            same = [g for g in grads if g.dtype == dtype]
            flat = torch.cat([g.reshape(-1) for g in same])
            dist.all_reduce(flat, group=group)
            flat /= self.layout.dp
            offset = 0
            for grad in same:
                grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
                offset += grad.numel()

    def grad_norm(self, params: list[nn.Parameter], clip: float | None) -> torch.Tensor:
        """The global gradient norm (clipping to ``clip`` first when set), a plain tensor that is
        the same on every rank: gradients are identical (ddp) or it is reduced over shards (fsdp)."""
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return torch.zeros((), device=self.device)
        if self.layout.tp > 1:
            return mixed_grad_norm(grads, clip, self.device)
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(params, clip)
        else:
            norm = torch.nn.utils.get_total_norm(grads)
        return norm.full_tensor() if is_dtensor(norm) else norm

    def forward_backward(self, model: nn.Module, task: Task, batch: Any, accum: int) -> dict[str, torch.Tensor]:
        """A pipelined plan's forward and backward of one micro-batch, its metric sums (``pipelined`` only)."""
        raise NotImplementedError(f"{self.layout_name} runs forward and backward in the step")

    def eval_step(self, model: nn.Module, task: Task, batch: Any) -> dict[str, torch.Tensor]:
        """One validation batch's metric sums on ``eval_model(model)``."""
        return task.eval_step(model, batch)

    def eval_model(self, model: nn.Module) -> nn.Module:
        """The module evaluation runs: the plain one (no DDP hooks; ranks may run different counts)."""
        return model.module if isinstance(model, DistributedDataParallel) else model

    def named_parameters(self, model: nn.Module) -> list[tuple[str, nn.Parameter]]:
        """The wrapped model's parameters by the plain model's names (what model.freeze and
        optim.param_groups match; a tied parameter under each of its names)."""
        return list(self.eval_model(model).named_parameters(remove_duplicate=False))

    @property
    def eval_in_lockstep(self) -> bool:
        """Whether every rank must run the same number of evaluation forwards (they communicate)."""
        return False

    def forget_step(self, model: nn.Module) -> None:
        """Every rank dropped the step between a forward and its backward (an out-of-memory retry,
        worker/step.py). DDP's reducer still awaits the backward of a synchronised forward on the
        ranks that completed one, and whether a rank's next forward broadcasts buffers depends on
        which of its forwards completed: both are reset the same way on every rank, as DDP does
        itself when its process group changes (buckets are then rebuilt, by all ranks together)."""
        if isinstance(model, DistributedDataParallel):
            model._has_rebuilt_buckets = False
            model.reducer._reset_state()
            model.require_forward_param_sync = True  # the next forward broadcasts rank 0's buffers

    # -- state -------------------------------------------------------------------------------

    def full_model_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The full weights by parameter name; sharded, gathered to rank 0 (empty elsewhere)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if self.sharded:
            options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=self.adapters_only)
            return cast(dict[str, torch.Tensor], get_model_state_dict(model, options=options))
        return self._saved(self.eval_model(model))

    def gathered(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Rank 0: whole tensors by name from this rank's (DTensor shards gathered); empty elsewhere.
        Every rank calls it (gathering a shard is a collective)."""
        whole = {name: tensor.full_tensor() if is_dtensor(tensor) else tensor for name, tensor in tensors.items()}
        return whole if self.layout.rank == 0 else {}

    def load_full_model_state(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Full weights (every rank holds all of them) into this model, strictly (with adapters,
        strictly the adapters); sharded, each rank keeps its part."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        self._check_saved(model, state)
        if self.sharded:
            options = StateDictOptions(full_state_dict=True, strict=not self.adapters_only)
            set_model_state_dict(model, cast(Any, state), options=options)
            return
        self.eval_model(model).load_state_dict(state, strict=not self.adapters_only)

    def model_state(self, model: nn.Module) -> dict[str, Any]:
        """The model's state for a checkpoint: whole tensors of the plain module (rank 0's are
        written), or under a sharded plan the DTensor shards keyed by parameter name, the form
        torch.distributed.checkpoint saves, loads and reshards. With LoRA adapters
        (``adapters_only``) only the trainable parameters: the base comes back from its source."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if self.sharded:
            return get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=self.adapters_only))
        return self._saved(self.eval_model(model))

    def _saved(self, module: nn.Module) -> dict[str, torch.Tensor]:
        state = dict(module.state_dict())
        if not self.adapters_only:
            return state
        trainable = {name for name, p in module.named_parameters() if p.requires_grad}
        return {name: value for name, value in state.items() if name in trainable}

    def _check_saved(self, model: nn.Module, state: dict[str, Any]) -> None:
        """With adapters, a checkpoint holds exactly the trainable parameters (no partial loads)."""
        if not self.adapters_only:
            return
        trainable = {name for name, p in self.eval_model(model).named_parameters() if p.requires_grad}
        if set(state) != trainable:
            missing, extra = sorted(trainable - set(state)), sorted(set(state) - trainable)
            raise ValueError(
                f"the checkpoint's adapters differ from the model's (missing {missing[:3]}, extra {extra[:3]})"
            )

    def optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's state for a checkpoint: torch's own (keyed by index), or under a sharded
        plan keyed by parameter name with DTensor shards."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        if self.sharded:
            return get_optimizer_state_dict(model, optimizer)
        return optimizer.state_dict()

    def load_model_state(self, model: nn.Module, state: dict[str, Any]) -> None:
        """A template of ``get_model_state_dict`` filled by torch.distributed.checkpoint (DTensors
        under a sharded plan, whole tensors under ddp)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        self._check_saved(model, state)
        set_model_state_dict(model, state, options=StateDictOptions(strict=not self.adapters_only))

    def load_optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """A template of ``get_optimizer_state_dict`` filled by torch.distributed.checkpoint."""
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(model, optimizer, state)

    def model_template(self, model: nn.Module) -> dict[str, Any]:
        """What a sharded checkpoint's weights load into, whatever this plan: keyed by parameter
        name, DTensor shards under a sharded plan, whole tensors under ddp."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=self.adapters_only))

    def optimizer_template(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """What a sharded checkpoint's optimizer state loads into, keyed by parameter name."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(model, optimizer)

    def load_full_optimizer_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        """An optimizer state dict saved by a whole (unsharded) optimizer, keyed by index."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        if not self.sharded:
            optimizer.load_state_dict(state)
            return
        # Parameters are numbered in the optimizer's own order, which the same config (model.freeze,
        # optim.param_groups) builds the same way: name them, and let the state-dict API shard them.
        saved, mine = (
            [len(g["params"]) for g in state["param_groups"]],
            [len(g["params"]) for g in optimizer.param_groups],
        )
        if saved != mine:
            raise ValueError(f"the checkpoint's optimizer groups hold {saved} parameters, this optimizer's {mine}")
        names = {id(p): n for n, p in model.named_parameters()}
        order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
        by_index = dict(enumerate(order))
        named = {
            "state": {by_index[int(i)]: s for i, s in state["state"].items()},
            "param_groups": [{**g, "params": [by_index[int(i)] for i in g["params"]]} for g in state["param_groups"]],
        }
        set_optimizer_state_dict(model, optimizer, cast(Any, named), options=StateDictOptions(full_state_dict=True))

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
        return self.layout_name


class FSDPPlan(ParallelPlan):
    """FSDP2: every repeated block is a unit (its parameters gathered just for its forward and
    backward), the root holds the rest; gradients are reduce-scattered, so each rank keeps and
    updates only its shard of parameters, gradients and optimizer state."""

    name = "fsdp"

    @property
    def sharded(self) -> bool:
        return True

    @property
    def replicate(self) -> int:
        return self.cfg.fsdp.replicate

    def _wrap(self, model: nn.Module, found: list[nn.Module]) -> nn.Module:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        fsdp = self.cfg.fsdp
        options: dict[str, Any] = {"reshard_after_forward": fsdp.reshard_after_forward}
        if fsdp.mixed_precision == "bf16":
            options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if fsdp.cpu_offload:
            options["offload_policy"] = CPUOffloadPolicy()
        if self.replicate > 1:
            # HSDP: a 2-D mesh makes fully_shard shard over "shard" and replicate over "replicate";
            # gradients are reduce-scattered within a shard group, then all-reduced across groups.
            options["mesh"] = self.mesh["replicate", "shard"]
        elif self.mesh is not None:
            options["mesh"] = self.mesh["dp"]  # blocks already split over "tp" become 2-D shards
        for block in found:
            fully_shard(block, **options)
        # Same seed on every rank built the same weights; each rank keeps its slice of them.
        fully_shard(model, **options)
        over = f"{self.layout.dp} data-parallel ranks"
        if self.replicate > 1:
            over = (
                f"groups of {self.layout.dp // self.replicate} data-parallel ranks, replicated {self.replicate} times"
            )
        self.notes.append(f"fsdp: {len(found)} block units + root, sharded over {over}")
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

    def describe(self) -> str:
        fsdp = self.cfg.fsdp
        extras = [f"reshard_after_forward={fsdp.reshard_after_forward}"]
        if fsdp.mixed_precision != "none":
            extras.append(f"mixed_precision={fsdp.mixed_precision}")
        if fsdp.cpu_offload:
            extras.append("cpu_offload")
        return f"{self.layout_name} ({', '.join(extras)})"


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: the local shard of a DTensor, else the tensor itself."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def build_plan(
    cfg: ParallelConfig, device: torch.device, *, sync_batchnorm: bool, layout: Layout | None = None
) -> ParallelPlan:
    kind = FSDPPlan if cfg.strategy == "fsdp" else ParallelPlan
    return kind(cfg, device, sync_batchnorm, layout=layout or Layout(0, world_size()))


def mixed_grad_norm(
    grads: list[torch.Tensor], clip: float | None, device: torch.device, holders: int | None = None
) -> torch.Tensor:
    """The global norm over gradients that are shards on different meshes and placements (tensor
    parallel: matrices split on "tp", FSDP shards on "dp", or both) or plain replicated tensors,
    in one all-reduce: each rank adds the squares of what it holds, divided by how many ranks
    hold the same piece (of ``holders`` ranks that could: all of them, or a pipeline stage's).
    Then clipping by that norm, as ``clip_grad_norm_`` does."""
    world = world_size()
    kinds: dict[int, list[torch.Tensor]] = {}
    for grad in grads:
        kinds.setdefault(copies(grad, holders or world), []).append(grad)
    squares = torch.zeros((), dtype=torch.float64, device=device)
    for count, same in kinds.items():
        norms = torch.stack(torch._foreach_norm([local(g) for g in same])).double()
        squares += norms.square().sum() / count
    if world > 1:
        dist.all_reduce(squares)
    total = squares.sqrt().float()
    if clip is not None:
        coef = torch.clamp(clip / (total + 1e-6), max=1.0)
        for same in kinds.values():
            torch._foreach_mul_(same, coef)
    return total


def copies(tensor: torch.Tensor, world: int) -> int:
    """How many of the ``world`` ranks hold this rank's piece of ``tensor``: all of them for a
    plain (replicated) tensor; for a DTensor, the ranks outside its mesh times its replicated
    mesh dimensions."""
    if not is_dtensor(tensor):
        return world
    mesh = tensor.device_mesh
    count = world // mesh.size()
    for dim, placement in enumerate(tensor.placements):
        if placement.is_replicate():
            count *= mesh.size(dim)
    return count


def all_reduce_max(value: int, device: torch.device) -> int:
    """The largest of every rank's ``value``."""
    if world_size() == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


def parameters_of(model: nn.Module) -> Iterable[nn.Parameter]:
    return (p for p in model.parameters() if p.requires_grad)
