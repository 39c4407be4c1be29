"""Where checkpoints live: one run's directory on a pyarrow file system (local, NFS or S3).

Layout: ``<root>/checkpoint_<step:09d>/`` (names: ``checkpoint/names.py``) with ``manifest.json``
written last. A checkpoint becomes visible only when complete: on file systems it is written
under a hidden ``.tmp-`` name and renamed; on object stores, where there is no rename, the
manifest is uploaded after every other file, and a directory without a valid manifest is not a
checkpoint.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import pyarrow.fs as pafs

from trainforge.checkpoint import verify as verify_module
from trainforge.checkpoint.crypto import ENCRYPTED_HINT, OVERHEAD, FileCipher
from trainforge.checkpoint.names import (
    RETIRED_PREFIX,
    TEMP_PREFIX,
    checkpoint_name,
    parse_checkpoint_name,
    retired_name,
    staging_name,
)
from trainforge.checkpoint.opened import CheckpointFiles, DirectoryFiles, decrypted, write_whole
from trainforge.checkpoint.saved import saved_from
from trainforge.checkpoint.schema import FULL, MANIFEST, MAX_STATE_BYTES, STATE_FILE, ComponentSchemas
from trainforge.checkpoint.sse import EncryptingWriter, ServerSide
from trainforge.checkpoint.uris import open_uri, plain
from trainforge.checkpoint.verify import Verification
from trainforge.errors import CheckpointError

__all__ = [
    "RETIRED_PREFIX",
    "TEMP_PREFIX",
    "CheckpointStore",
    "Child",
    "Entry",
    "checkpoint_name",
    "fsync_path",
    "join_uri",
    "parse_checkpoint_name",
]
log = logging.getLogger("trainforge.checkpoint")


@dataclass(frozen=True)
class Entry:
    """One checkpoint directory in a store, by step."""

    name: str
    step: int
    path: str


@dataclass(frozen=True)
class Child:
    """One directory directly under a store's root."""

    name: str
    path: str
    mtime_ns: int | None


class CheckpointStore:
    """The checkpoints of one run: list, verify, commit, fetch, retire."""

    def __init__(self, fs: pafs.FileSystem, root: str, cipher: FileCipher | None = None) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        self.cipher = cipher  # checkpoint.encryption's key: reads encrypted checkpoints (and writes)
        self._server_side: EncryptingWriter | None = None  # checkpoint.s3_sse (sse.py)

    def encrypt_on_server(self, sse: ServerSide | None) -> None:
        """``checkpoint.s3_sse``: every upload and copy of this store asks S3 to encrypt the object."""
        self._server_side = EncryptingWriter(self.fs, sse) if sse is not None else None

    @classmethod
    def from_uri(cls, uri: str, cipher: FileCipher | None = None) -> CheckpointStore:
        """A local path or a URI such as ``s3://bucket/prefix/run`` (credentials from the environment):
        one of the schemes ``checkpoint/uris.py`` reads, every request bounded; CheckpointError if not."""
        fs, path = open_uri(uri)
        return cls(fs, path, cipher)

    @classmethod
    def for_run(cls, storage_path: str, run_name: str) -> CheckpointStore:
        """The store of one run's checkpoints: ``<storage_path>/<run_name>``, as Ray Train lays it out."""
        return cls.from_uri(join_uri(storage_path, run_name))

    @classmethod
    def for_checkpoint(cls, uri: str, cipher: FileCipher | None = None) -> tuple[CheckpointStore, str]:
        """The store holding the checkpoint at ``uri`` (a path or URI), and the checkpoint's name."""
        path, mark, query = plain(uri).partition("?")
        parent, _, name = path.rstrip("/").rpartition("/")
        top = "/" if path.startswith("/") else "."  # /etc: the root's; etc: the working directory's
        return cls.from_uri(f"{parent or top}{mark}{query}", cipher), name

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

    def children(self) -> list[Child]:
        """The directories directly under the root; on a local file system without following links
        (a linked directory is not a checkpoint to restore or rotate) and without names that are
        not text (which no checkpoint has, and which pyarrow's listing cannot decode)."""
        if not self.is_local:
            selector = pafs.FileSelector(self.root, recursive=False, allow_not_found=True)
            return [
                Child(info.base_name, info.path, info.mtime_ns)
                for info in self.fs.get_file_info(selector)
                if info.type == pafs.FileType.Directory
            ]
        try:
            listing = list(os.scandir(self.root))
        except FileNotFoundError:
            return []
        found = []
        for item in listing:
            if item.is_dir(follow_symlinks=False) and item.name.isprintable() and _is_text(item.name):
                found.append(Child(item.name, self.path(item.name), item.stat(follow_symlinks=False).st_mtime_ns))
        return found

    def entries(self) -> list[Entry]:
        """Checkpoint directories, oldest first (complete or not: verification says which)."""
        entries = []
        for child in self.children():
            step = parse_checkpoint_name(child.name)
            if step is not None:
                entries.append(Entry(child.name, step, child.path))
        return sorted(entries, key=lambda e: e.step)

    def leftovers(self) -> list[str]:
        """Hidden temp directories of saves that never completed."""
        return sorted(c.name for c in self.children() if c.name.startswith(TEMP_PREFIX))

    def read_manifest(self, name: str) -> tuple[dict[str, Any] | None, str | None]:
        """The manifest's JSON (bounded, schema-checked), or None and why not."""
        try:
            return verify_module.read_manifest(self.fs, self.path(name), self.is_local)[1], None
        except CheckpointError as err:
            return None, str(err)

    def exports(self, name: str) -> dict[str, str]:
        """The weights files checkpoint ``name`` holds for the run directory: ``{run-directory file:
        checkpoint file}``, as its components declared them (``trainer_state.json``'s ``exports``);
        none when its state does not read."""
        manifest, _ = self.read_manifest(name)
        if manifest is None:
            return {}
        try:
            raw = verify_module.read_capped(
                self.fs, f"{self.path(name)}/{STATE_FILE}", self.is_local, MAX_STATE_BYTES + OVERHEAD
            )
            if manifest.get("encryption") and self.cipher is not None:
                raw = self.cipher.open_bytes(STATE_FILE, raw)
            saved = saved_from(raw, str(manifest.get("layout", FULL)), set(manifest["files"]))
        except (CheckpointError, OSError):
            return {}
        return saved.exports

    def copy_out(self, name: str, rel: str, target: Path) -> None:
        """File ``rel`` of checkpoint ``name`` to the local ``target`` (written whole, then renamed
        into place): as stored, or decrypted when the checkpoint is encrypted (CheckpointError if
        this store has not got its key, or the file fails authentication)."""
        manifest, _ = self.read_manifest(name)
        encrypted = bool(manifest and manifest.get("encryption"))
        if encrypted and self.cipher is None:
            raise CheckpointError(f"{name} is encrypted: {ENCRYPTED_HINT}")
        if encrypted:  # plaintext that has a name only once it is whole (opened.write_whole)
            cipher = self.cipher
            assert cipher is not None and manifest is not None
            size = int(manifest["files"][rel]["size"])

            def decrypt(out: IO[bytes]) -> None:
                with self.fs.open_input_file(f"{self.path(name)}/{rel}") as source:
                    cipher.open_stream(rel, source, size, out)

            write_whole(target, decrypt)
            return
        partial = target.with_name(f".{target.name}.partial")
        try:
            pafs.copy_files(f"{self.path(name)}/{rel}", str(partial), self.fs, pafs.LocalFileSystem())
            partial.replace(target)
        finally:
            partial.unlink(missing_ok=True)

    def verify(
        self,
        name: str,
        *,
        safe_load: bool = True,
        schemas: Mapping[str, ComponentSchemas] | None = None,
        contents: bool = True,
    ) -> Verification:
        """The one verification (``checkpoint/verify.py``): exactly the listed regular files, sizes,
        the digest of every byte, schemas (the components' own when given), and with ``safe_load``
        the weights-only load check. An encrypted checkpoint's contents (schemas, load check) need
        this store's key; without one it is a problem, unless ``contents`` is False (the hashes
        alone: ``trainforge ckpt verify`` without a key)."""
        return verify_module.verify_tree(
            self.fs,
            self.path(name),
            self.is_local,
            safe_load=safe_load,
            schemas=schemas,
            cipher=self.cipher,
            contents=contents,
        )

    @contextlib.contextmanager
    def opened(self, directory: Path) -> Iterator[CheckpointFiles]:
        """A fetched, verified checkpoint directory's files as plaintext: its own, or (encrypted)
        decrypted into anonymous files that vanish on exit, and with the process however it ends."""
        encryption = verify_module.local_encryption(directory)
        if encryption is None:
            yield DirectoryFiles(directory)
            return
        if self.cipher is None:
            raise CheckpointError(f"{directory.name} is encrypted: {ENCRYPTED_HINT}")
        self.cipher.check_key(encryption, directory.name)
        files = sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())
        with decrypted(directory, [rel for rel in files if rel != MANIFEST], self.cipher) as plain:
            yield plain

    def staging_dir(self, name: str, local_scratch: Path) -> Path:
        """Where a new checkpoint is written before ``commit``: beside its final place on a local
        file system (so committing is a rename), a local scratch directory otherwise."""
        base = Path(self.root) if self.is_local else local_scratch
        staging = base / staging_name(name)
        staging.mkdir(parents=True, exist_ok=False)
        return staging

    def commit(self, staging: Path, name: str) -> str:
        """Make a fully written staging directory (manifest included) visible as ``name``.

        A checkpoint already there under that name is replaced only if it does not verify (it is
        set aside then, for ``ckpt list`` to show). One that verifies is never touched, and the save
        fails instead: keeping the old one and reporting success would let the run believe this
        step's state is saved when the directory holds another timeline's (or another model's).
        """
        final = self.path(name)
        self.make_room(name)
        if self.is_local:
            # Every file was fsynced before the manifest named it; the directory entries too, so
            # that the rename cannot expose a directory whose files a crash forgets.
            for directory in sorted((p for p in staging.rglob("*") if p.is_dir()), reverse=True):
                fsync_path(directory)
            fsync_path(staging)
            staging.rename(final)
            fsync_path(Path(final).parent)  # the rename itself survives a crash
            return final
        files = sorted(p for p in staging.rglob("*") if p.is_file())
        for path in sorted(files, key=lambda p: p.relative_to(staging).as_posix() == MANIFEST):  # manifest last
            self.upload(path, name, path.relative_to(staging).as_posix())
        shutil.rmtree(staging, ignore_errors=True)  # the local copy has served its purpose
        return final

    def make_room(self, name: str) -> None:
        """Before a checkpoint is written under ``name``: an existing directory of that name that
        does not verify is set aside (deleted on object stores); one that verifies is an error."""
        if self.fs.get_file_info(self.path(name)).type == pafs.FileType.NotFound:
            return
        check = self.verify(name, safe_load=False)
        if check.ok:
            raise CheckpointError(
                f"{self.uri(name)} already exists and verifies; it was not replaced (another timeline of "
                "this run wrote it: move it away to save this step)"
            )
        log.warning("setting aside invalid %s before saving it again: %s", name, "; ".join(check.problems))
        self._retire_invalid(name)

    def promote(self, staging: str, name: str) -> None:
        """Object stores: copy the staging prefix ``staging`` (complete, manifest included) to the
        checkpoint ``name``, server-side, the manifest last; then delete the staging prefix."""
        self.make_room(name)
        source = self.path(staging)
        infos = self.fs.get_file_info(pafs.FileSelector(source, recursive=True))
        files = sorted(info.path[len(source) + 1 :] for info in infos if info.type == pafs.FileType.File)
        for rel in sorted(files, key=lambda rel: rel == MANIFEST):  # manifest last: then it exists
            target = f"{self.path(name)}/{rel}"
            self._make_parent(target)
            if self._server_side is not None:
                self._server_side.copy(f"{source}/{rel}", target)
            else:
                self.fs.copy_file(f"{source}/{rel}", target)
        # Committed is committed: a staging prefix left behind costs space, not the save (the
        # writer's first save of a later session removes it).
        try:
            self.fs.delete_dir(source)
        except OSError as err:
            log.warning("could not remove the staging prefix %s after committing %s: %s", staging, name, err)

    def discard_staging(self, staging: str) -> None:
        """Remove a staging directory (or prefix) of this store that a failed save left."""
        if self.fs.get_file_info(self.path(staging)).type == pafs.FileType.Directory:
            self.fs.delete_dir(self.path(staging))

    def upload(self, local: Path, name: str, rel: str) -> None:
        """Copy one local file to ``<checkpoint name>/<rel>`` on this store (object stores)."""
        target = f"{self.path(name)}/{rel}"
        self._make_parent(target)
        if self._server_side is not None:
            self._server_side.upload(local, target)
        else:
            pafs.copy_files(str(local), target, pafs.LocalFileSystem(), self.fs)

    def _make_parent(self, target: str) -> None:
        """The parent directory of ``target``, on file systems that have directories. Not on object
        stores: there a directory is an empty marker object, which would sit in the checkpoint's
        prefix beside the files the manifest lists."""
        if not is_object_store(self.fs):
            self.fs.create_dir(target.rpartition("/")[0], recursive=True)

    def _retire_invalid(self, name: str) -> None:
        """Set an invalid checkpoint dir aside under a hidden name unique to this call (two in the
        same second must not collide), or delete it on object stores, where a move is a copy."""
        if not self.is_local:
            self.fs.delete_dir(self.path(name))
            return
        self.fs.move(self.path(name), self.path(retired_name(name)))

    def clean_leftovers(self, older_than: float) -> list[str]:
        """Remove staging directories of saves that crashed: those last changed before
        ``older_than`` (a time), so that a save still in flight elsewhere is left alone."""
        removed = []
        for child in self.children():
            stale = child.mtime_ns is not None and child.mtime_ns / 1e9 < older_than
            if child.name.startswith(TEMP_PREFIX) and stale:
                self.fs.delete_dir(child.path)
                removed.append(child.name)
        return removed

    def fetch(self, name: str, scratch: Path) -> Path:
        """A local directory holding the checkpoint (with its subdirectories, such as a sharded
        checkpoint's ``sharded/``): the directory itself on local storage."""
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


def is_object_store(fs: pafs.FileSystem) -> bool:
    """S3, GCS or Azure (directly, under a SubTreeFileSystem, or through fsspec): no directories."""
    base = fs.base_fs if isinstance(fs, pafs.SubTreeFileSystem) else fs
    kind = base.type_name
    return kind in ("s3", "gcs", "abfs") or (
        kind.startswith("py::fsspec") and any(proto in kind for proto in ("s3", "gs", "gcs", "abfs", "az"))
    )


def join_uri(base: str, *parts: str) -> str:
    """``base`` with path segments appended: before a URI's query (``s3://k:s@bucket/p?endpoint_override=...``
    keeps its credentials and options), or to a plain path."""
    path, mark, query = base.partition("?") if "://" in base else (base, "", "")
    return "/".join([path.rstrip("/"), *parts]) + mark + query


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory's entries: renames and creations in it)."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _is_text(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # undecodable bytes, kept by os as lone surrogates
        return False
    return True
