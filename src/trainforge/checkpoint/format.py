"""Writing the on-disk checkpoint format: files plus ``manifest.json`` (size and SHA-256 of each), last.

A directory without a manifest that verifies is not a checkpoint; ``checkpoint/verify.py`` is the
one place that decides whether it does.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from trainforge.checkpoint.schema import FORMAT_VERSION, MANIFEST

__all__ = ["FORMAT_VERSION", "MANIFEST", "sha256_file", "write_json_atomic", "write_manifest"]

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


def write_manifest(directory: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """Hash every file under ``directory`` and write the manifest last; returns it."""
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        rel = path.relative_to(directory).as_posix()
        if rel == MANIFEST or path.name.startswith("."):
            continue
        # Durable before the manifest vouches for it: rotation may delete older checkpoints next.
        with path.open("rb") as handle:
            os.fsync(handle.fileno())
        files[rel] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
    manifest = {"format_version": FORMAT_VERSION, "files": files, **meta}
    write_json_atomic(directory / MANIFEST, manifest)
    return manifest
