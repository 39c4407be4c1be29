"""The run's record of reports: ``<run dir>/metrics.jsonl``, one JSON line per report, failure and hang."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from trainforge.observers.base import Observer, SinkSetup
from trainforge.protocol import Report, RunInfo, WorkerFailure
from trainforge.redact import redact_strings

METRICS_FILE = "metrics.jsonl"
DRIVER_START = "driver_start"  # metrics.jsonl's ``event`` when a driver session starts the run (again)


class MetricsLog(Observer):
    """Appends every report (``Report.to_json``) and worker failure to ``<run dir>/metrics.jsonl``:
    the source the summary's replay (driver/summary.RunLog), the report and MLflow's catch-up read."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / METRICS_FILE

    def on_start(self, info: RunInfo) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # A driver session begins: a replay (driver/summary.RunLog) counts restarts from the last one on.
        self._append({"event": DRIVER_START, "time": time.time()})

    def on_report(self, report: Report) -> None:
        self._append(report.to_json())

    def on_worker_error(self, failure: WorkerFailure) -> None:
        self._append(failure.to_json())

    def on_hang(self, diagnosis: Any) -> None:
        """driver/hangs.Diagnosis: ``{"event": "hang", "step", "text", "ranks", ...}``."""
        self._append(diagnosis.to_json())

    def _append(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as handle:
            handle.write(json.dumps(redact_strings(record)) + "\n")  # a worker's error may quote a secret


def sink(setup: SinkSetup) -> MetricsLog:
    return MetricsLog(setup.run_dir)
