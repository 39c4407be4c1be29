"""Worker side of checkpointing: when to save, what goes in, and restoring the newest valid one."""

from __future__ import annotations

import importlib.metadata
import logging
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray.train

from trainforge.checkpoint.format import verify, write_manifest
from trainforge.checkpoint.state import (
    Progress,
    TrainerState,
    capture_rng,
    load_optimizer,
    load_weights,
    read_trainer_state,
    restore_rng,
    write_state,
)
from trainforge.errors import CheckpointError
from trainforge.worker import parallel

if TYPE_CHECKING:
    from trainforge.worker.loop import WorkerRun

log = logging.getLogger("trainforge.worker")


def library_versions() -> dict[str, str]:
    found = {}
    for name in ("trainforge", "torch", "ray"):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = "unknown"
    return found


def checkpoint_dir_name(step: int) -> str:
    return f"checkpoint_{step:09d}"


class CheckpointWriter:
    """Decides when a report carries a checkpoint and writes it (rank 0 writes, all ranks report)."""

    def __init__(self, run: WorkerRun) -> None:
        self.run = run
        self.every = run.config.checkpoint.every_n_steps
        self._scratch = Path(tempfile.mkdtemp(prefix="trainforge-ckpt-"))

    def due(self, progress: Progress) -> bool:
        return self.every is not None and progress.global_step % self.every == 0

    def report(self, progress: Progress, metrics: dict[str, Any], *, force_checkpoint: bool = False) -> None:
        if not (force_checkpoint or self.due(progress)):
            ray.train.report(metrics)
            return
        # Collective: every rank's RNG state travels to rank 0, which writes the whole checkpoint.
        rng = parallel.all_gather_objects(capture_rng())
        name = checkpoint_dir_name(progress.global_step)
        if self.run.rank != 0:
            ray.train.report(metrics, checkpoint_dir_name=name)
            return
        directory = self._scratch / name
        self._write(directory, progress, metrics, rng)
        ray.train.report(
            metrics,
            checkpoint=ray.train.Checkpoint.from_directory(str(directory)),
            checkpoint_dir_name=name,
        )
        shutil.rmtree(directory, ignore_errors=True)

    def _write(self, directory: Path, progress: Progress, metrics: dict[str, Any], rng: list[Any]) -> None:
        runner = self.run.runner
        state = TrainerState(
            progress=Progress(**{**progress.__dict__, "world_size": self.run.world}),
            scheduler=runner.scheduler.state_dict(),
            scaler=runner.scaler.state_dict(),
            rng=[dict(r) for r in rng],
            metrics={k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))},
            config=self.run.config.to_dict(),
            versions=library_versions(),
        )
        write_state(directory, parallel.unwrap(self.run.model), runner.optimizer, state)
        write_manifest(directory, {"global_step": progress.global_step, "epoch": progress.epoch})

    def close(self) -> None:
        shutil.rmtree(self._scratch, ignore_errors=True)


def restore_latest(run: WorkerRun, checkpoint: ray.train.Checkpoint | None) -> Progress:
    """Load the checkpoint Ray hands back after a restart; a fresh Progress when there is none."""
    if checkpoint is None:
        return Progress(world_size=run.world)
    with checkpoint.as_directory() as path:
        directory = Path(path)
        check = verify(directory)
        if not check.ok:
            raise CheckpointError(f"checkpoint {checkpoint.path} is invalid: {'; '.join(check.problems)}")
        state = read_trainer_state(directory)
        load_weights(directory, parallel.unwrap(run.model))
        load_optimizer(directory, run.runner.optimizer)
    runner = run.runner
    runner.scheduler.load_state_dict({**state.scheduler, "lr_lambdas": [None] * len(runner.optimizer.param_groups)})
    runner.scaler.load_state_dict(state.scaler)
    progress = state.progress
    if progress.world_size == run.world:
        restore_rng(state.rng[run.rank])
    else:
        # Same global position, split over the new number of ranks; exactness is not promised.
        consumed = progress.epoch_position * progress.world_size
        per_step = run.config.train.batch_size * run.config.train.grad_accum_steps
        progress.epoch_position = consumed // run.world // per_step * per_step
        log.warning(
            "resuming with %d workers from a checkpoint written by %d: training continues, "
            "but the run is no longer bit-identical to an uninterrupted one",
            run.world,
            progress.world_size,
        )
    progress.world_size = run.world
    if run.rank == 0:
        log.info("resumed from %s at step %d (epoch %d)", checkpoint.path, progress.global_step, progress.epoch)
    return progress
