"""``train.anomaly.action: rollback``: back to the newest checkpoint without leaving the process.

Every rank, at the same step (the guard's verdict is all-reduced): the save in flight is let
commit, the newest checkpoint that verifies and loads is restored into every component by the
restore that starts a run (``worker/saving.restore``), the data position is moved past the
anomalous batch (the samples from the checkpoint up to and including it are never trained on),
the learning rate is scaled by ``lr_factor`` once more, and the guard keeps its counts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainforge.worker.anomaly import AnomalyGuard, AnomalyLimit
from trainforge.worker.saving import Checkpointing, Restored, restore
from trainforge.worker.schedule import LR_FROM_KWARGS

if TYPE_CHECKING:
    from trainforge.worker.build import WorkerRun


def roll_back(run: WorkerRun, checkpointing: Checkpointing, guard: AnomalyGuard, step: int) -> Restored | None:
    """Restore the newest checkpoint for the anomalous ``step``; None when the run has none yet
    (the step is then only skipped). AnomalyLimit once ``max_rollbacks`` are spent."""
    cfg = guard.cfg
    if guard.rolled_back >= cfg.max_rollbacks:
        raise AnomalyLimit(
            f"train.anomaly: step {step} is anomalous again after {guard.rolled_back} rollbacks "
            f"(max_rollbacks {cfg.max_rollbacks}); the run stops here: look at the anomaly events' samples, "
            "or raise train.anomaly.max_rollbacks"
        )
    data = run.data
    skip_to = (data.epoch, data.position + data.samples_per_step)  # past the anomalous batch
    counts, scale = guard.counts(), guard.lr_scale * cfg.lr_factor
    checkpointing.writer.wait()  # a save in flight commits (or fails) before the walk
    restored = restore(run, checkpointing.store)
    if restored.source is None:
        return None
    checkpointing.writer.passed_over.update(name for name, _ in restored.skipped)
    data.epoch, data.position = skip_to
    held = guard.lr_scale  # the scale the restored schedule already holds
    guard.set_counts(counts)
    guard.rolled_back += 1
    guard.lr_scale = scale
    runner = run.runner
    runner.scheduler.rebase([float(group["initial_lr"]) * scale / held for group in runner.optimizer.param_groups])
    fixed = type(runner.scheduler.scheduler).__name__
    if fixed in LR_FROM_KWARGS:
        restored.notes.append(
            f"train.anomaly.lr_factor leaves {fixed}'s LRs as they are: they come from schedule.kwargs"
        )
    return restored
