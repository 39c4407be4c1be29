"""The layouts ``trainforge plan`` weighs against each other: pipelined ones beside the data- and
tensor-parallel ones, what each sends between nodes, whether trainforge runs it, and which wins.

A layout is a ``Strategy``: pipeline stages x data-parallel ranks (DDP, FSDP or HSDP) x tensor
parallel, as ``worker/tp.py``'s ``Layout`` places them (tensor-parallel ranks consecutive, then
data-parallel, stages outermost), on nodes of ``GPUS_PER_NODE`` GPUs. Traffic between nodes is
counted as a hierarchical collective moves it (a ring inside each node, then one across the
nodes over the whole buffer, each node's members sharing its part), summed over the cluster and
divided by the samples one step trains: bytes per sample, comparable across layouts whose data-
parallel width differs.

Each layout's step is estimated as its compute (the model's forward FLOPs counted on fake
tensors, three times for forward and backward, four with activation checkpointing, split over the
stages and tensor-parallel ranks, at ``Cluster.gpu_flops``), stretched by the pipeline bubble,
plus the time its node sends between nodes on the cluster's links, not overlapped (pessimistic
for DDP and FSDP, which hide some of it; ``trainforge predict`` models the overlap of a config's
own layout). Tensor-parallel traffic stays inside a node and is not counted.

The recommendation is the layout that fits, runs in trainforge today, and loses the least time
per sample to the network and the pipeline bubble by that estimate; ties (every layout on one
node, say) go to the first in ``candidate_strategies``' order: no recompute before recompute,
checkpointing before tensor parallelism (whose own costs, collectives on the critical path and
smaller matrix products, the estimate does not model), HSDP before FSDP. A layout trainforge
does not run yet that would win is named in the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

from pydantic import ValidationError

from trainforge.config import Config
from trainforge.worker.capacity.estimate import FP32, Strategy, local_numel, rank_profile, stage_blocks
from trainforge.worker.capacity.profile import ModelProfile, ParamShape, compute_mode

GPUS_PER_NODE = 8
GB = 1e9
PIPELINE_STAGES = (2, 4, 8, 16, 32, 64)
# What crosses nodes, from the least to the most (a row's ``crosses_nodes``).
CROSSING = ("nothing", "point-to-point activations", "replica all-reduces", "sharded all-gathers")


@dataclass(frozen=True)
class Cluster:
    """What the time estimate assumes of the GPUs and their network: ``link_Bps`` per direction
    of each of a node's ``nics_per_node`` links, and the FLOP/s one GPU sustains."""

    link_Bps: float = 25 * GB  # InfiniBand HDR, predict's default --link ib200
    nics_per_node: int = 1
    gpu_flops: float = 400e12  # a bf16 H100 at about 40% of its dense peak
    gpus_per_node: int = GPUS_PER_NODE


@dataclass(frozen=True)
class Traffic:
    """Bytes one step sends between nodes (the whole cluster), the samples it trains, and the
    worst kind of collective that crosses nodes (an index into ``CROSSING``)."""

    bytes_per_step: float
    samples: int
    crossing: int

    @property
    def bytes_per_sample(self) -> float:
        return self.bytes_per_step / self.samples


@dataclass(frozen=True)
class StepTime:
    """A layout's estimated step: compute on one GPU (``bubble_s`` of it idle in the pipeline
    bubble), and sending between nodes."""

    compute_s: float
    bubble_s: float
    network_s: float
    samples: int

    @property
    def step_s(self) -> float:
        return self.compute_s + self.network_s

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.step_s if self.step_s > 0 else 0.0


def step_time(
    profile: ModelProfile, strategy: Strategy, sent: Traffic, gpus: int, micro_batch: int, cluster: Cluster
) -> StepTime:
    """Compute of one micro-batch on one GPU (its stage's and tensor-parallel share, stretched by
    the bubble) plus the time a node needs to send its share of ``sent`` over its links."""
    recompute = 4 / 3 if strategy.activation_checkpointing != "none" else 1.0  # the forward again
    flops = 3 * profile.activations.flops.at(micro_batch) * recompute / (strategy.pipeline * strategy.tensor_parallel)
    compute = flops / cluster.gpu_flops / (1 - strategy.bubble)
    nodes = -(-gpus // cluster.gpus_per_node)
    network = sent.bytes_per_step / nodes / (cluster.link_Bps * cluster.nics_per_node) if nodes > 1 else 0.0
    return StepTime(compute, compute * strategy.bubble, network, sent.samples)


def pipelined_strategies(
    profile: ModelProfile, gpus: int, micro_batch: int, bases: list[Strategy], config: Config
) -> tuple[list[Strategy], list[dict[str, str]]]:
    """Each base layout (ddp, fsdp, with checkpointing and tensor parallelism) cut into 2, 4, 8 ...
    stages that divide both the GPUs (with the tensor-parallel groups) and the blocks. The
    schedule and pipeline micro-batches are the config's ``parallel.pipeline``'s when it has one
    (with interleaved_1f1b, where the blocks divide into its stages per rank too), else 1F1B over
    one sample each (the smallest bubble a micro-batch allows)."""
    if profile.pipeline_problem is not None:
        return [], [{"name": "pp", "reason": profile.pipeline_problem}]
    own = config.parallel.pipeline
    schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = own.schedule if own is not None else "1f1b"
    virtual = own.per_worker if own is not None else 1
    microbatches = own.microbatches if own is not None else micro_batch
    # ddp rows first (with checkpointing: stages with whole copies need it most), then the sharded ones
    unsharded = [base for base in bases if not base.sharded]
    bases = [*unsharded, Strategy("ddp+ac", False, 1, "full"), *(base for base in bases if base.sharded)]
    chosen = []
    for stages in PIPELINE_STAGES:
        if stages > profile.blocks or profile.blocks % stages:
            continue
        for base in bases:
            tp = base.tensor_parallel
            if gpus % (stages * tp) or (base.sharded and gpus // (stages * tp) < 2):
                continue  # FSDP over one rank is DDP
            name = f"pp{stages}+{base.name}"
            # too few blocks to interleave them over the stages: one stage a rank
            interleaves = profile.blocks % (stages * virtual) == 0
            cut = replace(base, name=name, pipeline=stages, microbatches=microbatches)
            chosen.append(replace(cut, schedule=schedule, virtual=virtual) if interleaves else cut)
    return chosen, []


def spans(members: int, stride: int, node: int = GPUS_PER_NODE) -> tuple[int, int]:
    """(nodes, members per node) of a group of ``members`` ranks ``stride`` apart."""
    per_node = max(1, min(members, node // stride)) if stride < node else 1
    return -(-members // per_node), per_node


def node_share(kind: str, nbytes: float, members: int, stride: int) -> tuple[float, bool]:
    """What one member of a collective sends between nodes (its node's inter-node ring over the
    whole buffer, shared by the node's members), and whether the group crosses nodes at all."""
    nodes, per_node = spans(members, stride)
    if nodes == 1 or nbytes <= 0:
        return 0.0, False
    steps = 2 * (nodes - 1) if kind == "all_reduce" else nodes - 1
    return steps * nbytes / nodes / per_node, True


def traffic(config: Config, profile: ModelProfile, strategy: Strategy, gpus: int, micro_batch: int) -> Traffic:
    """Bytes sent between nodes per step over the samples of the step: gradient all-reduces
    (DDP; HSDP's replicas), FSDP's all-gathers (forward, and backward when resharded) and
    reduce-scatters, and a pipeline's activations and their gradients between stages."""
    tp, stages = strategy.tensor_parallel, strategy.pipeline
    dp = strategy.data_parallel(gpus)
    compute = 2 if compute_mode(config) == "bf16_params" else FP32
    per_gpu, crossing = 0.0, 0
    for index in range(stages):
        held = stage_params(profile, strategy, index)
        grads = sum(local_numel(p, tp, 1) * p.itemsize for p in held)
        numel = sum(local_numel(p, tp, 1) for p in held)
        if not strategy.sharded:
            sent, crosses = node_share("all_reduce", grads, dp, tp)
            crossing = max(crossing, 2 if crosses else 0)
        else:
            shards = strategy.shards(gpus)
            gathers = 2 if config.parallel.fsdp.reshard_after_forward else 1
            gather, crosses = node_share("all_gather", gathers * numel * compute, shards, tp)
            scatter, _ = node_share("reduce_scatter", grads, shards, tp)
            replica, replica_crosses = node_share("all_reduce", grads / shards, strategy.replicate, tp * shards)
            sent = gather + scatter + replica
            crossing = max(crossing, 3 if crosses else 2 if replica_crosses else 0)
        per_gpu += sent / stages  # a stage's ranks are 1 / stages of the GPUs
    total = per_gpu * gpus
    samples = dp * micro_batch
    if stages > 1:
        parts = stage_blocks(profile, strategy.parts)  # interleaved: every stage's hand-over to the next rank's
        hidden = [profile.activations.inputs[blocks.start].at(micro_batch) for blocks in parts]
        stride = dp * tp  # consecutive stages of one replica are this many ranks apart
        for index in range(1, len(parts)):
            rank, previous = index % stages, (index - 1) % stages
            if (rank * stride) // GPUS_PER_NODE != (previous * stride) // GPUS_PER_NODE:
                total += 2 * hidden[index] * dp * tp  # forward activations and their gradients back
                crossing = max(crossing, 1)
    return Traffic(total, samples, crossing)


def stage_params(profile: ModelProfile, strategy: Strategy, index: int) -> tuple[ParamShape, ...]:
    """The parameters pipeline rank ``index`` holds (all of them unpipelined)."""
    return rank_profile(profile, strategy, index).params if strategy.pipeline > 1 else profile.params


def settings_of(strategy: Strategy) -> dict[str, Any]:
    """The config keys that select ``strategy``."""
    settings: dict[str, Any] = {"parallel.strategy": "fsdp" if strategy.sharded else "ddp"}
    if strategy.replicate > 1:
        settings["parallel.fsdp.replicate"] = strategy.replicate
    if strategy.tensor_parallel > 1:
        settings["parallel.tensor_parallel"] = strategy.tensor_parallel
    settings["parallel.activation_checkpointing"] = strategy.activation_checkpointing
    if strategy.pipeline > 1:
        settings["parallel.pipeline"] = {
            "stages": strategy.pipeline,
            "schedule": strategy.schedule,
            "microbatches": strategy.microbatches,
        }
        if strategy.virtual > 1:
            settings["parallel.pipeline"]["virtual_stages"] = strategy.virtual
    return settings


def why_not(config: Config, strategy: Strategy, gpus: int) -> str | None:
    """Why trainforge does not run ``strategy`` on ``gpus`` workers with this config (the config
    checks ``trainforge train`` makes), or None when it does."""
    raw = config.to_dict()
    raw["scaling"]["num_workers"] = gpus
    parallel = raw["parallel"]
    parallel["pipeline"] = None
    parallel["fsdp"]["replicate"] = 1
    parallel["tensor_parallel"] = 1
    for key, value in settings_of(strategy).items():
        *path, leaf = key.split(".")[1:]
        section = parallel
        for part in path:
            section = section[part]
        section[leaf] = value
    try:
        Config.model_validate(raw)
    except ValidationError as err:
        first = err.errors()[0]
        return str(first["msg"]).removeprefix("Value error, ")
    return None


def recommend(rows: list[dict[str, Any]]) -> tuple[dict[str, Any] | None, str, dict[str, Any] | None]:
    """The layout to run (fits, runs, loses the least time to the network and the bubble), why it
    beats the next best and the best of the other kind (pipelined or not), and a layout trainforge
    does not run yet that would have won (or None)."""
    fitting = sorted((row for row in rows if row["fits"]), key=rank_key)
    running = [row for row in fitting if row["runs"]]
    if not running:
        return None, "no layout that trainforge runs fits", fitting[0] if fitting else None
    best = running[0]
    better = fitting[0] if fitting[0] is not best else None
    why = (
        f"{best['name']} fits ({best['per_gpu_gb']['total']:.1f} GiB per GPU) and "
        f"loses the least time per sample to the network and the pipeline bubble by the plan's estimate: "
        f"{describe(best)}"
    )
    others = running[1:]
    if not others:
        why += "; no other layout that trainforge runs fits"
    else:
        why += f"; the next that fits, {others[0]['name']}: {describe(others[0])}"
        if rank_key(others[0])[0] == rank_key(best)[0]:
            why += f"; as little, and {best['name']} {tie_break(best, others[0])}"
    pipelined = best["pipeline"] > 1
    rival = next((row for row in fitting if (row["pipeline"] > 1) != pipelined), None)
    if rival is not None and rival is not better and (not others or rival is not others[0]):
        kind = "unpipelined" if pipelined else "pipelined"
        runs = "" if rival["runs"] else f" (trainforge does not run it: {rival['why_not']})"
        why += f"; the best {kind} layout that fits, {rival['name']}{runs}: {describe(rival)}"
    if better is not None:
        why += f"; {better['name']} would win ({describe(better)}) but trainforge does not run it: {better['why_not']}"
    return best, why, better


def rank_key(row: dict[str, Any]) -> tuple[float, int]:
    """Fewer seconds per sample lost to the network and the bubble first (to 3 figures, so float
    noise does not decide), then the plan's order."""
    estimate = row["estimate"]
    lost = (estimate["network_s"] + estimate["bubble_s"]) / estimate["samples"]
    return (float(f"{lost:.3g}"), row["order"])


def describe(row: dict[str, Any]) -> str:
    """Samples per second, and what the step spends on compute, the bubble and the network, in words."""
    estimate = row["estimate"]
    words = f"{estimate['samples_per_s']:,.3g} samples/s ({seconds(estimate['compute_s'])} of compute"
    if row["bubble"]:
        words += f", {seconds(estimate['bubble_s'])} of it ({row['bubble']:.0%}) idle in the pipeline bubble"
    crossing = row["crosses_nodes"]
    if crossing == "nothing":
        words += ", every collective inside a node)"
    else:
        mb = row["cross_node_bytes_per_sample"] / 1e6
        size = f"{mb:,.0f}" if mb >= 100 else f"{mb:.3g}"
        words += f", {seconds(estimate['network_s'])} sending {crossing} between nodes, {size} MB per sample)"
    return words


def tie_break(best: dict[str, Any], other: dict[str, Any]) -> str:
    """Why ``best`` comes before ``other`` in the plan's order when the network does not decide."""
    if other["activation_checkpointing"] and not best["activation_checkpointing"]:
        return "recomputes no activations"
    if other["tensor_parallel"] > best["tensor_parallel"]:
        less = "no" if best["tensor_parallel"] == 1 else "less"
        return f"uses {less} tensor parallelism (collectives in every block, which the estimate leaves out)"
    if other["data_parallel"] != "ddp" and best["data_parallel"] == "ddp":
        return "keeps whole copies (no all-gathers)"
    if best["replicate"] > other["replicate"]:
        return f"all-gathers over {best['shards']} GPUs rather than {other['shards']}"
    return "comes first in the plan's order (less recompute and tensor parallelism)"


def seconds(value: float) -> str:
    return f"{value:.3g} s" if value >= 1 else f"{value * 1e3:.3g} ms"
