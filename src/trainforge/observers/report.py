"""The run report (report/), written when the run ends."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from trainforge.observers.base import Observer, SinkSetup
from trainforge.report import write_report

log = logging.getLogger("trainforge")


class ReportWriter(Observer):
    """Observer that writes the run report when the run ends, whatever its status; after the
    observers whose files it reads (metrics.jsonl, summary.json).

    A report that cannot be written is a warning, never an error: the run's outcome stands.
    """

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)

    def on_end(self, summary: dict[str, Any]) -> None:
        try:
            page = write_report(self.run_dir, summary)
        except Exception as err:  # the report is a convenience; training already succeeded or failed
            log.warning(
                "could not write the run report for %s: %s (retry with: trainforge report %s)",
                self.run_dir,
                err,
                self.run_dir,
            )
            return
        log.info("run report: %s", page)


def sink(setup: SinkSetup) -> ReportWriter:
    return ReportWriter(setup.run_dir)
