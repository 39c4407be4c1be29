"""The ``trainforge`` command: each verb parses, builds a config, calls the API and prints."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import IO, TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.markup import escape

from trainforge.errors import TrainforgeError
from trainforge.redact import redact_text, redacting

if TYPE_CHECKING:
    from trainforge.jobs import Jobs

app = typer.Typer(
    name="trainforge",
    help="Distributed PyTorch training on Ray Train: one command from a laptop to a GPU cluster.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
config_app = typer.Typer(help="Inspect configs.", no_args_is_help=True)
bench_app = typer.Typer(help="Benchmarks that print figures.", no_args_is_help=True)
app.add_typer(config_app, name="config")
app.add_typer(bench_app, name="bench")
ckpt_app = typer.Typer(help="List, verify and inspect checkpoints.", no_args_is_help=True)
app.add_typer(ckpt_app, name="ckpt")
data_app = typer.Typer(help="Prepare and verify token corpora for language models.", no_args_is_help=True)
app.add_typer(data_app, name="data")
jobs_app = typer.Typer(help="Runs submitted to a Ray cluster: list, status, logs, stop.", no_args_is_help=True)
app.add_typer(jobs_app, name="jobs")

err_console = Console(stderr=True)


def version_line() -> str:
    """``trainforge 0.1.0 (torch 2.5.1, ray 2.60.0)`` from package metadata: nothing heavy is imported."""
    from importlib.metadata import PackageNotFoundError, version

    from trainforge import __version__

    parts = []
    for package in ("torch", "ray"):
        try:
            parts.append(f"{package} {version(package)}")
        except PackageNotFoundError:
            parts.append(f"{package} not installed")
    return f"trainforge {__version__} ({', '.join(parts)})"


def _print_version(value: bool) -> None:
    if value:
        typer.echo(version_line())
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_print_version, is_eager=True, help="Print the versions of trainforge, torch and Ray."
        ),
    ] = False,
) -> None:
    """Distributed PyTorch training on Ray Train: one command from a laptop to a GPU cluster."""


ConfigArg = Annotated[str, typer.Argument(help="A run config YAML, or the name of a bundled one (e.g. quickstart).")]
SetOpt = Annotated[
    list[str] | None, typer.Option("--set", "-s", help="Override a key: --set train.batch_size=64 (repeatable).")
]


def resolve_config_path(name: str) -> str:
    """A path as given, or a config bundled with the package (``quickstart`` -> configs/quickstart.yaml)."""
    if Path(name).exists() or (name.endswith((".yaml", ".yml")) and "/" in name):
        return name
    bundled = Path(__file__).parent / "configs" / f"{Path(name).stem}.yaml"
    return str(bundled) if bundled.is_file() else name


@app.command()
def train(
    config: ConfigArg,
    set_: SetOpt = None,
    address: Annotated[
        str | None, typer.Option(help="Ray cluster to run on (host:port or ray://host:10001); default RAY_ADDRESS.")
    ] = None,
    resume: Annotated[
        str | None,
        typer.Option(
            help="auto (newest valid checkpoint of this run), none, or a checkpoint path; sets checkpoint.resume."
        ),
    ] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Show Ray's own logs.")] = False,
) -> None:
    """Train a model as CONFIG describes, on a local Ray or the cluster at --address.

    Re-running the same command continues the run from its newest valid checkpoint.
    Ctrl-C once: checkpoint and stop (resumable); twice: abort.
    """
    from trainforge.config import load_config

    _setup_logging(verbose)
    overrides = [*(set_ or []), *([f"checkpoint.resume={resume}"] if resume is not None else [])]
    # Validate before importing torch and Ray, so a config error costs milliseconds.
    resolved = load_config(resolve_config_path(config), overrides)
    from trainforge.api import fit

    result = fit(resolved, address=address, verbose=verbose, console=err_console)
    typer.echo(str(result.run_dir / "summary.json"))
    if result.status == "aborted":
        raise typer.Exit(130)


@app.command()
def tune(
    config: ConfigArg,
    space: Annotated[
        str, typer.Option("--space", help="Search space YAML: config keys -> domains (or a bundled one's name).")
    ],
    trials: Annotated[int | None, typer.Option(help="Number of trials; sets tune.num_trials.")] = None,
    scheduler: Annotated[str | None, typer.Option(help="asha, pbt, median or none; sets tune.scheduler.")] = None,
    search: Annotated[str | None, typer.Option(help="random, grid or optuna; sets tune.search.")] = None,
    set_: SetOpt = None,
    address: Annotated[
        str | None, typer.Option(help="Ray cluster to run on (host:port or ray://host:10001); default RAY_ADDRESS.")
    ] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Show Ray's own logs.")] = False,
) -> None:
    """Search hyperparameters: every trial is a complete run under <run.output_dir>/<run.name>/<trial>/.

    Writes tune_summary.json, best.yaml (trainforge train runs it as is) and plots there.
    Re-running the same command continues an interrupted search.
    """
    from trainforge.config import load_config
    from trainforge.tune.schedulers import make_plan
    from trainforge.tune.space import load_space

    _setup_logging(verbose)
    flags = {"num_trials": trials, "scheduler": scheduler, "search": search}
    overrides = [*(set_ or []), *(f"tune.{key}={value}" for key, value in flags.items() if value is not None)]
    # Config, space and search plan are checked before Ray and torch are imported: a mistake costs milliseconds.
    resolved = load_config(resolve_config_path(config), overrides)
    space_path = resolve_config_path(space)
    make_plan(resolved, load_space(space_path, resolved))
    from trainforge.api import tune as run_tune

    result = run_tune(resolved, space_path, address=address, verbose=verbose, console=err_console)
    typer.echo(str(result.search_dir / "tune_summary.json"))


AddressOpt = Annotated[
    str | None,
    typer.Option(
        "--address",
        help="The Ray dashboard of the cluster, http://HEAD:8265; default RAY_JOBS_ADDRESS, "
        "or RAY_ADDRESS when it is an http(s):// URL.",
    ),
]
TokenFileOpt = Annotated[
    Path | None,
    typer.Option(
        "--token-file",
        help="A file holding the cluster's token (ray get-auth-token); "
        "default RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, then ~/.ray/auth_token.",
    ),
]
JobArg = Annotated[str, typer.Argument(help="A job's id (raysubmit_...), as submit and jobs list print it.")]


@app.command()
def submit(
    config: ConfigArg,
    address: AddressOpt = None,
    set_: SetOpt = None,
    no_wait: Annotated[bool, typer.Option("--no-wait", help="Print the job id and return at once.")] = False,
    token_file: TokenFileOpt = None,
) -> None:
    """Run CONFIG on the cluster at --address as a Ray job and follow it; exit with its status.

    The working directory (your model and data factories) travels with the job; results land in
    run.output_dir and checkpoint.storage_path, which must be reachable from the cluster and from
    here (a shared directory or s3://). Exit 0 succeeded, 1 failed (2: a user error on the
    cluster), 130 stopped. Ctrl-C stops following; the job runs on (trainforge jobs stop JOB).
    """
    from trainforge.config import load_config

    # The config is checked before anything is sent: a mistake costs milliseconds and one line.
    resolved = load_config(resolve_config_path(config), set_ or [])
    from trainforge.jobs import Jobs, is_loopback, submit_run

    jobs = Jobs(address, token_file)
    submitted = submit_run(resolved, jobs, Path.cwd())
    err_console.print(f"submitted job {submitted.job_id} to {jobs.address}", highlight=False, soft_wrap=True)
    err_console.print(
        f"results: {submitted.run_dir} · checkpoints: {submitted.checkpoints} "
        f"(trainforge ckpt list {submitted.checkpoints})",
        highlight=False,
        soft_wrap=True,
    )
    if "://" not in submitted.run_dir and not is_loopback(jobs.address):
        err_console.print(
            "note: these are paths on the cluster's nodes; set run.output_dir and checkpoint.storage_path "
            "to a shared directory (or s3://) to read them here",
            highlight=False,
            soft_wrap=True,
        )
    if no_wait:
        err_console.print(
            f"follow it: trainforge jobs logs {submitted.job_id} --follow --address {jobs.address}",
            highlight=False,
            soft_wrap=True,
        )
        typer.echo(submitted.job_id)
        return
    code = _follow(jobs, submitted.job_id, sys.stderr)
    if code == 0:
        typer.echo(f"{submitted.run_dir}/summary.json")
    raise typer.Exit(code)


@jobs_app.command("list")
def jobs_list(address: AddressOpt = None, token_file: TokenFileOpt = None) -> None:
    """Every job the cluster knows, oldest first: id, status, run, start, duration."""
    from trainforge.jobs import Jobs, jobs_table

    _wide_console().print(jobs_table(Jobs(address, token_file).list()))


@jobs_app.command("status")
def jobs_status(job: JobArg, address: AddressOpt = None, token_file: TokenFileOpt = None) -> None:
    """A job's status, run, where its results are, start, end and exit code."""
    from trainforge.jobs import Jobs, job_fields

    for label, value in job_fields(Jobs(address, token_file).info(job)):
        typer.echo(f"{label + ':':<13}{value}")


@jobs_app.command("logs")
def jobs_logs(
    job: JobArg,
    address: AddressOpt = None,
    token_file: TokenFileOpt = None,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Follow the log until the job ends; exit with its status.")
    ] = False,
) -> None:
    """A job's output (the remote trainforge train's progress lines and errors)."""
    from trainforge.jobs import Jobs

    jobs = Jobs(address, token_file)
    if follow:
        raise typer.Exit(_follow(jobs, job, sys.stdout))
    typer.echo(jobs.logs(job), nl=False)


@jobs_app.command("stop")
def jobs_stop(job: JobArg, address: AddressOpt = None, token_file: TokenFileOpt = None) -> None:
    """Ask a job to stop: trainforge checkpoints at the next report and ends (Ray kills it after 120 s)."""
    from trainforge.jobs import Jobs

    jobs = Jobs(address, token_file)
    if jobs.stop(job):
        typer.echo(f"stopping {job}: it checkpoints at its next report (trainforge jobs status {job})")
    else:
        typer.echo(f"{job} was not running ({jobs.info(job).status})")


def _follow(jobs: Jobs, job: str, out: IO[str]) -> int:
    """Stream a job's log to ``out`` until it ends; the exit code its status calls for."""
    from trainforge.jobs import exit_code, job_name

    try:
        details = jobs.follow(job, out)
    except KeyboardInterrupt:
        err_console.print(
            f"stopped following; job {job} runs on (trainforge jobs stop {job} --address {jobs.address})",
            highlight=False,
            soft_wrap=True,
        )
        return 130
    code = exit_code(details)
    if code:
        err_console.print(
            f"job {job_name(details)} {details.status}: exit code {code}", highlight=False, soft_wrap=True
        )
    return code


@config_app.command("show")
def config_show(config: ConfigArg, set_: SetOpt = None) -> None:
    """Print the resolved config: file, then --set overrides, then TRAINFORGE_* environment."""
    from trainforge.config import load_config, to_yaml

    typer.echo(to_yaml(load_config(resolve_config_path(config), set_ or [])), nl=False)


def check_output_folder(output: Path | None) -> None:
    """``--output FILE``: its folder must exist (checked before any work starts)."""
    if output is not None and not output.parent.is_dir():
        raise TrainforgeError(f"--output {output}: folder {output.parent} does not exist")


@bench_app.command("peers")
def bench_peers(
    workers: Annotated[str, typer.Option(help="Comma-separated worker counts.")] = "1,2",
    steps: Annotated[int, typer.Option(help="Timed steps per measurement, after 5 warm-up steps (>= 10).")] = 100,
    batch_size: Annotated[int, typer.Option(help="Per-worker batch size.")] = 64,
    repeats: Annotated[int, typer.Option(help="Measurements per peer and worker count; the median is shown.")] = 2,
    peers: Annotated[
        str,
        typer.Option(help="Peers: a PyTorch, b torchrun, c Ray Train, d trainforge, e trainforge unobserved."),
    ] = "abcde",
    output: Annotated[Path | None, typer.Option(help="Also write every raw figure as JSON here.")] = None,
) -> None:
    """Samples/s of plain PyTorch, torchrun+DDP, plain Ray Train and trainforge (observed and not) on one workload."""
    from trainforge.config import MAX_WORKERS

    counts = _parse_counts("--workers", workers, MAX_WORKERS, "1,2")
    if not peers or set(peers) - set("abcde"):
        raise TrainforgeError(f"--peers {peers!r}: letters from abcde, e.g. --peers de")
    for flag, value, least in (("--steps", steps, 10), ("--batch-size", batch_size, 1), ("--repeats", repeats, 1)):
        if value < least:
            raise TrainforgeError(f"{flag} {value}: must be >= {least}")
    check_output_folder(output)
    from trainforge.bench.peers import run_peers

    _setup_logging(False)
    # The peers' runs live in a temporary folder: trainforge's "run report: PATH" lines would point nowhere.
    logging.getLogger("trainforge").setLevel(logging.WARNING)
    run_peers(
        counts, steps=steps, batch_size=batch_size, repeats=repeats, peers=peers, output=output, console=_wide_console()
    )


@bench_app.command("checkpoint")
def bench_checkpoint(
    size_mb: Annotated[float, typer.Option(help="Model size in MB (10^6 bytes); Adam state adds twice that.")] = 500,
    dir_: Annotated[
        Path | None, typer.Option("--dir", help="Folder on the disk to measure; default a new temp folder.")
    ] = None,
    repeats: Annotated[int, typer.Option(help="Measurements of each figure; the median is shown.")] = 3,
    output: Annotated[Path | None, typer.Option(help="Also write every raw figure as JSON here.")] = None,
) -> None:
    """Checkpoint save, async stall, write bandwidth and load time against their goals."""
    if size_mb <= 0:
        raise TrainforgeError(f"--size-mb {size_mb}: must be > 0")
    if repeats < 1:
        raise TrainforgeError(f"--repeats {repeats}: must be >= 1")
    if dir_ is not None and not dir_.is_dir():
        raise TrainforgeError(f"--dir {dir_}: folder does not exist")
    check_output_folder(output)
    from trainforge.bench.checkpoint import run_checkpoint_bench

    _setup_logging(False)
    run_checkpoint_bench(size_mb=size_mb, directory=dir_, repeats=repeats, output=output, console=Console())


@bench_app.command("tune")
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
    _setup_logging(False)
    logging.getLogger("trainforge").setLevel(logging.WARNING)
    run_tune_bench(
        measures=chosen,
        trials=trials,
        steps=steps,
        asha_trials=asha_trials,
        concurrent=concurrent,
        output=output,
        console=_wide_console(),
    )


@bench_app.command("memory")
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

    _setup_logging(False)
    run_memory_bench(model, parsed, workers, output, _wide_console())


@bench_app.command("switches", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def bench_switches(ctx: typer.Context) -> None:
    """Step time and peak memory of activation checkpointing, compile and channels-last, off vs on
    (options: trainforge bench switches -h)."""
    from trainforge.bench.switches import main

    main(list(ctx.args))


@bench_app.command("data")
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
    if dir_ is not None and dir_.exists() and not dir_.is_dir():
        raise TrainforgeError(f"--dir {dir_}: not a folder")
    check_output_folder(output)
    from trainforge.bench.data import run_data_bench

    _setup_logging(False)
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
        console=_wide_console(),
    )


@bench_app.command("collectives")
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

    _setup_logging(False)
    run_collectives_bench(parsed, workers=workers, iters=iters, output=output, console=_wide_console())


@bench_app.command("scaling")
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

    counts = _parse_counts("--workers", workers, MAX_WORKERS, "1,2,4")
    if len(set(counts)) != len(counts):
        raise TrainforgeError(f"--workers {workers!r}: each count once")
    if not 10 <= steps <= 100_000:
        raise TrainforgeError(f"--steps {steps}: from 10 to 100000 (the first report's steps are warm-up)")
    if not 1 <= workers_per_node <= 1024:
        raise TrainforgeError(f"--workers-per-node {workers_per_node}: from 1 to 1024")
    check_output_folder(output)
    if dir_ is not None and dir_.exists() and not dir_.is_dir():
        raise TrainforgeError(f"--dir {dir_}: exists and is not a folder")
    from trainforge.predict.links import resolve_link

    chosen = resolve_link(link, None) if link is not None else None
    resolved = load_config(resolve_config_path(config), set_ or [])
    if resolved.parallel.strategy != "ddp" or resolved.parallel.tensor_parallel > 1:
        raise TrainforgeError(
            "bench scaling times DDP's gradient all-reduce: parallel.strategy must be ddp and "
            "parallel.tensor_parallel 1 (--set parallel.strategy=ddp)"
        )
    from trainforge.bench.scaling import run_scaling_bench

    _setup_logging(False)
    run_scaling_bench(
        resolved,
        counts,
        steps=steps,
        folder=dir_.resolve() if dir_ is not None else None,
        link=chosen,
        workers_per_node=workers_per_node,
        address=address,
        output=output,
        console=_wide_console(),
    )


@bench_app.command("gpu")
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
    _setup_logging(False)
    run_gpu_bench(output=output, console=_wide_console(), peak_tflops=peak_tflops)


CkptPathArg = Annotated[str, typer.Argument(help="A checkpoint directory: a local path or a URI (s3://...).")]


@ckpt_app.command("list")
def ckpt_list(
    location: Annotated[
        str, typer.Argument(help="A run directory, a storage folder holding runs, or a URI (s3://bucket/prefix/run).")
    ],
) -> None:
    """Every checkpoint of a run, verified: step, epoch, metrics, size, time, and valid or why not."""
    from trainforge.checkpoint.inspect import list_checkpoints, list_table

    _wide_console().print(list_table(location, list_checkpoints(location)))


@ckpt_app.command("verify")
def ckpt_verify(path: CkptPathArg) -> None:
    """Check a checkpoint as restore does (sizes, digests, safe load): exit 0 if valid, 1 if not."""
    from trainforge.checkpoint.hashing import LABELS
    from trainforge.checkpoint.inspect import human_bytes, verify_checkpoint

    check = verify_checkpoint(path)
    if check.ok:
        manifest = check.manifest or {}
        files = manifest.get("files", {})
        size = sum(int(entry["size"]) for entry in files.values())
        label = LABELS.get(str(manifest.get("hash", "sha256")), "SHA-256")
        layout = manifest.get("layout", "full")
        sharding = f", sharded over {manifest.get('world_size')} ranks" if layout == "sharded" else ""
        typer.echo(f"valid: {path} ({len(files)} files, {human_bytes(size)}, {label} checked{sharding})")
        return
    typer.echo(f"invalid: {path}")
    for problem in check.problems:
        typer.echo(f"  {problem}")
    raise typer.Exit(1)


@ckpt_app.command("inspect")
def ckpt_inspect(
    path: CkptPathArg,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead.")] = False,
) -> None:
    """Manifest, progress, versions, metrics, config and tensor summary, without loading tensors."""
    from trainforge.checkpoint.inspect import inspect_checkpoint, inspection_view

    report = inspect_checkpoint(path)
    if as_json:
        typer.echo(json.dumps(report, indent=1, sort_keys=True))
    else:
        _wide_console().print(inspection_view(report), highlight=False)


@app.command()
def plan(
    config: ConfigArg,
    gpus: Annotated[int | None, typer.Option(help="GPUs to plan for; default scaling.num_workers.")] = None,
    gpu_memory_gb: Annotated[float, typer.Option(help="Memory of one GPU in GiB (2^30 bytes).")] = 80.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead.")] = False,
    set_: SetOpt = None,
) -> None:
    """Memory per GPU of each parallel strategy for CONFIG, whether it fits, and a recommendation.

    The model is built on fake (meta) tensors: nothing is allocated, a 10B model plans in seconds.
    """
    import math

    from trainforge.config import MAX_WORKERS, load_config

    if gpus is not None and not 1 <= gpus <= MAX_WORKERS:
        raise TrainforgeError(f"--gpus {gpus}: from 1 to {MAX_WORKERS}")
    if not (math.isfinite(gpu_memory_gb) and 0 < gpu_memory_gb <= 1e6):
        raise TrainforgeError(f"--gpu-memory-gb {gpu_memory_gb}: must be a number of GiB > 0 (e.g. 80)")
    resolved = load_config(resolve_config_path(config), set_ or [])
    from trainforge.planning import plan_memory, render_plan

    result = plan_memory(resolved, gpus or resolved.scaling.max_workers, gpu_memory_gb)
    if as_json:
        typer.echo(json.dumps(result, indent=1))
    else:
        render_plan(result, _wide_console())


@app.command()
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
    """Step time, samples/s, efficiency and exposed communication of CONFIG per GPU count, before renting them.

    DDP's bucketed all-reduce or FSDP's all-gathers and reduce-scatters, as rings over the link's
    latency and bandwidth, overlapped with the backward; the per-GPU batch is fixed. With a cost
    section (cost.price_per_gpu_hour), also the cost of an epoch.
    """
    import math

    from trainforge.config import load_config
    from trainforge.predict.links import resolve_link

    counts = _parse_counts("--gpus", gpus, 1_000_000, "1,2,4,8,64,512")
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
    )
    if as_json:
        typer.echo(json.dumps(result, indent=1))
    else:
        render(result, _wide_console())


def _parse_counts(flag: str, text: str, most: int, example: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise TrainforgeError(f"{flag} {text!r}: expected comma-separated integers such as {example}") from None
    if not counts or not all(1 <= count <= most for count in counts):
        raise TrainforgeError(f"{flag} {text!r}: counts from 1 to {most}")
    return counts


@app.command()
def report(
    run_dir: Annotated[Path, typer.Argument(help="A run directory: <run.output_dir>/<run.name>.")],
) -> None:
    """Write RUN_DIR/report/: PNG plots and a self-contained report.html; print the page's path."""
    from trainforge.report import write_report

    typer.echo(str(write_report(run_dir)))


@data_app.command("prepare")
def data_prepare(
    inputs: Annotated[
        list[str],
        typer.Argument(
            help="Text files, directories (recursively), .jsonl files (a 'text' field per line), "
            "or stdlib: the Python standard library's own sources."
        ),
    ],
    output: Annotated[Path, typer.Option("--output", "-o", help="The folder to write (must be new or empty).")],
    tokenizer: Annotated[
        str, typer.Option(help="bytes (UTF-8 bytes), bpe:VOCAB (train a byte-level BPE) or a tokenizer.json path.")
    ] = "bytes",
    val_fraction: Annotated[float, typer.Option(help="Share of documents held out for validation, by content.")] = 0.05,
    workers: Annotated[
        int | None, typer.Option(help="Tokenizing processes for large inputs; default one per CPU.")
    ] = None,
    max_files: Annotated[int | None, typer.Option(help="Use at most this many input files, evenly spaced.")] = None,
    include: Annotated[
        list[str] | None, typer.Option(help="In directories, only file names matching this glob (repeatable).")
    ] = None,
    shard_tokens: Annotated[
        int | None, typer.Option(help="Tokens per shard file; default 134217728 (256 MiB of uint16).")
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace a corpus already prepared at --output.")] = False,
) -> None:
    """Tokenize INPUT... into memory-mapped token shards, an index and a manifest (SHA-256 per file) in --output."""
    if workers is not None and not 1 <= workers <= 1024:
        raise TrainforgeError(f"--workers {workers}: from 1 to 1024")
    if max_files is not None and max_files < 1:
        raise TrainforgeError(f"--max-files {max_files}: must be >= 1")
    if shard_tokens is not None and not 1024 <= shard_tokens <= 1 << 31:
        raise TrainforgeError(f"--shard-tokens {shard_tokens}: from 1024 to {1 << 31}")
    from trainforge.data.corpus import DEFAULT_SHARD_TOKENS, PrepareOptions, prepare_corpus
    from trainforge.data.tokens import describe

    _setup_logging(False)
    options = PrepareOptions(
        inputs=inputs,
        output=output,
        tokenizer=tokenizer,
        val_fraction=val_fraction,
        workers=workers,
        max_files=max_files,
        include=include or [],
        shard_tokens=shard_tokens or DEFAULT_SHARD_TOKENS,
        force=force,
    )
    prepared = prepare_corpus(options, show_progress=sys.stderr.isatty())
    skipped = f"; {prepared.skipped} files skipped (binary or not UTF-8)" if prepared.skipped else ""
    typer.echo(f"prepared {prepared.path} in {prepared.seconds:.1f} s: {describe(prepared.manifest)}{skipped}")


@data_app.command("verify")
def data_verify(
    path: Annotated[Path, typer.Argument(help="A folder written by trainforge data prepare.")],
    quick: Annotated[bool, typer.Option("--quick", help="Check sizes only, not the SHA-256 digests.")] = False,
) -> None:
    """Check a prepared corpus against its manifest (sizes and SHA-256): exit 0 if valid, else one line and 2."""
    from trainforge.data.shards import verify_corpus
    from trainforge.data.tokens import describe

    manifest = verify_corpus(path, full=not quick, origin="corpus")
    size = sum(entry.size for entry in manifest.files.values())
    checked = "sizes checked" if quick else "SHA-256 checked"
    typer.echo(f"valid: {path} ({len(manifest.files)} files, {size:,} bytes, {checked}): {describe(manifest)}")


@app.command()
def generate(
    run_dir: Annotated[Path, typer.Argument(help="A run directory of a language model trained on data.name tokens.")],
    prompt: Annotated[str, typer.Option(help="The text to continue.")] = "",
    max_tokens: Annotated[int, typer.Option(help="Tokens to generate at most (stops at an end of document).")] = 200,
    temperature: Annotated[float, typer.Option(help="Sampling temperature; 0 picks the likeliest token.")] = 0.8,
    top_k: Annotated[int, typer.Option(help="Sample among the k likeliest tokens; 0: all.")] = 0,
    seed: Annotated[int, typer.Option(help="Seed of the sampling.")] = 0,
) -> None:
    """Print PROMPT continued by the run's final model (RUN_DIR/model.safetensors)."""
    import math

    if not 1 <= max_tokens <= 100_000:
        raise TrainforgeError(f"--max-tokens {max_tokens}: from 1 to 100000")
    if not (math.isfinite(temperature) and 0 <= temperature <= 100):
        raise TrainforgeError(f"--temperature {temperature}: a number from 0 (greedy) to 100")
    if top_k < 0:
        raise TrainforgeError(f"--top-k {top_k}: must be >= 0 (0 keeps every token)")
    from trainforge.generate import Sampling, load_run_model, sample

    run = load_run_model(run_dir)
    typer.echo(sample(run, prompt, Sampling(max_tokens, temperature, top_k, seed)))


def _wide_console() -> Console:
    """Rich's console, 200 columns wide when stdout is a file or pipe (instead of 80), so tables keep their rows."""
    return Console() if sys.stdout.isatty() else Console(width=200)


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    for handler in logging.getLogger().handlers:  # Ray's, MLflow's and ours on the console
        redacting(handler)
    logging.getLogger("trainforge").setLevel(logging.INFO)


def main(argv: list[str] | None = None) -> None:
    """Console entry point: user errors become one line on stderr and exit code 2.

    Usage errors (an unknown command or option, a missing argument) print click's short usage
    message and exit 2. Typer vendors click (``typer._click``), so ``import click`` would name a
    different exception class; ``typer.TyperException`` is the public base of the vendored ones.
    """
    try:
        # standalone_mode=False: click returns typer.Exit's code instead of exiting; pass it on.
        code = app(args=argv, prog_name="trainforge", standalone_mode=False)
        if isinstance(code, int) and code:
            sys.exit(code)
    except TrainforgeError as err:
        # escape: messages quote values such as [lo, hi], which rich would take for markup.
        err_console.print(f"[red]error:[/] {escape(redact_text(str(err)))}", highlight=False, soft_wrap=True)
        sys.exit(err.exit_code)
    except typer.Exit as exit_:
        sys.exit(exit_.exit_code)
    except typer.Abort:
        err_console.print("aborted")
        sys.exit(130)
    except typer.TyperException as err:
        show = getattr(err, "show", None)
        if callable(show):
            show()
        else:
            err_console.print(f"error: {escape(err.format_message())}", highlight=False, soft_wrap=True)
        sys.exit(getattr(err, "exit_code", 2))


if __name__ == "__main__":
    main()
