"""``trainforge plan``: which parallel strategy fits a config on N GPUs, before any GPU is used.

Every strategy that applies (ddp, fsdp, fsdp with activation checkpointing, fsdp x tensor
parallelism 2/4/8 ways, with and without checkpointing, and on more than one node HSDP beside each
fsdp row) is estimated from one fake-tensor profile of the model (``worker/capacity/estimate.py``);
the first that fits, in the order of ``candidate_strategies``, is recommended.
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
    ModelProfile,
    Strategy,
    compute_mode,
    configured_micro_batch,
    max_micro_batch,
    profile_model,
    rank_breakdown,
)

TENSOR_PARALLEL = (2, 4, 8)
GPUS_PER_NODE = 8  # HSDP's shard groups are whole nodes of this many GPUs
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
    the smallest group of whole nodes (1, 2, 4, ... nodes that divide ``gpus``) whose state fits,
    else the largest, and replicated across the groups. HSDP comes first: its all-gathers and
    reduce-scatters stay inside a group, and only an all-reduce of each shard crosses groups."""
    groups = [n * node for n in (1 << i for i in range(16)) if n * node < gpus and gpus % (n * node) == 0]
    chosen: list[Strategy] = []
    for strategy in strategies:
        # A group holds tensor-parallel groups of tp GPUs, and at least two shards of each.
        tp = strategy.tensor_parallel
        variants = [
            replace(strategy, name="hsdp" + strategy.name.removeprefix("fsdp"), replicate=gpus // group)
            for group in groups
            if group // tp >= 2
        ]
        if strategy.sharded and strategy.replicate == 1 and variants:
            chosen.append(next((v for v in variants if fits(v)), variants[-1]))
        chosen.append(strategy)
    return chosen


def settings_of(strategy: Strategy) -> dict[str, Any]:
    """The config keys that select ``strategy``."""
    settings: dict[str, Any] = {"parallel.strategy": "fsdp" if strategy.sharded else "ddp"}
    if strategy.replicate > 1:
        settings["parallel.fsdp.replicate"] = strategy.replicate
    if strategy.tensor_parallel > 1:
        settings["parallel.tensor_parallel"] = strategy.tensor_parallel
    settings["parallel.activation_checkpointing"] = strategy.activation_checkpointing
    return settings


def plan_memory(config: Config, gpus: int, gpu_memory_gb: float) -> dict[str, Any]:
    """The plan as one JSON-ready dict (the ``--json`` output; docs/planning.md lists its keys)."""
    profile = profile_model(config)
    memory = int(gpu_memory_gb * GIB)
    reserve = GPU_RESERVE.of(memory)
    strategies, skipped = candidate_strategies(profile, gpus)

    def fits(strategy: Strategy) -> bool:
        return rank_breakdown(config, gpus, strategy, profile=profile).total + reserve <= memory

    strategies = with_hsdp(strategies, fits, gpus)
    rows = []
    for strategy in strategies:
        parts = rank_breakdown(config, gpus, strategy, profile=profile)
        total = parts.total + reserve
        held = {**{name: getattr(parts, name) for name in PARTS[:5]}, "reserve": reserve, "total": total}
        rows.append(
            {
                "name": strategy.name,
                "tensor_parallel": strategy.tensor_parallel,
                "replicate": strategy.replicate,
                "shards": strategy.shards(gpus),
                "activation_checkpointing": strategy.activation_checkpointing != "none",
                "per_gpu_gb": {name: gib(value) for name, value in held.items()},
                "fits": total <= memory,
                "max_micro_batch": max_micro_batch(config, gpus, memory, GPU_RESERVE, strategy, profile),
            }
        )
    best = next((s for s, row in zip(strategies, rows, strict=True) if row["fits"]), None)
    return {
        "model": {"name": config.model.name or config.model.factory, "parameters": profile.parameters},
        "gpus": gpus,
        "gpu_memory_gb": float(gpu_memory_gb),
        "micro_batch": configured_micro_batch(config),
        "sample_shape": list(profile.sample_shape),
        "compute": compute_mode(config),
        "optimizer": config.optim.name,
        "reserve": {"fixed_gb": gib(GPU_RESERVE.fixed_bytes), "fraction": GPU_RESERVE.fraction},
        "strategies": rows,
        "skipped": skipped,
        "recommended": best.name if best is not None else "none",
        "settings": settings_of(best) if best is not None else {},
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
    for column in ("strategy", *PARTS, "fits", "max micro-batch"):
        table.add_column(column, justify="left" if column == "strategy" else "right")
    for row in report["strategies"]:
        figures = [f"{row['per_gpu_gb'][part]:.2f}" for part in PARTS]
        fits = "yes" if row["fits"] else "[red]no[/]"
        mark = " *" if row["name"] == report["recommended"] else ""
        groups = f" {row['replicate']}x{row['shards']}" if row["replicate"] > 1 else ""  # replicas x shards
        table.add_row(row["name"] + groups + mark, *figures, fits, str(row["max_micro_batch"]))
    return table


def render_plan(report: dict[str, Any], console: Console) -> None:
    console.print(plan_table(report))
    reserve = report["reserve"]
    console.print(
        f"reserve: {reserve['fixed_gb']:g} GiB (CUDA context, NCCL) + {100 * reserve['fraction']:g}% of the GPU "
        "(allocator fragmentation); buffers: DDP's gradient buckets, FSDP's gathered root and blocks",
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
        return
    keys = ", ".join(f"{key}: {value}" for key, value in report["settings"].items())
    console.print(f"recommended: {report['recommended']} ({keys})", highlight=False)
