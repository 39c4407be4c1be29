"""Asynchronous saving, rotation and restore-candidate selection for one run's checkpoints.

The training step only pays for copying the state to host memory (``Snapshot``). Writing,
hashing, committing and rotating happen on one background thread, with at most one save in
flight: a new save first waits for the previous one.
"""

from __future__ import annotations

import logging
import math
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainforge.checkpoint.format import MANIFEST, write_manifest_of
from trainforge.checkpoint.state import TrainerState, write_state
from trainforge.checkpoint.storage import CheckpointStore, Entry, checkpoint_name

log = logging.getLogger("trainforge.checkpoint")
LEFTOVER_MARGIN_S = 5.0


@dataclass
class Snapshot:
    """Host copies of everything a checkpoint holds, taken at one step."""

    step: int
    epoch: int
    model_state: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any]
    trainer_state: TrainerState
    extra: dict[str, Any] = field(default_factory=dict)  # more torch files by name (sync.pt)


@dataclass
class SaveOutcome:
    """What happened to one save, collected by the training thread at its next report."""

    step: int
    name: str
    uri: str | None = None
    error: str | None = None
    seconds: float = 0.0
    size_bytes: int = 0


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
class CheckpointManager:
    """Owned by rank 0: saves in the background and reports outcomes when asked."""

    store: CheckpointStore
    policy: RotationPolicy
    scratch: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="trainforge-ckpt-")))
    _thread: threading.Thread | None = None
    _done: list[SaveOutcome] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    # Verification reads every byte: its verdict per checkpoint, keyed by the manifest's identity.
    _verified: dict[str, tuple[tuple[int | None, int | None], bool]] = field(default_factory=dict)
    _started: float = field(default_factory=time.time)
    _cleaned: bool = False

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
        """Saves that finished (or failed) since the last call, oldest first."""
        with self._lock:
            done, self._done = self._done, []
        return done

    def record(self, outcome: SaveOutcome) -> None:
        """A save written by the ranks themselves (a sharded checkpoint, committed by rank 0 on the
        training thread): reported at the next ``collect``; if it succeeded, it counts as verified
        and rotation runs in the background, as after a save of this manager's own."""
        self.wait()
        if outcome.error is not None:
            with self._lock:
                self._done.append(outcome)
            return
        self._thread = threading.Thread(
            target=self._after_commit, args=(outcome,), name="trainforge-rotate", daemon=True
        )
        self._thread.start()

    def _after_commit(self, outcome: SaveOutcome) -> None:
        self._clean_leftovers()
        try:
            self._remember_verified(outcome.name)
            self.rotate(keep_also=outcome.name)
        except Exception as err:  # storage errors while listing or deleting
            log.warning("rotation after saving %s failed (older checkpoints kept): %s", outcome.name, err)
        with self._lock:
            self._done.append(outcome)

    def _save(self, snapshot: Snapshot) -> None:
        name = checkpoint_name(snapshot.step)
        started = time.perf_counter()
        staging: Path | None = None
        self._clean_leftovers()
        try:
            staging = self.store.staging_dir(name, self.scratch)
            # Every file is hashed while written and fsynced: the manifest vouches for durable bytes.
            files = write_state(
                staging, snapshot.model_state, snapshot.optimizer_state, snapshot.trainer_state, extra=snapshot.extra
            )
            meta = {
                "global_step": snapshot.step,
                "epoch": snapshot.epoch,
                "metrics": snapshot.trainer_state.metrics,
                "created_at": time.time(),
                "world_size": snapshot.trainer_state.progress.world_size,
            }
            manifest = write_manifest_of(staging, files, meta)
            self.store.commit(staging, name)
            size = sum(int(f["size"]) for f in manifest["files"].values())
            outcome = SaveOutcome(snapshot.step, name, self.store.uri(name), None, time.perf_counter() - started, size)
        except Exception as err:  # disk full, permission denied, storage unreachable: reported, not raised
            log.error("checkpoint save at step %d failed: %s", snapshot.step, err)
            if staging is not None:
                try:
                    self.store.discard(staging, name)
                except Exception as cleanup_err:
                    log.warning("could not clean up the failed save of %s: %s", name, cleanup_err)
            reason = f"{type(err).__name__}: {err}"
            outcome = SaveOutcome(snapshot.step, name, None, reason, time.perf_counter() - started)
        else:
            # Committed is committed: a failure to rotate costs disk space, not the save.
            self._remember_verified(name)
            try:
                self.rotate(keep_also=name)
            except Exception as err:  # storage errors while listing or deleting
                log.warning("rotation after saving %s failed (older checkpoints kept): %s", name, err)
        with self._lock:
            self._done.append(outcome)

    def _clean_leftovers(self) -> None:
        """Once, before this manager's first save: remove staging dirs of saves that crashed before
        it started (never one changed since, which may be a save still in flight elsewhere)."""
        if self._cleaned:
            return
        self._cleaned = True
        try:
            # A margin for coarse file-system clocks: a dir created just after this manager
            # started may carry a time stamp a few milliseconds before it.
            removed = self.store.clean_leftovers(older_than=self._started - LEFTOVER_MARGIN_S)
        except OSError as err:
            log.warning("could not remove the staging dirs of crashed saves: %s", err)
            return
        if removed:
            log.info("removed staging dirs of saves that never completed: %s", ", ".join(removed))

    def _manifest_key(self, name: str) -> tuple[int | None, int | None]:
        info = self.store.fs.get_file_info(f"{self.store.path(name)}/{MANIFEST}")
        return info.mtime_ns, info.size

    def _remember_verified(self, name: str) -> None:
        """This manager just wrote and hashed ``name``: valid without reading it back."""
        self._verified[name] = (self._manifest_key(name), True)

    def is_verified(self, name: str) -> bool:
        """Whether checkpoint ``name`` verifies; checked once per version of its manifest."""
        key = self._manifest_key(name)
        cached = self._verified.get(name)
        if cached is not None and cached[0] == key:
            return cached[1]
        check = self.store.verify(name)
        if not check.ok:
            log.warning("rotation keeps invalid %s out of the count: %s", name, "; ".join(check.problems))
        self._verified[name] = (key, check.ok)
        return check.ok

    def rotate(self, keep_also: str) -> list[str]:
        """Delete verified checkpoints the policy does not keep; never the one just written. Returns
        what went.

        Only verified checkpoints count toward ``keep_last``: after a walk-back past a corrupt
        newest one, the corrupt one must not push the last valid copies out. Directories that do
        not verify are never deleted here (a concurrent writer, or evidence for ``ckpt list``).
        """
        entries = self.store.entries()
        valid = [e for e in entries if e.name == keep_also or self.is_verified(e.name)]
        manifests = {}
        for entry in valid:
            manifest, _ = self.store.read_manifest(entry.name)
            manifests[entry.name] = manifest or {}
        kept = self.policy.keep(valid, manifests) | {keep_also}
        removed = []
        for entry in valid:
            if entry.name not in kept:
                self.store.delete(entry.name)
                self._verified.pop(entry.name, None)
                removed.append(entry.name)
        return removed

    def close(self) -> None:
        self.wait()
        shutil.rmtree(self.scratch, ignore_errors=True)
