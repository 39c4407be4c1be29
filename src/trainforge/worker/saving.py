"""Worker side of checkpointing: snapshots of every component for the writer, and restoring the
newest checkpoint that verifies and loads.

Saving (every rank): each component's ``state_dict()``, copied to host memory (the only stall),
handed to this rank's ``CheckpointWriter`` (``checkpoint/writer.py``), which writes and commits it
in the background. Full and sharded are two layouts of that one path: under ``ddp`` rank 0 writes
the shared tensors whole, under ``fsdp`` or tensor parallelism every rank writes its shards.

Restoring (every rank): rank 0 walks the run's checkpoints from the newest, verifying each; every
rank loads the one proposed into every component (``checkpoint/reader.py``), and all ranks learn
every rank's outcome, so that all move on to the next candidate, or all stop, together.
"""

from __future__ import annotations

import importlib.metadata
import logging
import pickle
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import ray.train
from safetensors import SafetensorError

from trainforge.checkpoint.crypto import cipher_of
from trainforge.checkpoint.names import name_of_uri
from trainforge.checkpoint.opened import CheckpointFiles
from trainforge.checkpoint.problems import KEY, OUTDATED
from trainforge.checkpoint.reader import load_shards, load_state
from trainforge.checkpoint.saved import Saved, read_saved
from trainforge.checkpoint.schema import FULL, SHARDED, ComponentSchemas
from trainforge.checkpoint.sse import ServerSide
from trainforge.checkpoint.state import Record, Snapshot, State, is_flat_weights, snapshot_tensors, weights_snapshot
from trainforge.checkpoint.storage import CheckpointStore
from trainforge.checkpoint.writer import CheckpointWriter, RotationPolicy, SaveOutcome, save_group
from trainforge.config import CheckpointConfig
from trainforge.errors import CheckpointError
from trainforge.redact import redact_config
from trainforge.worker import collectives
from trainforge.worker.components.base import Restore
from trainforge.worker.components.training import Progress
from trainforge.worker.registry import state_schemas

if TYPE_CHECKING:
    from trainforge.worker.build import WorkerRun

log = logging.getLogger("trainforge.worker")


def library_versions() -> dict[str, str]:
    found = {}
    for name in ("trainforge", "torch", "ray"):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = "unknown"
    return found


def run_store() -> CheckpointStore:
    """This run's checkpoint directory on the storage Ray Train was given (local, NFS or S3)."""
    storage = ray.train.get_context().get_storage()
    return CheckpointStore(storage.storage_filesystem, storage.experiment_fs_path)


class Checkpointing:
    """When to save and what goes in: every component's state, handed to this rank's writer."""

    def __init__(self, run: WorkerRun, store: CheckpointStore) -> None:
        cfg: CheckpointConfig = run.config.checkpoint
        self.run = run
        self.cfg = cfg
        self.store = store
        # checkpoint.encryption: the key, from this worker's environment (one line if it is not there)
        store.cipher = cipher_of(cfg.encryption)
        if cfg.s3_sse is not None:  # S3 encrypts every object the run's saves write
            store.encrypt_on_server(ServerSide(cfg.s3_sse, cfg.s3_sse_kms_key_id))
        self.schemas = state_schemas()
        policy = RotationPolicy(cfg.keep_last, cfg.keep_best_metric, cfg.keep_best_mode)
        group = save_group(run.config.failure.collective_timeout_s)  # collective: every rank, now
        self.writer = CheckpointWriter(store, policy, group, schemas=self.schemas, cipher=store.cipher)
        self.last_saved_step = -1
        self.stall_s = 0.0  # the training thread's wait in the last save: snapshot copy (+ previous save)
        self.previous: dict[str, State] = {}

    def due(self, step: int) -> bool:
        return self.cfg.every_n_steps is not None and step % self.cfg.every_n_steps == 0

    def save(self, metrics: dict[str, Any], *, final: bool = False) -> None:
        """Snapshot every component now (every rank), write in the background. ``final``: a
        sharded run's last save also holds the full weights of what the run exports (gathered to
        rank 0, a collective)."""
        run = self.run
        step = run.progress.global_step
        if step == self.last_saved_step:
            return
        self.last_saved_step = step
        started = time.perf_counter()
        # At most one save in flight, and its buffers are reused below: wait for it first.
        self.writer.wait()
        layout = SHARDED if run.plan.sharded else FULL
        states = {}
        for name, component in run.components.items():
            state = component.state_dict()
            if layout == FULL and run.rank != 0:
                state.tensors = None  # the shared tensors are rank 0's to write
            states[name] = host_copy(state, self.previous.get(name))
        self.previous = states
        exports = {c.export: name for name, c in run.components.items() if c.export is not None}
        full = {}
        if final and layout == SHARDED:
            full = {exports[target]: run.components[exports[target]].full_weights() for target in exports}
            full = {name: weights for name, weights in full.items() if weights}
        record = None
        if run.rank == 0:
            record = Record(
                plan=run.plan.layout_name,
                tensor_parallel=run.plan.layout.tp,
                metrics={k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))},
                config=redact_config(run.config.to_dict()),  # a record: no credentials
                versions=library_versions(),
            )
        snapshot = Snapshot(step, run.data.epoch, layout, states, run.rank, run.world, record, exports, full)
        self.writer.save_async(snapshot)
        self.stall_s = time.perf_counter() - started

    def collect(self) -> list[SaveOutcome]:
        return self.writer.collect()

    def wait(self) -> list[SaveOutcome]:
        """Block until the save in flight (if any) is committed; its outcome (rank 0)."""
        self.writer.wait()
        return self.writer.collect()

    def close(self) -> None:
        self.writer.close()


def host_copy(state: State, reuse: State | None) -> State:
    """``state`` with every tensor copied to host memory (flat weights with tied tensors once, as
    safetensors keeps them); ``reuse``: the previous copy, whose buffers are overwritten."""
    old = reuse or State()
    tensors = state.tensors
    if is_flat_weights(tensors):
        tensors = weights_snapshot(tensors, old.tensors if isinstance(old.tensors, dict) else None)
    else:
        tensors = snapshot_tensors(tensors, old.tensors)
    return State(state.values, tensors, state.rank_values, snapshot_tensors(state.rank_tensors, old.rank_tensors))


# ---------------------------------------------------------------------------------------------
# Restore


@dataclass
class Candidates:
    """Rank 0's walk over restore candidates, newest first, each verified before it is proposed.

    ``none`` and a path decide only the run's first start (the driver has checked that the run
    holds no checkpoints yet); once the run has checkpoints of its own, a worker-group restart
    continues from them, as ``auto`` does.
    """

    store: CheckpointStore
    resume: str
    schemas: dict[str, ComponentSchemas]
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (checkpoint name, why)
    unloadable: list[str] = field(default_factory=list)
    locked: list[tuple[str, str]] = field(default_factory=list)  # skipped: this run's key does not open them
    _queue: list[str] = field(default_factory=list)
    explicit: bool = False

    def __post_init__(self) -> None:
        own = self.store.entries()
        self.explicit = self.resume not in ("auto", "none") and not own
        self._queue = [e.name for e in reversed(own)]

    def propose(self) -> tuple[Any, ...]:
        """The next proposal to broadcast: ("try", uri, explicit), ("none",) or ("error", message)."""
        if self.explicit:
            if self.unloadable:
                return ("error", f"checkpoint {self.resume} does not load into this run: {self.unloadable[0]}")
            store, name = CheckpointStore.for_checkpoint(self.resume, self.store.cipher)
            check = store.verify(name, schemas=self.schemas)
            if not check.ok:
                return ("error", f"checkpoint {self.resume} is not valid: {'; '.join(check.problems)}")
            return ("try", store.uri(name), True)
        while self._queue:
            name = self._queue.pop(0)
            check = self.store.verify(name, schemas=self.schemas)
            if check.ok:
                return ("try", self.store.uri(name), False)
            why = "; ".join(check.problems)
            if OUTDATED in check.kinds:  # resuming from an older checkpoint instead would lose steps
                return ("error", f"checkpoint {self.store.uri(name)} {why}")
            if KEY in check.kinds:
                self.locked.append((name, why))
            self.skip(name, why)
        if self.unloadable:
            return (
                "error",
                f"no checkpoint of this run loads into the model as configured ({self.unloadable[0]}); "
                "go back to the config that wrote them, or start afresh under another run.name",
            )
        if self.locked:  # a fresh start over checkpoints this key cannot open would bury them
            name, why = self.locked[0]
            return (
                "error",
                f"no checkpoint of this run opens with this run's key ({name}: {why}); give the key they "
                "were written with, or start afresh under another run.name",
            )
        return ("none",)

    def skip(self, name: str, reason: str) -> None:
        log.warning("skipping checkpoint %s: %s", name, reason)
        self.skipped.append((name, reason))


@dataclass
class Restored:
    """Where a run starts: the checkpoint it came from (None: a fresh start) and what restore skipped."""

    progress: Progress
    source: str | None = None
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (checkpoint name, why), newest first
    written_by: int | None = None  # workers that wrote the checkpoint, when it differs from now
    resharded_from: str | None = None  # the writer's layout (``fsdp x tp2``), when it differs from this run's
    notes: list[str] = field(default_factory=list)  # what else restore changed on purpose (for the run's events)


@dataclass
class Loaded:
    """What one load of a checkpoint into a run found: its writers and what it changed on purpose."""

    world: int
    plan: str
    notes: list[str]


def restore(run: WorkerRun, store: CheckpointStore) -> Restored:
    """All ranks: agree on the newest checkpoint that verifies and loads, and load it into every
    component; a fresh start when none verifies. CheckpointError (the same on every rank) when some
    verified but none loads, or when an explicitly named checkpoint does not.

    Rank 0 verifies and proposes one candidate at a time; every rank tries to load it, and every
    rank learns every rank's outcome (an all-gather), so that all move on to the next candidate,
    or all stop, together. A failed load leaves components half-written: the next candidate's
    strict load overwrites all of them, and if none loads the run stops rather than train on it.
    """
    schemas = state_schemas()
    candidates = Candidates(store, run.config.checkpoint.resume, schemas) if run.rank == 0 else None
    while True:
        mine = (candidates.propose(), list(candidates.skipped)) if candidates is not None else None
        proposal, skipped = cast(tuple[tuple[Any, ...], list[tuple[str, str]]], collectives.broadcast_object(mine))
        if proposal[0] == "error":
            raise CheckpointError(proposal[1])
        if proposal[0] == "none":
            return Restored(run.progress, None, skipped)
        _, uri, explicit = proposal
        name = name_of_uri(uri)
        # The run's own store keeps its file system settings (endpoint, credentials); others are parsed.
        source = store if uri == store.uri(name) else CheckpointStore.for_checkpoint(uri, store.cipher)[0]
        loaded, failure = try_load(run, source, name, schemas)
        failures = [f for f in collectives.all_gather_objects(failure) if f]
        if not failures and loaded is not None:
            progress = run.progress
            if run.rank == 0:
                log.info("resumed from %s at step %d (epoch %d)", uri, progress.global_step, run.data.epoch)
            writers = None if loaded.world == run.world else loaded.world
            resharded = loaded.plan if loaded.plan != run.plan.layout_name else None
            return Restored(progress, uri, skipped, writers, resharded, loaded.notes)
        if candidates is not None:
            reason = f"does not load into this run's model: {failures[0]}"
            candidates.unloadable.append(f"{name} {reason}")
            if not explicit:
                candidates.skip(name, reason)


_LOAD_ERRORS = (
    CheckpointError,
    RuntimeError,
    ValueError,
    KeyError,
    TypeError,
    IndexError,
    OSError,
    SafetensorError,
    pickle.UnpicklingError,
)


def try_load(
    run: WorkerRun, source: CheckpointStore, name: str, schemas: dict[str, ComponentSchemas]
) -> tuple[Loaded | None, str | None]:
    """This rank's load of a verified checkpoint: what it found, or (None, why not, one line).

    A checkpoint that verifies can still fail to load into this run: another model shape (strict
    weights), another parameter layout (optimizer groups), state a schema cannot see.
    """
    try:
        with (
            tempfile.TemporaryDirectory(prefix="trainforge-restore-") as scratch,
            source.opened(source.fetch(name, Path(scratch))) as directory,  # decrypted when encrypted
        ):
            return load_into(run, directory, schemas), None
    except _LOAD_ERRORS as err:
        return None, one_line(err)


def one_line(err: BaseException) -> str:
    """An exception as one line of at most 300 characters (torch's load errors span several)."""
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def load_into(
    run: WorkerRun, directory: Path | CheckpointFiles, schemas: dict[str, ComponentSchemas] | None = None
) -> Loaded:
    """Every component's state from a verified checkpoint (its directory, or its files as
    ``CheckpointStore.opened`` gives them: decrypted when encrypted), in registry order: each
    component's JSON checked against its schema before anything is applied, the sharded tensors
    loaded in one (collective) pass, each rank's own state only when the same ranks wrote it.

    Either layout loads into either plan: a sharded checkpoint through torch.distributed.checkpoint
    (which reshards to this run's plan and world size), a full one through the plan's full-state
    load (which shards it under fsdp)."""
    saved = read_saved(directory, state_schemas() if schemas is None else schemas)
    restore = restore_context(run, saved)
    shards = {}
    if saved.layout == SHARDED:
        templates = {}
        for name, component in run.components.items():
            where = saved.files.get(name)
            if name in saved.components and where is not None and where.tensors == SHARDED:
                template = component.template(State(dict(saved.components[name])), restore)
                if template is not None:
                    templates[name] = template
        shards = load_shards(directory, saved, templates)
    for name, component in run.components.items():
        if name not in saved.components:
            component.missing(restore)
            continue
        state = load_state(directory, saved, name, rank=run.rank, same_ranks=restore.same_ranks, shards=shards)
        component.load_state_dict(state, restore)
    if not restore.same_ranks and run.rank == 0:
        log.warning(
            "resuming with %d workers from a checkpoint written by %d: training continues, "
            "but the run is no longer bit-identical to an uninterrupted one",
            run.world,
            saved.world,
        )
    return Loaded(saved.world, saved.plan, restore.notes)


def restore_context(run: WorkerRun, saved: Saved) -> Restore:
    """What the components' loads see of the checkpoint's writers."""
    return Restore(
        step=saved.step,
        world=saved.world,
        plan=saved.plan,
        config=saved.config,
        same_ranks=saved.world == run.world and saved.tensor_parallel == run.plan.layout.tp,
        sharded=saved.layout == SHARDED,
    )
