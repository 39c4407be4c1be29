"""Every worker's log lines in one file: ``<run dir>/workers.log``."""

from __future__ import annotations

from pathlib import Path

from trainforge.observers.base import Observer, SinkSetup
from trainforge.protocol import LogLine, RunInfo
from trainforge.redact import redact_text

WORKERS_LOG = "workers.log"


class WorkerLog(Observer):
    """Appends every worker's log lines (tagged with rank and node) to ``<run dir>/workers.log``."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / WORKERS_LOG

    def on_start(self, info: RunInfo) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def on_log(self, lines: list[LogLine]) -> None:
        with self.path.open("a") as handle:
            handle.writelines(redact_text(line.text) + "\n" for line in lines)  # also what print() wrote


def sink(setup: SinkSetup) -> WorkerLog:
    return WorkerLog(setup.run_dir)
