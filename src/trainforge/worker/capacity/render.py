"""``trainforge plan``: which parallel strategy fits a config on N GPUs, before any GPU is used.

Every layout that applies (ddp, fsdp, fsdp with activation checkpointing, fsdp x tensor
parallelism 2/4/8 ways, with and without checkpointing, on more than one node HSDP beside each
fsdp row, and each of them cut into pipeline stages) is estimated from one fake-tensor profile of
the model (``worker/capacity/estimate.py``); ``worker/capacity/layouts.py`` counts what each sends
between nodes and picks the recommendation, with the reason it beats the others.
Figures are GiB (2^30 bytes), as ``torch.cuda`` and nvidia-smi count them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from rich.console import Console
from rich.table import Table

from trainforge.config import Config
from trainforge.worker.capacity.estimate import (
    GIB,
    GPU_RESERVE,
    Strategy,
    configured_micro_batch,
    max_micro_batch,
    rank_breakdown,
)
from trainforge.worker.capacity.layouts import (
    CROSSING,
    GPUS_PER_NODE,
    Cluster,
    pipelined_strategies,
    recommend,
    settings_of,
    step_time,
    traffic,
    why_not,
)
from trainforge.worker.capacity.profile import ModelProfile, compute_mode, profile_model

__all__ = ["candidate_strategies", "plan_memory", "render_plan", "settings_of", "with_hsdp"]

TENSOR_PARALLEL = (2, 4, 8)
PARTS = ("params", "grads", "optimizer", "activations", "buffers", "reserve", "total")


def candidate_strategies(profile: ModelProfile, gpus: int) -> tuple[list[Strategy], list[dict[str, str]]]:
    """The strategies to estimate, in order of preference (least communication and recompute
    first: checkpointing before tensor parallelism), and the ones left out with the reason."""
    chosen = [Strategy("ddp", False), Strategy("fsdp", True), Strategy("fsdp+ac", True, 1, "full")]
    skipped: list[dict[str, str]] = []
    for tp in TENSOR_PARALLEL:
        problem = profile.tp_problem(tp)
        if problem is None and gpus % tp:
            problem = f"needs a multiple of {tp} GPUs, got {gpus}"
        if problem is not None:
            skipped.append({"name": f"fsdp+tp{tp}", "reason": problem})
            continue
        chosen += [Strategy(f"fsdp+tp{tp}", True, tp), Strategy(f"fsdp+tp{tp}+ac", True, tp, "full")]
    return chosen, skipped


def with_hsdp(
    strategies: list[Strategy], fits: Callable[[Strategy], bool], gpus: int, node: int = GPUS_PER_NODE
) -> list[Strategy]:
    """Beside (before) every fsdp strategy on more than one node, its HSDP variant: sharded within
    the smallest group of whole nodes (1, 2, 4, ... nodes that divide a pipeline stage's GPUs)
    whose state fits, else the largest, and replicated across the groups. HSDP comes first: its
    all-gathers and reduce-scatters stay inside a group, and only an all-reduce of each shard
    crosses groups."""
    chosen: list[Strategy] = []
    for strategy in strategies:
        # A group holds tensor-parallel groups of tp GPUs, and at least two shards of each.
        tp, stage = strategy.tensor_parallel, gpus // strategy.pipeline
        groups = [n * node for n in (1 << i for i in range(16)) if n * node < stage and stage % (n * node) == 0]
        hsdp = strategy.name.replace("fsdp", "hsdp", 1)
        variants = [replace(strategy, name=hsdp, replicate=stage // group) for group in groups if group // tp >= 2]
        if strategy.sharded and strategy.replicate == 1 and variants:
            chosen.append(next((v for v in variants if fits(v)), variants[-1]))
        chosen.append(strategy)
    return chosen


def plan_memory(config: Config, gpus: int, gpu_memory_gb: float, cluster: Cluster | None = None) -> dict[str, Any]:
    """The plan as one JSON-ready dict (the ``--json`` output; docs/planning.md lists its keys).
    ``cluster``: the links and GPU speed the time estimate assumes (default ``Cluster()``)."""
    cluster = cluster or Cluster()
    profile = profile_model(config)
    memory = int(gpu_memory_gb * GIB)
    reserve = GPU_RESERVE.of(memory)
    micro_batch = configured_micro_batch(config)
    strategies, skipped = candidate_strategies(profile, gpus)
    pipelined, cannot = pipelined_strategies(profile, gpus, micro_batch, strategies, config)

    def fits(strategy: Strategy) -> bool:
        return rank_breakdown(config, gpus, strategy, profile=profile).total + reserve <= memory

    strategies = with_hsdp(strategies + pipelined, fits, gpus)
    rows = [
        layout_row(config, profile, strategy, gpus, memory, order, cluster) for order, strategy in enumerate(strategies)
    ]
    best, why, better = recommend(rows)
    return {
        "model": {"name": config.model.name or config.model.factory, "parameters": profile.parameters},
        "gpus": gpus,
        "gpu_memory_gb": float(gpu_memory_gb),
        "micro_batch": configured_micro_batch(config),
        "sample_shape": list(profile.sample_shape),
        "compute": compute_mode(config),
        "optimizer": config.optim.name,
        "reserve": {"fixed_gb": gib(GPU_RESERVE.fixed_bytes), "fraction": GPU_RESERVE.fraction},
        "cluster": {
            "gpus_per_node": cluster.gpus_per_node,
            "link_GBps": cluster.link_Bps / 1e9,
            "nics_per_node": cluster.nics_per_node,
            "gpu_tflops": cluster.gpu_flops / 1e12,
        },
        "forward_flops_per_sample": profile.activations.flops.per_sample,
        "strategies": rows,
        "skipped": skipped + cannot,
        "recommended": best["name"] if best is not None else "none",
        "settings": best["settings"] if best is not None else {},
        "why": why,
        "better_not_run": better["name"] if better is not None else None,
    }


def layout_row(
    config: Config, profile: ModelProfile, strategy: Strategy, gpus: int, memory: int, order: int, cluster: Cluster
) -> dict[str, Any]:
    """One layout's line of the plan (docs/planning.md lists the keys)."""
    reserve = GPU_RESERVE.of(memory)
    micro_batch = configured_micro_batch(config)
    parts = rank_breakdown(config, gpus, strategy, profile=profile)
    total = parts.total + reserve
    held = {**{name: getattr(parts, name) for name in PARTS[:5]}, "reserve": reserve, "total": total}
    sent = traffic(config, profile, strategy, gpus, micro_batch)
    estimate = step_time(profile, strategy, sent, gpus, micro_batch, cluster)
    reason = why_not(config, strategy, gpus)
    dp = strategy.data_parallel(gpus)
    return {
        "name": strategy.name,
        "mesh": {"pp": strategy.pipeline, "dp": dp, "tp": strategy.tensor_parallel},
        "data_parallel": ("hsdp" if strategy.replicate > 1 else "fsdp") if strategy.sharded else "ddp",
        "tensor_parallel": strategy.tensor_parallel,
        "replicate": strategy.replicate,
        "shards": strategy.shards(gpus),
        "pipeline": strategy.pipeline,
        "schedule": strategy.schedule if strategy.pipeline > 1 else None,
        "microbatches": strategy.microbatches if strategy.pipeline > 1 else None,
        "virtual_stages": strategy.virtual if strategy.pipeline > 1 else None,
        "bubble": strategy.bubble,
        "activation_checkpointing": strategy.activation_checkpointing != "none",
        "per_gpu_gb": {name: gib(value) for name, value in held.items()},
        "bytes_per_rank": int(total),
        "fits": total <= memory,
        "max_micro_batch": max_micro_batch(config, gpus, memory, GPU_RESERVE, strategy, profile),
        "crosses_nodes": CROSSING[sent.crossing],
        "cross_node_bytes_per_sample": round(sent.bytes_per_sample),
        "estimate": {
            "compute_s": estimate.compute_s,
            "bubble_s": estimate.bubble_s,
            "network_s": estimate.network_s,
            "step_s": estimate.step_s,
            "samples": estimate.samples,
            "samples_per_s": estimate.samples_per_s,
        },
        "runs": reason is None,
        "why_not": reason,
        "settings": settings_of(strategy),
        "order": order,
    }


def gib(value: float) -> float:
    return round(value / GIB, 3)


def plan_table(report: dict[str, Any]) -> Table:
    model = report["model"]
    shape = "x".join(str(d) for d in report["sample_shape"])
    title = (
        f"{model['name']} ({model['parameters'] / 1e9:.2f}B parameters), micro-batch {report['micro_batch']} "
        f"of {shape}, {report['compute']}, {report['optimizer']}: GiB per GPU on "
        f"{report['gpus']} x {report['gpu_memory_gb']:g} GiB"
    )
    table = Table(title=title)
    columns = ("layout", *PARTS, "fits", "max micro-batch", "bubble", "MB/sample across nodes", "samples/s", "runs")
    for column in columns:
        table.add_column(column, justify="left" if column == "layout" else "right")
    for row in report["strategies"]:
        figures = [f"{row['per_gpu_gb'][part]:.2f}" for part in PARTS]
        fits = "yes" if row["fits"] else "[red]no[/]"
        mark = " *" if row["name"] == report["recommended"] else ""
        groups = f" {row['replicate']}x{row['shards']}" if row["replicate"] > 1 else ""  # replicas x shards
        table.add_row(
            row["name"] + groups + mark,
            *figures,
            fits,
            str(row["max_micro_batch"]),
            f"{row['bubble']:.0%}" if row["pipeline"] > 1 else "",
            f"{row['cross_node_bytes_per_sample'] / 1e6:,.1f}",
            f"{row['estimate']['samples_per_s']:,.3g}",
            "yes" if row["runs"] else "no",
        )
    return table


def render_plan(report: dict[str, Any], console: Console) -> None:
    console.print(plan_table(report))
    reserve = report["reserve"]
    console.print(
        f"reserve: {reserve['fixed_gb']:g} GiB (CUDA context, NCCL) + {100 * reserve['fraction']:g}% of the GPU "
        "(allocator fragmentation); buffers: DDP's gradient buckets, FSDP's gathered root and blocks",
        highlight=False,
    )
    cluster = report["cluster"]
    console.print(
        f"samples/s: estimated at {cluster['gpu_tflops']:g} TFLOP/s per GPU and {cluster['nics_per_node']} x "
        f"{cluster['link_GBps']:g} GB/s between nodes of {cluster['gpus_per_node']} GPUs, network not overlapped",
        highlight=False,
    )
    for entry in report["skipped"]:
        console.print(f"not applicable: {entry['name']}: {entry['reason']}", highlight=False)
    if report["recommended"] == "none":
        largest = max(report["strategies"], key=lambda row: row["max_micro_batch"])
        console.print(
            f"recommended: none fits micro-batch {report['micro_batch']}; "
            + (
                f"{largest['name']} fits micro-batch {largest['max_micro_batch']}"
                if largest["max_micro_batch"]
                else "not even the model's state fits: more GPUs or GPUs with more memory"
            ),
            highlight=False,
        )
        console.print(f"why: {report['why']}", highlight=False)
        return
    keys = ", ".join(f"{key}: {value}" for key, value in report["settings"].items())
    console.print(f"recommended: {report['recommended']} ({keys})", highlight=False)
    console.print(f"why: {report['why']}", highlight=False)
