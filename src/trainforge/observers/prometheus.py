"""Prometheus, driver side: what only the driver sees, as gauges of the run (the workers export
their own, metrics/worker/).

* ``trainforge_restarts{reason}``: the workers cannot count their own deaths; the driver sees
  every failure through the observers' ``on_worker_error`` (forwarded by the Ray Train controller's
  callback). Every reason starts at 0, so the series exist before the first failure.
* ``trainforge_run_last_report_timestamp_seconds`` and ``trainforge_run_active``: the stall
  alert's input. A run that waits for workers (a lost node, no capacity) has no worker series at
  all; the driver's keep saying that the run is on and when it last made progress.
* ``trainforge_run_cost{currency}`` and ``trainforge_run_cost_projected{currency}``: with a price
  in the ``cost`` section, the figures the driver adds to each report (cost.py), and at the end the
  session's whole bill as summary.json states it.

The driver records with ``ray.util.metrics`` like any Ray worker; its node's metrics agent
exports them.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable
from typing import Any

from trainforge.config import Config
from trainforge.metrics.names import DRIVER, RESTART_REASONS
from trainforge.metrics.worker.export import Gauges
from trainforge.observers.base import Observer, SinkSetup
from trainforge.protocol import PROJECTED_KEY, SO_FAR_KEY, Report, RunInfo, WorkerFailure

# Ray's memory monitor (OutOfMemoryError), torch's CUDA OOM, the kernel's OOM killer seen by Ray.
# Heuristics on the first line of each rank's error, as the controller forwards it.
OOM = re.compile(r"OutOfMemoryError|out of memory|running low on memory|\boom", re.IGNORECASE)
NODE = re.compile(r"NodeDied|node (?:has )?died|node\b.{0,80}?\b(?:terminated|removed|lost|dead)\b", re.IGNORECASE)


def failure_reason(errors: Iterable[str]) -> str:
    """One reason per worker-group failure: oom if any rank ran out of memory, else node if a
    node was lost, else error."""
    texts = list(errors)
    if any(OOM.search(text) for text in texts):
        return "oom"
    if any(NODE.search(text) for text in texts):
        return "node"
    return "error"


class RunMetrics(Observer):
    """Observer that records the run's progress and its worker-group failures."""

    def __init__(self, config: Config) -> None:
        self.labels = {"run": config.run.name, "trial": config.metrics.trial or ""}
        self.counts = dict.fromkeys(RESTART_REASONS, 0)
        self.gauges: Gauges | None = None

    def on_start(self, info: RunInfo) -> None:
        self.gauges = Gauges(DRIVER, self.labels)
        self.gauges.set("trainforge_run_active", 1)
        self.gauges.set("trainforge_run_last_report_timestamp_seconds", time.time())
        for reason in self.counts:
            self._record_restarts(reason)

    def on_report(self, report: Report) -> None:
        if self.gauges is not None:
            at = report.time if report.time is not None else time.time()
            self.gauges.set("trainforge_run_last_report_timestamp_seconds", at)
            so_far = report.figures.get(SO_FAR_KEY)
            if so_far is not None:
                self._record_cost(so_far, report.figures.get(PROJECTED_KEY), report.currency or "")

    def on_worker_error(self, failure: WorkerFailure) -> None:
        reason = failure_reason(failure.errors.values())
        self.counts[reason] += 1
        self._record_restarts(reason)

    def on_end(self, summary: dict[str, Any]) -> None:
        if self.gauges is not None:
            cost = summary.get("cost")
            if isinstance(cost, dict):  # the session's whole bill, as summary.json states it
                self._record_cost(cost["so_far"], cost.get("projected_total"), str(cost["currency"]))
            self.gauges.set("trainforge_run_active", 0)

    def _record_cost(self, so_far: float, projected: float | None, currency: str) -> None:
        if self.gauges is None:
            return
        self.gauges.set("trainforge_run_cost", so_far, currency=currency)
        if projected is not None:
            self.gauges.set("trainforge_run_cost_projected", projected, currency=currency)

    def _record_restarts(self, reason: str) -> None:
        if self.gauges is not None:
            self.gauges.set("trainforge_restarts", self.counts[reason], reason=reason)


def sink(setup: SinkSetup) -> RunMetrics | None:
    """The run's Prometheus observer, when ``metrics.enabled``."""
    return RunMetrics(setup.config) if setup.config.metrics.enabled else None
