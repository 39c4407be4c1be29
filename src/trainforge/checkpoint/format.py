"""Writing the on-disk checkpoint format: files plus ``manifest.json`` (size and digest of each), last.

A directory without a manifest that verifies is not a checkpoint; ``checkpoint/verify.py`` is the
one place that decides whether it does. The writers hash every file as they write it
(``checkpoint/hashing.py``) and ``fsync`` it before the manifest names it, so the manifest only
ever vouches for bytes that are on disk, and nothing is read back.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from trainforge.checkpoint.hashing import DEFAULT_HASH, FileRecord, Sealing, hash_file, open_hashing
from trainforge.checkpoint.schema import FORMAT_VERSION, FULL, MANIFEST

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST",
    "manifest_of",
    "sha256_file",
    "write_json_atomic",
    "write_json_hashed",
    "write_manifest",
    "write_manifest_of",
]

_CHUNK = 8 << 20


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON via a temp file and rename, so readers never see half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as handle:
        json.dump(data, handle, indent=1, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())
    tmp.replace(path)


def write_json_hashed(
    path: Path, data: Any, algorithm: str = DEFAULT_HASH, sealer: Sealing | None = None
) -> FileRecord:
    """Write a checkpoint's JSON file, hashed (and with ``sealer`` encrypted) as it is written and
    fsynced; its record."""
    writer = open_hashing(path, algorithm, sealer)
    try:
        writer.write(json.dumps(data, indent=1).encode())
    except BaseException:
        writer.close()
        raise
    return writer.finish()


def manifest_of(
    files: dict[str, FileRecord], meta: dict[str, Any], *, algorithm: str = DEFAULT_HASH, layout: str = FULL
) -> dict[str, Any]:
    """The manifest (format 2) of files already hashed: ``{rel name: FileRecord}`` plus ``meta``."""
    return {
        **meta,
        "format_version": FORMAT_VERSION,
        "hash": algorithm,
        "layout": layout,
        "files": {rel: files[rel].to_json() for rel in sorted(files)},
    }


def write_manifest_of(
    directory: Path,
    files: dict[str, FileRecord],
    meta: dict[str, Any],
    *,
    algorithm: str = DEFAULT_HASH,
    layout: str = FULL,
) -> dict[str, Any]:
    """Write the manifest of files that were hashed (and fsynced) while written, last; returns it."""
    manifest = manifest_of(files, meta, algorithm=algorithm, layout=layout)
    write_json_atomic(directory / MANIFEST, manifest)
    return manifest


def write_manifest(directory: Path, meta: dict[str, Any], *, algorithm: str = DEFAULT_HASH) -> dict[str, Any]:
    """Hash every (non-hidden) file under ``directory`` by reading it back and write the manifest
    last; returns it. For files written by code that could not hash them on the way (and tests);
    the savers use :func:`write_manifest_of`."""
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        rel = path.relative_to(directory).as_posix()
        if rel == MANIFEST or path.name.startswith("."):
            continue
        # Durable before the manifest vouches for it: rotation may delete older checkpoints next.
        with path.open("rb") as handle:
            os.fsync(handle.fileno())
        files[rel] = hash_file(path, algorithm)
    return write_manifest_of(directory, files, meta, algorithm=algorithm)
