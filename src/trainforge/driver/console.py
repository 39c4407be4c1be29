"""The progress display: a rich bar on a terminal, one plain line per report elsewhere (CI, files)."""

from __future__ import annotations

import logging
import time
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from trainforge.protocol import CURRENCY_KEY, PROJECTED_KEY, SO_FAR_KEY
from trainforge.redact import redact_text


def describe(metrics: dict[str, Any]) -> str:
    """The few numbers a user watches, in one short line."""
    parts = [f"epoch {metrics.get('epoch', 0)}"]
    for key, label, fmt in (
        ("train/loss", "loss", "{:.4f}"),
        ("train/accuracy", "acc", "{:.3f}"),
        ("val/loss", "val_loss", "{:.4f}"),
        ("val/accuracy", "val_acc", "{:.3f}"),
        ("perf/samples_per_s", "samples/s", "{:,.0f}"),
    ):
        if key in metrics:
            parts.append(f"{label} {fmt.format(metrics[key])}")
    if SO_FAR_KEY in metrics:
        parts.append(describe_cost(metrics[SO_FAR_KEY], metrics.get(PROJECTED_KEY), str(metrics.get(CURRENCY_KEY, ""))))
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

    def on_start(self, info: dict[str, Any]) -> None:
        self.console.print(
            f"[bold]trainforge[/] run [cyan]{info['name']}[/] · {info['workers']} worker(s) on {info['cluster']}"
            f" · output {info['run_dir']}",
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

    def on_report(self, metrics: dict[str, Any]) -> None:
        for event in metrics.get("events", []):
            colour = "red" if "failed" in event else "yellow" if "skipped" in event else "cyan"
            self.console.print(f"[{colour}]{escape(redact_text(event))}[/]", highlight=False, soft_wrap=True)
        step, total = metrics.get("step", 0), metrics.get("total_steps")
        if self.progress is not None:
            self.progress.update(self.task_id, completed=step, total=total, description=describe(metrics))
        else:
            self.console.print(f"step {step}/{total}  {describe(metrics)}", highlight=False, soft_wrap=True)

    def on_worker_error(self, errors: dict[int, str], at: float | None = None) -> None:
        for rank, error in sorted(errors.items()):
            text = escape(redact_text(error))
            self.console.print(f"[yellow]worker {rank} failed:[/] {text}", highlight=False, soft_wrap=True)

    def on_log(self, lines: list[dict[str, Any]]) -> None:
        """Warnings and errors from any worker; the rest is in workers.log."""
        for line in lines:
            if line["level"] >= logging.WARNING:
                colour = "red" if line["level"] >= logging.ERROR else "yellow"
                self.console.print(f"[{colour}]{escape(redact_text(line['text']))}[/]", highlight=False, soft_wrap=True)

    def on_end(self, summary: dict[str, Any]) -> None:
        if self.progress is not None:
            self.progress.stop()
        final = {**summary.get("final_metrics", {}), "epoch": summary["epoch"]}
        cost = summary.get("cost")
        if isinstance(cost, dict):  # the whole session's bill, not the last report's
            final.update({SO_FAR_KEY: cost["so_far"], CURRENCY_KEY: cost["currency"]})
            final.pop(PROJECTED_KEY, None)
        colour = {"finished": "green", "stopped": "yellow"}.get(summary["status"], "red")
        self.console.print(
            f"[{colour}]{summary['status']}[/] at step {summary['global_step']} in {summary['wall_time_s']:.1f} s · "
            f"{describe(final)} · {summary['throughput_samples_per_s']:,.0f} samples/s (steady)",
            highlight=False,
            soft_wrap=True,
        )
