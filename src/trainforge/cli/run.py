"""``trainforge train``, ``tune`` and ``config show``: a run or a search from a config file."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape

from trainforge.cli.common import (
    ConfigArg,
    SetOpt,
    err_console,
    resolve_config_path,
    setup_logging,
)

if TYPE_CHECKING:
    from trainforge.config import Config

app = typer.Typer(help="Inspect configs.", no_args_is_help=True)  # trainforge config ...

# trainforge train's exit codes besides 0 (finished), 1 (training failed) and 2 (a user's error):
STOPPED_EXIT = 3  # stopped before its end (Ctrl-C or SIGTERM once, preemption): resumable
ABORTED_EXIT = 130  # aborted (a second Ctrl-C): resumable from its last checkpoint


def train(
    config: ConfigArg,
    set_: SetOpt = None,
    address: Annotated[
        str | None, typer.Option(help="Ray cluster to run on (host:port or ray://host:10001); default RAY_ADDRESS.")
    ] = None,
    resume: Annotated[
        str | None,
        typer.Option(
            help="auto (newest valid checkpoint of this run), none, or a checkpoint path; sets checkpoint.resume. "
            "Given, a run directory trained with a different config continues with the new values."
        ),
    ] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Show Ray's own logs.")] = False,
) -> None:
    """Train a model as CONFIG describes, on a local Ray or the cluster at --address.

    Re-running the same command continues the run from its newest valid checkpoint; with a
    changed config it is refused unless --resume is given.
    Ctrl-C once: checkpoint and stop (resumable, exit 3); twice: abort (exit 130).
    """
    from trainforge.config import load_config
    from trainforge.driver.job_secrets import submitted_source

    setup_logging(verbose)
    overrides = [*(set_ or []), *([f"checkpoint.resume={resume}"] if resume is not None else [])]
    # Validate before importing torch and Ray, so a config error costs milliseconds. A job that
    # trainforge submit started gets its secrets from its environment, not from the file.
    resolved = load_config(submitted_source(resolve_config_path(config)), overrides)
    err_console.print(escape(first_line(resolved)), highlight=False, soft_wrap=True)
    from trainforge.driver.rerun import check_rerun

    check_rerun(resolved, resume=resume is not None)  # refused before Ray starts; the driver asks again under the lock
    from trainforge.driver.tls import use_tls

    use_tls(resolved.cluster.tls)  # before Ray is imported: Ray reads its TLS settings then
    from trainforge.driver.startup import command_started

    command_started()  # the run's start-up is timed from this process's start (summary.json's startup)
    from trainforge.driver.ray_session import early_local_ray

    with early_local_ray(resolved, address, verbose=verbose):  # Ray boots while torch and the driver import
        from trainforge.api import fit

        result = fit(resolved, address=address, verbose=verbose, console=err_console, resume=resume)
    typer.echo(str(result.run_dir / "summary.json"))
    code = {"stopped": STOPPED_EXIT, "aborted": ABORTED_EXIT}.get(result.status)
    if code is not None:
        again = resume_command(config, set_, address, verbose, resolved)
        step = result.summary.get("global_step")
        said = f"{result.status} at step {step}; to resume: {again}"
        err_console.print(escape(said), highlight=False, soft_wrap=True)
        raise typer.Exit(code)


def first_line(config: Config) -> str:
    """What ``train`` says before it imports torch and Ray (seconds before the run's own lines)."""
    workers = config.scaling.num_workers
    shown = f"{workers[0]}-{workers[1]}" if isinstance(workers, tuple) else str(workers)
    output = Path(config.run.output_dir) / config.run.name
    return f"trainforge: training {config.run.name} on {shown} worker(s), output {output} ..."


def resume_command(config: str, set_: list[str] | None, address: str | None, verbose: bool, resolved: Config) -> str:
    """The command that continues a stopped run: this one, with ``--resume auto`` where the config
    does not resume by itself (``--resume none`` or a path started the run). Secrets are masked, as
    everywhere the run prints: a ``--set`` of a secret-named key, credentials in a URI."""
    from trainforge.redact import MASK, is_secret_key, redact_text

    words = ["trainforge", "train", config]
    for item in set_ or []:
        key, _, value = item.partition("=")
        words += ["--set", f"{key}={MASK if is_secret_key(key.rsplit('.', 1)[-1]) else redact_text(value)}"]
    if address is not None:
        words += ["--address", redact_text(address)]
    if resolved.checkpoint.resume != "auto":
        words += ["--resume", "auto"]
    if verbose:
        words.append("--verbose")
    return shlex.join(words)


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
    from trainforge.tune.schedulers import make_settings
    from trainforge.tune.space import load_space

    setup_logging(verbose)
    flags = {"num_trials": trials, "scheduler": scheduler, "search": search}
    overrides = [*(set_ or []), *(f"tune.{key}={value}" for key, value in flags.items() if value is not None)]
    # Config, space and search settings are checked before Ray and torch are imported: a mistake costs milliseconds.
    resolved = load_config(resolve_config_path(config), overrides)
    from trainforge.driver.tls import use_tls

    use_tls(resolved.cluster.tls)  # as for train
    space_path = resolve_config_path(space)
    make_settings(resolved, load_space(space_path, resolved))
    from trainforge.driver.ray_session import early_local_ray

    with early_local_ray(resolved, address, verbose=verbose):  # as for train
        from trainforge.api import tune as run_tune

        result = run_tune(resolved, space_path, address=address, verbose=verbose, console=err_console)
    typer.echo(str(result.search_dir / "tune_summary.json"))


@app.command("show")
def config_show(config: ConfigArg, set_: SetOpt = None) -> None:
    """Print the resolved config: file, then --set overrides, then TRAINFORGE_* environment."""
    from trainforge.config import load_config, to_yaml

    typer.echo(to_yaml(load_config(resolve_config_path(config), set_ or [])), nl=False)
