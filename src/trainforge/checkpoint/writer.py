"""Saving checkpoints in the background, on every rank, and rotating them (rank 0).

The one save path, for both layouts. The training thread only pays for the host copies of the
state (``Snapshot``). Then, on a thread of every rank, over a process group of the writers' own
(so that its collectives never interleave with the training's):

1. rank 0 names the staging directory (a broadcast);
2. each rank writes its files into it, hashed and fsynced: in the full layout rank 0 the shared
   tensors (``<component>.safetensors`` or ``.pt``), in the sharded layout every rank its
   DCP shards; every rank its own tensor state (``ranks/<rank>/...``);
3. the ranks gather their file records and their own JSON state (RNG) on rank 0;
4. rank 0 writes ``trainer_state.json``, the manifest last, commits, and rotates.

At most one save is in flight per rank: a new save first waits for the previous one, on every rank
alike, so the writers' collectives always pair up. Failures are reported (``collect``, rank 0),
never raised into the training thread; a rotation error does not fail a committed save.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from pathlib import Path
from stat import S_ISDIR
from typing import Any, Protocol

import pyarrow.fs as pafs
import torch.distributed as dist

from trainforge.checkpoint.crypto import FileCipher
from trainforge.checkpoint.hashing import DEFAULT_HASH, FileRecord, in_parallel
from trainforge.checkpoint.names import parse_checkpoint_name, staging_name
from trainforge.checkpoint.schema import FORMAT_VERSION, SHARDED, ComponentSchemas, rank_path
from trainforge.checkpoint.staging import StagedSave, merge_files
from trainforge.checkpoint.state import Snapshot, tensor_file, write_tensors
from trainforge.checkpoint.storage import CheckpointStore, Entry, checkpoint_name

log = logging.getLogger("trainforge.checkpoint")
LEFTOVER_MARGIN_S = 5.0


@dataclass
class SaveOutcome:
    """What happened to one save, collected by the training thread at its next report."""

    step: int
    name: str
    uri: str | None = None
    error: str | None = None
    seconds: float = 0.0
    size_bytes: int = 0


class Collectives(Protocol):
    """What a save needs of the ranks: rank 0's choice for all, and every rank's part on rank 0."""

    rank: int
    world: int
    process_group: Any  # for torch.distributed.checkpoint; None: the default group (or none at all)

    def broadcast(self, obj: Any) -> Any: ...
    def gather(self, obj: Any) -> list[Any] | None: ...


@dataclass
class Alone:
    """The collectives of a single writer."""

    rank: int = 0
    world: int = 1
    process_group: Any = None

    def broadcast(self, obj: Any) -> Any:
        return obj

    def gather(self, obj: Any) -> list[Any] | None:
        return [obj]


class SaveGroup:
    """The writers' own gloo process group over every rank (created collectively), so that a save's
    collectives run on the save thread without ever meeting the training's on the default group."""

    def __init__(self, timeout_s: float) -> None:
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.process_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=math.ceil(timeout_s)))

    def broadcast(self, obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.process_group)
        return box[0]

    def gather(self, obj: Any) -> list[Any] | None:
        found: list[Any] | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object(obj, found, dst=0, group=self.process_group)
        return found


def save_group(timeout_s: float) -> Collectives:
    """Every rank: the save's collectives (a gloo group of its own when there are several ranks)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return SaveGroup(timeout_s)
    return Alone()


@dataclass
class RotationPolicy:
    """Keep the newest ``keep_last``, plus the best by ``metric`` when one is given.

    Both are chosen among verified checkpoints only (the caller passes those). A metric that is not
    a finite number (NaN, a string) never makes a checkpoint the best.
    """

    keep_last: int
    metric: str | None = None
    mode: str = "min"

    def keep(self, entries: list[Entry], manifests: dict[str, dict[str, Any]]) -> set[str]:
        kept = {e.name for e in entries[-self.keep_last :]} if self.keep_last > 0 else set()
        if self.metric:
            scored = []
            for entry in entries:
                metrics = manifests.get(entry.name, {}).get("metrics")
                value = metrics.get(self.metric) if isinstance(metrics, dict) else None
                if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                    scored.append((float(value), entry.name))
            if scored:
                best = min(scored) if self.mode == "min" else max(scored)
                kept.add(best[1])
        return kept


@dataclass
class CheckpointWriter:
    """One per rank: writes this rank's part of every save on a background thread; rank 0 also
    commits, rotates and reports outcomes. ``schemas``: the components' state schemas, for the
    verification that rotation runs."""

    store: CheckpointStore
    policy: RotationPolicy
    group: Collectives = field(default_factory=Alone)
    schemas: Mapping[str, ComponentSchemas] | None = None
    # Where an object store's files are written before they are uploaded; made at the first such save
    # (a local store stages beside its checkpoints and needs none), removed by close.
    scratch: Path | None = None
    algorithm: str = DEFAULT_HASH
    cipher: FileCipher | None = None  # checkpoint.encryption
    _thread: threading.Thread | None = None
    _done: list[SaveOutcome] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    # Checkpoints restore passed over (they did not verify, or verified but did not load into this
    # run's model): never counted by rotation, never deleted by it.
    passed_over: set[str] = field(default_factory=set)
    # Checkpoints rotation keeps besides those its policy keeps (train.early_stopping's best pass,
    # with restore_best); the training thread replaces the set, the save thread reads it.
    keep: set[str] = field(default_factory=set)
    # Verification reads every byte: its verdict per checkpoint, kept while no file of the
    # checkpoint changed (the size and modification time of each, the manifest's included).
    _verified: dict[str, tuple[Signature, bool]] = field(default_factory=dict)
    _started: float = field(default_factory=time.time)
    _cleaned: bool = False

    @property
    def rank(self) -> int:
        return self.group.rank

    def save_async(self, snapshot: Snapshot) -> float:
        """Start writing ``snapshot``; returns seconds spent waiting for the previous save."""
        started = time.perf_counter()
        self.wait()
        waited = time.perf_counter() - started
        self._thread = threading.Thread(target=self._save, args=(snapshot,), name="trainforge-save", daemon=True)
        self._thread.start()
        return waited

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def collect(self) -> list[SaveOutcome]:
        """Saves that finished (or failed) since the last call, oldest first (rank 0; [] elsewhere)."""
        with self._lock:
            done, self._done = self._done, []
        return done

    def close(self) -> None:
        self.wait()
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)

    def _scratch(self) -> Path | None:
        if self.store.is_local:
            return None
        if self.scratch is None:
            self.scratch = Path(tempfile.mkdtemp(prefix="trainforge-ckpt-"))
        return self.scratch

    # -- the save thread ---------------------------------------------------------------------

    def _save(self, snapshot: Snapshot) -> None:
        name = checkpoint_name(snapshot.step)
        started = time.perf_counter()
        if self.rank == 0:
            self._clean_leftovers()
        try:
            outcome = self._write(snapshot, name, started)
        except Exception as err:  # the writers' collectives themselves failed (a rank is gone)
            log.error("checkpoint save at step %d failed: %s", snapshot.step, err)
            outcome = SaveOutcome(snapshot.step, name, None, f"{type(err).__name__}: {err}", 0.0)
        if outcome is None:
            return
        outcome.seconds = time.perf_counter() - started
        if outcome.error is None:
            # Committed is committed: a failure to rotate costs disk space, not the save.
            try:
                self.passed_over.discard(name)  # written anew by this run (the bad one was set aside)
                self._remember_verified(name)
                self.rotate(keep_also=name)
            except Exception as err:  # storage errors while listing or deleting
                log.warning("rotation after saving %s failed (older checkpoints kept): %s", name, err)
        with self._lock:
            self._done.append(outcome)

    def _write(self, snapshot: Snapshot, name: str, started: float) -> SaveOutcome | None:
        """Steps 1-4 of the module docstring; rank 0's outcome (None on the other ranks)."""
        staging = StagedSave(
            self.store,
            str(self.group.broadcast(staging_name(name) if self.rank == 0 else None)),
            self.rank,
            algorithm=self.algorithm,
            scratch=self._scratch(),
            cipher=self.cipher,
        )
        files: dict[str, dict[str, Any]] = {}
        error: str | None = None
        try:
            files = {rel: record.to_json() for rel, record in self._write_files(staging, snapshot).items()}
        except Exception as err:  # disk full, permission denied, storage unreachable: reported, not raised
            error = f"{type(err).__name__}: {err}"
            error = f"rank {self.rank}: {error}" if self.group.world > 1 else error
        mine = {n: s.rank_values for n, s in snapshot.states.items() if s.rank_values is not None}
        gathered = self.group.gather((files, mine, error))
        if gathered is None:  # not rank 0: its part is written (and, to an object store, uploaded)
            staging.release()
            return None
        errors = [e for _, _, e in gathered if e]
        outcome = SaveOutcome(snapshot.step, name)
        if errors:
            log.error("checkpoint save at step %d failed: %s", snapshot.step, errors[0])
            outcome.error = errors[0]
            self._abort(staging)
            return outcome
        try:
            merged = merge_files(rank_files for rank_files, _, _ in gathered)
            state = state_file(snapshot, [ranks for _, ranks, _ in gathered], merged)
            meta = {
                "name": name,
                "layout": snapshot.layout,
                "global_step": snapshot.step,
                "epoch": snapshot.epoch,
                "metrics": snapshot.record.metrics if snapshot.record else {},
                "created_at": time.time(),
                "world_size": snapshot.world,
            }
            manifest = staging.commit(merged, state, meta)
            outcome.uri = self.store.uri(name)
            outcome.size_bytes = sum(int(entry["size"]) for entry in manifest["files"].values())
        except Exception as err:
            log.error("checkpoint save at step %d failed: %s", snapshot.step, err)
            outcome.error = f"{type(err).__name__}: {err}"
            self._abort(staging)
        return outcome

    def _write_files(self, staging: StagedSave, snapshot: Snapshot) -> dict[str, FileRecord]:
        """This rank's files of the checkpoint, each hashed and fsynced (and uploaded)."""
        records: dict[str, FileRecord] = {}
        shared = {n: s.tensors for n, s in snapshot.states.items() if s.tensors is not None}
        if snapshot.layout == SHARDED:
            if shared:  # a collective: every rank writes its shards, rank 0 the metadata
                import torch.distributed.checkpoint as dcp  # sharded runs only (0.5 s of a worker's start)

                dcp.save(shared, storage_writer=staging.storage_writer(), process_group=self.group.process_group)
                records.update(staging.shard_files())
            shared = {}
        jobs = {}
        if self.rank == 0:
            for component, tree in shared.items():
                jobs[tensor_file(component, tree)] = tree
        for component, weights in snapshot.full_weights.items():
            jobs[f"{component}.safetensors"] = weights
        for component, state in snapshot.states.items():
            if state.rank_tensors is not None:
                jobs[rank_path(self.rank, component)] = state.rank_tensors
        written = in_parallel(partial(self._write_one, staging, rel, tree) for rel, tree in jobs.items())
        records.update(zip(jobs, written, strict=True))
        return records

    def _write_one(self, staging: StagedSave, rel: str, tree: Any) -> FileRecord:
        return staging.write(rel, lambda path, sealer: write_tensors(path, tree, self.algorithm, sealer))

    def _abort(self, staging: StagedSave) -> None:
        try:
            staging.abort()
        except Exception as cleanup_err:
            log.warning("could not clean up the failed save in %s: %s", staging.staging_name, cleanup_err)

    # -- rotation (rank 0) -------------------------------------------------------------------

    def _clean_leftovers(self) -> None:
        """Once, before this writer's first save: remove staging dirs of saves that crashed before
        it started (never one changed since, which may be a save still in flight elsewhere)."""
        if self._cleaned:
            return
        self._cleaned = True
        try:
            # A margin for coarse file-system clocks: a dir created just after this writer
            # started may carry a time stamp a few milliseconds before it.
            removed = self.store.clean_leftovers(older_than=self._started - LEFTOVER_MARGIN_S)
        except OSError as err:
            log.warning("could not remove the staging dirs of crashed saves: %s", err)
            return
        if removed:
            log.info("removed staging dirs of saves that never completed: %s", ", ".join(removed))

    def _signature(self, name: str) -> Signature:
        return file_signature(self.store, name)

    def _remember_verified(self, name: str) -> None:
        """This writer just wrote and hashed ``name``: valid without reading it back."""
        self._verified[name] = (self._signature(name), True)

    def is_verified(self, name: str) -> bool:
        """Whether checkpoint ``name`` verifies; read again whenever one of its files changed."""
        key = self._signature(name)
        cached = self._verified.get(name)
        if cached is not None and cached[0] == key:
            return cached[1]
        check = self.store.verify(name, schemas=self.schemas)
        if not check.ok:
            log.warning("rotation keeps invalid %s out of the count: %s", name, "; ".join(check.problems))
        self._verified[name] = (key, check.ok)
        return check.ok

    def rotate(self, keep_also: str) -> list[str]:
        """Delete verified checkpoints the policy does not keep; never the one just written. Returns
        what went.

        Only checkpoints of this run's own line count toward ``keep_last``, and only those are
        ever deleted:
        - ones that verify now (a verdict is reused only while none of the checkpoint's files
          changed): after a walk-back past a corrupt newest one, or a file corrupted after its save,
          the corrupt one must not push the last valid copies out;
        - not one restore passed over (``passed_over``: it verified but did not load into this
          run's model, a foreign checkpoint say);
        - not one of a later step than the one just written: it is not this run's history (a
          foreign checkpoint, or the line a walk-back left).
        Directories left out are never deleted here (a concurrent writer, or evidence for ``ckpt
        list``).
        """
        step = parse_checkpoint_name(keep_also)
        entries = [
            e
            for e in self.store.entries()
            if e.name == keep_also or (e.name not in self.passed_over and (step is None or e.step < step))
        ]
        valid = [e for e in entries if e.name == keep_also or self.is_verified(e.name)]
        manifests = {}
        for entry in valid:
            manifest, _ = self.store.read_manifest(entry.name)
            manifests[entry.name] = manifest or {}
        kept = self.policy.keep(valid, manifests) | {keep_also} | set(self.keep)
        removed = []
        for entry in valid:
            if entry.name not in kept:
                self.store.delete(entry.name)
                self._verified.pop(entry.name, None)
                removed.append(entry.name)
        return removed


Signature = tuple[tuple[str, int | None, int | None], ...]


def file_signature(store: CheckpointStore, name: str) -> Signature:
    """Every file under checkpoint ``name`` with its size and modification time: what changes when
    any byte of the checkpoint is written again (a flipped bit under an unchanged time stamp
    does not change it; restore and ``ckpt verify`` hash every byte)."""
    root = store.path(name)
    found: list[tuple[str, int | None, int | None]] = []
    if store.is_local:  # without following links, as verification reads
        for folder, dirs, files in os.walk(root, followlinks=False):
            for item in dirs + files:
                path = os.path.join(folder, item)
                with contextlib.suppress(OSError):
                    stat = os.lstat(path)
                    if not S_ISDIR(stat.st_mode):
                        found.append((path[len(root) :], stat.st_size, stat.st_mtime_ns))
        return tuple(sorted(found))
    selector = pafs.FileSelector(root, recursive=True, allow_not_found=True)
    for info in store.fs.get_file_info(selector):
        if info.type != pafs.FileType.Directory:
            found.append((info.path[len(root) :], info.size, info.mtime_ns))
    return tuple(sorted(found))


def state_file(snapshot: Snapshot, ranks: list[dict[str, dict[str, Any]]], files: Mapping[str, Any]) -> dict[str, Any]:
    """``trainer_state.json`` (format 3) of rank 0's snapshot, every rank's own state and the
    files the ranks wrote."""
    where: dict[str, dict[str, Any]] = {}
    for component, state in snapshot.states.items():
        entry: dict[str, Any] = {}
        if state.tensors is not None:
            entry["tensors"] = SHARDED if snapshot.layout == SHARDED else tensor_file(component, state.tensors)
        if rank_path(0, component) in files:
            entry["rank_tensors"] = True
        if entry:
            where[component] = entry
    exports = {
        target: f"{component}.safetensors"
        for target, component in snapshot.exports.items()
        if f"{component}.safetensors" in files
    }
    record = snapshot.record
    return {
        "format_version": FORMAT_VERSION,
        "global_step": snapshot.step,
        "epoch": snapshot.epoch,
        "world_size": snapshot.world,
        "layout": snapshot.layout,
        "plan": record.plan if record else "",
        "tensor_parallel": record.tensor_parallel if record else 1,
        "components": {component: dict(state.values) for component, state in snapshot.states.items()},
        "ranks": ranks,
        "files": where,
        "exports": exports,
        "metrics": record.metrics if record else {},
        "config": record.config if record else {},
        "versions": record.versions if record else {},
    }


__all__ = [
    "Alone",
    "CheckpointWriter",
    "Collectives",
    "RotationPolicy",
    "SaveOutcome",
    "save_group",
    "state_file",
]
