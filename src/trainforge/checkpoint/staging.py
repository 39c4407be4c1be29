"""One checkpoint being written: every rank puts its files into one staging directory, rank 0
commits it (``trainer_state.json``, then the manifest last, then the checkpoint appears).

Both layouts go through here: in the full layout rank 0 writes the shared tensor files and every
rank its own state (``ranks/<rank>/...``); in the sharded layout every rank also writes its DCP
shards (``sharded/``). Every file is hashed while written and fsynced before its rank reports it.

On a local or NFS store the ranks write into one shared staging directory beside the checkpoints,
which rank 0 renames. On an object store each rank writes to local scratch and uploads its files to
the staging prefix; rank 0 uploads ``trainer_state.json`` and the manifest, then copies the staging
prefix to the checkpoint's (server-side copies, the manifest last) and deletes the staging prefix.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainforge.checkpoint.crypto import FileCipher
from trainforge.checkpoint.format import write_json_hashed, write_manifest_of
from trainforge.checkpoint.hashing import DEFAULT_HASH, FileRecord, Sealing
from trainforge.checkpoint.schema import MANIFEST, SHARDED_DIR, STATE_FILE
from trainforge.checkpoint.storage import CheckpointStore, fsync_path
from trainforge.errors import CheckpointError

if TYPE_CHECKING:
    from torch.distributed.checkpoint.filesystem import FileSystemWriter


class StagedSave:
    """This rank's part of one checkpoint, in the staging directory ``staging_name`` of ``store``."""

    def __init__(
        self,
        store: CheckpointStore,
        staging_name: str,
        rank: int,
        *,
        algorithm: str = DEFAULT_HASH,
        scratch: Path | None = None,
        threads: int = 1,
        cipher: FileCipher | None = None,
    ) -> None:
        self.store = store
        self.cipher = cipher  # checkpoint.encryption: every file but the manifest encrypted
        self.rank = rank
        self.algorithm = algorithm
        self.threads = threads
        self.staging_name = staging_name
        scratch = scratch or Path(tempfile.gettempdir()) / "trainforge-staging"
        base = Path(store.root) if store.is_local else scratch / f"rank{rank}"
        self.staging = base / staging_name
        self.staging.mkdir(parents=True, exist_ok=True)
        self._shards: Any = None

    def write(self, rel: str, write: Callable[[Path, Sealing | None], FileRecord]) -> FileRecord:
        """``write(path, sealer)`` writes (hashing, fsyncing, encrypting with ``sealer`` when the
        checkpoint is encrypted) the file ``rel``; published to the staging prefix."""
        path = self.staging / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        record = write(path, self.sealer(rel))
        self._publish({rel: record})
        return record

    def storage_writer(self) -> FileSystemWriter:
        """DCP's file system writer into ``<staging>/sharded/``, hashing every file as it is written."""
        from trainforge.checkpoint.sharded import shard_writer  # torch.distributed.checkpoint: sharded only

        self._shards = shard_writer(self.staging / SHARDED_DIR, self.algorithm, self.threads, self.cipher)
        return self._shards

    def shard_files(self) -> dict[str, FileRecord]:
        """After ``dcp.save``: this rank's shard files (rank 0's include ``sharded/.metadata``),
        fsynced and (on an object store) uploaded to the staging prefix."""
        if self._shards is None:
            return {}
        records = {f"{SHARDED_DIR}/{rel}": record for rel, record in self._shards.written().items()}
        self._publish(records)
        return records

    def commit(
        self, all_files: dict[str, dict[str, Any]], state: dict[str, Any], meta: dict[str, Any]
    ) -> dict[str, Any]:
        """Rank 0, once every rank's files were gathered: write ``trainer_state.json`` (``state``,
        hashed while written), the manifest (``meta`` plus every file) last, and make the checkpoint
        visible; the manifest."""
        name = str(meta["name"])
        files = {rel: FileRecord(int(entry["size"]), str(entry["digest"])) for rel, entry in all_files.items()}
        files[STATE_FILE] = write_json_hashed(self.staging / STATE_FILE, state, self.algorithm, self.sealer(STATE_FILE))
        manifest_meta = {k: v for k, v in meta.items() if k not in ("name", "layout")}
        if self.cipher is not None:
            manifest_meta["encryption"] = self.cipher.record()
        manifest = write_manifest_of(
            self.staging, files, manifest_meta, algorithm=self.algorithm, layout=meta["layout"]
        )
        if self.store.is_local:
            for directory in sorted((p for p in self.staging.rglob("*") if p.is_dir()), reverse=True):
                fsync_path(directory)
            self.store.commit(self.staging, name)
        else:
            self.store.upload(self.staging / STATE_FILE, self.staging_name, STATE_FILE)
            self.store.upload(self.staging / MANIFEST, self.staging_name, MANIFEST)
            shutil.rmtree(self.staging, ignore_errors=True)
            self.store.promote(self.staging_name, name)
        return manifest

    def sealer(self, rel: str) -> Sealing | None:
        return self.cipher.sealer(rel) if self.cipher is not None else None

    def abort(self) -> None:
        """Remove what a failed save left: rank 0 the staging directory (or prefix); every rank its
        local scratch on an object store."""
        if not self.store.is_local:
            shutil.rmtree(self.staging, ignore_errors=True)
        if self.rank == 0:
            self.store.discard_staging(self.staging_name)

    def release(self) -> None:
        """A rank other than 0, its files published: on an object store its local copies go."""
        if not self.store.is_local:
            shutil.rmtree(self.staging, ignore_errors=True)

    def _publish(self, records: dict[str, FileRecord]) -> None:
        """On an object store, upload this rank's files to the staging prefix (local: written in place)."""
        if not self.store.is_local:
            for rel in sorted(records):
                self.store.upload(self.staging / rel, self.staging_name, rel)


def merge_files(per_rank: Iterable[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Every rank's files as one table; two ranks claiming one file is an error."""
    merged: dict[str, dict[str, Any]] = {}
    for files in per_rank:
        for rel, entry in files.items():
            if rel in merged:
                raise CheckpointError(f"two ranks wrote {rel}")
            merged[rel] = entry
    return merged
