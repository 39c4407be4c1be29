"""``trainforge bench ...``: benchmarks that print figures (and write JSON with --output)."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Annotated

import typer

from trainforge.cli.common import (
    ConfigArg,
    SetOpt,
    check_output_folder,
    parse_counts,
    resolve_config_path,
    setup_logging,
    wide_console,
)
from trainforge.errors import TrainforgeError
from trainforge.files import check_output_path

app = typer.Typer(help="Benchmarks that print figures.", no_args_is_help=True)


@app.command("peers")
def bench_peers(
    workers: Annotated[str, typer.Option(help="Comma-separated worker counts.")] = "1,2",
    workload: Annotated[
        str, typer.Option(help="cnn (a small CNN on images, samples/s) or lm (llama_tiny on tokens, tokens/s).")
    ] = "cnn",
    steps: Annotated[
        int | None, typer.Option(help="Timed steps per measurement, after 5 warm-up steps (>= 10; cnn 100, lm 40).")
    ] = None,
    batch_size: Annotated[int | None, typer.Option(help="Per-worker batch size (cnn 64, lm 16).")] = None,
    repeats: Annotated[int, typer.Option(help="Measurements per peer and worker count; the median is shown.")] = 2,
    peers: Annotated[
        str | None,
        typer.Option(
            help="Peers, letters (abcdefg) or comma-separated names: a pytorch, b torchrun, c ray_train, "
            "d trainforge, e unobserved (trainforge without tracking), f lightning, g accelerate. "
            "Default: all whose packages are installed (f, g: the bench extra)."
        ),
    ] = None,
    output: Annotated[Path | None, typer.Option(help="Also write every raw figure as JSON here.")] = None,
    overrides: Annotated[
        list[str] | None,
        typer.Option(
            "--set",
            "-s",
            help="Override a key of trainforge's runs, (d) and (e) only: --set parallel.channels_last=false.",
        ),
    ] = None,
    peers_reuse_freed_memory: Annotated[
        bool,
        typer.Option(
            "--peers-reuse-freed-memory",
            help="Give the other peers' processes trainforge's allocator thresholds (train.reuse_freed_memory), "
            "so that only the training loops differ.",
        ),
    ] = False,
) -> None:
    """Throughput and time to the first step of plain PyTorch, torchrun+DDP, plain Ray Train, trainforge
    (observed and not), Lightning and Accelerate on one workload."""
    from trainforge.bench.roster import parse_peers, parse_workload
    from trainforge.config import MAX_WORKERS

    counts = parse_counts("--workers", workers, MAX_WORKERS, "1,2")
    kind = parse_workload(workload)
    chosen = parse_peers(peers)
    for flag, value, least in (("--steps", steps, 10), ("--batch-size", batch_size, 1), ("--repeats", repeats, 1)):
        if value is not None and value < least:
            raise TrainforgeError(f"{flag} {value}: must be >= {least}")
    check_output_folder(output)
    if overrides:  # refused now, in one line, not after the other peers' measurements
        from trainforge.bench.workload import Workload
        from trainforge.config import validate

        validate(
            dataclasses.replace(Workload(kind=kind), overrides=tuple(overrides)).trainforge_config(1, "check", ".")
        )
    from trainforge.bench.peers import run_peers

    setup_logging(False)
    # The peers' runs live in a temporary folder: trainforge's "run report: PATH" lines would point nowhere.
    logging.getLogger("trainforge").setLevel(logging.WARNING)
    run_peers(
        counts,
        kind=kind,
        steps=steps,
        batch_size=batch_size,
        repeats=repeats,
        peers=chosen,
        output=output,
        console=wide_console(),
        overrides=overrides or (),
        peers_reuse_freed_memory=peers_reuse_freed_memory,
    )


@app.command("startup")
def bench_startup(
    workers: Annotated[int, typer.Option(help="Workers of the tiny job (2: the issue's job).")] = 2,
    repeats: Annotated[int, typer.Option(help="Measurements per peer and setting; the median is shown.")] = 2,
    setting: Annotated[
        str,
        typer.Option(
            help="cold (each command starts its runtime), running (inside one running Ray, and on warm "
            "workers), or both."
        ),
    ] = "both",
    output: Annotated[Path | None, typer.Option(help="Also write every raw figure as JSON here.")] = None,
) -> None:
    """Seconds to the first step and to exit: torchrun, plain Ray Train and trainforge, cold and in a running Ray."""
    from trainforge.config import MAX_WORKERS

    if not 1 <= workers <= min(MAX_WORKERS, 64):
        raise TrainforgeError(f"--workers {workers}: must be 1-64")
    if repeats < 1:
        raise TrainforgeError(f"--repeats {repeats}: must be >= 1")
    if setting not in ("cold", "running", "both"):
        raise TrainforgeError(f"--setting {setting!r}: cold, running or both")
    check_output_folder(output)
    from trainforge.bench.startup import run_bench

    setup_logging(False)
    logging.getLogger("trainforge").setLevel(logging.WARNING)
    run_bench(
        workers=workers,
        repeats=repeats,
        output=output,
        console=wide_console(),
        cold=setting != "running",
        running=setting != "cold",
    )


@app.command("recovery")
def bench_recovery(
    faults: Annotated[
        str,
        typer.Option(
            help="Comma-separated: killed (SIGKILL of a worker), frozen (SIGSTOP of one), lost (every "
            "process of a node that runs one, on a cluster of Ray nodes on this machine)."
        ),
    ] = "killed,frozen,lost",
    repeats: Annotated[int, typer.Option(help="Measurements per fault and peer; the median is shown.")] = 1,
    output: Annotated[Path | None, typer.Option(help="Also write every raw figure as JSON here.")] = None,
) -> None:
    """Seconds from a killed or frozen worker, or a lost node, to the next training step: trainforge beside
    Ray Train alone."""
    from trainforge.bench.recovery import FAULTS

    chosen = [fault.strip() for fault in faults.split(",") if fault.strip()]
    unknown = [fault for fault in chosen if fault not in FAULTS]
    if not chosen or unknown:
        raise TrainforgeError(f"--faults {faults!r}: a comma-separated list of {', '.join(FAULTS)}")
    if not 1 <= repeats <= 100:
        raise TrainforgeError(f"--repeats {repeats}: must be 1-100")
    check_output_folder(output)
    from trainforge.bench.recovery import run_bench

    setup_logging(False)
    logging.getLogger("trainforge").setLevel(logging.WARNING)
    console = wide_console()
    run_bench(list(dict.fromkeys(chosen)), repeats, output, console, lambda line: console.print(line, markup=False))


@app.command("checkpoint")
def bench_checkpoint(
    size_mb: Annotated[float, typer.Option(help="Model size in MB (10^6 bytes); Adam state adds twice that.")] = 500,
    dir_: Annotated[
        Path | None, typer.Option("--dir", help="Folder on the disk to measure; default a new temp folder.")
    ] = None,
    repeats: Annotated[int, typer.Option(help="Measurements of each figure; the median is shown.")] = 3,
    output: Annotated[Path | None, typer.Option(help="Also write every raw figure as JSON here.")] = None,
    encrypt: Annotated[
        bool, typer.Option("--encrypt", help="Encrypt every checkpoint as checkpoint.encryption does (a random key).")
    ] = False,
) -> None:
    """Checkpoint save, async stall, write bandwidth and load time against their goals."""
    if size_mb <= 0:
        raise TrainforgeError(f"--size-mb {size_mb}: must be > 0")
    if repeats < 1:
        raise TrainforgeError(f"--repeats {repeats}: must be >= 1")
    if dir_ is not None:
        check_output_path(dir_, "--dir", "folder")
        if not dir_.is_dir():
            raise TrainforgeError(f"--dir {dir_}: folder does not exist")
    check_output_folder(output)
    from trainforge.bench.checkpoint import run_checkpoint_bench

    setup_logging(False)
    run_checkpoint_bench(
        size_mb=size_mb, directory=dir_, repeats=repeats, output=output, console=wide_console(), encrypt=encrypt
    )


@app.command("tune")
def bench_tune(
    measure: Annotated[
        str, typer.Option(help="Comma-separated: overhead (per-trial time outside training), asha, concurrency.")
    ] = "overhead,asha,concurrency",
    trials: Annotated[int, typer.Option(help="overhead: trials to time.")] = 3,
    steps: Annotated[
        int, typer.Option(help="overhead: optimizer steps per trial (about a minute of training).")
    ] = 15000,
    asha_trials: Annotated[int, typer.Option(help="asha: trials of the demo search, with ASHA and without.")] = 12,
    concurrent: Annotated[int, typer.Option(help="concurrency: one-worker trials run at once.")] = 10,
    output: Annotated[Path | None, typer.Option(help="Also write every raw figure as JSON here.")] = None,
) -> None:
    """Trial overhead, compute saved by ASHA on the demo search, and concurrent trials."""
    from trainforge.bench.tune import MEASURES, run_tune_bench

    chosen = tuple(part.strip() for part in measure.split(",") if part.strip())
    unknown = [m for m in chosen if m not in MEASURES]
    if not chosen or unknown:
        raise TrainforgeError(f"--measure {measure!r}: choose from {', '.join(MEASURES)}")
    for flag, value in (
        ("--trials", trials),
        ("--steps", steps),
        ("--asha-trials", asha_trials),
        ("--concurrent", concurrent),
    ):
        if value < 1:
            raise TrainforgeError(f"{flag} {value}: must be >= 1")
    check_output_folder(output)
    setup_logging(False)
    logging.getLogger("trainforge").setLevel(logging.WARNING)
    run_tune_bench(
        measures=chosen,
        trials=trials,
        steps=steps,
        asha_trials=asha_trials,
        concurrent=concurrent,
        output=output,
        console=wide_console(),
    )


@app.command("memory")
def bench_memory(
    model: Annotated[str, typer.Option(help="A built-in language model.")] = "llama_tiny",
    kwargs: Annotated[str, typer.Option(help="model.kwargs as JSON, e.g. '{\"num_hidden_layers\": 2}'.")] = "{}",
    workers: Annotated[int, typer.Option(help="Local gloo ranks (processes) per strategy.")] = 2,
    output: Annotated[Path | None, typer.Option(help="Also write every raw figure as JSON here.")] = None,
) -> None:
    """Per-rank bytes of parameters, gradients and optimizer state under ddp and fsdp, measured."""
    try:
        parsed = json.loads(kwargs)
    except json.JSONDecodeError as err:
        raise TrainforgeError(f"--kwargs {kwargs!r}: not JSON ({err.msg})") from None
    if not isinstance(parsed, dict):
        raise TrainforgeError(f"--kwargs {kwargs!r}: must be a JSON object")
    if not 2 <= workers <= 64:
        raise TrainforgeError(f"--workers {workers}: from 2 to 64")
    check_output_folder(output)
    from trainforge.bench.memory import run_memory_bench

    setup_logging(False)
    run_memory_bench(model, parsed, workers, output, wide_console())


@app.command("switches", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def bench_switches(ctx: typer.Context) -> None:
    """Step time and peak memory of activation checkpointing, compile and channels-last, off vs on
    (options: trainforge bench switches -h)."""
    from trainforge.bench.switches import main

    main(list(ctx.args))


@app.command("data")
def bench_data(
    size_gb: Annotated[float, typer.Option(help="Data set size in GB (10^9 bytes).")] = 10.0,
    s3: Annotated[
        bool, typer.Option("--s3", help="Stream from S3: moto's server on loopback, or the one at --endpoint-url.")
    ] = False,
    endpoint_url: Annotated[
        str | None, typer.Option(help="With --s3: an S3-compatible server (credentials from the environment).")
    ] = None,
    dir_: Annotated[
        Path | None,
        typer.Option("--dir", help="Where to generate; default ~/.cache/trainforge/bench-data. Same spec: reused."),
    ] = None,
    image_size: Annotated[int, typer.Option(help="Side of the stored PNG images in pixels (trained at 32).")] = 128,
    workers: Annotated[int, typer.Option(help="Training workers.")] = 2,
    keep: Annotated[bool, typer.Option("--keep", help="Keep the generated data for the next run.")] = False,
    output: Annotated[Path | None, typer.Option(help="Also write every raw figure as JSON here.")] = None,
) -> None:
    """One epoch of a generated parquet image data set through small_cnn: samples/s, cold read GB/s,
    peak RSS per process, object store use and the data-wait share of step time."""
    import math

    if not (math.isfinite(size_gb) and 0 < size_gb <= 100_000):
        raise TrainforgeError(f"--size-gb {size_gb}: a number of GB > 0 (e.g. 2 or 10)")
    if not 8 <= image_size <= 4096:
        raise TrainforgeError(f"--image-size {image_size}: from 8 to 4096 pixels")
    if not 1 <= workers <= 64:
        raise TrainforgeError(f"--workers {workers}: from 1 to 64")
    if endpoint_url is not None and not s3:
        raise TrainforgeError(f"--endpoint-url {endpoint_url}: only with --s3")
    if dir_ is not None:
        check_output_path(dir_, "--dir", "folder")
    check_output_folder(output)
    from trainforge.bench.data import run_data_bench

    setup_logging(False)
    logging.getLogger("trainforge").setLevel(logging.WARNING)  # the epoch's run lives in a temporary folder
    run_data_bench(
        size_gb=size_gb,
        image_size=image_size,
        workers=workers,
        directory=dir_,
        keep=keep,
        s3=s3,
        endpoint_url=endpoint_url,
        output=output,
        console=wide_console(),
    )


@app.command("collectives")
def bench_collectives(
    sizes: Annotated[
        str, typer.Option(help="Message sizes LO..HI, every power of 2 between (units B, KB, MB, GB of 1024).")
    ] = "1KB..256MB",
    workers: Annotated[int, typer.Option(help="Local ranks (gloo on CPU, NCCL when CUDA has enough GPUs).")] = 2,
    iters: Annotated[int, typer.Option(help="Timed iterations per size after 2 warm-up ones; median shown.")] = 10,
    output: Annotated[
        Path | None,
        typer.Option(help="Also write the figures and fits as JSON (predict --link measured reads it)."),
    ] = None,
) -> None:
    """All-reduce, reduce-scatter, all-gather and broadcast: time, algbw and busbw per size, and an alpha-beta fit."""
    from trainforge.bench.collectives import parse_sizes

    parsed = parse_sizes(sizes)
    if not 2 <= workers <= 64:
        raise TrainforgeError(f"--workers {workers}: from 2 to 64")
    if not 1 <= iters <= 10_000:
        raise TrainforgeError(f"--iters {iters}: from 1 to 10000")
    check_output_folder(output)
    from trainforge.bench.collectives import run_collectives_bench

    setup_logging(False)
    run_collectives_bench(parsed, workers=workers, iters=iters, output=output, console=wide_console())


@app.command("scaling")
def bench_scaling(
    config: ConfigArg,
    workers: Annotated[str, typer.Option(help="Comma-separated worker counts, each trained in turn.")] = "1,2,4",
    steps: Annotated[int, typer.Option(help="Optimizer steps per count (the first report's are warm-up).")] = 60,
    link: Annotated[
        str | None,
        typer.Option(
            help="Also check trainforge predict's communication model: each count's efficiency predicted "
            "from its measured compute and this link (a preset or a rate such as 1gbit), with the error."
        ),
    ] = None,
    workers_per_node: Annotated[int, typer.Option(help="With --link: workers per node (joined by NVLink).")] = 1,
    dir_: Annotated[
        Path | None,
        typer.Option("--dir", help="Folder for the runs, scaling.json and report.html; default under run.output_dir."),
    ] = None,
    output: Annotated[Path | None, typer.Option(help="Also write the figures as JSON here.")] = None,
    address: Annotated[
        str | None, typer.Option(help="Ray cluster to run on (host:port or ray://host:10001); default RAY_ADDRESS.")
    ] = None,
    set_: SetOpt = None,
) -> None:
    """Throughput, efficiency against linear and each step's compute / exposed communication / data
    wait at every worker count, measured by training CONFIG briefly at each; with a report."""
    from trainforge.config import MAX_WORKERS, load_config

    counts = parse_counts("--workers", workers, MAX_WORKERS, "1,2,4")
    if len(set(counts)) != len(counts):
        raise TrainforgeError(f"--workers {workers!r}: each count once")
    if not 10 <= steps <= 100_000:
        raise TrainforgeError(f"--steps {steps}: from 10 to 100000 (the first report's steps are warm-up)")
    if not 1 <= workers_per_node <= 1024:
        raise TrainforgeError(f"--workers-per-node {workers_per_node}: from 1 to 1024")
    check_output_folder(output)
    if dir_ is not None:
        check_output_path(dir_, "--dir", "folder")
    from trainforge.predict.links import resolve_link

    chosen = resolve_link(link, None) if link is not None else None
    resolved = load_config(resolve_config_path(config), set_ or [])
    if resolved.parallel.strategy != "ddp" or resolved.parallel.tensor_parallel > 1:
        raise TrainforgeError(
            "bench scaling times DDP's gradient all-reduce: parallel.strategy must be ddp and "
            "parallel.tensor_parallel 1 (--set parallel.strategy=ddp)"
        )
    from trainforge.bench.scaling import run_scaling_bench

    setup_logging(False)
    run_scaling_bench(
        resolved,
        counts,
        steps=steps,
        folder=dir_.resolve() if dir_ is not None else None,
        link=chosen,
        workers_per_node=workers_per_node,
        address=address,
        output=output,
        console=wide_console(),
    )


@app.command("gpu")
def bench_gpu(
    output: Annotated[Path | None, typer.Option(help="Also write the figures as JSON here.")] = None,
    peak_tflops: Annotated[
        float | None, typer.Option(help="The GPU's peak dense bf16 TFLOPS for MFU, when its name is not in the table.")
    ] = None,
) -> None:
    """ResNet-50 bf16 channels-last images/s (eager and compiled) and llama_1b FSDP tokens/s and MFU
    on this machine's GPUs; refuses without CUDA."""
    from trainforge.bench.gpu import require_cuda, run_gpu_bench

    if peak_tflops is not None and not 0 < peak_tflops <= 100_000:
        raise TrainforgeError(f"--peak-tflops {peak_tflops}: a number of TFLOPS > 0 (e.g. 989 for an H100 SXM)")
    check_output_folder(output)
    require_cuda()  # before anything runs or is written
    setup_logging(False)
    run_gpu_bench(output=output, console=wide_console(), peak_tflops=peak_tflops)
