"""Asynchronous saving, rotation and restore-candidate selection for one run's checkpoints.

The training step only pays for copying the state to host memory (``Snapshot``). Writing,
hashing, committing and rotating happen on one background thread, with at most one save in
flight: a new save first waits for the previous one.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainforge.checkpoint.format import write_manifest
from trainforge.checkpoint.state import TrainerState, write_state
from trainforge.checkpoint.storage import CheckpointStore, Entry, checkpoint_name

log = logging.getLogger("trainforge.checkpoint")


@dataclass
class Snapshot:
    """Host copies of everything a checkpoint holds, taken at one step."""

    step: int
    epoch: int
    model_state: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any]
    trainer_state: TrainerState


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
    """Keep the newest ``keep_last``, plus the best by ``metric`` when one is given."""

    keep_last: int
    metric: str | None = None
    mode: str = "min"

    def keep(self, entries: list[Entry], manifests: dict[str, dict[str, Any]]) -> set[str]:
        newest = [e.name for e in entries[-self.keep_last :]]
        kept = set(newest)
        if self.metric:
            scored = [
                (float(m["metrics"][self.metric]), name)
                for name, m in manifests.items()
                if isinstance(m.get("metrics"), dict) and self.metric in m["metrics"]
            ]
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

    def _save(self, snapshot: Snapshot) -> None:
        name = checkpoint_name(snapshot.step)
        started = time.perf_counter()
        staging: Path | None = None
        try:
            staging = self.store.staging_dir(name, self.scratch)
            write_state(staging, snapshot.model_state, snapshot.optimizer_state, snapshot.trainer_state)
            meta = {
                "global_step": snapshot.step,
                "epoch": snapshot.epoch,
                "metrics": snapshot.trainer_state.metrics,
                "created_at": time.time(),
                "world_size": snapshot.trainer_state.progress.world_size,
            }
            manifest = write_manifest(staging, meta)
            self.store.commit(staging, name)
            size = sum(int(f["size"]) for f in manifest["files"].values())
            outcome = SaveOutcome(snapshot.step, name, self.store.uri(name), None, time.perf_counter() - started, size)
            self.rotate(keep_also=name)
        except Exception as err:  # disk full, permission denied, storage unreachable: reported, not raised
            log.error("checkpoint save at step %d failed: %s", snapshot.step, err)
            if staging is not None:
                try:
                    self.store.discard(staging, name)
                except Exception as cleanup_err:
                    log.warning("could not clean up the failed save of %s: %s", name, cleanup_err)
            reason = f"{type(err).__name__}: {err}"
            outcome = SaveOutcome(snapshot.step, name, None, reason, time.perf_counter() - started)
        with self._lock:
            self._done.append(outcome)

    def rotate(self, keep_also: str) -> list[str]:
        """Delete checkpoints the policy does not keep; never the one just written. Returns what went."""
        entries = self.store.entries()
        manifests = {}
        for entry in entries:
            manifest, _ = self.store.read_manifest(entry.name)
            if manifest is not None:
                manifests[entry.name] = manifest
        kept = self.policy.keep([e for e in entries if e.name in manifests], manifests) | {keep_also}
        removed = []
        for entry in entries:
            # Directories without a readable manifest are not ours to judge here (a concurrent
            # writer, or evidence of corruption for `ckpt list`); only complete ones rotate out.
            if entry.name not in kept and entry.name in manifests:
                self.store.delete(entry.name)
                removed.append(entry.name)
        return removed

    def close(self) -> None:
        self.wait()
        shutil.rmtree(self.scratch, ignore_errors=True)
