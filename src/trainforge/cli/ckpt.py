"""``trainforge ckpt list|verify|inspect``: checkpoints read without loading their tensors."""

from __future__ import annotations

from typing import Annotated

import typer

from trainforge.cli.common import (
    json_text,
    wide_console,
)

app = typer.Typer(help="List, verify and inspect checkpoints.", no_args_is_help=True)
CkptPathArg = Annotated[str, typer.Argument(help="A checkpoint directory: a local path or a URI (s3://...).")]


@app.command("list")
def ckpt_list(
    location: Annotated[
        str, typer.Argument(help="A run directory, a storage folder holding runs, or a URI (s3://bucket/prefix/run).")
    ],
) -> None:
    """Every checkpoint of a run, verified: step, epoch, metrics, size, time, and valid or why not."""
    from trainforge.checkpoint.inspect import list_checkpoints, list_table
    from trainforge.worker.registry import state_schemas

    wide_console().print(list_table(location, list_checkpoints(location, state_schemas())))


@app.command("verify")
def ckpt_verify(path: CkptPathArg) -> None:
    """Check a checkpoint as restore does (sizes, digests, safe load): exit 0 if valid, 1 if not."""
    from trainforge.checkpoint.hashing import LABELS
    from trainforge.checkpoint.inspect import human_bytes, verify_checkpoint
    from trainforge.worker.registry import state_schemas

    check = verify_checkpoint(path, state_schemas())
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


@app.command("inspect")
def ckpt_inspect(
    path: CkptPathArg,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead.")] = False,
) -> None:
    """Manifest, progress, versions, metrics, config and tensor summary, without loading tensors."""
    from trainforge.checkpoint.inspect import inspect_checkpoint, inspection_view

    report = inspect_checkpoint(path)
    if as_json:
        typer.echo(json_text(report, indent=1, sort_keys=True))
    else:
        wide_console().print(inspection_view(report), highlight=False)
