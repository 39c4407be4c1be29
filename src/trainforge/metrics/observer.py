"""Driver side: worker-group failures as ``trainforge_restarts{reason}``.

The workers cannot count their own deaths; the driver sees every failure through observe.py's
``on_worker_error`` (forwarded by the Ray Train controller's callback) and records it with
``ray.util.metrics`` from the driver process, which exports through its node's metrics agent
like any Ray worker. All reasons start at 0 so that the series exist before the first failure.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from trainforge.config import Config
from trainforge.metrics.export import Gauges
from trainforge.metrics.names import DRIVER, RESTART_REASONS

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


class RestartMetrics:
    """Observer (observe.py) that records the run's worker-group failures by reason."""

    def __init__(self, config: Config) -> None:
        self.labels = {"run": config.run.name, "trial": config.metrics.trial or ""}
        self.counts = dict.fromkeys(RESTART_REASONS, 0)
        self.gauges: Gauges | None = None

    def on_start(self, info: dict[str, Any]) -> None:
        self.gauges = Gauges(DRIVER, self.labels)
        for reason in self.counts:
            self._record(reason)

    def on_report(self, metrics: dict[str, Any]) -> None:
        pass

    def on_worker_error(self, errors: dict[int, str]) -> None:
        reason = failure_reason(errors.values())
        self.counts[reason] += 1
        self._record(reason)

    def on_end(self, summary: dict[str, Any]) -> None:
        pass

    def _record(self, reason: str) -> None:
        if self.gauges is not None:
            self.gauges.set("trainforge_restarts", self.counts[reason], reason=reason)


def metrics_observers(config: Config) -> list[RestartMetrics]:
    """What ``api.fit`` adds to its observers: the restart gauge, when ``metrics.enabled``."""
    return [RestartMetrics(config)] if config.metrics.enabled else []
