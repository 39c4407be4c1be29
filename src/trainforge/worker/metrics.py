"""Turning a report interval's device-side sums into metrics that are identical on every rank."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from trainforge.worker import parallel
from trainforge.worker.step import MetricSums

if TYPE_CHECKING:
    from trainforge.checkpoint.state import Progress
    from trainforge.worker.build import WorkerRun

WARMUP_STEPS = 5  # steps excluded from the throughput figure (allocator, caches, first all-reduce)


class Throughput:
    """Samples per second over all workers, wall clock from the end of warm-up to the last step.

    Reports and checkpoint stalls count (they cost training time); validation does not.
    """

    def __init__(self, global_batch: int) -> None:
        self.global_batch = global_batch
        self.local_steps = 0
        self.timed_steps = 0
        self.started: float | None = None
        self.last = 0.0
        self.excluded_s = 0.0
        self.pending_s = 0.0

    def step_done(self) -> None:
        now = time.perf_counter()
        self.local_steps += 1
        if self.local_steps == WARMUP_STEPS:
            self.started = now
            self.pending_s = 0.0
        elif self.started is not None:
            self.timed_steps += 1
            self.last = now
            self.excluded_s += self.pending_s  # excluded time counts once a timed step follows it
            self.pending_s = 0.0

    def exclude(self, seconds: float) -> None:
        """Time (validation) that is not training; it is taken out only if it lies inside the window."""
        self.pending_s += seconds

    @property
    def samples_per_s(self) -> float:
        if self.started is None or self.timed_steps == 0:
            return 0.0
        return self.timed_steps * self.global_batch / max(self.last - self.started - self.excluded_s, 1e-9)


STEP_PARTS = ("data_s", "compute_s", "optim_s")


def local_times(sums: MetricSums) -> dict[str, float]:
    """This rank's own per-step times over the interval, before the all-reduce averages them away
    (the figures that tell a straggler apart)."""
    steps = float(sums.values["steps"]) if "steps" in sums.values else 0.0
    local = {name: float(sums.values[name]) / steps if steps else 0.0 for name in STEP_PARTS if name in sums.values}
    local["step_s"] = sum(local.values())
    local["steps"] = steps
    return local


def reduce_metrics(
    run: WorkerRun, sums: MetricSums, interval_s: float, progress: Progress, meter: Throughput
) -> tuple[dict[str, Any], dict[str, float]]:
    """One all-reduce of the interval's sums; every rank gets the same numbers.

    Returns the metrics to report and the raw totals, whose ``ctrl/*`` entries carry rank 0's
    control signals (save outcomes, stop requests) to every rank in the same collective.
    """
    names = sorted(sums.values)
    vector = torch.stack([sums.values[n] for n in names]) if names else torch.zeros(0, dtype=torch.float64)
    totals = dict(zip(names, parallel.all_reduce_sum(vector, run.device).tolist(), strict=True))
    sums.reset()
    steps = max(totals.get("steps", 0.0) / run.world, 1.0)
    per_step = {k: totals.get(k, 0.0) / run.world / steps for k in STEP_PARTS}
    metrics: dict[str, Any] = {
        "step": progress.global_step,
        "epoch": progress.epoch,
        "samples_seen": progress.samples_seen,
        "total_steps": run.total_steps,
        "world_size": run.world,
        "time/unix": time.time(),
        "train/lr": run.runner.optimizer.param_groups[0]["lr"],
        "train/grad_norm": totals.get("grad_norm_sum", 0.0) / run.world / steps,
        "train/skipped_steps": totals.get("skipped_steps", 0.0) / run.world,
        "perf/samples_per_s": totals.get("steps", 0.0) / run.world * meter.global_batch / interval_s
        if interval_s > 0
        else 0.0,
        "perf/steady_samples_per_s": meter.samples_per_s,
        "perf/step_time_s": sum(per_step.values()),
        "perf/data_wait_s": per_step["data_s"],
        "perf/compute_s": per_step["compute_s"],
        "perf/optimizer_s": per_step["optim_s"],
    }
    if totals.get("count"):
        for name, value in run.task.finalize(totals).items():
            metrics[f"train/{name}"] = value
    return metrics, totals
