"""Memory per rank, estimated before anything is allocated: the memory planner's model.

The model is built under ``FakeTensorMode`` (meta storage: shapes and dtypes, no bytes), so a 10B
model costs seconds and no memory. Parameters, gradients and optimizer state follow from the
parameter shapes and the strategy (docs/planning.md gives each term's model); activations are
measured, not guessed: one fake forward and loss at micro-batches 2 and 4 under
``saved_tensors_hooks`` sums the bytes autograd keeps for backward, by repeated block, and the two
points give a fixed part and a per-sample part (activations are linear in the micro-batch).

``max_micro_batch(config, world_size, memory_bytes)`` is what a worker asks ("how large a
micro-batch fits in this rank's memory"); ``rank_breakdown`` gives the terms for one strategy.
Both are pure functions of the config: no process group, no device.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from trainforge.config import MAX_BATCH, Config
from trainforge.data import build_datasets
from trainforge.errors import ModelError, TrainforgeError
from trainforge.models import build_model, build_task
from trainforge.worker.blocks import repeated_blocks
from trainforge.worker.capacity.activations import ActivationProfile, PerBatch, measure_activations
from trainforge.worker.tp import COLWISE, ROWWISE, check_tensor_parallel, tp_styles

GIB = 1 << 30
FP32 = 4
ADAM_STEP_BYTES = 4  # AdamW's per-parameter ``step``: a float32 scalar (on the host unless fused/capturable)


@dataclass(frozen=True)
class Reserve:
    """Memory a rank has but tensors cannot use: ``fixed_bytes`` (CUDA context, NCCL and allocator
    workspaces) plus ``fraction`` of the total (caching-allocator fragmentation)."""

    fixed_bytes: int
    fraction: float

    def of(self, memory_bytes: int) -> int:
        return self.fixed_bytes + int(self.fraction * memory_bytes)


GPU_RESERVE = Reserve(fixed_bytes=GIB, fraction=0.05)
CPU_RESERVE = Reserve(fixed_bytes=GIB // 2, fraction=0.05)  # the process's own libraries, allocator slack


def reserve_for(config: Config) -> Reserve:
    return GPU_RESERVE if config.scaling.use_gpu else CPU_RESERVE


@dataclass(frozen=True)
class Strategy:
    """How the model is spread: ``sharded`` (FSDP over the data-parallel ranks) or replicated (DDP),
    ``tensor_parallel`` ways of tensor parallelism first, and activation checkpointing. HSDP
    (``replicate`` > 1) shards over groups of ``data-parallel ranks / replicate`` only."""

    name: str
    sharded: bool
    tensor_parallel: int = 1
    activation_checkpointing: Literal["none", "full", "every_n"] = "none"
    every_n: int = 2
    replicate: int = 1

    def shards(self, world_size: int) -> int:
        """How many ways each parameter is sharded (FSDP's dim-0 split): 1 replicated (DDP)."""
        if not self.sharded:
            return 1
        return max(1, world_size // self.tensor_parallel // self.replicate)


def strategy_of(config: Config) -> Strategy:
    """The config's own ``parallel`` settings as a Strategy."""
    par = config.parallel
    tp = int(getattr(par, "tensor_parallel", 1) or 1)
    replicate = par.fsdp.replicate if par.strategy == "fsdp" else 1
    kind = "hsdp" if replicate > 1 else par.strategy
    name = kind + (f"+tp{tp}" if tp > 1 else "") + ("+ac" if par.activation_checkpointing != "none" else "")
    return Strategy(
        name=name,
        sharded=par.strategy == "fsdp",
        tensor_parallel=tp,
        activation_checkpointing=par.activation_checkpointing,
        every_n=par.activation_checkpointing_every_n,
        replicate=replicate,
    )


@dataclass(frozen=True)
class Breakdown:
    """Bytes one rank holds under a strategy at one micro-batch. ``buffers``: communication and
    working copies (DDP's gradient buckets; FSDP's unsharded root and block); ``activations``: what
    autograd keeps for backward plus the forward's largest tensor."""

    params: int
    grads: int
    optimizer: int
    activations: int
    buffers: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers


# ---------------------------------------------------------------------------------------------
# The model's shapes and activations, measured once per config


@dataclass(frozen=True)
class ParamShape:
    name: str
    shape: tuple[int, ...]
    itemsize: int
    unit: int  # FSDP unit: -1 the root, i the i-th repeated block
    split_dim: int | None  # the dim tensor parallelism splits; None: replicated


TP_SIZES = (2, 4, 8)


@dataclass(frozen=True)
class ModelProfile:
    """What the estimate needs from the model: parameter shapes by FSDP unit, why tensor
    parallelism of each size does not apply (None where it does), and the activation profile."""

    params: tuple[ParamShape, ...]
    blocks: int
    tp_problems: dict[int, str | None]
    activations: ActivationProfile
    sample_shape: tuple[int, ...]  # one sample's input, e.g. (seq_len,)

    @property
    def parameters(self) -> int:
        return sum(math.prod(p.shape) for p in self.params)

    def tp_problem(self, tp: int) -> str | None:
        """Why ``tp``-way tensor parallelism does not apply to this model, or None."""
        return None if tp == 1 else self.tp_problems.get(tp, f"tensor parallelism {tp} was not checked")


def split_dims(model: nn.Module, styles: dict[str, Any]) -> dict[str, int]:
    """Parameter name -> the dim tensor parallelism splits (``worker/tp.py``'s plan): column-wise
    modules split weight and bias by output features (dim 0), row-wise ones the weight by input
    features (dim 1; the bias is added after the reduce, replicated). Names may be patterns."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    dims: dict[str, int] = {}
    for pattern, style in styles.items():
        colwise = style == COLWISE or isinstance(style, ColwiseParallel)
        rowwise = style == ROWWISE or isinstance(style, RowwiseParallel)
        for name, module in model.named_modules():
            if (colwise or rowwise) and fnmatch.fnmatchcase(name, pattern):
                for leaf, _ in module.named_parameters(recurse=False):
                    if colwise:
                        dims[f"{name}.{leaf}"] = 0
                    elif leaf == "weight":
                        dims[f"{name}.{leaf}"] = 1
    return dims


def tp_problems(model: nn.Module, config: Config) -> tuple[dict[int, str | None], dict[str, Any]]:
    """The model's tensor-parallel styles, and for each size why it does not apply (the checks
    ``trainforge train`` makes before Ray starts)."""
    user_plan = getattr(config.parallel, "tp_plan", None)
    sizes = sorted({*TP_SIZES, int(getattr(config.parallel, "tensor_parallel", 1) or 1)} - {1})
    try:
        styles = tp_styles(model, user_plan)
    except TrainforgeError as err:
        return {tp: str(err) for tp in sizes}, {}
    problems: dict[int, str | None] = {}
    for tp in sizes:
        try:
            check_tensor_parallel(model, tp, user_plan)
            problems[tp] = None
        except TrainforgeError as err:
            problems[tp] = str(err)
    return problems, styles


def profile_model(config: Config) -> ModelProfile:
    """Build the model under FakeTensorMode and measure it; the global RNG is left as it was."""
    _, _, spec = build_datasets(config.data, config.seed)
    if config.model.task == "custom" or spec.kind == "custom":
        raise ModelError(
            "the memory planner measures activations on (input, target) batches; a model.task custom model "
            "steps on batches of its own shape, which it cannot fake: set train.batch_size (trainforge plan "
            "has no estimate for it)"
        )
    with torch.random.fork_rng(devices=[]), FakeTensorMode() as mode:
        model = build_model(config.model, spec)
        task = build_task(config.model, spec)
        blocks = repeated_blocks(model, config.parallel.fsdp.wrap)
        problems, styles = tp_problems(model, config)
        dims = split_dims(model, styles)
        unit_of = {id(p): i for i, block in enumerate(blocks) for p in block.parameters()}
        params = tuple(
            ParamShape(name, tuple(p.shape), p.element_size(), unit_of.get(id(p), -1), dims.get(name))
            for name, p in model.named_parameters()
            if p.requires_grad
        )
        if compute_mode(config) == "bf16_params":
            cast_parameters(model, torch.bfloat16)  # FSDP's bf16 policy computes with bf16 parameters
        profile = measure_activations(mode, model, blocks, task, spec, autocast_dtype(config))
    return ModelProfile(params, len(blocks), problems, profile, tuple(spec.input_shape))


def cast_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """New parameters of ``dtype`` in place of the floating ones (ties kept); ``Module.to`` cannot
    swap fake tensors."""
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None and param.is_floating_point():
                if id(param) not in made:
                    made[id(param)] = nn.Parameter(param.detach().to(dtype), requires_grad=param.requires_grad)
                module._parameters[name] = made[id(param)]


def compute_mode(config: Config) -> Literal["fp32", "autocast", "bf16_params"]:
    if config.parallel.fsdp.mixed_precision == "bf16":
        return "bf16_params"
    return "fp32" if config.precision == "fp32" else "autocast"


def autocast_dtype(config: Config) -> torch.dtype | None:
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(config.precision)


# ---------------------------------------------------------------------------------------------
# The estimate


def local_numel(param: ParamShape, tp: int, shards: int) -> int:
    """Elements this rank allocates: split ``tp`` ways on the TP dim, then dim 0 ``shards`` ways.

    FSDP2 pads dim 0 to a multiple of the shard count (each rank holds ``ceil(dim0 / N)`` rows);
    the rank that holds the most is the one that must fit."""
    dims = list(param.shape)
    if tp > 1 and param.split_dim is not None:
        dims[param.split_dim] = -(-dims[param.split_dim] // tp)
    if shards > 1 and dims:
        dims[0] = -(-dims[0] // shards)
    return math.prod(dims)


def optimizer_states(config: Config) -> tuple[int, int]:
    """(state tensors shaped like each parameter, extra bytes per parameter tensor) of ``optim``."""
    optim = config.optim
    if optim.name in ("adam", "adamw"):
        return 2, ADAM_STEP_BYTES  # exp_avg, exp_avg_sq; and the step counter
    if optim.name == "sgd":
        return (1 if optim.momentum > 0 else 0), 0  # SGD's momentum buffer
    if optim.name == "SGD":
        return (1 if float(optim.kwargs.get("momentum", 0) or 0) > 0 else 0), 0
    return STATE_TENSORS.get(optim.name, 2), ADAM_STEP_BYTES  # an unknown class: two, as the Adam family


# A torch.optim class's state tensors shaped like each parameter (before options such as
# RMSprop's momentum or centred variant, or Adam's amsgrad, add one).
STATE_TENSORS = {
    "Adadelta": 2,
    "Adafactor": 1,
    "Adagrad": 1,
    "Adam": 2,
    "AdamW": 2,
    "Adamax": 2,
    "ASGD": 1,
    "NAdam": 2,
    "RAdam": 2,
    "RMSprop": 1,
    "Rprop": 2,
}


def rank_breakdown(
    config: Config,
    world_size: int,
    strategy: Strategy | None = None,
    micro_batch: int | None = None,
    profile: ModelProfile | None = None,
) -> Breakdown:
    """This config's bytes per rank under ``strategy`` (default: the config's own ``parallel``) on
    ``world_size`` ranks at ``micro_batch`` (default ``train.batch_size``). Pass a ``profile`` to
    estimate several strategies from one measurement."""
    strategy = strategy or strategy_of(config)
    profile = profile or profile_model(config)
    batch = configured_micro_batch(config) if micro_batch is None else micro_batch
    fixed = fixed_bytes(config, world_size, strategy, profile)
    acts = activation_bytes(profile, strategy)
    return replace(fixed, activations=int(acts.at(batch)))


def configured_micro_batch(config: Config) -> int:
    """``train.batch_size``, or 1 while it is ``auto`` (what auto picks is ``max_micro_batch``)."""
    batch = config.train.batch_size
    return batch if isinstance(batch, int) else 1


def fixed_bytes(config: Config, world_size: int, strategy: Strategy, profile: ModelProfile) -> Breakdown:
    """Every term but activations (which grow with the micro-batch)."""
    tp = strategy.tensor_parallel
    dp = max(1, world_size // tp)
    shards = strategy.shards(world_size)  # HSDP: a shard group's ranks, not every data-parallel rank
    states, per_tensor = optimizer_states(config)
    params = sum(local_numel(p, tp, shards) * p.itemsize for p in profile.params)
    optimizer = states * params + per_tensor * len(profile.params)
    return Breakdown(
        params=params,
        grads=params,  # fp32 gradients shaped like the (sharded) fp32 parameters
        optimizer=optimizer,
        activations=0,
        buffers=buffer_bytes(config, strategy, profile, dp, params),
    )


def buffer_bytes(config: Config, strategy: Strategy, profile: ModelProfile, dp: int, grads: int) -> int:
    """Working copies beside the rank's own tensors.

    DDP (more than one rank) keeps its gradient buckets, a flat copy of every gradient. FSDP
    gathers units: the root (kept unsharded from forward through backward, with its unsharded
    gradients) and the current block plus the prefetched next one in the compute dtype, with one
    block's unsharded fp32 gradients before their reduce-scatter; without resharding after forward
    every block stays gathered until its backward."""
    if dp == 1:
        return 0
    if not strategy.sharded:
        return grads
    tp = strategy.tensor_parallel
    compute = 2 if compute_mode(config) == "bf16_params" else FP32
    unit_numel: dict[int, int] = {}
    for p in profile.params:
        unit_numel[p.unit] = unit_numel.get(p.unit, 0) + local_numel(p, tp, 1)
    root = unit_numel.pop(-1, 0)
    largest = max(unit_numel.values(), default=0)
    gathered = sum(unit_numel.values()) if not config.parallel.fsdp.reshard_after_forward else 2 * largest
    return root * (compute + FP32) + gathered * compute + largest * FP32


def activation_bytes(profile: ModelProfile, strategy: Strategy) -> PerBatch:
    """The most activation bytes live at once, as fixed + per-sample parts.

    Without checkpointing that is the start of backward: everything saved, plus the forward's
    largest tensor (the logits, whose gradient comes next). A checkpointed block keeps only its
    inputs; its saved tensors come back one block at a time in backward, when what the head and
    loss saved is gone, so the peak is the larger of the start of backward and the recompute of a
    checkpointed block (what lies before it, its inputs, its saved tensors and its output's
    gradient, about its input's size). Under tensor parallelism what blocks save is divided by
    ``tp`` (attention and MLP intermediates are split; the norms' inputs are replicated, so this
    is optimistic by their share); block inputs, embeddings, head and loss are replicated."""
    acts = profile.activations
    tp = strategy.tensor_parallel
    step = {"none": 0, "full": 1, "every_n": strategy.every_n}[strategy.activation_checkpointing]
    kept = acts.before
    recompute = PerBatch(0.0, 0.0)
    for i, saved in enumerate(acts.blocks):
        if step and i % step == 0:
            recompute = recompute.max(kept + acts.inputs[i] + acts.inputs[i] + saved.scaled(1 / tp))
            kept = kept + acts.inputs[i]
        else:
            kept = kept + saved.scaled(1 / tp)
    return (kept + acts.after + acts.largest).max(recompute)


def max_micro_batch(
    config: Config,
    world_size: int,
    memory_bytes: int,
    reserve: Reserve | None = None,
    strategy: Strategy | None = None,
    profile: ModelProfile | None = None,
) -> int:
    """The largest micro-batch whose estimate fits in ``memory_bytes`` per rank under the config's
    own ``parallel`` settings (or ``strategy``), after ``reserve`` (default: ``reserve_for(config)``);
    0 when not even the model's state fits. Capped at the config's largest batch size."""
    strategy = strategy or strategy_of(config)
    profile = profile or profile_model(config)
    usable = memory_bytes - (reserve or reserve_for(config)).of(memory_bytes)
    fixed = fixed_bytes(config, world_size, strategy, profile).total
    acts = activation_bytes(profile, strategy)
    room = usable - fixed - acts.fixed
    if room < acts.per_sample:
        return 0
    if acts.per_sample <= 0:
        return MAX_BATCH
    batch = min(MAX_BATCH, int(room // acts.per_sample))
    while batch > 0 and fixed + acts.at(batch) > usable:  # float rounding at the boundary
        batch -= 1
    return batch
