"""``trainforge plan`` (memory per rank) and ``trainforge predict`` (step time and scaling per GPU count)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from trainforge.cli.common import (
    ConfigArg,
    SetOpt,
    json_text,
    parse_counts,
    resolve_config_path,
    wide_console,
)
from trainforge.errors import TrainforgeError


def plan(
    config: ConfigArg,
    gpus: Annotated[int | None, typer.Option(help="GPUs to plan for; default scaling.num_workers.")] = None,
    gpu_memory_gb: Annotated[float, typer.Option(help="Memory of one GPU in GiB (2^30 bytes).")] = 80.0,
    link: Annotated[
        str,
        typer.Option(
            help="Link between nodes of 8 GPUs: nvlink, ib200, ib400, eth25, eth50, eth100, or a rate (100gbit)."
        ),
    ] = "ib200",
    nics_per_node: Annotated[int, typer.Option(help="Links of --link per node (8: a NIC per GPU).")] = 1,
    gpu_tflops: Annotated[
        float, typer.Option(help="TFLOP/s one GPU sustains on the model (default: a bf16 H100 at about 40%).")
    ] = 400.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead.")] = False,
    set_: SetOpt = None,
) -> None:
    """Memory per GPU of each layout for CONFIG (data, tensor and pipeline parallel), whether it
    fits, its estimated speed, and a recommendation with the reason.

    The model is built on fake (meta) tensors: nothing is allocated, a 10B model plans in seconds.
    """
    import math

    from trainforge.config import MAX_WORKERS, load_config
    from trainforge.predict.links import resolve_link

    if gpus is not None and not 1 <= gpus <= MAX_WORKERS:
        raise TrainforgeError(f"--gpus {gpus}: from 1 to {MAX_WORKERS}")
    if not (math.isfinite(gpu_memory_gb) and 0 < gpu_memory_gb <= 1e6):
        raise TrainforgeError(f"--gpu-memory-gb {gpu_memory_gb}: must be a number of GiB > 0 (e.g. 80)")
    if not 1 <= nics_per_node <= 1024:
        raise TrainforgeError(f"--nics-per-node {nics_per_node}: from 1 to 1024")
    if not (math.isfinite(gpu_tflops) and 0 < gpu_tflops <= 1e6):
        raise TrainforgeError(f"--gpu-tflops {gpu_tflops}: must be a number of TFLOP/s > 0 (e.g. 400)")
    if link == "measured":
        raise TrainforgeError("--link measured: trainforge predict's; plan takes a preset or a rate (100gbit)")
    chosen = resolve_link(link, None)
    resolved = load_config(resolve_config_path(config), set_ or [])
    from trainforge.worker.capacity.layouts import Cluster
    from trainforge.worker.capacity.render import plan_memory, render_plan

    cluster = Cluster(link_Bps=chosen.bandwidth_Bps, nics_per_node=nics_per_node, gpu_flops=gpu_tflops * 1e12)
    result = plan_memory(resolved, gpus or resolved.scaling.max_workers, gpu_memory_gb, cluster)
    if as_json:
        typer.echo(json_text(result, indent=1))
    else:
        render_plan(result, wide_console())


def predict(
    config: ConfigArg,
    gpus: Annotated[str, typer.Option(help="Comma-separated GPU counts to predict.")] = "1,2,4,8,64,512",
    link: Annotated[
        str,
        typer.Option(
            help="Link between nodes: nvlink, ib200, ib400, eth25, eth50, eth100 (presets, docs/benchmarks.md), "
            "measured (--collectives), or a rate as tc writes it with an optional latency per ring step "
            "(100mbit, 10gbit@30us)."
        ),
    ] = "ib200",
    collectives: Annotated[
        Path | None, typer.Option(help="With --link measured: the JSON of trainforge bench collectives --output.")
    ] = None,
    step_time: Annotated[
        float | None,
        typer.Option(help="Compute seconds of one optimizer step on one GPU; default: measured here on the model."),
    ] = None,
    model_params: Annotated[
        int | None,
        typer.Option(help="The model as a parameter count (float32), not built; needs --step-time."),
    ] = None,
    gpus_per_node: Annotated[int, typer.Option(help="GPUs per node, joined by NVLink inside it.")] = 8,
    nics_per_node: Annotated[int, typer.Option(help="Links of --link per node (8: a NIC per GPU).")] = 1,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead.")] = False,
    set_: SetOpt = None,
) -> None:
    """Predict how fast CONFIG trains per GPU count (step time, samples/s, efficiency), before renting the GPUs.

    DDP's bucketed all-reduce or FSDP's all-gathers and reduce-scatters, as rings over the link's
    latency and bandwidth, overlapped with the backward; the per-GPU batch is fixed. With a cost
    section (cost.price_per_gpu_hour), also the cost of an epoch.
    """
    import math

    from trainforge.config import load_config
    from trainforge.predict.links import resolve_link

    counts = parse_counts("--gpus", gpus, 1_000_000, "1,2,4,8,64,512")
    if step_time is not None and not (math.isfinite(step_time) and 0 < step_time <= 86_400):
        raise TrainforgeError(f"--step-time {step_time}: seconds > 0 (e.g. 0.25)")
    if model_params is not None and not 1 <= model_params <= 10**13:
        raise TrainforgeError(f"--model-params {model_params}: a parameter count from 1 to 10^13 (e.g. 25557032)")
    if model_params is not None and step_time is None:
        raise TrainforgeError("--model-params needs --step-time (a model that is not built cannot be timed)")
    for flag, value in (("--gpus-per-node", gpus_per_node), ("--nics-per-node", nics_per_node)):
        if not 1 <= value <= 1024:
            raise TrainforgeError(f"{flag} {value}: from 1 to 1024")
    chosen = resolve_link(link, collectives)
    resolved = load_config(resolve_config_path(config), set_ or [])
    from trainforge.bench.machine import device_name
    from trainforge.predict.render import render, run_predict

    result = run_predict(
        resolved,
        config,
        counts,
        chosen,
        step_time=step_time,
        model_params=model_params,
        gpus_per_node=gpus_per_node,
        nics_per_node=nics_per_node,
        device=device_name(resolved.scaling.use_gpu),
    )
    if as_json:
        typer.echo(json_text(result, indent=1))
    else:
        render(result, wide_console())
