"""``trainforge report`` and ``trainforge generate``: what a finished run directory holds, shown."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from trainforge.cli.export import TRUST_HELP
from trainforge.errors import TrainforgeError, printable_lines


def report(
    run_dir: Annotated[Path, typer.Argument(help="A run directory: <run.output_dir>/<run.name>.")],
) -> None:
    """Write RUN_DIR/report/: PNG plots and a self-contained report.html; print the page's path."""
    from trainforge.report import write_report

    typer.echo(str(write_report(run_dir)))


def generate(
    run_dir: Annotated[Path, typer.Argument(help="A run directory of a language model trained on data.name tokens.")],
    prompt: Annotated[str, typer.Option(help="The text to continue.")] = "",
    max_tokens: Annotated[int, typer.Option(help="Tokens to generate at most (stops at an end of document).")] = 200,
    temperature: Annotated[float, typer.Option(help="Sampling temperature; 0 picks the likeliest token.")] = 0.8,
    top_k: Annotated[int, typer.Option(help="Sample among the k likeliest tokens; 0: all.")] = 0,
    seed: Annotated[int, typer.Option(help="Seed of the sampling.")] = 0,
    trust_run_config: Annotated[bool, typer.Option("--trust-run-config", help=TRUST_HELP)] = False,
) -> None:
    """Print PROMPT continued by the run's final model (RUN_DIR/model.safetensors)."""
    import math

    if not 1 <= max_tokens <= 100_000:
        raise TrainforgeError(f"--max-tokens {max_tokens}: from 1 to 100000")
    if not (math.isfinite(temperature) and 0 <= temperature <= 100):
        raise TrainforgeError(f"--temperature {temperature}: a number from 0 (greedy) to 100")
    if top_k < 0:
        raise TrainforgeError(f"--top-k {top_k}: must be >= 0 (0 keeps every token)")
    from trainforge.models.generate import Sampling, load_run_model, sample

    run = load_run_model(run_dir, trust_run_config=trust_run_config)
    # What an untrusted run's model writes is data: no control character reaches the terminal.
    typer.echo(printable_lines(sample(run, prompt, Sampling(max_tokens, temperature, top_k, seed))))
