"""What a run costs: the hardware Ray reserves for its workers, times wall hours, at the ``cost`` prices.

Billed: workers x (GPUs and CPUs each worker reserves, as Ray's ScalingConfig reserves them) x wall
hours since the driver started, at ``cost.price_per_gpu_hour`` and ``cost.price_per_cpu_hour``.
The worker count is the reported ``world_size`` (an elastic run's changes are integrated over time);
the driver's time before the first report (Ray starting, placement) is billed at the configured
count, since rented machines cost money while they wait too. The projection to the end of the run
extends the current hourly rate over the steps left at the pace of this driver session.

One meter per driver session. A run that resumes (its first report has a ``Resumed`` event) carries
the bill of its earlier driver sessions: the last ``cost/so_far`` in the run's metrics.jsonl when
this session started (every session's figure includes the ones before it), so the money spent on
steps that a crash then lost stays on the bill. A run that starts over is billed from zero.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from trainforge.config import Config, CostConfig, ScalingConfig
from trainforge.protocol import PROJECTED_KEY, SO_FAR_KEY, Report, Resumed


@dataclass(frozen=True)
class Units:
    """What one worker reserves, and so what is billed for it."""

    gpus: float
    cpus: float


def units_per_worker(scaling: ScalingConfig) -> Units:
    """Ray's own defaults (ray.train.ScalingConfig): one GPU and no CPU with ``use_gpu`` and no
    ``resources_per_worker``, one CPU without; a GPU worker with resources given reserves 1 GPU
    unless it says otherwise."""
    given = scaling.resources_per_worker
    if given is None:
        return Units(gpus=1.0, cpus=0.0) if scaling.use_gpu else Units(gpus=0.0, cpus=1.0)
    gpus = float(given.get("GPU", 1.0)) if scaling.use_gpu else float(given.get("GPU", 0.0))
    return Units(gpus=gpus, cpus=float(given.get("CPU", 0.0)))


@dataclass(frozen=True)
class CostEstimate:
    """summary.json's ``cost``: the cost so far, projected to the end, and what it was billed on."""

    currency: str
    so_far: float
    projected_total: float | None
    price_per_gpu_hour: float | None
    price_per_cpu_hour: float | None
    gpu_hours: float
    cpu_hours: float

    def to_dict(self) -> dict[str, Any]:
        # 9 decimals: a short run's bill is a few thousandths, and 6 decimals left it (and its hours)
        # off by up to 1e-4 relative, more than the figures' own precision
        return {key: round(value, 9) if isinstance(value, float) else value for key, value in asdict(self).items()}


def hourly_rate(prices: CostConfig, units: Units, workers: float) -> float:
    """What ``workers`` workers cost per hour."""
    gpu = (prices.price_per_gpu_hour or 0.0) * units.gpus
    cpu = (prices.price_per_cpu_hour or 0.0) * units.cpus
    return workers * (gpu + cpu)


def project(so_far: float, rate_per_hour: float, elapsed_s: float, steps_done: int, steps_left: int) -> float | None:
    """``so_far`` plus the remaining steps at this session's pace (``steps_done`` in ``elapsed_s``)
    at ``rate_per_hour``; None before any step has been timed."""
    if steps_left <= 0:
        return so_far
    if steps_done <= 0 or elapsed_s <= 0:
        return None
    remaining_s = steps_left * elapsed_s / steps_done
    return so_far + rate_per_hour * remaining_s / 3600.0


class CostMeter:
    """The driver's running bill: worker-hours integrated between reports, projected from progress."""

    def __init__(
        self, prices: CostConfig, units: Units, workers: int, now: float | None = None, *, earlier: float = 0.0
    ) -> None:
        self.prices = prices
        self.units = units
        self.workers = float(workers)
        self.started = self.last = time.monotonic() if now is None else now
        self.worker_hours = 0.0
        self.first_step: int | None = None
        self.first_seen = self.started
        self.earlier = earlier  # earlier sessions' bill, carried once the run turns out to resume
        self.carried = 0.0

    @classmethod
    def for_config(cls, config: Config, now: float | None = None) -> CostMeter | None:
        """The run's meter, or None when no price is set."""
        if not config.cost.enabled:
            return None
        earlier = earlier_sessions_cost(config.run_dir / "metrics.jsonl")
        return cls(config.cost, units_per_worker(config.scaling), config.scaling.max_workers, now, earlier=earlier)

    def advance(self, now: float, workers: float | None = None) -> None:
        """Bill the time since the last call at the worker count that held over it, then take ``workers``."""
        self.worker_hours += self.workers * max(0.0, now - self.last) / 3600.0
        self.last = now
        if workers is not None and workers > 0:
            self.workers = float(workers)

    def estimate(
        self, now: float, step: int, total_steps: int | None, workers: float | None = None, *, resumed: bool = False
    ) -> CostEstimate:
        """The bill at ``now``, with the projection to ``total_steps`` (None: not projected).
        The pace is counted from step 0 at the driver's start, or for a ``resumed`` run from its
        first report (whose steps were trained by earlier sessions)."""
        self.advance(now, workers)
        if self.first_step is None:
            self.first_step, self.first_seen = (step, now) if resumed else (0, self.started)
            self.carried = self.earlier if resumed else 0.0
        gpu_hours = self.worker_hours * self.units.gpus
        cpu_hours = self.worker_hours * self.units.cpus
        # worker-hours at one worker's rate, plus what earlier sessions of a resumed run cost
        so_far = self.carried + hourly_rate(self.prices, self.units, self.worker_hours)
        projected = None
        if total_steps is not None:
            rate = hourly_rate(self.prices, self.units, self.workers)
            projected = project(so_far, rate, now - self.first_seen, step - self.first_step, total_steps - step)
        return CostEstimate(
            currency=self.prices.currency,
            so_far=so_far,
            projected_total=projected,
            price_per_gpu_hour=self.prices.price_per_gpu_hour,
            price_per_cpu_hour=self.prices.price_per_cpu_hour,
            gpu_hours=gpu_hours,
            cpu_hours=cpu_hours,
        )

    def final(self, report: Report | None, wall_time_s: float) -> CostEstimate:
        """The bill for the whole driver session (``wall_time_s`` from the meter's start), for summary.json."""
        if report is None:
            return self.estimate(self.started + wall_time_s, 0, None)
        return self.estimate(self.started + wall_time_s, report.step, report.total_steps, _workers(report))

    def on_report(self, report: Report, now: float | None = None) -> Report:
        """The report with the figures ``cost/so_far`` and ``cost/projected_total`` and its currency
        (a new Report)."""
        estimate = self.estimate(
            time.monotonic() if now is None else now,
            report.step,
            report.total_steps,
            _workers(report),
            resumed=any(isinstance(event, Resumed) for event in report.events),
        )
        figures = {SO_FAR_KEY: estimate.so_far}
        if estimate.projected_total is not None:
            figures[PROJECTED_KEY] = estimate.projected_total
        return replace(report, figures={**report.figures, **figures}, currency=estimate.currency)


def earlier_sessions_cost(metrics_path: Path) -> float:
    """The last ``cost/so_far`` a run directory's metrics.jsonl holds (0 without one): what the
    run's earlier driver sessions cost, each session's figure including those before it."""
    last = 0.0
    try:
        lines = metrics_path.read_text(errors="replace").splitlines()
    except OSError:
        return 0.0
    for line in lines:
        if SO_FAR_KEY not in line:
            continue
        try:
            report = Report.from_json(json.loads(line))
        except ValueError:
            continue  # a line cut short by a crash
        value = report.figures.get(SO_FAR_KEY) if report is not None else None
        if value is not None and math.isfinite(value) and value >= 0:
            last = float(value)
    return last


def _workers(report: Report) -> float | None:
    return float(report.world_size) if report.world_size is not None else None
