"""The on-disk checkpoint format: files plus ``manifest.json`` (size and SHA-256 of each), written last.

A directory without a manifest that verifies is not a checkpoint. Verification reads every byte,
so it is done once per restore candidate, not on every listing.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
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


@dataclass(frozen=True)
class Verification:
    """The outcome of checking one checkpoint directory against its manifest."""

    path: Path
    problems: tuple[str, ...]
    manifest: dict[str, Any] | None

    @property
    def ok(self) -> bool:
        return not self.problems


def read_manifest(directory: Path) -> tuple[dict[str, Any] | None, str | None]:
    path = directory / MANIFEST
    if not path.is_file():
        return None, "manifest.json is missing (incomplete or interrupted save)"
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        return None, f"manifest.json is malformed: {err}"
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        return None, "manifest.json is malformed: no 'files' table"
    return manifest, None


def verify(directory: str | os.PathLike[str]) -> Verification:
    """Check that every file the manifest lists exists with its size and hash."""
    root = Path(directory)
    if not root.is_dir():
        return Verification(root, (f"{root} is not a directory",), None)
    manifest, problem = read_manifest(root)
    if manifest is None:
        return Verification(root, (problem or "manifest unreadable",), None)
    problems = []
    for rel, entry in manifest["files"].items():
        if not isinstance(entry, dict):
            problems.append(f"manifest.json is malformed: the entry for {rel} is not a table")
            continue
        path = root / rel
        if not path.is_file():
            problems.append(f"{rel} is missing")
            continue
        size = path.stat().st_size
        if size != entry.get("size"):
            problems.append(f"{rel} has {size} bytes, manifest says {entry.get('size')} (truncated or overwritten)")
        elif sha256_file(path) != entry.get("sha256"):
            problems.append(f"{rel} fails its SHA-256 check (corrupted)")
    return Verification(root, tuple(problems), manifest)
