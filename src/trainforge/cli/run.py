"""``trainforge train``, ``tune`` and ``config show``: a run or a search from a config file."""

from __future__ import annotations

from typing import Annotated

import typer

from trainforge.cli.common import (
    ConfigArg,
    SetOpt,
    err_console,
    resolve_config_path,
    setup_logging,
)

app = typer.Typer(help="Inspect configs.", no_args_is_help=True)  # trainforge config ...


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
    from trainforge.driver.job_secrets import submitted_source

    setup_logging(verbose)
    overrides = [*(set_ or []), *([f"checkpoint.resume={resume}"] if resume is not None else [])]
    # Validate before importing torch and Ray, so a config error costs milliseconds. A job that
    # trainforge submit started gets its secrets from its environment, not from the file.
    resolved = load_config(submitted_source(resolve_config_path(config)), overrides)
    from trainforge.driver.tls import use_tls

    use_tls(resolved.cluster.tls)  # before Ray is imported: Ray reads its TLS settings then
    from trainforge.driver.startup import command_started

    command_started()  # the run's start-up is timed from this process's start (summary.json's startup)
    from trainforge.driver.ray_session import early_local_ray

    with early_local_ray(resolved, address, verbose=verbose):  # Ray boots while torch and the driver import
        from trainforge.api import fit

        result = fit(resolved, address=address, verbose=verbose, console=err_console)
    typer.echo(str(result.run_dir / "summary.json"))
    if result.status == "aborted":
        raise typer.Exit(130)


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
