"""``trainforge report RUN_DIR``: plots and a self-contained HTML page from a run directory.

The report reads only what the driver wrote (``metrics.jsonl``, ``summary.json``, ``config.yaml``),
so it works for finished, stopped, failed and still-running runs, and on any machine the run
directory is copied to. It writes ``RUN_DIR/report/report.html`` and one PNG per plot next to it.
``data.py`` reads the run directory, ``plots.py`` draws, ``html.py`` lays out the page. A run
writes its report at its end through observers/report.py.
"""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any

from trainforge.errors import shown
from trainforge.files import check_output_path, file_kind
from trainforge.report.data import REPORT_DIR, ReportError, RunData, load_run

__all__ = ["REPORT_DIR", "ReportError", "RunData", "load_run", "write_report"]


def write_report(run_dir: str | Path, summary: dict[str, Any] | None = None) -> Path:
    """Write ``RUN_DIR/report/`` (PNGs and report.html) and return the path of report.html."""
    # Here, not at the top: matplotlib loads only when a report is written, not with every driver.
    from trainforge.report.html import render_page
    from trainforge.report.plots import render_plots

    data = load_run(run_dir, summary)
    out = data.run_dir / REPORT_DIR
    # The run directory is data: a link there (the folder, a page or a plot in it) is not written through.
    check_output_path(out, "the report's folder", "folder", ReportError)
    try:
        out.mkdir(exist_ok=True)
        odd = sorted((item.name, item.lstat().st_mode) for item in out.iterdir() if not _a_plain_file(item))
    except OSError as err:
        raise ReportError(f"cannot write the report into {out}: {err.strerror or err}") from None
    if odd:
        # A page or plot is replaced only where a regular file is: a FIFO would hang the write, a folder fail it.
        name, mode = odd[0]
        what = "a symbolic link" if stat.S_ISLNK(mode) else file_kind(mode)
        raise ReportError(f"{out} holds {what} ({shown(name)}): the report is written among regular files only")
    plots = render_plots(data, out)
    page = out / "report.html"
    page.write_text(render_page(data, plots), encoding="utf-8")
    return page


def _a_plain_file(path: Path) -> bool:
    return stat.S_ISREG(path.lstat().st_mode)
