"""``trainforge submit`` and ``trainforge jobs list|status|logs|stop``: runs as Ray jobs on a cluster."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import IO, TYPE_CHECKING, Annotated

import typer

from trainforge.cli.common import (
    ConfigArg,
    SetOpt,
    err_console,
    resolve_config_path,
    wide_console,
)
from trainforge.errors import TrainforgeError

if TYPE_CHECKING:
    from trainforge.driver.jobs import Jobs

app = typer.Typer(help="Runs submitted to a Ray cluster: list, status, logs, stop.", no_args_is_help=True)


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


WaitOpt = Annotated[
    str,
    typer.Option(
        "--wait-for-cluster",
        metavar="SECONDS",
        help="Wait up to SECONDS for a head that is still starting (connection refused, HTTP 5xx such as "
        "Ray's 'No available agent'), retrying with a progress line on stderr; 0: try once.",
    ),
]


CaOpt = Annotated[
    str | None,
    typer.Option(
        "--ca",
        help="The CA certificate that signed the https:// dashboard's (its TLS proxy's) certificate; "
        "submit's default: cluster.tls.ca; otherwise the system's CAs.",
    ),
]


JobArg = Annotated[str, typer.Argument(help="A job's id (raysubmit_...), as submit and jobs list print it.")]


def submit(
    config: ConfigArg,
    address: AddressOpt = None,
    set_: SetOpt = None,
    no_wait: Annotated[bool, typer.Option("--no-wait", help="Print the job id and return at once.")] = False,
    token_file: TokenFileOpt = None,
    wait_for_cluster: WaitOpt = "60",
    ca: CaOpt = None,
    resume: Annotated[
        str | None,
        typer.Option(
            help="As trainforge train --resume: auto, none or a checkpoint path (continues a changed config)."
        ),
    ] = None,
    include: Annotated[
        list[Path] | None,
        typer.Option(
            "--include",
            metavar="PATH",
            help="Send PATH (a file or folder in the working directory) although it looks like a secret "
            "(key material, credentials, a secret-named file); repeatable.",
        ),
    ] = None,
    dry_run: Annotated[
        bool,
        typer.Option("--dry-run", help="List what would be sent and what is left out and why; contact no cluster."),
    ] = False,
) -> None:
    """Run CONFIG on the cluster at --address as a Ray job and follow it; exit with its status.

    The working directory (your model and data factories) travels with the job; results land in
    run.output_dir and checkpoint.storage_path, which must be reachable from the cluster and from
    here (a shared directory or s3://). Key and certificate files, credential files, the token and
    whatever holds or names a secret stay here (--dry-run lists them). Exit 0 succeeded, 1 failed
    (2: a user error on the cluster, 3: the run stopped before its end, e.g. preempted), 130
    stopped. Ctrl-C stops following; the job runs on (trainforge jobs stop JOB).
    """
    from trainforge.config import load_config

    # The flags and the config are checked before anything is sent: a mistake costs milliseconds and one line.
    wait_s = wait_seconds(wait_for_cluster)
    overrides = [*(set_ or []), *([f"checkpoint.resume={resume}"] if resume is not None else [])]
    resolved = load_config(resolve_config_path(config), overrides)
    from trainforge.driver.job_package import dry_run_lines, summary_line
    from trainforge.driver.jobs import CONFIG_PREFIX, is_loopback, submission_contents, submit_run

    contents = submission_contents(resolved, Path.cwd(), token_file=token_file, includes=include)
    if dry_run:
        shipped = f"{CONFIG_PREFIX}{resolved.run.name}-<id>.yaml"
        typer.echo("\n".join(dry_run_lines(contents, [shipped])))
        return
    tls = resolved.cluster.tls
    if ca is None and tls is not None:  # a TLS cluster's Jobs API is reached over https, checked with its CA
        jobs = _jobs(address, token_file, wait_s, tls.ca, "cluster.tls.ca")
    else:
        jobs = _jobs(address, token_file, wait_s, ca)
    submitted = submit_run(resolved, jobs, contents, resume=resume)
    err_console.print(f"submitted job {submitted.job_id} to {_shown(jobs)}", highlight=False, soft_wrap=True)
    left_out = summary_line(contents)
    if left_out is not None:
        err_console.print(left_out, highlight=False, soft_wrap=True, markup=False)
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
            f"follow it: trainforge jobs logs {submitted.job_id} --follow --address {_shown(jobs)}",
            highlight=False,
            soft_wrap=True,
        )
        typer.echo(submitted.job_id)
        return
    code = _follow(jobs, submitted.job_id, sys.stderr)
    if code == 0:
        typer.echo(f"{submitted.run_dir}/summary.json")
    raise typer.Exit(code)


@app.command("list")
def jobs_list(
    address: AddressOpt = None, token_file: TokenFileOpt = None, wait_for_cluster: WaitOpt = "60", ca: CaOpt = None
) -> None:
    """Every job the cluster knows, oldest first: id, status, run, start, duration."""
    from trainforge.driver.jobs import jobs_table

    wide_console().print(jobs_table(_jobs(address, token_file, wait_seconds(wait_for_cluster), ca).list()))


@app.command("status")
def jobs_status(
    job: JobArg,
    address: AddressOpt = None,
    token_file: TokenFileOpt = None,
    wait_for_cluster: WaitOpt = "60",
    ca: CaOpt = None,
) -> None:
    """A job's status, run, where its results are, start, end and exit code."""
    from trainforge.driver.jobs import job_fields

    for label, value in job_fields(_jobs(address, token_file, wait_seconds(wait_for_cluster), ca).info(job)):
        typer.echo(f"{label + ':':<13}{value}")


@app.command("logs")
def jobs_logs(
    job: JobArg,
    address: AddressOpt = None,
    token_file: TokenFileOpt = None,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Follow the log until the job ends; exit with its status.")
    ] = False,
    wait_for_cluster: WaitOpt = "60",
    ca: CaOpt = None,
) -> None:
    """A job's output (the remote trainforge train's progress lines and errors)."""
    jobs = _jobs(address, token_file, wait_seconds(wait_for_cluster), ca)
    if follow:
        raise typer.Exit(_follow(jobs, job, sys.stdout))
    typer.echo(jobs.logs(job), nl=False)


@app.command("stop")
def jobs_stop(
    job: JobArg,
    address: AddressOpt = None,
    token_file: TokenFileOpt = None,
    wait_for_cluster: WaitOpt = "60",
    ca: CaOpt = None,
) -> None:
    """Ask a job to stop: trainforge checkpoints at the next report and ends (Ray kills it after 120 s)."""
    jobs = _jobs(address, token_file, wait_seconds(wait_for_cluster), ca)
    if jobs.stop(job):
        typer.echo(f"stopping {job}: it checkpoints at its next report (trainforge jobs status {job})")
    else:
        typer.echo(f"{job} was not running ({jobs.info(job).status})")


def wait_seconds(text: str) -> float:
    """``--wait-for-cluster``: seconds from 0 (try once) to an hour."""
    from trainforge.driver.dashboard import MAX_WAIT_S

    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not 0 <= seconds <= MAX_WAIT_S:  # NaN fails too
        raise TrainforgeError(f"--wait-for-cluster {text!r}: seconds from 0 (try once) to {MAX_WAIT_S:g}")
    return seconds


def _jobs(
    address: str | None, token_file: Path | None, wait_s: float, ca: str | None = None, ca_source: str = "--ca"
) -> Jobs:
    """The dashboard's client, waiting up to ``wait_s`` for a head that is starting (a line on stderr);
    ``ca`` checks an https:// dashboard's certificate."""
    from trainforge.driver.jobs import Jobs

    return Jobs(address, token_file, wait_s=wait_s, progress=sys.stderr, ca=ca, ca_source=ca_source)


def _shown(jobs: Jobs) -> str:
    """The dashboard's address as printed: a user and password in it masked."""
    from trainforge.redact import redact_text

    return redact_text(jobs.address)


def _follow(jobs: Jobs, job: str, out: IO[str]) -> int:
    """Stream a job's log to ``out`` until it ends; the exit code its status calls for."""
    from trainforge.driver.jobs import exit_code, job_name

    try:
        details = jobs.follow(job, out)
    except KeyboardInterrupt:
        err_console.print(
            f"stopped following; job {job} runs on (trainforge jobs stop {job} --address {_shown(jobs)})",
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
