"""The ``trainforge`` command: each verb parses, builds a config, calls the API and prints.

One module per verb group: ``run`` (train, tune, config show), ``jobs`` (submit, jobs), ``bench``,
``certs``, ``ckpt``, ``data``, ``plan`` (plan, predict), ``report`` (report, generate), ``export``, ``evaluate``;
``common`` holds what they share. Verbs import torch, Ray and the driver only once their flags are checked, so a
mistake costs milliseconds.
"""

from __future__ import annotations

import sys
import traceback
from typing import Annotated

import typer
from rich.markup import escape

from trainforge.cli import bench, certs, ckpt, data, evaluate, export, jobs, plan, report, run
from trainforge.cli.common import err_console
from trainforge.errors import TrainforgeError, printable
from trainforge.redact import redact_text

app = typer.Typer(
    name="trainforge",
    help="Distributed PyTorch training on Ray Train: one command from a laptop to a GPU cluster.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
for command in (
    run.train,
    run.tune,
    jobs.submit,
    plan.plan,
    plan.predict,
    report.report,
    report.generate,
    export.export,
    evaluate.evaluate,
):
    app.command()(command)
app.add_typer(run.app, name="config")
app.add_typer(bench.app, name="bench")
app.add_typer(certs.app, name="certs")
app.add_typer(ckpt.app, name="ckpt")
app.add_typer(data.app, name="data")
app.add_typer(jobs.app, name="jobs")


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
        # escape: messages quote values such as [lo, hi], which rich would take for markup;
        # printable: a name read from a file brings no newline or terminal escape (errors.printable).
        err_console.print(f"[red]error:[/] {escape(printable(redact_text(str(err))))}", highlight=False, soft_wrap=True)
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
            err_console.print(f"error: {escape(redact_text(err.format_message()))}", highlight=False, soft_wrap=True)
        sys.exit(getattr(err, "exit_code", 2))
    except Exception:
        # A bug, not a user's error: the traceback is for its report, with credentials masked.
        sys.stderr.write(redact_text(traceback.format_exc()))
        sys.exit(1)


if __name__ == "__main__":
    main()
