"""The progress display: a rich bar on a terminal, one plain line per report elsewhere (CI, files)."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from trainforge.protocol import PROJECTED_KEY, SO_FAR_KEY, LogLine, Report, RunInfo, WorkerFailure
from trainforge.redact import redact_text

# An event's level -> its colour on the console
COLOURS = {"info": "cyan", "warning": "yellow", "error": "red"}


def describe(figures: Mapping[str, float], *, epoch: int | None = None, currency: str | None = None) -> str:
    """The few numbers a user watches, in one short line."""
    parts = [f"epoch {epoch or 0}"]
    for key, label, fmt in (
        ("train/loss", "loss", "{:.4f}"),
        ("train/accuracy", "acc", "{:.3f}"),
        ("val/loss", "val_loss", "{:.4f}"),
        ("val/accuracy", "val_acc", "{:.3f}"),
        ("val/mse", "val_mse", "{:.4g}"),  # regression
        ("perf/samples_per_s", "samples/s", "{:,.0f}"),
    ):
        if key in figures:
            parts.append(f"{label} {fmt.format(figures[key])}")
    if SO_FAR_KEY in figures:
        parts.append(describe_cost(figures[SO_FAR_KEY], figures.get(PROJECTED_KEY), currency or ""))
    return "  ".join(parts)


def describe_cost(so_far: float, projected: float | None, currency: str) -> str:
    """``cost 1.23 USD (projected 4.56)``: the bill so far and at the end of the run at this pace."""
    text = f"cost {so_far:,.2f} {currency}".rstrip()
    return text + (f" (projected {projected:,.2f})" if projected is not None else "")


class ProgressDisplay:
    """Observer that shows step, epoch, loss, samples/s and ETA as reports arrive."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.live = console.is_terminal
        self.progress: Progress | None = None
        self.task_id: Any = None
        self.started = time.monotonic()

    def on_start(self, info: RunInfo) -> None:
        self.console.print(
            f"[bold]trainforge[/] run [cyan]{info.name}[/] · {info.workers} worker(s) on {info.cluster}"
            f" · output {info.run_dir}",
            soft_wrap=True,
        )
        if self.live:
            self.progress = Progress(
                TextColumn("step {task.completed}/{task.total}"),
                BarColumn(),
                TextColumn("{task.description}"),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                console=self.console,
                transient=False,
            )
            self.progress.start()
            self.task_id = self.progress.add_task("starting workers…", total=None)

    def on_report(self, report: Report) -> None:
        for event in report.events:
            colour = COLOURS[event.level]
            self.console.print(f"[{colour}]{escape(redact_text(event.text))}[/]", highlight=False, soft_wrap=True)
        step, total = report.step, report.total_steps
        line = describe(report.figures, epoch=report.epoch, currency=report.currency)
        if self.progress is not None:
            self.progress.update(self.task_id, completed=step, total=total, description=line)
        else:
            self.console.print(f"step {step}/{total}  {line}", highlight=False, soft_wrap=True)

    def on_worker_error(self, failure: WorkerFailure) -> None:
        for rank, error in sorted(failure.errors.items()):
            text = escape(redact_text(error))
            self.console.print(f"[yellow]worker {rank} failed:[/] {text}", highlight=False, soft_wrap=True)

    def on_log(self, lines: list[LogLine]) -> None:
        """Warnings and errors from any worker; the rest is in workers.log."""
        for line in lines:
            if line.level >= logging.WARNING:
                colour = "red" if line.level >= logging.ERROR else "yellow"
                self.console.print(f"[{colour}]{escape(redact_text(line.text))}[/]", highlight=False, soft_wrap=True)

    def on_end(self, summary: dict[str, Any]) -> None:
        if self.progress is not None:
            self.progress.stop()
        final = dict(summary.get("final_metrics", {}))
        currency = None
        cost = summary.get("cost")
        if isinstance(cost, dict):  # the whole session's bill, not the last report's
            final[SO_FAR_KEY], currency = cost["so_far"], cost["currency"]
            final.pop(PROJECTED_KEY, None)
        colour = {"finished": "green", "stopped": "yellow"}.get(summary["status"], "red")
        line = describe(final, epoch=summary["epoch"], currency=currency)
        self.console.print(
            f"[{colour}]{summary['status']}[/] at step {summary['global_step']} in {summary['wall_time_s']:.1f} s · "
            f"{line} · {summary['throughput_samples_per_s']:,.0f} samples/s (steady)",
            highlight=False,
            soft_wrap=True,
        )
