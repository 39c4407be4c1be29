"""The one verification of a checkpoint, used by restore, rotation and ``trainforge ckpt``.

A checkpoint directory is valid when, in this order (cheap checks first, nothing hashed or parsed
before the checks that bound its cost):
1. it holds regular files only: no symbolic links, FIFOs, devices or sockets (``lstat``, and
   ``O_NOFOLLOW | O_NONBLOCK`` when opening, so a FIFO cannot block and a link is never followed);
2. ``manifest.json`` is at most ``MAX_MANIFEST_BYTES`` and matches its schema (format 1: SHA-256;
   format 2: the hash it names, SHA-256 or BLAKE3, and its layout, full or sharded): plain
   relative names, including every file a checkpoint of that layout needs;
3. the files on storage are exactly the files the manifest lists, each with its declared size, and
   the only directory is a sharded checkpoint's real ``sharded/`` (not a link);
4. every file's digest matches (reading no more than the declared size);
5. ``trainer_state.json`` (bounded) matches its schema and names only files the manifest lists;
   given the components' schemas (the worker's registry owns them: restore, rotation and
   ``trainforge ckpt`` pass them), every component's state matches its own, so that what verifies
   also loads;
6. optionally, the safe-load check: every safetensors header parses and every ``.pt`` file
   unpickles under ``weights_only``; in the sharded layout also DCP's ``.metadata`` unpickles
   under an allow-list and points only inside the listed shards (this step needs torch).
   An encrypted checkpoint (``checkpoint.encryption``): every file decrypts and authenticates
   under the key instead (the bytes are a key holder's; the load itself is ``weights_only``).
It works over a pyarrow file system: the local one (where links and FIFOs exist) and object stores.
"""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs

from trainforge.checkpoint.crypto import ENCRYPTED_HINT, OVERHEAD, FileCipher
from trainforge.checkpoint.hashing import LABELS, new_digest
from trainforge.checkpoint.problems import INVALID, KEY, UNREADABLE, Problem, ProblemKind, problem_of
from trainforge.checkpoint.saved import saved_from
from trainforge.checkpoint.schema import (
    MANIFEST,
    MAX_MANIFEST_BYTES,
    MAX_STATE_BYTES,
    SHARDED,
    SHARDED_METADATA,
    STATE_FILE,
    ComponentSchemas,
    Encryption,
    Manifest,
    is_checkpoint_name,
    kind_of,
    open_regular,
    parse_manifest,
    printable,
)
from trainforge.errors import CheckpointError

_CHUNK = 8 << 20
_MAX_ENTRIES = 10_000  # a checkpoint holds a few files per rank; a bigger tree is not one of ours


@dataclass(frozen=True)
class Verification:
    """The outcome of checking one checkpoint directory: its problems, typed (``problems.py``);
    ``manifest`` is the raw JSON when it parsed."""

    path: Path
    issues: tuple[Problem, ...]
    manifest: dict[str, Any] | None

    @property
    def ok(self) -> bool:
        return not self.issues

    @property
    def problems(self) -> tuple[str, ...]:
        """The problems' texts, for people."""
        return tuple(issue.text for issue in self.issues)

    @property
    def kinds(self) -> set[ProblemKind]:
        return {issue.kind for issue in self.issues}


@dataclass
class Tree:
    """What a checkpoint directory holds: regular files by relative name and size, and the rest."""

    files: dict[str, int] = field(default_factory=dict)
    dirs: set[str] = field(default_factory=set)
    others: dict[str, str] = field(default_factory=dict)  # relative name -> what it is ("a FIFO")
    problems: list[str] = field(default_factory=list)


def list_tree(fs: pafs.FileSystem, root: str, local: bool) -> Tree:
    """Everything under ``root`` without following links; names that are not plain are problems."""
    tree = _list_local(root) if local else _list_remote(fs, root)
    for rel in [*tree.files, *tree.dirs, *tree.others]:
        if not is_checkpoint_name(rel):
            tree.problems.append(f"{printable(rel)} has a name that is not a plain file name (unexpected file)")
    return tree


def _list_local(root: str) -> Tree:
    tree = Tree()
    pending = [""]
    count = 0
    while pending:
        prefix = pending.pop()
        with os.scandir(os.path.join(root, prefix) if prefix else root) as listing:
            for item in listing:
                count += 1
                if count > _MAX_ENTRIES:
                    tree.problems.append(f"holds more than {_MAX_ENTRIES} entries: not a checkpoint")
                    return tree
                rel = f"{prefix}/{item.name}" if prefix else item.name
                mode = item.stat(follow_symlinks=False).st_mode
                if stat.S_ISREG(mode):
                    tree.files[rel] = item.stat(follow_symlinks=False).st_size
                elif stat.S_ISDIR(mode):
                    tree.dirs.add(rel)
                    if rel.count("/") < 8:
                        pending.append(rel)
                else:
                    tree.others[rel] = kind_of(mode)
    return tree


def _list_remote(fs: pafs.FileSystem, root: str) -> Tree:
    tree = Tree()
    infos = fs.get_file_info(pafs.FileSelector(root, recursive=True))
    for info in infos[: _MAX_ENTRIES + 1]:
        rel = info.path[len(root) + 1 :]
        if info.type == pafs.FileType.File:
            tree.files[rel] = int(info.size or 0)
        elif info.type == pafs.FileType.Directory:
            tree.dirs.add(rel)
        else:
            tree.others[rel] = "not a regular file"
    if len(infos) > _MAX_ENTRIES:
        tree.problems.append(f"holds more than {_MAX_ENTRIES} entries: not a checkpoint")
    return tree


def read_capped(fs: pafs.FileSystem, path: str, local: bool, cap: int) -> bytes:
    """At most ``cap + 1`` bytes of a regular file (so that a caller sees it is too big); a link,
    FIFO or device is a CheckpointError, and never blocks or is followed."""
    with open_file(fs, path, local) as stream:
        return bytes(stream.read(cap + 1))


def open_file(fs: pafs.FileSystem, path: str, local: bool) -> Any:
    """A file of a checkpoint opened for reading: locally, a regular file only (see ``open_regular``)."""
    if local:
        return open_regular(path, printable(path.rsplit("/", 1)[-1]))
    return fs.open_input_stream(path)


def sha256_of(fs: pafs.FileSystem, path: str, local: bool, size: int) -> tuple[str, bool]:
    """The SHA-256 of a file's first ``size`` bytes, and whether it holds exactly that many."""
    return digest_of(fs, path, local, size, "sha256")


def digest_of(fs: pafs.FileSystem, path: str, local: bool, size: int, algorithm: str) -> tuple[str, bool]:
    """The digest (``sha256`` or ``blake3``) of a file's first ``size`` bytes, and whether it holds
    exactly that many."""
    digest = new_digest(algorithm)
    left = size
    with open_file(fs, path, local) as stream:
        while left > 0:
            chunk = stream.read(min(_CHUNK, left))
            if not chunk:
                return digest.hexdigest(), False
            digest.update(chunk)
            left -= len(chunk)
        exact = not stream.read(1)
    return digest.hexdigest(), exact


def read_manifest(fs: pafs.FileSystem, root: str, local: bool) -> tuple[Manifest, dict[str, Any]]:
    """The manifest of the checkpoint at ``root``, bounded and validated; CheckpointError if none."""
    try:
        raw = read_capped(fs, f"{root}/{MANIFEST}", local, MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        raise CheckpointError(f"{MANIFEST} is missing (incomplete or interrupted save)") from None
    except OSError as err:
        raise CheckpointError(f"{MANIFEST} is unreadable: {err}") from None
    return parse_manifest(raw)


def verify_tree(
    fs: pafs.FileSystem,
    root: str,
    local: bool,
    *,
    safe_load: bool = True,
    schemas: Mapping[str, ComponentSchemas] | None = None,
    cipher: FileCipher | None = None,
    contents: bool = True,
) -> Verification:
    """Check the checkpoint directory at ``root`` (see the module docstring); never raises for
    anything the checkpoint holds, only lists problems.

    An encrypted checkpoint (``checkpoint.encryption``) is checked the same way through step 4 (the
    manifest hashes its ciphertext); steps 5 and 6 read its plaintext with ``cipher``, whose key
    must be the one the manifest names. Without ``cipher`` they are a problem, or with ``contents``
    False skipped: the hashes alone are what ``trainforge ckpt verify`` checks without a key."""
    where = Path(root)
    manifest: dict[str, Any] | None = None
    try:
        kind = fs.get_file_info(root).type
        if kind != pafs.FileType.Directory:
            missing = kind == pafs.FileType.NotFound
            return _invalid(where, [f"{root} {'does not exist' if missing else 'is not a directory'}"], None)
        tree = list_tree(fs, root, local)
        schema, manifest = read_manifest(fs, root, local)
        problems = tree.problems + _file_set_problems(schema, tree)
        if not problems:
            problems = _hash_problems(fs, root, local, schema)
        if not problems and schema.encryption is not None and cipher is None:
            if contents:
                text = f"encrypted ({schema.encryption.scheme}, key {schema.encryption.key_id}): {ENCRYPTED_HINT}"
                return Verification(where, (Problem(KEY, text),), manifest)
            return _invalid(where, problems, manifest)
        if not problems:
            raw = read_capped(fs, f"{root}/{STATE_FILE}", local, MAX_STATE_BYTES + OVERHEAD)
            if schema.encryption is not None and cipher is not None:
                cipher.check_key(schema.encryption, "the checkpoint")
                raw = cipher.open_bytes(STATE_FILE, raw)
            saved_from(raw, schema.layout, set(schema.files), schemas)
            if safe_load:
                refusal = _load_refusal(fs, root, local, schema, cipher)
                problems = [refusal] if refusal else []
    except CheckpointError as err:
        return Verification(where, (problem_of(err),), manifest)
    except OSError as err:  # storage unreachable, permission denied, the directory vanished
        return Verification(where, (Problem(UNREADABLE, f"unreadable: {printable(str(err))}"),), manifest)
    return _invalid(where, problems, manifest)


def _invalid(where: Path, problems: list[str], manifest: dict[str, Any] | None) -> Verification:
    return Verification(where, tuple(Problem(INVALID, text) for text in problems), manifest)


def _file_set_problems(manifest: Manifest, tree: Tree) -> list[str]:
    """Exactly the listed files, each a regular file of its declared size; checked before hashing."""
    problems = []
    for rel, entry in sorted(manifest.files.items()):
        if rel in tree.others:
            problems.append(f"{rel} is {tree.others[rel]}, not a regular file")
        elif rel not in tree.files:
            problems.append(f"{rel} is missing")
        elif tree.files[rel] != entry.size:
            problems.append(f"{rel} has {tree.files[rel]} bytes, manifest says {entry.size} (truncated or overwritten)")
    listed = set(manifest.files) | {MANIFEST}
    parents = {rel.rsplit("/", 1)[0] for rel in manifest.files if "/" in rel}
    parents |= {p.rsplit("/", i)[0] for p in parents for i in range(1, p.count("/") + 1)}
    for rel in sorted(parents & tree.others.keys()):
        # sharded/ as a link would let a checkpoint's shards live anywhere: it must be a directory.
        problems.append(f"{rel}/ is {tree.others[rel]}, not a directory")
    for rel in sorted({*tree.files, *tree.others} - listed - parents):
        if is_checkpoint_name(rel):
            what = f" ({tree.others[rel]})" if rel in tree.others else ""
            problems.append(f"{rel} is not listed in the manifest (unexpected file){what}")
    for rel in sorted(tree.dirs - parents):
        if is_checkpoint_name(rel):
            problems.append(f"{rel}/ is not listed in the manifest (unexpected directory)")
    return problems


def _hash_problems(fs: pafs.FileSystem, root: str, local: bool, manifest: Manifest) -> list[str]:
    problems = []
    for rel, entry in sorted(manifest.files.items()):
        digest, exact = digest_of(fs, f"{root}/{rel}", local, entry.size, manifest.hash)
        if not exact:
            problems.append(f"{rel} changed size while it was read (truncated or overwritten)")
        elif digest != entry.hexdigest:
            problems.append(f"{rel} fails its {LABELS[manifest.hash]} check (corrupted)")
    return problems


def _load_refusal(
    fs: pafs.FileSystem, root: str, local: bool, manifest: Manifest, cipher: FileCipher | None
) -> str | None:
    """Why a checkpoint whose files verify still must not be loaded (a hostile ``.pt`` file, or
    a sharded checkpoint's metadata that would unpickle objects or read outside its shards)."""
    if manifest.layout == SHARDED:
        from trainforge.checkpoint.dcp_metadata import MAX_METADATA_BYTES, metadata_refusal  # torch

        raw = read_capped(fs, f"{root}/{SHARDED_METADATA}", local, MAX_METADATA_BYTES + OVERHEAD)
        if manifest.encryption is not None and cipher is not None:
            raw = cipher.open_bytes(SHARDED_METADATA, raw)
        # Sizes as the plaintext has them: DCP's byte ranges point into the decrypted shards.
        less = OVERHEAD if manifest.encryption is not None else 0
        refusal = metadata_refusal(raw, {rel: entry.size - less for rel, entry in manifest.files.items()})
        if refusal:
            return refusal
    if manifest.encryption is not None and cipher is not None:
        return _authentication_refusal(fs, root, local, manifest, cipher)
    from trainforge.checkpoint.state import check_loadable  # torch: only once the files verified

    files = [rel for rel in manifest.files if rel.endswith((".pt", ".safetensors"))]
    if local:
        return check_loadable(Path(root), files)
    with tempfile.TemporaryDirectory(prefix="trainforge-check-") as scratch:
        local_copy = Path(scratch) / "checkpoint"
        for rel in files:
            (local_copy / rel).parent.mkdir(parents=True, exist_ok=True)
            pafs.copy_files(f"{root}/{rel}", str(local_copy / rel), fs, pafs.LocalFileSystem())
        return check_loadable(local_copy, files)


class _Discard:
    """A sink for decrypted bytes that only authentication needs."""

    def write(self, data: bytes) -> int:
        return len(data)


def _authentication_refusal(
    fs: pafs.FileSystem, root: str, local: bool, manifest: Manifest, cipher: FileCipher
) -> str | None:
    """An encrypted checkpoint's safe-load check: every file decrypts and authenticates under the
    key (the bytes are a key holder's, as written; decrypted into nothing, so no plaintext is
    stored). Its tensors load with ``weights_only`` and safetensors when restore reads them."""
    for rel, entry in sorted(manifest.files.items()):
        path = f"{root}/{rel}"
        try:
            with open_file(fs, path, True) if local else fs.open_input_file(path) as source:
                cipher.open_stream(rel, source, entry.size, _Discard())  # type: ignore[arg-type]
        except CheckpointError as err:
            return str(err)
    return None


def local_encryption(directory: Path) -> Encryption | None:
    """The encryption record of the local checkpoint at ``directory`` (None: plaintext, or no
    manifest that parses; verification has said so already)."""
    try:
        return read_manifest(pafs.LocalFileSystem(), str(directory), True)[0].encryption
    except (CheckpointError, OSError):
        return None
