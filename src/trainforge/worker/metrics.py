"""Turning the device-side sums of a report's log intervals into metrics that are identical on every rank."""

from __future__ import annotations

import time
from dataclasses import astuple, dataclass, fields
from typing import TYPE_CHECKING

import torch

from trainforge.protocol import Report
from trainforge.worker import collectives
from trainforge.worker.step import MetricSums

if TYPE_CHECKING:
    from trainforge.worker.build import WorkerRun
    from trainforge.worker.components.training import Progress

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
OWN_PARTS = ("data_s", "forward_s")  # a rank's own work, no peer waited for (worker/straggler.py)
MAX_HISTORY = 128  # points per report; beyond it, neighbouring intervals are merged pairwise


@dataclass
class Interval:
    """One closed log interval: its sums (device tensors, not yet reduced) and what the host
    knew when it closed."""

    step: int
    unix: float
    lr: float
    seconds: float
    sums: dict[str, torch.Tensor]


class IntervalHistory:
    """The log intervals since the last report, kept apart so that the report can carry one point
    per interval (``trainforge.protocol``) while reducing them all in its single all-reduce.

    Closing an interval moves the sums' tensors here: no device work, no host sync. Interval ends
    depend only on the step count, so every rank holds the same number of intervals with the
    same keys, which the stacked all-reduce requires.
    """

    def __init__(self, capacity: int = MAX_HISTORY) -> None:
        self.capacity = max(capacity, 2)
        self.intervals: list[Interval] = []
        self.opened = time.perf_counter()

    def close(self, sums: MetricSums, step: int, lr: float) -> None:
        """End the current interval at ``step``; an interval without steps is not one."""
        now = time.perf_counter()
        if "steps" in sums.values:
            self.intervals.append(Interval(step, time.time(), lr, now - self.opened, dict(sums.values)))
            sums.reset()
        self.opened = now
        if len(self.intervals) > self.capacity:
            self._merge_pairs()

    def take(self) -> list[Interval]:
        taken, self.intervals = self.intervals, []
        return taken

    def _merge_pairs(self) -> None:
        # Very short steps with a small log interval: halve the resolution rather than grow the
        # report without bound. Rank-consistent, since the count of intervals is.
        merged = []
        for first, second in zip(self.intervals[0::2], self.intervals[1::2], strict=False):
            sums = dict(first.sums)
            for key, value in second.sums.items():
                sums[key] = sums[key] + value if key in sums else value
            merged.append(Interval(second.step, second.unix, second.lr, first.seconds + second.seconds, sums))
        if len(self.intervals) % 2:
            merged.append(self.intervals[-1])
        self.intervals = merged


@dataclass
class Signals:
    """Control signals: what rank 0 alone knows (save outcomes, the driver's stop flag, time since
    the last save) and the preemption notice, reduced in the report's all-reduce next to the metric
    sums (their own field, never metric names), so that every rank takes the same decision."""

    save_failures: float = 0.0
    stop: float = 0.0
    preempted: float = 0.0
    minutes_since_save: float = 0.0

    def vector(self) -> list[float]:
        return [float(value) for value in astuple(self)]

    @classmethod
    def from_vector(cls, values: list[float]) -> Signals:
        return cls(*values[: len(fields(cls))])


@dataclass
class Reduced:
    """What one report's all-reduce gives a rank."""

    report: Report  # figures over the report's whole span, its history points, where the run stands
    totals: dict[str, float]  # sums over all ranks and the span
    local: dict[str, float]  # this rank's own step times over the span (``local_times``)
    signals: Signals  # summed over ranks
    own_s: list[float]  # every rank's own time per step over the span (``OWN_PARTS``), by rank


def local_times(totals: dict[str, float]) -> dict[str, float]:
    """This rank's own per-step times over the span, before the all-reduce averages them away
    (the figures that tell a straggler apart)."""
    steps = totals.get("steps", 0.0)
    local = {name: totals[name] / steps if steps else 0.0 for name in STEP_PARTS if name in totals}
    local["step_s"] = sum(local.values())
    local["steps"] = steps
    local["own_s"] = sum(totals.get(name, 0.0) for name in OWN_PARTS) / steps if steps else 0.0
    return local


def interval_figures(run: WorkerRun, totals: dict[str, float], seconds: float, global_batch: int) -> dict[str, float]:
    """Training and speed figures of one stretch of steps from its all-reduced sums."""
    steps = max(totals.get("steps", 0.0) / run.world, 1.0)
    per_step = {k: totals.get(k, 0.0) / run.world / steps for k in STEP_PARTS}
    figures = {
        "train/grad_norm": totals.get("grad_norm_sum", 0.0) / run.world / steps,
        "train/skipped_steps": totals.get("skipped_steps", 0.0) / run.world,
        "perf/samples_per_s": totals.get("steps", 0.0) / run.world * global_batch / seconds if seconds > 0 else 0.0,
        "perf/step_time_s": sum(per_step.values()),
        "perf/data_wait_s": per_step["data_s"],
        "perf/compute_s": per_step["compute_s"],
        "perf/optimizer_s": per_step["optim_s"],
    }
    if totals.get("count"):
        for name, value in run.task.finalize(totals).items():
            figures[f"train/{name}"] = value
    return figures


def reduce_metrics(
    run: WorkerRun,
    sums: MetricSums,
    history: IntervalHistory,
    interval_s: float,
    progress: Progress,
    meter: Throughput,
    signals: Signals | None = None,
) -> Reduced:
    """One all-reduce for the whole report: every interval's sums stacked ``[intervals, metrics]``
    plus the control ``signals`` plus one slot per rank for its own time (an all-gather in the same
    collective: every other rank adds zero there); every rank gets the same numbers.

    The report's top-level figures come from the column totals (the span since the last report),
    its ``history`` from each row.
    """
    lr = float(run.runner.optimizer.param_groups[0]["lr"])
    history.close(sums, progress.global_step, lr)  # the part-interval up to this report
    intervals = history.take()
    sums.reset()
    names = sorted({key for interval in intervals for key in interval.sums})
    zero = torch.zeros((), dtype=torch.float64, device=run.device)
    pieces = [torch.stack([interval.sums.get(n, zero) for n in names]) for interval in intervals if names]
    matrix = torch.stack(pieces) if pieces else torch.zeros((0, len(names)), dtype=torch.float64, device=run.device)
    control = (signals or Signals()).vector()
    mine = matrix.sum(0)  # this rank's own column totals, before the collective
    slots = matrix.new_zeros(run.world)
    own = [mine[names.index(name)] for name in OWN_PARTS if name in names]
    if own:
        slots[run.rank] = torch.stack(own).sum()
    vector = torch.cat([matrix.flatten(), matrix.new_tensor(control), slots])
    reduced = collectives.all_reduce_sum(vector, run.device)
    flat = torch.cat([reduced, mine]).tolist()  # one device-to-host copy

    width, rows = len(names), len(intervals)
    row_totals = [dict(zip(names, flat[r * width : (r + 1) * width], strict=True)) for r in range(rows)]
    end = rows * width
    totals = {n: sum(row[n] for row in row_totals) for n in names}
    summed = Signals.from_vector(flat[end : end + len(control)])
    end += len(control)
    steps_per_rank = totals.get("steps", 0.0) / run.world
    own_s = [value / steps_per_rank if steps_per_rank else 0.0 for value in flat[end : end + run.world]]
    local = local_times(dict(zip(names, flat[end + run.world :], strict=True)))

    report = Report(
        step=progress.global_step,
        epoch=run.data.epoch,
        samples_seen=progress.samples_seen,
        total_steps=run.total_steps,
        world_size=run.world,
        time=time.time(),
        parameters=run.parameters,
        figures={
            "train/lr": lr,
            **interval_figures(run, totals, interval_s, meter.global_batch),
            "perf/steady_samples_per_s": meter.samples_per_s,
        },
        history=[
            {
                "step": interval.step,
                "time/unix": interval.unix,
                "train/lr": interval.lr,
                **interval_figures(run, row, interval.seconds, meter.global_batch),
            }
            for interval, row in zip(intervals, row_totals, strict=True)
        ],
    )
    return Reduced(report, totals, local, summed, own_s)
