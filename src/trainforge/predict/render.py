"""``trainforge predict``'s result: the inputs used, a point per GPU count, cost per epoch; a table or JSON."""

from __future__ import annotations

import platform
from dataclasses import asdict
from typing import Any

from rich.console import Console
from rich.table import Table

from trainforge.config import Config
from trainforge.errors import TrainforgeError
from trainforge.predict import inputs as measured
from trainforge.predict.links import GB, INTRA_NODE, Link
from trainforge.predict.model import BACKWARD_SHARE, Topology, Workload, predict_points

COMMON_ASSUMPTIONS = (
    "per-GPU batch fixed: the global batch grows with the GPUs (weak scaling); efficiency = 1-GPU step / N-GPU step",
    f"forward 1/3 and backward {BACKWARD_SHARE:.2f} of a micro-batch's compute; the optimizer is inside the measure",
    "ring collectives; across nodes a hierarchical ring (intra-node ring on nvlink, then inter-node ring on the link)",
    "no data loading, stragglers or network contention from other jobs",
)
# what is assumed about the run's own way of communicating, by inputs["strategy"]
STRATEGY_ASSUMPTIONS = {
    "ddp": "DDP: buckets all-reduced in backward order on one stream as they fill; the last bucket is exposed",
    "sync": "parallel.sync (local SGD / DiLoCo): one parameter all-reduce every H steps after the step, exposed whole",
    "fsdp": "FSDP: per-unit all-gathers one unit ahead (forward, and backward when resharded), reduce-scatter after "
    "each unit's backward, one stream",
}
HSDP_ASSUMPTION = (
    "HSDP (parallel.fsdp.replicate): FSDP's collectives inside shard groups of {group} GPUs (all GPUs when fewer), "
    "then each unit's reduced shard all-reduced across the groups on the same stream, a node's GPUs sharing its NICs"
)

PIPELINE_ASSUMPTION = (
    "pipeline (parallel.pipeline): {stages} stages{virtual} over {microbatches} pipeline micro-batches, "
    "{bubble:.0%} of the compute idle in the bubble ((P - 1) / (V M + P - 1), V stages per GPU); each slot "
    "waits for one send from the previous stage and one from the next; {reduced}, not overlapped"
)
PIPELINE_REDUCED = {
    "ddp": "a stage's gradients all-reduced over its replicas after the last backward",
    "fsdp": (
        "each stage sharded over its replicas: its parameters all-gathered for every pipeline micro-batch's "
        "forward and backward (once a micro-batch without reshard_after_forward) and its gradients "
        "reduce-scattered after each micro-batch"
    ),
}


def assumptions_for(
    strategy: str, sync_every_n_steps: int | None, shard_group: int = 0, pipeline: Workload | None = None
) -> list[str]:
    """The assumptions that apply to this run: the common ones and its strategy's (a pipeline's
    instead of DDP's buckets)."""
    key = "sync" if sync_every_n_steps else strategy
    own = STRATEGY_ASSUMPTIONS.get(key)
    if pipeline is not None and pipeline.stages > 1:
        own = PIPELINE_ASSUMPTION.format(
            stages=pipeline.stages,
            virtual=f" x {pipeline.virtual_stages} per GPU" if pipeline.virtual_stages > 1 else "",
            microbatches=pipeline.pipeline_microbatches,
            bubble=pipeline.bubble,
            reduced=PIPELINE_REDUCED[pipeline.strategy],
        )
    hsdp = [HSDP_ASSUMPTION.format(group=shard_group)] if shard_group else []
    return [*COMMON_ASSUMPTIONS[:3], *([own] if own else []), *hsdp, COMMON_ASSUMPTIONS[3]]


def link_record(link: Link) -> dict[str, Any]:
    return {
        "name": link.name,
        "alpha_s": link.alpha_s,
        "bandwidth_GBps": link.bandwidth_Bps / GB,
        "source": link.source,
    }


def run_predict(
    config: Config,
    config_name: str,
    gpu_counts: list[int],
    link: Link,
    *,
    step_time: float | None = None,
    model_params: int | None = None,
    gpus_per_node: int = 8,
    nics_per_node: int = 1,
    device: str = "this machine",
) -> dict[str, Any]:
    """The ``--json`` object: ``points`` (one per GPU count) plus the ``inputs`` and ``assumptions`` used.
    ``device``: what the compute is measured on, for the record (``bench.machine.device_name``)."""
    micro, accumulate = measured.per_gpu_batch(config)
    data = measured.TrainingSet(config)  # built once, if anything below needs it
    sizes = measured.model_bytes(config, model_params, data)
    if step_time is None:
        compute_s = measured.measure_compute(config, data=data)
        compute_source = f"measured here: median of 3 steps after 1 warm-up on {platform.machine()} ({device})"
    else:
        compute_s, compute_source = step_time, "--step-time"
    work = measured.workload_of(config, sizes, compute_s)
    topology = Topology(gpus_per_node, INTRA_NODE, link, nics_per_node)
    points = [asdict(p) for p in predict_points(work, gpu_counts, topology)]
    if not points:
        raise TrainforgeError(
            f"--gpus {','.join(map(str, gpu_counts))}: a pipeline of {work.stages} stages runs on multiples of "
            f"{work.stages} GPUs"
        )
    report: dict[str, Any] = {
        "points": points,
        "inputs": {
            "config": config_name,
            "strategy": work.strategy,
            "model": sizes.source,
            "parameters": sizes.parameters,
            "grad_bytes": work.grad_bytes,
            "param_bytes": work.param_bytes,
            "bucket_bytes": work.bucket_bytes,
            "units": work.units,
            "sync_every_n_steps": work.sync_every_n_steps,
            "shard_group": work.shard_group,
            "pipeline": {
                "stages": work.stages,
                "microbatches": work.pipeline_microbatches,
                "bubble": work.bubble,
                "p2p_bytes": work.p2p_bytes,
                "schedule": config.parallel.pipeline.schedule,
                "virtual_stages": work.virtual_stages,
            }
            if config.parallel.pipeline is not None
            else None,
            "micro_batch": micro,
            "micro_batches": accumulate,
            "samples_per_gpu": work.samples_per_gpu,
            "compute_s": compute_s,
            "compute_source": compute_source,
            "gpus_per_node": gpus_per_node,
            "nics_per_node": nics_per_node,
            "intra_node_link": link_record(INTRA_NODE),
            "link": link_record(link),
        },
        "assumptions": assumptions_for(work.strategy, work.sync_every_n_steps, work.shard_group, work),
        "left_out_gpus": [count for count in gpu_counts if count % work.stages],  # not a multiple of the stages
    }
    price = config.cost.price_per_gpu_hour
    samples = measured.train_samples(config, data) if price is not None else None
    if price is not None and samples:
        report["cost"] = {"price_per_gpu_hour": price, "currency": config.cost.currency, "train_samples": samples}
        for point in points:
            point["epoch_s"] = samples / point["samples_per_s"]
            point["cost_per_epoch"] = point["epoch_s"] / 3600 * point["gpus"] * price
    return report


def render(report: dict[str, Any], console: Console) -> None:
    given = report["inputs"]
    link, intra = given["link"], given["intra_node_link"]
    console.print(
        f"predict {given['config']}: {given['strategy']}{pipeline_words(given.get('pipeline'))}, "
        f"{given['parameters'] / 1e6:.2f} M parameters "
        f"({given['model']}), {given['grad_bytes'] / 1e6:.1f} MB of gradients per step, "
        f"{given['samples_per_gpu']} samples per GPU per step, compute {given['compute_s'] * 1e3:.1f} ms "
        f"({given['compute_source']})",
        highlight=False,
        soft_wrap=True,
    )
    console.print(
        f"links: {given['gpus_per_node']} GPU(s) per node over {intra['name']} ({intra['bandwidth_GBps']:.3g} GB/s, "
        f"alpha {intra['alpha_s'] * 1e6:.3g} us); nodes over {given['nics_per_node']} x {link['name']} "
        f"({link['bandwidth_GBps']:.3g} GB/s, alpha {link['alpha_s'] * 1e6:.3g} us: {link['source']})",
        highlight=False,
        soft_wrap=True,
    )
    cost = report.get("cost")
    table = Table(title="Predicted scaling (per-GPU batch fixed; efficiency against linear from 1 GPU)")
    columns = ["GPUs", "step (ms)", "samples/s", "efficiency", "comm exposed (ms)", "comm total (ms)"]
    pipelined = given.get("pipeline") is not None
    if pipelined:
        columns.append("bubble (ms)")
    if cost:
        columns += ["epoch (h)", f"cost/epoch ({cost['currency']})"]
    for column in columns:
        table.add_column(column, justify="right")
    for point in report["points"]:
        cells = [
            str(point["gpus"]),
            f"{point['step_time_s'] * 1e3:.2f}",
            f"{point['samples_per_s']:,.1f}",
            f"{point['efficiency']:.1%}",
            f"{point['comm_exposed_s'] * 1e3:.2f}",
            f"{point['comm_total_s'] * 1e3:.2f}",
        ]
        if pipelined:
            cells.append(f"{point['bubble_s'] * 1e3:.2f}")
        if cost:
            cells += [f"{point['epoch_s'] / 3600:.3f}", f"{point['cost_per_epoch']:,.2f}"]
        table.add_row(*cells)
    console.print(table)
    if report.get("left_out_gpus"):
        stages = given["pipeline"]["stages"]
        left = ", ".join(map(str, report["left_out_gpus"]))
        console.print(f"left out: {left} GPUs (not a multiple of the {stages} pipeline stages)", highlight=False)
    for line in report["assumptions"]:
        console.print(f"  assumes {line}", highlight=False, soft_wrap=True)


def pipeline_words(pipeline: dict[str, Any] | None) -> str:
    if pipeline is None:
        return ""
    return (
        f" x {pipeline['stages']} pipeline stages ({pipeline['schedule']}, {pipeline['microbatches']} micro-batches, "
        f"bubble {pipeline['bubble']:.0%}, {pipeline['p2p_bytes'] / 1e6:.3g} MB sent per micro-batch and stage)"
    )
