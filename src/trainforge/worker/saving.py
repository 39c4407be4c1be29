"""Worker side of checkpointing: taking snapshots, and restoring the newest checkpoint that verifies.

Every rank takes part in the collective steps (gathering RNG states, agreeing on which checkpoint
to restore); rank 0 alone writes, through the background CheckpointManager.
"""

from __future__ import annotations

import importlib.metadata
import logging
import pickle
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import ray.train
import torch
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from trainforge.checkpoint.manager import CheckpointManager, RotationPolicy, SaveOutcome, Snapshot
from trainforge.checkpoint.names import name_of_uri, staging_name
from trainforge.checkpoint.schema import SHARDED_DIR, SYNC_FILE
from trainforge.checkpoint.sharded import ShardedSave, load_sharded
from trainforge.checkpoint.state import (
    MODEL_FILE,
    OPTIMIZER_FILE,
    Progress,
    TrainerState,
    model_snapshot,
    read_trainer_state,
    snapshot_tensors,
)
from trainforge.checkpoint.storage import CheckpointStore, checkpoint_name
from trainforge.config import CheckpointConfig
from trainforge.errors import CheckpointError
from trainforge.redact import redact_config
from trainforge.worker import collectives
from trainforge.worker.components import RngState
from trainforge.worker.optim import apply_hyperparameters, effective_lr, hyperparameters_differ

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
    """When to save, what goes in; rank 0 hands snapshots to the background manager."""

    def __init__(self, run: WorkerRun, store: CheckpointStore) -> None:
        cfg: CheckpointConfig = run.config.checkpoint
        self.run = run
        self.cfg = cfg
        self.store = store
        self.manager = (
            CheckpointManager(store, RotationPolicy(cfg.keep_last, cfg.keep_best_metric, cfg.keep_best_mode))
            if run.rank == 0
            else None
        )
        self.last_saved_step = -1
        self.stall_s = 0.0  # the training thread's wait in the last save: snapshot copy (+ previous save)
        self.previous: Snapshot | None = None

    def due(self, step: int) -> bool:
        return self.cfg.every_n_steps is not None and step % self.cfg.every_n_steps == 0

    def save(self, progress: Progress, metrics: dict[str, Any], *, final: bool = False) -> None:
        """Snapshot now (all ranks: the RNG gather is a collective), write in the background (rank 0),
        or, for a sharded plan, every rank writes its shards now (``final``: with the full weights)."""
        if progress.global_step == self.last_saved_step:
            return
        rng = collectives.all_gather_objects(RngState().state_dict())
        # parallel.sync: every rank's own model and optimizer state, gathered to rank 0 (a collective).
        sync_state = self.run.sync.gather_state() if self.run.sync is not None else None
        self.last_saved_step = progress.global_step
        state = self.trainer_state(progress, metrics, rng)
        if self.run.plan.sharded:
            self.save_sharded(progress.global_step, state, final=final)
            return
        if self.manager is None:
            return
        runner = self.run.runner
        started = time.perf_counter()
        # At most one save in flight, and its buffers are reused below: wait for it first.
        self.manager.wait()
        previous = self.previous
        snapshot = Snapshot(
            step=progress.global_step,
            epoch=progress.epoch,
            model_state=model_snapshot(
                self.run.plan.eval_model(self.run.model), previous.model_state if previous else None
            ),
            optimizer_state=snapshot_tensors(
                runner.optimizer.state_dict(), previous.optimizer_state if previous else None
            ),
            trainer_state=state,
            extra={SYNC_FILE: sync_state} if sync_state is not None else {},
        )
        self.manager.save_async(snapshot)
        self.previous = snapshot
        self.stall_s = time.perf_counter() - started

    def trainer_state(self, progress: Progress, metrics: dict[str, Any], rng: list[object]) -> TrainerState:
        """The JSON part of a checkpoint, from each component's state: progress (with the data
        source's position), optimization (schedule, scaler), every rank's RNG."""
        data, optim = self.run.data.state_dict(), self.run.runner.optim.state_dict()
        position = {
            "epoch": data["epoch"],
            "epoch_position": data["position"],
            "world_size": self.run.world,
            "micro_batch_size": data["micro_batch_size"],
            "grad_accum_steps": data["grad_accum_steps"],
        }
        return TrainerState(
            progress=Progress(**{**asdict(progress), **position}),
            scheduler=optim["scheduler"],
            scaler=optim["scaler"],
            rng=[dict(r) for r in rng],  # type: ignore[call-overload]
            metrics={k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))},
            config=redact_config(self.run.config.to_dict()),  # a record: no credentials
            versions=library_versions(),
        )

    def save_sharded(self, step: int, state: TrainerState, *, final: bool) -> None:
        """Every rank writes its own shards (torch.distributed.checkpoint) into one staging directory;
        rank 0 writes the manifest over every rank's files last, then commits. Synchronous: the
        shards are written from the live (sharded) state, with no host copy to hand to a thread.
        The final save also holds ``model.safetensors``: the full weights, gathered to rank 0."""
        run = self.run
        started = time.perf_counter()
        if self.manager is not None:
            self.manager.wait()  # rotation of the previous save, if still running
        staging = str(collectives.broadcast_object(staging_name(checkpoint_name(step))))
        save = ShardedSave(self.store, step, staging, run.rank, run.world)
        error: str | None = None
        try:
            dcp.save(run.plan.sharded_state(run.model, run.runner.optimizer), storage_writer=save.storage_writer())
            files = save.rank_files()
            if final:
                files.update(save.write_full_model(run.plan.full_model_state(run.model)))
        except (OSError, RuntimeError, ValueError, CheckpointError) as err:
            files, error = {}, f"rank {run.rank}: {one_line(err)}"
        gathered = cast(list[tuple[dict[str, Any], str | None]], collectives.all_gather_objects((files, error)))
        if self.manager is None:
            self.stall_s = time.perf_counter() - started
            return
        errors = [e for _, e in gathered if e]
        outcome = SaveOutcome(step=step, name=checkpoint_name(step))
        if errors:
            save.abort()
            outcome.error = errors[0]
        else:
            merged = {name: entry for rank_files, _ in gathered for name, entry in rank_files.items()}
            try:
                outcome.uri = save.commit(merged, state)
                outcome.size_bytes = sum(int(e["size"]) for e in merged.values())
            except (OSError, RuntimeError, ValueError, CheckpointError) as err:
                save.abort()
                outcome.error = one_line(err)
        outcome.seconds = time.perf_counter() - started
        self.manager.record(outcome)
        self.stall_s = outcome.seconds

    def collect(self) -> list[SaveOutcome]:
        return self.manager.collect() if self.manager is not None else []

    def wait(self) -> list[SaveOutcome]:
        """Block until the save in flight (if any) is committed; its outcome."""
        if self.manager is None:
            return []
        self.manager.wait()
        return self.manager.collect()

    def close(self) -> None:
        if self.manager is not None:
            self.manager.close()


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
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (checkpoint name, why)
    unloadable: list[str] = field(default_factory=list)
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
            store, name = CheckpointStore.for_checkpoint(self.resume)
            check = store.verify(name)
            if not check.ok:
                return ("error", f"checkpoint {self.resume} is not valid: {'; '.join(check.problems)}")
            return ("try", store.uri(name), True)
        while self._queue:
            name = self._queue.pop(0)
            check = self.store.verify(name)
            if check.ok:
                return ("try", self.store.uri(name), False)
            self.skip(name, "; ".join(check.problems))
        if self.unloadable:
            return (
                "error",
                f"no checkpoint of this run loads into the model as configured ({self.unloadable[0]}); "
                "go back to the config that wrote them, or start afresh under another run.name",
            )
        return ("none",)

    def skip(self, name: str, reason: str) -> None:
        log.warning("skipping checkpoint %s: %s", name, reason)
        self.skipped.append((name, reason))


@dataclass
class Restored:
    """Where a run starts: its progress, the checkpoint it came from, and what restore skipped."""

    progress: Progress
    source: str | None = None
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (checkpoint name, why), newest first
    written_by: int | None = None  # workers that wrote the checkpoint, when it differs from now
    resharded_from: str | None = None  # the writer's layout (``fsdp x tp2``), when it differs from this run's
    notes: list[str] = field(default_factory=list)  # what else restore changed on purpose (for the run's events)


def restore(run: WorkerRun, store: CheckpointStore) -> Restored:
    """All ranks: agree on the newest checkpoint that verifies and loads, and load it; a fresh
    Progress when none verifies. CheckpointError (the same on every rank) when some verified but
    none loads, or when an explicitly named checkpoint does not.

    Rank 0 verifies and proposes one candidate at a time; every rank tries to load it, and every
    rank learns every rank's outcome (an all-gather), so that all move on to the next candidate,
    or all stop, together. A failed load leaves the model half-written: the next candidate's
    strict load overwrites all of it, and if none loads the run stops rather than train on it.
    """
    candidates = Candidates(store, run.config.checkpoint.resume) if run.rank == 0 else None
    while True:
        mine = (candidates.propose(), list(candidates.skipped)) if candidates is not None else None
        proposal, skipped = cast(tuple[tuple[Any, ...], list[tuple[str, str]]], collectives.broadcast_object(mine))
        if proposal[0] == "error":
            raise CheckpointError(proposal[1])
        if proposal[0] == "none":
            return Restored(Progress(world_size=run.world), None, skipped)
        _, uri, explicit = proposal
        name = name_of_uri(uri)
        # The run's own store keeps its file system settings (endpoint, credentials); others are parsed.
        source = store if uri == store.uri(name) else CheckpointStore.for_checkpoint(uri)[0]
        notes: list[str] = []
        loaded, failure = try_load(run, source, name, notes)
        failures = [f for f in collectives.all_gather_objects(failure) if f]
        if not failures and loaded is not None:
            progress, written_by, saved_layout = loaded
            if run.rank == 0:
                log.info("resumed from %s at step %d (epoch %d)", uri, progress.global_step, progress.epoch)
            writers = None if written_by == run.world else written_by
            resharded = saved_layout if saved_layout != run.plan.layout_name else None
            return Restored(progress, uri, skipped, writers, resharded, notes)
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
    run: WorkerRun, source: CheckpointStore, name: str, notes: list[str]
) -> tuple[tuple[Progress, int, str] | None, str | None]:
    """This rank's load of a verified checkpoint: (progress, writers, their layout) or (None, why not, one line).

    A checkpoint that verifies can still fail to load into this run: another model shape (strict
    weights), another parameter layout (optimizer groups), state a schema cannot see.
    """
    try:
        with tempfile.TemporaryDirectory(prefix="trainforge-restore-") as scratch:
            return load_into(run, source.fetch(name, Path(scratch)), notes), None
    except _LOAD_ERRORS as err:
        return None, one_line(err)


def one_line(err: BaseException) -> str:
    """An exception as one line of at most 300 characters (torch's load errors span several)."""
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def load_into(run: WorkerRun, directory: Path, notes: list[str] | None = None) -> tuple[Progress, int, str]:
    """Weights, optimizer, schedule, scaler, progress and this rank's RNG from a verified directory;
    also the number of workers that wrote it and their layout (``fsdp x tp2``). What else restore
    changed on purpose goes to ``notes``.

    Either layout loads into either plan: a sharded checkpoint through torch.distributed.checkpoint
    (which reshards to this run's plan and world size), a full one through the plan's full-state
    load (which shards it under fsdp)."""
    state = read_trainer_state(directory)
    notes = [] if notes is None else notes
    saved = state.config.get("parallel", {})
    saved_tp = int(saved.get("tensor_parallel", 1) or 1)
    saved_plan = str(saved.get("strategy", "ddp")) + (f" x tp{saved_tp}" if saved_tp > 1 else "")
    if (directory / SHARDED_DIR).is_dir():
        load_sharded_checkpoint(run, directory, state, notes)
    else:
        run.plan.load_full_model_state(run.model, read_full_weights(directory, run.plan.eval_model(run.model)))
        restore_optimizer(run, directory, state, notes)
    progress = state.progress
    written_by = progress.world_size
    run.data.progress = progress
    # The data was split over the writer's data-parallel ranks: its workers over its tensor-parallel size.
    position = {
        "epoch": progress.epoch,
        "position": progress.epoch_position,
        "world_size": written_by // saved_tp,
        "micro_batch_size": progress.micro_batch_size,  # auto batch size reuses the saved split
    }
    run.data.load_state_dict(position)
    if run.sync is not None:  # local SGD / DiLoCo: anchor, outer optimizer, this rank's own state
        note = run.sync.restore(directory, progress.global_step, run.world)
        notes.extend([note] if note else [])
    if run.plan.compression is not None:
        run.plan.compression.resume_at(progress.global_step)
    if written_by == run.world and saved_tp == run.plan.layout.tp:
        RngState().load_state_dict(state.rng[run.rank])
    elif run.rank == 0:
        log.warning(
            "resuming with %d workers from a checkpoint written by %d: training continues, "
            "but the run is no longer bit-identical to an uninterrupted one",
            run.world,
            written_by,
        )
    progress.world_size = run.world
    return progress, written_by, saved_plan


def read_full_weights(directory: Path, model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.safetensors`` as a dict, with tied weights (stored once) filled in under every name."""
    weights = load_file(str(directory / MODEL_FILE))
    canonical: dict[int, str] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        first = canonical.setdefault(id(tensor), name)
        if name not in weights and first in weights:
            weights[name] = weights[first]
        elif first not in weights and name in weights:
            weights[first] = weights[name]
    return weights


def load_sharded_checkpoint(run: WorkerRun, directory: Path, state: TrainerState, notes: list[str]) -> None:
    """Model and optimizer from torch.distributed.checkpoint shards, resharded to this run."""
    cfg = run.config
    optimizer = run.runner.optimizer
    saved_optim = state.config.get("optim", {}).get("name", cfg.optim.name)
    template = run.plan.sharded_state(run.model, optimizer)
    if saved_optim != cfg.optim.name:
        template.pop("optim")
        notes.append(f"optimizer state not restored: the checkpoint used {saved_optim}, this run {cfg.optim.name}")
    load_sharded(directory, template)
    run.plan.load_sharded_state(run.model, optimizer, template)
    restore_schedule(run, state, notes)


def restore_optimizer(run: WorkerRun, directory: Path, state: TrainerState, notes: list[str]) -> None:
    """Optimizer and schedule state; then, when the checkpoint was saved under other optimizer or
    schedule settings (another run's checkpoint: a PBT exploit, a fine-tune), this run's own values.

    Restoring the state dicts brings back the saving run's LR and the like; the config in effect
    is this run's, so its values are put back on top (``apply_hyperparameters``). Moments saved by
    another kind of optimizer cannot be used and are left out.
    """
    cfg = run.config
    optimizer = run.runner.optimizer
    saved_optim = state.config.get("optim", {}).get("name", cfg.optim.name)
    if saved_optim == cfg.optim.name:
        run.plan.load_full_optimizer_state(run.model, optimizer, read_optimizer(directory))
    else:
        notes.append(f"optimizer state not restored: the checkpoint used {saved_optim}, this run {cfg.optim.name}")
    restore_schedule(run, state, notes)


def read_optimizer(directory: Path) -> dict[str, Any]:
    # weights_only=True: tensors and plain containers only, never arbitrary pickled objects.
    return cast(dict[str, Any], torch.load(directory / OPTIMIZER_FILE, map_location="cpu", weights_only=True))


def restore_schedule(run: WorkerRun, state: TrainerState, notes: list[str]) -> None:
    """The schedule's position and the scaler's, then this run's own hyperparameters where the
    checkpoint's differ."""
    cfg = run.config
    optimizer, scheduler = run.runner.optimizer, run.runner.scheduler
    run.runner.optim.load_state_dict({"scheduler": state.scheduler, "scaler": state.scaler})
    if state.config and hyperparameters_differ(state.config, cfg.optim, cfg.schedule):
        lr = effective_lr(cfg.optim, run.data.samples_per_step * run.data_world)
        apply_hyperparameters(optimizer, scheduler, cfg.optim, lr)
        notes.append(f"optimizer hyperparameters from this run's config (lr now {optimizer.param_groups[0]['lr']:.4g})")
