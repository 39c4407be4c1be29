"""Where checkpoints live: one run's directory on a pyarrow file system (local, NFS or S3).

Layout: ``<root>/checkpoint_<step:09d>/`` with ``manifest.json`` written last. A checkpoint becomes
visible only when complete: on file systems it is written under a hidden ``.tmp-`` name and
renamed; on object stores, where there is no rename, the manifest is uploaded after every other
file, and a directory without a valid manifest is not a checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs

from trainforge.checkpoint.format import MANIFEST, Verification

CHECKPOINT_RE = re.compile(r"^checkpoint_(\d+)$")
TEMP_PREFIX = ".tmp-"
_CHUNK = 8 << 20


def checkpoint_name(step: int) -> str:
    return f"checkpoint_{step:09d}"


@dataclass(frozen=True)
class Entry:
    """One checkpoint directory in a store, by step."""

    name: str
    step: int
    path: str


class CheckpointStore:
    """The checkpoints of one run: list, verify, commit, fetch, retire."""

    def __init__(self, fs: pafs.FileSystem, root: str) -> None:
        self.fs = fs
        self.root = root.rstrip("/")

    @classmethod
    def from_uri(cls, uri: str) -> CheckpointStore:
        """A local path or a URI such as ``s3://bucket/prefix/run`` (credentials from the environment)."""
        if "://" not in uri:
            return cls(pafs.LocalFileSystem(), str(Path(uri).expanduser().resolve()))
        fs, path = pafs.FileSystem.from_uri(uri)
        return cls(fs, path)

    @classmethod
    def for_checkpoint(cls, uri: str) -> tuple[CheckpointStore, str]:
        """The store holding the checkpoint at ``uri`` (a path or URI), and the checkpoint's name."""
        parent, _, name = uri.rstrip("/").rpartition("/")
        return cls.from_uri(parent or "."), name

    @property
    def is_local(self) -> bool:
        return isinstance(self.fs, pafs.LocalFileSystem)

    def path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def uri(self, name: str) -> str:
        """How to name a checkpoint to a user: a local path, or scheme://bucket/key."""
        if self.is_local:
            return self.path(name)
        return f"{self.fs.type_name}://{self.path(name)}"

    def _children(self) -> list[pafs.FileInfo]:
        selector = pafs.FileSelector(self.root, recursive=False, allow_not_found=True)
        return [info for info in self.fs.get_file_info(selector) if info.type == pafs.FileType.Directory]

    def entries(self) -> list[Entry]:
        """Checkpoint directories, oldest first (complete or not: verification says which)."""
        entries = []
        for info in self._children():
            match = CHECKPOINT_RE.match(info.base_name)
            if match:
                entries.append(Entry(info.base_name, int(match.group(1)), info.path))
        return sorted(entries, key=lambda e: e.step)

    def leftovers(self) -> list[str]:
        """Hidden temp directories of saves that never completed."""
        return sorted(i.base_name for i in self._children() if i.base_name.startswith(TEMP_PREFIX))

    def read_manifest(self, name: str) -> tuple[dict[str, Any] | None, str | None]:
        try:
            with self.fs.open_input_stream(f"{self.path(name)}/{MANIFEST}") as stream:
                raw = stream.read()
        except (FileNotFoundError, OSError):
            return None, "manifest.json is missing (incomplete or interrupted save)"
        try:
            manifest = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            return None, f"manifest.json is malformed: {err}"
        if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
            return None, "manifest.json is malformed: no 'files' table"
        return manifest, None

    def verify(self, name: str) -> Verification:
        """Every file the manifest lists is there with its size and SHA-256 (reads every byte)."""
        where = Path(self.path(name))
        manifest, problem = self.read_manifest(name)
        if manifest is None:
            return Verification(where, (problem or "manifest unreadable",), None)
        problems = []
        for rel, entry in manifest["files"].items():
            if not isinstance(entry, dict):
                problems.append(f"manifest.json is malformed: the entry for {rel} is not a table")
                continue
            info = self.fs.get_file_info(f"{self.path(name)}/{rel}")
            if info.type != pafs.FileType.File:
                problems.append(f"{rel} is missing")
            elif info.size != entry.get("size"):
                problems.append(f"{rel} has {info.size} bytes, manifest says {entry.get('size')} (truncated?)")
            elif self._sha256(f"{self.path(name)}/{rel}") != entry.get("sha256"):
                problems.append(f"{rel} fails its SHA-256 check (corrupted)")
        return Verification(where, tuple(problems), manifest)

    def _sha256(self, path: str) -> str:
        digest = hashlib.sha256()
        with self.fs.open_input_stream(path) as stream:
            while chunk := stream.read(_CHUNK):
                digest.update(chunk)
        return digest.hexdigest()

    def staging_dir(self, name: str, local_scratch: Path) -> Path:
        """Where a new checkpoint is written before ``commit``: beside its final place on a local
        file system (so committing is a rename), a local scratch directory otherwise."""
        base = Path(self.root) if self.is_local else local_scratch
        staging = base / f"{TEMP_PREFIX}{name}-{uuid.uuid4().hex[:8]}"
        staging.mkdir(parents=True, exist_ok=False)
        return staging

    def commit(self, staging: Path, name: str) -> str:
        """Make a fully written staging directory (manifest included) visible as ``name``."""
        final = self.path(name)
        if self.is_local:
            target = Path(final)
            if target.exists():
                self._retire_invalid(name)
            staging.rename(target)
            fsync_path(target.parent)  # the rename itself survives a crash
            return final
        files = sorted(p for p in staging.rglob("*") if p.is_file())
        for path in sorted(files, key=lambda p: p.name == MANIFEST):  # manifest last
            rel = path.relative_to(staging).as_posix()
            pafs.copy_files(str(path), f"{final}/{rel}", pafs.LocalFileSystem(), self.fs)
        shutil.rmtree(staging, ignore_errors=True)  # the local copy has served its purpose
        return final

    def _retire_invalid(self, name: str) -> None:
        """A checkpoint dir that restore skipped as invalid, about to be re-saved: keep it aside, hidden."""
        self.fs.move(self.path(name), self.path(f".invalid-{name}-{int(time.time())}"))

    def fetch(self, name: str, scratch: Path) -> Path:
        """A local directory holding the checkpoint: the directory itself on local storage."""
        if self.is_local:
            return Path(self.path(name))
        local = scratch / name
        local.mkdir(parents=True, exist_ok=True)
        pafs.copy_files(self.path(name), str(local), self.fs, pafs.LocalFileSystem())
        return local

    def delete(self, name: str) -> None:
        self.fs.delete_dir(self.path(name))

    def discard(self, staging: Path, name: str) -> None:
        """Remove what a failed save left: its staging dir and, on object stores, a partial upload."""
        shutil.rmtree(staging, ignore_errors=True)
        if not self.is_local:
            manifest, _ = self.read_manifest(name)
            if manifest is None and self.fs.get_file_info(self.path(name)).type == pafs.FileType.Directory:
                self.fs.delete_dir(self.path(name))


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory's entries: renames and creations in it)."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
