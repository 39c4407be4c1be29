"""``trainforge report RUN_DIR``: plots and a self-contained HTML page from a run directory.

The report reads only what the driver wrote (``metrics.jsonl``, ``summary.json``, ``config.yaml``),
so it works for finished, stopped, failed and still-running runs, and on any machine the run
directory is copied to. It writes ``RUN_DIR/report/report.html`` and one PNG per plot next to it.
``data.py`` reads the run directory, ``plots.py`` draws, ``html.py`` lays out the page.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from trainforge.protocol import Report, RunInfo, WorkerFailure
from trainforge.report.data import REPORT_DIR, ReportError, RunData, load_run

log = logging.getLogger("trainforge")

__all__ = ["REPORT_DIR", "ReportError", "ReportWriter", "RunData", "load_run", "write_report"]


def write_report(run_dir: str | Path, summary: dict[str, Any] | None = None) -> Path:
    """Write ``RUN_DIR/report/`` (PNGs and report.html) and return the path of report.html."""
    # Here, not at the top: matplotlib loads only when a report is written, not with every driver.
    from trainforge.report.html import render_page
    from trainforge.report.plots import render_plots

    data = load_run(run_dir, summary)
    out = data.run_dir / REPORT_DIR
    try:
        out.mkdir(exist_ok=True)
    except OSError as err:
        raise ReportError(f"cannot write the report into {out}: {err.strerror or err}") from None
    plots = render_plots(data, out)
    page = out / "report.html"
    page.write_text(render_page(data, plots), encoding="utf-8")
    return page


class ReportWriter:
    """Observer that writes the run report when the run ends, whatever its status.

    A report that cannot be written is a warning, never an error: the run's outcome stands.
    """

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)

    def on_start(self, info: RunInfo) -> None:
        pass

    def on_report(self, report: Report) -> None:
        pass

    def on_worker_error(self, failure: WorkerFailure) -> None:
        pass

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
