"""``trainforge export``: a run's trained model as a Hugging Face directory or safetensors weights."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from trainforge.errors import TrainforgeError

TRUST_HELP = (
    "Import the code the run's config names (model.factory, data.factory, parallel.tp_plan, optim.factory, "
    "callbacks); without it such a run directory is refused: its config is data, written by whoever trained it."
)


def export(
    run_dir: Annotated[Path, typer.Argument(help="A run directory: <run.output_dir>/<run.name>.")],
    format: Annotated[str, typer.Option("--format", help="hf (transformers' from_pretrained) or safetensors.")],
    output: Annotated[Path, typer.Option("--output", help="A new (or empty) folder to write.")],
    checkpoint: Annotated[
        str, typer.Option("--checkpoint", help="last (newest that verifies), best (lowest val/loss) or a path.")
    ] = "last",
    merge_lora: Annotated[
        bool, typer.Option("--merge-lora", help="Fold LoRA adapters into the base weights (runs with model.lora).")
    ] = False,
    trust_run_config: Annotated[bool, typer.Option("--trust-run-config", help=TRUST_HELP)] = False,
) -> None:
    """Write the run's model where tools without trainforge load it; the weights come from a verified checkpoint."""
    if not run_dir.is_dir():
        raise TrainforgeError(f"RUN_DIR {run_dir}: no such directory")
    from trainforge.models.export import describe, export_run  # checks --format and --output first

    typer.echo(
        describe(
            export_run(run_dir, format, output, checkpoint, merge_lora=merge_lora, trust_run_config=trust_run_config)
        )
    )
