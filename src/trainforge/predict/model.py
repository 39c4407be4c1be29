"""The step time of data-parallel training on N GPUs: compute, ring collectives, and their overlap.

Assumptions, each a choice a reader may disagree with (docs/benchmarks.md repeats them):

* the per-GPU batch is fixed, so the global batch grows with the GPUs (weak scaling); one GPU
  communicates nothing, and efficiency is ``step time on 1 GPU / step time on N``;
* GPUs sit ``gpus_per_node`` to a node, joined by the intra-node link (NVLink); nodes are joined
  by the chosen link, ``nics_per_node`` of it per node. A collective is hierarchical: a ring inside
  the node over the full buffer, then a ring across the nodes over the full buffer on the node's
  links (the node's GPUs run parallel rings on their shares, sharing its NICs). With one node
  only the intra-node ring runs; with one GPU per node only the inter-node ring;
* the forward is 1/3 of a micro-batch's compute and the backward 2/3; the optimizer step is
  counted in the measured compute and not modelled apart;
* DDP: gradients fill buckets of ``bucket_bytes`` in the backward's order at a uniform rate;
  each bucket's all-reduce starts when it is full and the previous one is done (one stream), so
  communication hides behind the rest of the backward and the last bucket is always exposed.
  With gradient accumulation only the last micro-batch communicates (DDP's ``no_sync``);
* local SGD / DiLoCo (``parallel.sync``): no gradient communication; every ``sync_every_n_steps``
  steps one all-reduce of the parameters (one flat buffer) after the step, exposed whole, so a
  step pays 1/H of it on average;
* FSDP: the model is ``units`` equal units. Every micro-batch's forward all-gathers each unit's
  parameters, one unit ahead of compute; the backward all-gathers them again when the forward
  resharded them, and the last micro-batch reduce-scatters each unit's gradients after its
  backward, all on one stream in issue order (next unit's gather before this unit's scatter);
* a pipeline (``parallel.pipeline``): P stages, each 1/P of the compute, over M pipeline
  micro-batches per micro-batch; GPipe and 1F1B both take ``M + P - 1`` slots of one pipeline
  micro-batch's forward and backward, so ``(P - 1) / (M + P - 1)`` of the time is the bubble.
  Interleaved 1F1B (V stages per GPU, each 1/(P V) of the compute) takes ``V M + P - 1`` slots
  of one such stage: a bubble of ``(P - 1) / (V M + P - 1)``, for V times the sends.
  Each slot also waits for the activations from the previous stage and their gradient from the
  next (point-to-point, over the inter-node link when the pipeline spans nodes, the node's
  sending GPUs sharing its NICs). Under ddp a stage's gradients are all-reduced over its replicas
  after the last backward, not overlapped (as ``PipelinePlan`` does); under fsdp each stage is
  sharded over its replicas: its parameters all-gathered for the pipeline micro-batches' passes and
  its gradients reduce-scattered after each micro-batch, not overlapped. A pipeline of P stages runs
  on a multiple of P GPUs, one replica per P.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from trainforge.predict.links import Link

BACKWARD_SHARE = 2 / 3
DDP_BUCKET_BYTES = 25 * 1024 * 1024  # torch DDP's bucket_cap_mb=25 (MiB)
Collective = Literal["all_reduce", "reduce_scatter", "all_gather"]


@dataclass(frozen=True)
class Topology:
    gpus_per_node: int
    intra: Link
    inter: Link
    nics_per_node: int = 1


@dataclass(frozen=True)
class Workload:
    """One optimizer step of one GPU: what it computes and what it must exchange."""

    strategy: Literal["ddp", "fsdp"]
    compute_s: float  # forward + backward (+ optimizer) of every micro-batch of a step, one GPU
    samples_per_gpu: int  # per optimizer step: micro-batch x micro_batches
    grad_bytes: int  # reduced per step: DDP all-reduce, FSDP reduce-scatter
    param_bytes: int = 0  # FSDP: all-gathered per pass, in the dtype the forward computes with
    micro_batches: int = 1
    bucket_bytes: int = DDP_BUCKET_BYTES
    units: int = 1
    reshard_after_forward: bool = True
    sync_every_n_steps: int = 0  # parallel.sync: parameters averaged every H steps instead (0: off)
    shard_group: int = 0  # HSDP (parallel.fsdp.replicate): GPUs per shard group (0: FSDP over all of them)
    stages: int = 1  # parallel.pipeline.stages (1: not pipelined)
    pipeline_microbatches: int = 1  # parallel.pipeline.microbatches per micro-batch
    p2p_bytes: int = 0  # the activations one pipeline micro-batch sends from a stage to the next
    virtual_stages: int = 1  # stages per GPU (interleaved_1f1b)

    @property
    def bubble(self) -> float:
        """The pipeline's idle share, ``(P - 1) / (V M + P - 1)`` (0 unpipelined)."""
        return (self.stages - 1) / (self.virtual_stages * self.pipeline_microbatches + self.stages - 1)


@dataclass(frozen=True)
class Point:
    gpus: int
    step_time_s: float
    samples_per_s: float
    efficiency: float
    comm_exposed_s: float
    comm_total_s: float  # every collective's time, hidden or not
    bubble_s: float = 0.0  # of the step, idle in the pipeline bubble


def ring_time(kind: Collective, nbytes: float, ranks: int, link: Link, links: float = 1) -> float:
    """A ring collective of an ``nbytes`` buffer over ``ranks``: steps x (alpha + bytes/ranks over the link)."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    steps = 2 * (ranks - 1) if kind == "all_reduce" else ranks - 1
    return steps * (link.alpha_s + nbytes / (ranks * link.bandwidth_Bps * links))


def collective_time(kind: Collective, nbytes: float, gpus: int, topology: Topology) -> float:
    """Inside each node over the intra-node link, then across nodes over the chosen link."""
    per_node = max(1, min(gpus, topology.gpus_per_node))
    nodes = math.ceil(gpus / per_node)
    inside = ring_time(kind, nbytes, per_node, topology.intra)
    across = ring_time(kind, nbytes, nodes, topology.inter, topology.nics_per_node)
    return inside + across


def buckets(total: int, cap: int) -> list[int]:
    """``total`` bytes in buckets of ``cap``, the remainder last."""
    full, rest = divmod(total, cap)
    return [cap] * full + ([rest] if rest else [])


def ddp_step(work: Workload, gpus: int, topology: Topology) -> tuple[float, float]:
    """(step time, communication time) under DDP's bucketed all-reduce."""
    if gpus == 1 or work.grad_bytes <= 0:
        return work.compute_s, 0.0
    micro = work.compute_s / work.micro_batches
    backward = BACKWARD_SHARE * micro
    backward_start = work.compute_s - backward  # the last micro-batch's backward: the only one that syncs
    filled, free_at, total = 0, 0.0, 0.0
    for size in buckets(work.grad_bytes, work.bucket_bytes):
        filled += size
        ready = backward_start + backward * filled / work.grad_bytes
        took = collective_time("all_reduce", size, gpus, topology)
        free_at = max(ready, free_at) + took
        total += took
    return max(work.compute_s, free_at), total


def local_sgd_step(work: Workload, gpus: int, topology: Topology) -> tuple[float, float]:
    """(average step time, average communication time) when parameters are averaged every H steps."""
    if gpus == 1:
        return work.compute_s, 0.0
    average = collective_time("all_reduce", work.grad_bytes, gpus, topology) / work.sync_every_n_steps
    return work.compute_s + average, average


def replica_all_reduce(nbytes: float, group: int, gpus: int, topology: Topology) -> float:
    """HSDP's all-reduce of one shard over the ``gpus / group`` replicas (ranks ``group`` apart).
    Every shard position runs its own at once: inside a node over the intra-node link when a node
    holds several groups, then across nodes, where the node's GPUs share its NICs."""
    per_node = max(1, min(gpus, topology.gpus_per_node))
    inside = max(1, per_node // group)
    nodes = max(1, gpus // group // inside)
    concurrent = min(group, per_node)  # positions of one node all-reducing across nodes together
    across = ring_time("all_reduce", nbytes, nodes, topology.inter, topology.nics_per_node / concurrent)
    return ring_time("all_reduce", nbytes, inside, topology.intra) + across


def fsdp_step(work: Workload, gpus: int, topology: Topology) -> tuple[float, float]:
    """(step time, communication time) under FSDP: per-unit all-gathers and reduce-scatters; under
    HSDP those inside a shard group, and each unit's reduced shard then all-reduced across groups."""
    if gpus == 1:
        return work.compute_s, 0.0
    units = max(1, work.units)
    micro = work.compute_s / work.micro_batches
    forward_unit = (1 - BACKWARD_SHARE) * micro / units
    backward_unit = BACKWARD_SHARE * micro / units
    group = min(gpus, work.shard_group) if work.shard_group else gpus
    gather = collective_time("all_gather", work.param_bytes / units, group, topology)
    scatter = collective_time("reduce_scatter", work.grad_bytes / units, group, topology)
    if group < gpus:
        scatter += replica_all_reduce(work.grad_bytes / units / group, group, gpus, topology)
    clock = Streams()
    for index in range(work.micro_batches):
        clock.pass_(units, forward_unit, gather)
        backward_gather = gather if work.reshard_after_forward else 0.0
        sync = index == work.micro_batches - 1
        clock.pass_(units, backward_unit, backward_gather, scatter if sync else 0.0)
    return max(clock.compute, clock.comm), clock.comm_total


class Streams:
    """One compute stream and one communication stream, as FSDP issues work on them."""

    def __init__(self) -> None:
        self.compute = 0.0  # when the compute stream is free
        self.comm = 0.0  # when the communication stream is free
        self.comm_total = 0.0

    def _send(self, after: float, took: float) -> float:
        self.comm = max(self.comm, after) + took
        self.comm_total += took
        return self.comm

    def pass_(self, units: int, per_unit: float, gather: float, scatter: float = 0.0) -> None:
        """A forward or backward over ``units``: unit i+1's gather is issued when unit i starts."""
        gathered = [self._send(self.compute, gather) if gather else 0.0]
        for unit in range(units):
            if gather and unit + 1 < units:
                gathered.append(self._send(self.compute, gather))
            self.compute = max(self.compute, gathered[unit] if gather else 0.0) + per_unit
            if scatter:
                self._send(self.compute, scatter)


def point_to_point_time(nbytes: float, stages: int, gpus: int, topology: Topology) -> float:
    """One send between consecutive stages (``gpus / stages`` ranks apart): over the intra-node
    link while the whole pipeline is inside a node, else over the nodes' links, shared by the
    node's GPUs that send at once."""
    replicas = gpus // stages
    per_node = max(1, min(gpus, topology.gpus_per_node))
    if (stages - 1) * replicas < per_node:
        link, share = topology.intra, 1.0
    else:
        link, share = topology.inter, topology.nics_per_node / min(per_node, replicas)
    return link.alpha_s + nbytes / (link.bandwidth_Bps * share)


def pipeline_step(work: Workload, gpus: int, topology: Topology) -> tuple[float, float, float]:
    """(step time, communication time, bubble time) of a pipeline: per micro-batch ``V M + P - 1``
    slots of a pipeline micro-batch's forward and backward on one stage (of ``P V``) and its two
    sends, then the GPU's stages' gradients all-reduced over its ``gpus / P`` replicas (ddp), or
    (fsdp: each stage sharded over its replicas) per micro-batch the stages' parameters gathered
    for every pipeline micro-batch's forward and backward (once when ``reshard_after_forward`` is
    off: they stay gathered until the last backward) and their gradients reduce-scattered (torch's
    pipeline stage reduces after each schedule step); none of it overlapped."""
    stages, microbatches, virtual = work.stages, work.pipeline_microbatches, work.virtual_stages
    slot = work.compute_s / work.micro_batches / stages / microbatches / virtual
    send = point_to_point_time(work.p2p_bytes, stages, gpus, topology) if work.p2p_bytes else 0.0
    slots = virtual * microbatches + stages - 1
    per_micro_batch = slots * (slot + 2 * send)
    replicas = gpus // stages
    reduce = 0.0
    if replicas > 1 and work.strategy == "fsdp":
        gathers = 2 * microbatches if work.reshard_after_forward else 1
        group = min(replicas, work.shard_group) if work.shard_group else replicas  # HSDP: a shard group
        gather = collective_time("all_gather", work.param_bytes / stages, group, topology)
        scatter = collective_time("reduce_scatter", work.grad_bytes / stages, group, topology)
        if group < replicas:
            scatter += replica_all_reduce(work.grad_bytes / stages / group, group, replicas, topology)
        per_micro_batch += gathers * gather + scatter
    elif replicas > 1:
        reduce = collective_time("all_reduce", work.grad_bytes / stages, replicas, topology)
    step = work.micro_batches * per_micro_batch + reduce
    bubble = work.micro_batches * (stages - 1) * slot
    return step, step - work.micro_batches * slots * slot, bubble


def predict_points(work: Workload, gpu_counts: list[int], topology: Topology) -> list[Point]:
    """One point per GPU count; efficiency against linear scaling of the 1-GPU step. A pipeline's
    GPU counts are multiples of its stages (others are left out)."""
    step_of = fsdp_step if work.strategy == "fsdp" else ddp_step
    if work.sync_every_n_steps:
        step_of = local_sgd_step
    points = []
    for gpus in gpu_counts:
        bubble = 0.0
        if work.stages > 1:
            if gpus % work.stages:
                continue
            step, comm, bubble = pipeline_step(work, gpus, topology)
        else:
            step, comm = step_of(work, gpus, topology)
        ideal = work.compute_s / work.stages  # one GPU's share of a replica's step
        points.append(
            Point(
                gpus=gpus,
                step_time_s=step,
                samples_per_s=gpus // work.stages * work.samples_per_gpu / step,
                efficiency=ideal / step,
                comm_exposed_s=step - ideal - bubble,
                comm_total_s=comm,
                bubble_s=bubble,
            )
        )
    return points
