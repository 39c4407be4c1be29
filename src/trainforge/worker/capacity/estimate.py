"""Memory per rank, estimated before anything is allocated: the memory planner's model.

The model is built under ``FakeTensorMode`` (meta storage: shapes and dtypes, no bytes,
``profile.py``), so a 10B model costs seconds and no memory. Parameters, gradients and optimizer
state follow from the parameter shapes and the strategy (docs/planning.md gives each term's model); activations are
measured, not guessed: one fake forward and loss at micro-batches 2 and 4 under
``saved_tensors_hooks`` sums the bytes autograd keeps for backward, by repeated block, and the two
points give a fixed part and a per-sample part (activations are linear in the micro-batch).

Under pipeline parallelism each stage is estimated apart (its blocks, the embeddings on the
first, the final norm and head on the last; the activations of the pipeline micro-batches it
holds at once) and the stage that holds the most is the rank that must fit. Under interleaved
1F1B a rank holds several stages (``r, r + P, ...``): their parameters together, and the
activations its stages hold at the schedule's peak (``interleaved_in_flight``).

``max_micro_batch(config, world_size, memory_bytes)`` is what a worker asks ("how large a
micro-batch fits in this rank's memory"); ``rank_breakdown`` gives the terms for one strategy.
Both are pure functions of the config: no process group, no device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

from trainforge.config import MAX_BATCH, Config
from trainforge.worker.capacity.activations import PerBatch
from trainforge.worker.capacity.profile import ModelProfile, ParamShape, compute_mode, profile_model
from trainforge.worker.pipeline import split_blocks, stages_of

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
    (``replicate`` > 1) shards over groups of ``data-parallel ranks / replicate`` only.
    ``pipeline`` > 1 cuts the model into that many stages (``schedule`` over ``microbatches``
    pipeline micro-batches per micro-batch), ``virtual`` each under interleaved_1f1b (then the
    model has ``pipeline x virtual`` stages); the data-parallel ranks are the rest."""

    name: str
    sharded: bool
    tensor_parallel: int = 1
    activation_checkpointing: Literal["none", "full", "every_n"] = "none"
    every_n: int = 2
    replicate: int = 1
    pipeline: int = 1
    schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = "1f1b"
    microbatches: int = 1
    virtual: int = 1

    @property
    def parts(self) -> int:
        """The model's stages: ``pipeline`` ranks x ``virtual`` stages each."""
        return self.pipeline * self.virtual

    def data_parallel(self, world_size: int) -> int:
        """Ranks that read different batches: the world over pipeline stages and tensor-parallel groups."""
        return max(1, world_size // self.tensor_parallel // self.pipeline)

    def shards(self, world_size: int) -> int:
        """How many ways each parameter is sharded (FSDP's dim-0 split): 1 replicated (DDP)."""
        if not self.sharded:
            return 1
        return max(1, self.data_parallel(world_size) // self.replicate)

    def in_flight(self, stage: int) -> int:
        """Pipeline micro-batches whose activations ``stage`` holds at once: GPipe runs every
        forward before any backward (all of them); 1F1B starts backward after the pipeline fills,
        so stage ``s`` of ``P`` holds ``P - s`` (at most all of them)."""
        if self.pipeline == 1:
            return 1
        if self.schedule == "gpipe":
            return self.microbatches
        return min(self.microbatches, self.pipeline - stage)

    @property
    def bubble(self) -> float:
        """The pipeline's idle share of a step, ``(P - 1) / (V M + P - 1)`` (V = 1 for GPipe and 1F1B)."""
        return (self.pipeline - 1) / (self.virtual * self.microbatches + self.pipeline - 1)


def strategy_of(config: Config) -> Strategy:
    """The config's own ``parallel`` settings as a Strategy."""
    par = config.parallel
    tp = int(getattr(par, "tensor_parallel", 1) or 1)
    replicate = par.fsdp.replicate if par.strategy == "fsdp" else 1
    kind = "hsdp" if replicate > 1 else par.strategy
    pipe = par.pipeline
    stages = f"pp{pipe.stages}+" if pipe is not None else ""
    name = stages + kind + (f"+tp{tp}" if tp > 1 else "") + ("+ac" if par.activation_checkpointing != "none" else "")
    return Strategy(
        name=name,
        sharded=par.strategy == "fsdp",
        tensor_parallel=tp,
        activation_checkpointing=par.activation_checkpointing,
        every_n=par.activation_checkpointing_every_n,
        replicate=replicate,
        pipeline=pipe.stages if pipe is not None else 1,
        schedule=pipe.schedule if pipe is not None else "1f1b",
        microbatches=pipe.microbatches if pipe is not None else 1,
        virtual=pipe.per_worker if pipe is not None else 1,
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
    return max(stage_breakdowns(config, world_size, strategy, micro_batch, profile), key=lambda parts: parts.total)


def stage_breakdowns(
    config: Config,
    world_size: int,
    strategy: Strategy | None = None,
    micro_batch: int | None = None,
    profile: ModelProfile | None = None,
) -> list[Breakdown]:
    """``rank_breakdown`` of each pipeline stage's ranks, first to last (one entry unpipelined)."""
    strategy = strategy or strategy_of(config)
    profile = profile or profile_model(config)
    batch = configured_micro_batch(config) if micro_batch is None else micro_batch
    return [
        replace(fixed, activations=int(acts.at(batch)))
        for fixed, acts in per_stage(config, world_size, strategy, profile)
    ]


def per_stage(
    config: Config, world_size: int, strategy: Strategy, profile: ModelProfile
) -> list[tuple[Breakdown, PerBatch]]:
    """Each kind of rank's fixed bytes and activations: one kind, or one per pipeline stage."""
    if strategy.pipeline == 1:
        return [(fixed_bytes(config, world_size, strategy, profile), activation_bytes(profile, strategy))]
    return [
        (fixed_bytes(config, world_size, strategy, rank_profile(profile, strategy, index)), acts)
        for index, acts in enumerate(stage_activations(profile, strategy))
    ]


def stage_blocks(profile: ModelProfile, stages: int) -> list[range]:
    """The blocks of each stage, as ``worker/pipeline.py`` splits them (equal counts)."""
    return split_blocks(profile.blocks, stages)


def stage_profile(profile: ModelProfile, stages: int, index: int | Sequence[int]) -> ModelProfile:
    """``profile`` with the parameters stage ``index`` of ``stages`` holds (or stages, all of
    them): its blocks, and the embeddings on the first stage, the final norm and head on the last."""
    indices = {index} if isinstance(index, int) else set(index)
    parts = stage_blocks(profile, stages)
    blocks = {block for i in indices for block in parts[i]}

    def held(param: ParamShape) -> bool:
        if param.unit >= 0:
            return param.unit in blocks
        return 0 in indices if param.name in profile.first_stage else stages - 1 in indices

    return replace(profile, params=tuple(p for p in profile.params if held(p)))


def rank_stages(strategy: Strategy, rank: int) -> list[int]:
    """The stages pipeline rank ``rank`` holds: ``rank``, ``rank + P``, ... (one unless interleaved)."""
    return stages_of(rank, strategy.pipeline, strategy.parts)


def rank_profile(profile: ModelProfile, strategy: Strategy, rank: int) -> ModelProfile:
    """``profile`` with the parameters pipeline rank ``rank`` holds (all of its stages')."""
    return stage_profile(profile, strategy.parts, rank_stages(strategy, rank))


def interleaved_in_flight(strategy: Strategy, rank: int) -> list[list[int]]:
    """Pipeline micro-batches whose activations each of ``rank``'s stages holds, after each of
    its operations under torch's interleaved 1F1B (``ScheduleInterleaved1F1B``): ``warmup``
    forwards, then a forward and a backward each, then the remaining backwards; forwards go
    through its stages a round of micro-batches at a time, backwards the other way."""
    pp, local, m = strategy.pipeline, strategy.virtual, strategy.microbatches
    per_round = m // max(1, m // pp)
    warmup = min((local - 1) * per_round + 2 * (pp - 1 - rank), m * local)
    live, seen = [0] * local, []
    forwards = backwards = 0

    def forward() -> None:
        nonlocal forwards
        live[(forwards // per_round) % local] += 1
        forwards += 1
        seen.append(list(live))

    def backward() -> None:
        nonlocal backwards
        live[local - 1 - (backwards // per_round) % local] -= 1
        backwards += 1
        seen.append(list(live))

    for _ in range(warmup):
        forward()
    for _ in range(m * local - warmup):
        forward()
        backward()
    for _ in range(warmup):
        backward()
    return seen


def stage_activations(profile: ModelProfile, strategy: Strategy) -> list[PerBatch]:
    """Each pipeline rank's activation bytes at a training micro-batch: what one pipeline
    micro-batch (``1 / microbatches`` of its samples) saves on each stage the rank holds, times
    the micro-batches the schedule keeps in flight there; one micro-batch's logits' gradient on
    the last stage's rank."""
    acts = profile.activations
    share = 1 / strategy.microbatches
    parts = stage_blocks(profile, strategy.parts)
    kept: list[tuple[PerBatch, PerBatch]] = []
    for index, blocks in enumerate(parts):
        first, last = index == 0, index == len(parts) - 1
        saved, recompute = kept_by_blocks(profile, strategy, blocks, acts.before if first else PerBatch(0.0, 0.0))
        if last:
            saved = saved + acts.after
        kept.append((saved.scaled(share), recompute.scaled(share)))
    result = []
    for rank in range(strategy.pipeline):
        stages = rank_stages(strategy, rank)
        if strategy.schedule == "interleaved_1f1b":
            held = interleaved_peak([kept[i] for i in stages], interleaved_in_flight(strategy, rank))
        else:
            # the other micro-batches in flight keep what they saved while one recomputes a block
            saved, recompute = kept[rank]
            others = strategy.in_flight(rank) - 1
            held = (saved + saved.scaled(others)).max(recompute + saved.scaled(others))
        has_last = strategy.parts - 1 in stages
        largest = PerBatch(acts.largest.fixed, acts.largest.per_sample * share) if has_last else PerBatch(0.0, 0.0)
        result.append(held + largest)
    return result


def interleaved_peak(kept: list[tuple[PerBatch, PerBatch]], counts: list[list[int]]) -> PerBatch:
    """A rank's activations at the schedule's fullest moment (by bytes per sample): each of its
    stages' saved bytes times the micro-batches in flight there, and, when a stage recomputes a
    block, that block's recompute over one of its micro-batches' saved bytes."""
    fullest = max(counts, key=lambda live: sum(n * saved.per_sample for n, (saved, _) in zip(live, kept, strict=True)))
    held = PerBatch(0.0, 0.0)
    for n, (saved, _) in zip(fullest, kept, strict=True):
        held = held + saved.scaled(n)
    extra = PerBatch(0.0, 0.0)
    for n, (saved, recompute) in zip(fullest, kept, strict=True):
        if n:
            extra = extra.max(PerBatch(recompute.fixed - saved.fixed, recompute.per_sample - saved.per_sample))
    return held + extra


def configured_micro_batch(config: Config) -> int:
    """``train.batch_size``, or 1 while it is ``auto`` (what auto picks is ``max_micro_batch``)."""
    batch = config.train.batch_size
    return batch if isinstance(batch, int) else 1


def fixed_bytes(config: Config, world_size: int, strategy: Strategy, profile: ModelProfile) -> Breakdown:
    """Every term but activations (which grow with the micro-batch)."""
    tp = strategy.tensor_parallel
    dp = strategy.data_parallel(world_size)
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
    kept, recompute = kept_by_blocks(profile, strategy, range(len(acts.blocks)), acts.before)
    return (kept + acts.after + acts.largest).max(recompute)


def kept_by_blocks(
    profile: ModelProfile, strategy: Strategy, blocks: range, kept: PerBatch
) -> tuple[PerBatch, PerBatch]:
    """What ``kept`` grows to through ``blocks`` (checkpointed ones keep their inputs only), and
    the peak of recomputing a checkpointed block."""
    acts = profile.activations
    tp = strategy.tensor_parallel
    step = {"none": 0, "full": 1, "every_n": strategy.every_n}[strategy.activation_checkpointing]
    recompute = PerBatch(0.0, 0.0)
    for i in blocks:
        saved = acts.blocks[i]
        if step and i % step == 0:
            recompute = recompute.max(kept + acts.inputs[i] + acts.inputs[i] + saved.scaled(1 / tp))
            kept = kept + acts.inputs[i]
        else:
            kept = kept + saved.scaled(1 / tp)
    return kept, recompute


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
    return min(
        largest_batch(usable, fixed.total, acts) for fixed, acts in per_stage(config, world_size, strategy, profile)
    )


def largest_batch(usable: int, fixed: int, acts: PerBatch) -> int:
    """The largest micro-batch with ``fixed + acts`` within ``usable`` bytes (0: none)."""
    room = usable - fixed - acts.fixed
    if room < acts.per_sample:
        return 0
    if acts.per_sample <= 0:
        return MAX_BATCH
    batch = min(MAX_BATCH, int(room // acts.per_sample))
    while batch > 0 and fixed + acts.at(batch) > usable:  # float rounding at the boundary
        batch -= 1
    return batch
