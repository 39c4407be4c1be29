"""``trainforge data prepare|verify``: token corpora for language models."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from trainforge.cli.common import (
    setup_logging,
)
from trainforge.errors import TrainforgeError, printable

app = typer.Typer(help="Prepare and verify token corpora for language models.", no_args_is_help=True)


@app.command("prepare")
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

    setup_logging(False)
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
    line = f"prepared {prepared.path} in {prepared.seconds:.1f} s: {describe(prepared.manifest)}{skipped}"
    typer.echo(printable(line))


@app.command("verify")
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
    # The manifest is read back from the disk: what it names is printed as data (errors.printable).
    line = f"valid: {path} ({len(manifest.files)} files, {size:,} bytes, {checked}): {describe(manifest)}"
    typer.echo(printable(line))
