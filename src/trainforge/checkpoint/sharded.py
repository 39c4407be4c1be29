"""torch.distributed.checkpoint (DCP) for sharded checkpoints: shards hashed while written, read
without unpickling.

In the sharded layout (``"layout": "sharded"`` in the manifest) every rank writes its own shards of
the components' tensors into ``sharded/`` (``__<rank>_<n>.distcp``; rank 0 also DCP's ``.metadata``),
through :func:`shard_writer`: DCP's own ``FileSystemWriter`` over streams that hash every byte and
are fsynced before the rank reports them, so the manifest only vouches for durable bytes
(``checkpoint/writer.py`` runs the save, ``checkpoint/staging.py`` commits it).

Loading never unpickles arbitrary objects: DCP's ``.metadata`` is a pickle, read here with an
unpickler that admits DCP's metadata classes only, and non-tensor values load ``weights_only``.
"""

from __future__ import annotations

import contextlib
import io
import os
import threading
from collections.abc import Generator
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from trainforge.checkpoint.crypto import FileCipher
from trainforge.checkpoint.dcp_metadata import MAX_METADATA_BYTES, read_metadata
from trainforge.checkpoint.hashing import DEFAULT_HASH, FileRecord, HashingWriter
from trainforge.checkpoint.opened import CheckpointFiles, as_files
from trainforge.checkpoint.schema import SHARDED_DIR, SHARDED_METADATA
from trainforge.checkpoint.storage import fsync_path


def load_sharded(directory: Path | CheckpointFiles, state: dict[str, Any]) -> None:
    """Load a verified sharded checkpoint (its directory, or its files decrypted) into ``state`` in
    place (DCP reshards to this world size). Metadata is unpickled with an allow-list and non-tensor
    values load ``weights_only``."""
    dcp.load(state, storage_reader=_SafeReader(as_files(directory)), planner=_SafeLoadPlanner())


# ---------------------------------------------------------------------------------------------
# Writing: DCP's FileSystemWriter over a file system whose streams hash what they write


class _HashingFileSystem(FileSystem):
    """DCP's local file system, but every stream opened for writing hashes its bytes; the records
    follow DCP's ``.metadata.tmp`` -> ``.metadata`` rename."""

    def __init__(self, algorithm: str, cipher: FileCipher | None = None) -> None:
        self.algorithm = algorithm
        self.cipher = cipher
        self._records: dict[Path, FileRecord] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[io.IOBase, None, None]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        target = Path(path)
        sealer = None
        if self.cipher is not None:  # named as the file will be once DCP renamed .metadata.tmp
            sealer = self.cipher.sealer(f"{SHARDED_DIR}/{target.name.removesuffix('.tmp')}")
        writer = HashingWriter(target.open(mode), self.algorithm, sealer)
        try:
            yield writer
            # DCP fsyncs (sync_files) and closes the stream itself; make sure of both.
            if not writer.closed:
                writer.finish()
        finally:
            writer.close()
        with self._lock:
            self._records[target] = writer.record

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        super().rename(path, new_path)
        with self._lock:
            if Path(path) in self._records:
                self._records[Path(new_path)] = self._records.pop(Path(path))

    def rm_file(self, path: str | os.PathLike[str]) -> None:
        super().rm_file(path)
        with self._lock:
            self._records.pop(Path(path), None)

    def written(self) -> dict[str, FileRecord]:
        """Files written and still there, by name inside the directory, each fsynced again (cheap
        when DCP already did: nothing is left to flush)."""
        with self._lock:
            records = dict(self._records)
        found = {}
        for path, record in records.items():
            fsync_path(path)
            found[path.name] = record
        return found


def shard_writer(
    directory: Path, algorithm: str = DEFAULT_HASH, threads: int = 1, cipher: FileCipher | None = None
) -> ShardWriter:
    """DCP's file system writer into ``directory``, hashing (and with ``cipher`` encrypting) every
    file as it is written; its ``written()`` gives the files and their records once ``dcp.save``
    returned."""
    directory.mkdir(parents=True, exist_ok=True)
    return ShardWriter(directory, _HashingFileSystem(algorithm, cipher), threads)


class ShardWriter(FileSystemWriter):
    def __init__(self, path: Path, fs: _HashingFileSystem, threads: int) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=threads, overwrite=False)
        self.fs = fs  # DCP writes through this file system
        self.hashing = fs

    def written(self) -> dict[str, FileRecord]:
        return self.hashing.written()


# ---------------------------------------------------------------------------------------------
# Reading without unpickling arbitrary objects


class _CheckpointStreams(FileSystem):
    """DCP's reads, from a checkpoint's files by their names inside it (each a regular file)."""

    def __init__(self, files: CheckpointFiles) -> None:
        self.files = files

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[io.IOBase, None, None]:
        if mode != "rb":
            raise ValueError(f"a checkpoint's shards are only read (mode {mode!r})")
        with self.files.open(Path(path).as_posix()) as stream:
            yield cast(io.IOBase, stream)


class _SafeReader(FileSystemReader):
    def __init__(self, files: CheckpointFiles) -> None:
        super().__init__(SHARDED_DIR)  # a name inside the checkpoint: the streams resolve it
        self.fs = _CheckpointStreams(files)
        self.files = files

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        with self.files.open(SHARDED_METADATA) as handle:
            metadata = read_metadata(handle.read(MAX_METADATA_BYTES + 1))
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata


class _SafeLoadPlanner(DefaultLoadPlanner):
    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        # DCP's default unpickles non-tensor values with weights_only=False; a checkpoint is untrusted.
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def read_sharded_whole(directory: Path | CheckpointFiles, key: str) -> dict[str, Any]:
    """Component ``key``'s tensors in a verified sharded checkpoint, whole: every rank's shards
    read in this process, with no template and no process group (an export, a warm start). It
    holds the whole component in memory; a run's last save also has its full weights in a safetensors file."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    class _SafeWholePlanner(_EmptyStateDictLoadPlanner):
        load_bytes = _SafeLoadPlanner.load_bytes

    state: dict[str, Any] = {}
    reader = _SafeReader(as_files(directory))
    _load_state_dict(state, storage_reader=reader, planner=_SafeWholePlanner(keys={key}), no_dist=True)
    found = state.get(key)
    return dict(found) if isinstance(found, dict) else {}
