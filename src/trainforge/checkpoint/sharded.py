"""Sharded checkpoints: every rank writes its own shards (torch.distributed.checkpoint, DCP).

Layout (``"layout": "sharded"`` in the manifest)::

    checkpoint_000000100/
      manifest.json          written last, by rank 0: every rank's files with size and digest
      trainer_state.json     as in the full layout
      sharded/.metadata      DCP's metadata, written by the coordinator (rank 0)
      sharded/__<rank>_<n>.distcp   each rank's shards

How the worker saves (every rank, in this order; ``dcp.save`` and the gather are collectives)::

    staging = broadcast_object(staging_name(checkpoint_name(step)))        # rank 0 picks it
    save = ShardedSave(store, step, staging, rank, world)
    dcp.save(state, storage_writer=save.storage_writer())
    files = save.rank_files()                                               # fsynced / uploaded
    files |= save.write_full_model(full_weights)                            # optional, rank 0
    files = merge_files(all_gather_objects(files))
    if rank == 0:
        uri = save.commit(files, trainer_state)                             # manifest last
    (on an error anywhere: save.abort() on rank 0)

Every shard is hashed while DCP writes it (a hashing stream under DCP's own ``FileSystemWriter``)
and fsynced before its rank reports it, so the manifest only vouches for durable bytes. On a local
or NFS store the ranks write into one shared staging directory beside the checkpoints, which rank 0
renames. On an object store each rank writes to local scratch and uploads its files to the staging
prefix; rank 0 uploads ``trainer_state.json`` and the manifest, then copies the staging prefix to
the checkpoint's (server-side copies, the manifest last) and deletes the staging prefix.

Loading never unpickles arbitrary objects: DCP's ``.metadata`` is a pickle, read here with an
unpickler that admits DCP's metadata classes only, and non-tensor values load ``weights_only``.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Generator, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from trainforge.checkpoint.dcp_metadata import MAX_METADATA_BYTES, read_metadata
from trainforge.checkpoint.format import write_manifest_of
from trainforge.checkpoint.hashing import DEFAULT_HASH, FileRecord, HashingWriter
from trainforge.checkpoint.names import checkpoint_name
from trainforge.checkpoint.schema import (
    MANIFEST,
    MODEL_FILE,
    SHARDED,
    SHARDED_DIR,
    SHARDED_METADATA,
    STATE_FILE,
    open_regular,
)
from trainforge.checkpoint.state import TrainerState, write_safetensors, write_trainer_state
from trainforge.checkpoint.storage import CheckpointStore, fsync_path
from trainforge.errors import CheckpointError


class ShardedSave:
    """One sharded checkpoint, written by every rank into one staging directory."""

    def __init__(
        self,
        store: CheckpointStore,
        step: int,
        staging_name: str,
        rank: int,
        world: int,
        *,
        algorithm: str = DEFAULT_HASH,
        scratch: Path | None = None,
        threads: int = 1,
    ) -> None:
        self.store = store
        self.step = step
        self.name = checkpoint_name(step)
        self.rank = rank
        self.world = world
        self.algorithm = algorithm
        self.threads = threads
        self.staging_name = staging_name
        scratch = scratch or Path(tempfile.gettempdir()) / "trainforge-sharded"
        base = Path(store.root) if store.is_local else scratch / f"rank{rank}"
        self.staging = base / staging_name
        self._fs = _HashingFileSystem(algorithm)

    def storage_writer(self) -> FileSystemWriter:
        """DCP's file system writer into ``<staging>/sharded/``, hashing every file as it is written."""
        (self.staging / SHARDED_DIR).mkdir(parents=True, exist_ok=True)
        return _HashingWriter(self.staging / SHARDED_DIR, self._fs, self.threads)

    def rank_files(self) -> dict[str, dict[str, Any]]:
        """After ``dcp.save``: this rank's files ``{rel name: {size, digest}}``, fsynced (and, for an
        object store, uploaded to the staging prefix). Rank 0's include ``sharded/.metadata``."""
        records = {f"{SHARDED_DIR}/{rel}": record for rel, record in self._fs.written().items()}
        self._publish(records)
        return {rel: record.to_json() for rel, record in records.items()}

    def write_full_model(self, model_state: dict[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
        """Rank 0 (other ranks: nothing): the full, unsharded weights as ``model.safetensors`` beside
        the shards (a run's final checkpoint), hashed while written; ``{rel name: {size, digest}}``."""
        if self.rank != 0:
            return {}
        records = {MODEL_FILE: write_safetensors(self.staging / MODEL_FILE, model_state, self.algorithm)}
        self._publish(records)
        return {rel: record.to_json() for rel, record in records.items()}

    def commit(self, all_files: dict[str, dict[str, Any]], trainer_state: TrainerState) -> str:
        """Rank 0, once every rank's ``rank_files()`` were gathered: write ``trainer_state.json``
        (hashed while written), the manifest last, and make the checkpoint visible; its URI."""
        files = {rel: FileRecord(int(entry["size"]), str(entry["digest"])) for rel, entry in all_files.items()}
        files[STATE_FILE] = write_trainer_state(self.staging, trainer_state, self.algorithm)
        meta = {
            "global_step": self.step,
            "epoch": trainer_state.progress.epoch,
            "metrics": trainer_state.metrics,
            "created_at": time.time(),
            "world_size": self.world,
        }
        write_manifest_of(self.staging, files, meta, algorithm=self.algorithm, layout=SHARDED)
        if self.store.is_local:
            fsync_path(self.staging / SHARDED_DIR)
            self.store.commit(self.staging, self.name)
        else:
            self.store.upload(self.staging / STATE_FILE, self.staging_name, STATE_FILE)
            self.store.upload(self.staging / MANIFEST, self.staging_name, MANIFEST)
            shutil.rmtree(self.staging, ignore_errors=True)
            self.store.promote(self.staging_name, self.name)
        return self.store.uri(self.name)

    def abort(self) -> None:
        """Remove what a failed save left: rank 0 the staging directory (or prefix); every rank its
        local scratch on an object store."""
        if not self.store.is_local:
            shutil.rmtree(self.staging, ignore_errors=True)
        if self.rank == 0:
            self.store.discard_staging(self.staging_name)

    def _publish(self, records: dict[str, FileRecord]) -> None:
        """On an object store, upload this rank's files to the staging prefix (local: written in place)."""
        if not self.store.is_local:
            for rel in sorted(records):
                self.store.upload(self.staging / rel, self.staging_name, rel)


def merge_files(per_rank: Iterable[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Every rank's ``rank_files()`` as one table; two ranks claiming one file is an error."""
    merged: dict[str, dict[str, Any]] = {}
    for files in per_rank:
        for rel, entry in files.items():
            if rel in merged:
                raise CheckpointError(f"two ranks wrote {rel}")
            merged[rel] = entry
    return merged


def load_sharded(directory: Path, state: dict[str, Any]) -> None:
    """Load a verified sharded checkpoint into ``state`` in place (DCP reshards to this world size).
    Metadata is unpickled with an allow-list and non-tensor values load ``weights_only``."""
    dcp.load(state, storage_reader=_SafeReader(directory / SHARDED_DIR), planner=_SafeLoadPlanner())


# ---------------------------------------------------------------------------------------------
# Writing: DCP's FileSystemWriter over a file system whose streams hash what they write


class _HashingFileSystem(FileSystem):
    """DCP's local file system, but every stream opened for writing hashes its bytes; the records
    follow DCP's ``.metadata.tmp`` -> ``.metadata`` rename."""

    def __init__(self, algorithm: str) -> None:
        self.algorithm = algorithm
        self._records: dict[Path, FileRecord] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[io.IOBase, None, None]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        target = Path(path)
        writer = HashingWriter(target.open(mode), self.algorithm)
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


class _HashingWriter(FileSystemWriter):
    def __init__(self, path: Path, fs: _HashingFileSystem, threads: int) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=threads, overwrite=False)
        self.fs = fs


# ---------------------------------------------------------------------------------------------
# Reading without unpickling arbitrary objects


class _SafeReader(FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        with open_regular(Path(self.path) / ".metadata", SHARDED_METADATA) as handle:
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
