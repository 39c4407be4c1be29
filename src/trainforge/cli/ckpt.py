"""``trainforge ckpt list|verify|inspect|upgrade``: checkpoints read without loading their tensors,
and an earlier format converted to today's."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from trainforge.cli.common import (
    json_text,
    wide_console,
)
from trainforge.errors import TrainforgeError, printable

if TYPE_CHECKING:
    from trainforge.checkpoint.crypto import FileCipher

app = typer.Typer(help="List, verify, inspect and upgrade checkpoints.", no_args_is_help=True)
CkptPathArg = Annotated[str, typer.Argument(help="A checkpoint directory: a local path or a URI (s3://...).")]
KeyEnvOpt = Annotated[
    str | None,
    typer.Option(
        "--key-env",
        metavar="NAME",
        help="The environment variable holding the key of encrypted checkpoints (checkpoint.encryption.key_env).",
    ),
]


def cipher_from(key_env: str | None) -> FileCipher | None:
    """``--key-env NAME``: the key in that variable (one line if it is unset or not a key)."""
    from trainforge.checkpoint.crypto import ENV_NAME, FileCipher

    if key_env is None:
        return None
    if not ENV_NAME.fullmatch(key_env):
        raise TrainforgeError(f"--key-env {key_env!r}: the name of an environment variable (letters, digits, _)")
    return FileCipher.from_env(key_env)


@app.command("list")
def ckpt_list(
    location: Annotated[
        str, typer.Argument(help="A run directory, a storage folder holding runs, or a URI (s3://bucket/prefix/run).")
    ],
    key_env: KeyEnvOpt = None,
) -> None:
    """Every checkpoint of a run, verified: step, epoch, metrics, size, time, and valid or why not."""
    from trainforge.checkpoint.inspect import list_checkpoints, list_table
    from trainforge.worker.registry import state_schemas

    wide_console().print(list_table(location, list_checkpoints(location, state_schemas(), cipher_from(key_env))))


@app.command("verify")
def ckpt_verify(path: CkptPathArg, key_env: KeyEnvOpt = None) -> None:
    """Check a checkpoint as restore does (sizes, digests, safe load): exit 0 if valid, 1 if not.
    An encrypted checkpoint without --key-env: the ciphertext's sizes and digests."""
    from trainforge.checkpoint.hashing import LABELS
    from trainforge.checkpoint.inspect import human_bytes, verify_checkpoint
    from trainforge.worker.registry import state_schemas

    cipher = cipher_from(key_env)
    check = verify_checkpoint(path, state_schemas(), cipher)
    if check.ok:
        manifest = check.manifest or {}
        files = manifest.get("files", {})
        size = sum(int(entry["size"]) for entry in files.values())
        label = LABELS.get(str(manifest.get("hash", "sha256")), "SHA-256")
        layout = manifest.get("layout", "full")
        sharding = f", sharded over {manifest.get('world_size')} ranks" if layout == "sharded" else ""
        encryption = manifest.get("encryption")
        sealed = ""
        if encryption:
            opened = "contents checked with its key" if cipher else "contents not checked: --key-env to read them"
            sealed = f", encrypted with key {encryption['key_id']}: {opened}"
        # The manifest is read back from storage: what it says is printed as data (errors.printable).
        line = f"valid: {path} ({len(files)} files, {human_bytes(size)}, {label} checked{sharding}{sealed})"
        typer.echo(printable(line))
        return
    typer.echo(printable(f"invalid: {path}"))
    for problem in check.problems:
        typer.echo(f"  {printable(problem)}")
    raise typer.Exit(1)


@app.command("inspect")
def ckpt_inspect(
    path: CkptPathArg,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead.")] = False,
    key_env: KeyEnvOpt = None,
) -> None:
    """Manifest, progress, versions, metrics, config and tensor summary, without loading tensors."""
    from trainforge.checkpoint.inspect import inspect_checkpoint, inspection_view

    report = inspect_checkpoint(path, cipher_from(key_env))
    if as_json:
        typer.echo(json_text(report, indent=1, sort_keys=True))
    else:
        wide_console().print(inspection_view(report), highlight=False)


@app.command("upgrade")
def ckpt_upgrade(
    path: Annotated[str, typer.Argument(help="A local checkpoint directory written by an earlier trainforge.")],
) -> None:
    """Rewrite a checkpoint of an earlier format (1 or 2) as today's, in place; the old one is kept
    beside it (hidden). Restore and model.pretrained read only today's format."""
    from pathlib import Path

    from trainforge.checkpoint.upgrade import upgrade
    from trainforge.worker.registry import state_schemas

    done = upgrade(Path(path).expanduser(), state_schemas())
    typer.echo(f"upgraded: {done.path} (format {done.old_format} -> 3; the original is kept as {done.kept})")
