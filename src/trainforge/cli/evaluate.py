"""``trainforge evaluate``: the task's metrics of a run's checkpoint on a split of its data."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from trainforge.cli.ckpt import KeyEnvOpt, cipher_from
from trainforge.cli.common import check_output_folder, json_text, wide_console, write_output
from trainforge.cli.export import TRUST_HELP
from trainforge.errors import TrainforgeError

if TYPE_CHECKING:
    from trainforge.worker.evaluation import Evaluation

SPLITS = ("val", "test")


def evaluate(
    run_dir: Annotated[Path, typer.Argument(help="A run directory: <run.output_dir>/<run.name>.")],
    checkpoint: Annotated[
        str,
        typer.Option(
            "--checkpoint",
            help="last (newest that verifies), best (by train.early_stopping's metric, else lowest val/loss) "
            "or a checkpoint's path.",
        ),
    ] = "last",
    split: Annotated[
        str, typer.Option("--split", help="val (the run's validation set) or test (the data's held-out split).")
    ] = "val",
    output: Annotated[Path | None, typer.Option("--output", help="Also write the result as JSON to this file.")] = None,
    trust_run_config: Annotated[bool, typer.Option("--trust-run-config", help=TRUST_HELP)] = False,
    key_env: KeyEnvOpt = None,
) -> None:
    """Evaluate a run's model: the task's metrics (loss, accuracy, mse...) of a checkpoint on a data split.

    Computed in this process on the CPU, as the run's workers computed their validation: --split val
    gives the figures the run reported at that checkpoint's step.
    """
    if not run_dir.is_dir():
        raise TrainforgeError(f"RUN_DIR {run_dir}: no such directory")
    if split not in SPLITS:
        raise TrainforgeError(f"--split {split!r}: one of {', '.join(SPLITS)}")
    if not checkpoint.strip():
        raise TrainforgeError("--checkpoint: last, best or a checkpoint directory's path")
    check_output_folder(output)
    cipher = cipher_from(key_env)
    from trainforge.worker.evaluation import evaluate_run  # torch and the worker code: after the checks

    found = evaluate_run(run_dir, checkpoint, split, trust_run_config=trust_run_config, cipher=cipher)
    show(found)
    if output is not None:
        write_output(output, json_text(found.to_json(), indent=2) + "\n")


def show(found: Evaluation) -> None:
    """A line naming the checkpoint and the split, then a table: each metric, and beside it what
    the run reported at that step where its metrics.jsonl holds it."""
    from rich.table import Table

    console = wide_console()
    console.print(
        f"{found.checkpoint} (step {found.step}), {found.split} split: {found.samples} samples",
        highlight=False,
        soft_wrap=True,
    )
    table = Table()
    table.add_column("metric")
    table.add_column("value", justify="right")
    if found.reported:
        table.add_column("run reported", justify="right")
    for name, value in found.metrics.items():
        row = [name, f"{value:.6g}"]
        if found.reported:
            reported = found.reported.get(name)
            row.append(f"{reported:.6g}" if reported is not None else "-")
        table.add_row(*row)
    console.print(table)
