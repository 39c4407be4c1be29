"""The console: the run's start as it happens, then its progress (a rich bar on a terminal; on a
pipe or a file, plain lines at most every ``PLAIN_EVERY_S``, so logs stay readable), each
validation as it starts and with the task's metrics, the run's events, and how it ended.

Every line goes to one rich ``Console`` (stderr for the CLI): a second console writing while the
bar is live would tear it.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from trainforge.protocol import (
    PROJECTED_KEY,
    SO_FAR_KEY,
    LogLine,
    Report,
    RunInfo,
    ValidationStarted,
    WorkerFailure,
)
from trainforge.redact import redact_text

# An event's level -> its colour on the console
COLOURS = {"info": "cyan", "warning": "yellow", "error": "red"}
# On a pipe or in a file: a progress line at most this often (events, validations and the end
# are printed as they come).
PLAIN_EVERY_S = 10.0
# What each start-up phase's line says (driver/startup.py's phases, by the mark that ends them).
PHASE_TEXT = {
    "cli": "config read",
    "imports": "torch and Ray imported",
    "preflight": "checks passed",
    "ray": "Ray ready",
    "controller": "Ray Train controller started",
    "workers": "worker processes started",
    "process_group": "process group formed",
    "train_fn": "training function on the workers",
    "data": "data ready",
    "model": "model built",
    "restore": "checkpoint restored (or none to restore)",
    "first_step": "first step done",
}
# Figures of the progress line: (report key, label, format).
PROGRESS_FIGURES = (
    ("train/loss", "loss", "{:.4f}"),
    ("train/accuracy", "acc", "{:.3f}"),
    ("val/loss", "val_loss", "{:.4f}"),
    ("val/accuracy", "val_acc", "{:.3f}"),
    ("val/mse", "val_mse", "{:.4g}"),  # regression
    ("val/mae", "val_mae", "{:.4g}"),
    ("val/r2", "val_r2", "{:.3f}"),
    ("val/perplexity", "val_ppl", "{:.2f}"),  # causal_lm
    ("perf/samples_per_s", "samples/s", "{:,.0f}"),
)
# How a validation metric is shown by its name; others with FORMAT.
METRIC_FORMATS = {"loss": "{:.4f}", "accuracy": "{:.4f}", "r2": "{:.4f}", "perplexity": "{:.2f}"}
FORMAT = "{:.4g}"


def describe(figures: Mapping[str, float], *, epoch: int | None = None, currency: str | None = None) -> str:
    """The few numbers a user watches, in one short line: the loss, the task's validation
    metrics (classification: accuracy; regression: mse, mae, r2; causal_lm: perplexity), samples/s."""
    parts = [f"epoch {epoch or 0}"]
    for key, label, fmt in PROGRESS_FIGURES:
        if key in figures:
            parts.append(f"{label} {fmt.format(figures[key])}")
    if SO_FAR_KEY in figures:
        parts.append(describe_cost(figures[SO_FAR_KEY], figures.get(PROJECTED_KEY), currency or ""))
    return "  ".join(parts)


def describe_cost(so_far: float, projected: float | None, currency: str) -> str:
    """``cost 1.23 USD (projected 4.56)``: the bill so far and at the end of the run at this pace."""
    text = f"cost {so_far:,.2f} {currency}".rstrip()
    return text + (f" (projected {projected:,.2f})" if projected is not None else "")


def validation_metrics(point: Mapping[str, float]) -> str:
    """``loss 0.0123  mse 0.0123  mae 0.0871  r2 0.8740``: every validation metric of a pass
    (``val/...`` by its name; other passes, such as ``val_ema/...``, by their whole key)."""
    parts = []
    for key, value in point.items():
        if not key.startswith("val"):
            continue
        name = key.removeprefix("val/")
        parts.append(f"{name} {METRIC_FORMATS.get(name, FORMAT).format(value)}")
    return "  ".join(parts)


def hms(seconds: float | None) -> str:
    """``1:02:03`` / ``2:03``; ``?`` when unknown."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "?"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def ended_as(summary: Mapping[str, Any]) -> str:
    """How the run ended, in a few words: ``finished``; ``finished early (...)`` when early stopping
    or a callback ended it; ``stopped (resumable)``; ``failed``, ``aborted``."""
    status = str(summary["status"])
    early, ended = summary.get("stopped_early"), summary.get("stopped_by")
    if status == "finished" and isinstance(early, Mapping) and early.get("best_step") is not None:
        best = early.get("best")
        value = f" {best:.4g}" if isinstance(best, (int, float)) else ""
        return f"finished early (best {early.get('metric', 'metric')}{value} at step {early['best_step']})"
    if status == "finished" and isinstance(ended, Mapping) and ended.get("source") == "callback":
        return f"finished early ({ended.get('reason')})"
    return "stopped (resumable)" if status == "stopped" else status


class StartupLines:
    """A start-up watcher (driver/startup.Timeline.watch): a line per phase as it ends, with the
    seconds since the command (or the ``fit`` call) started."""

    def __init__(self, console: Console) -> None:
        self.console = console

    def __call__(self, name: str, seconds: float) -> None:
        text = PHASE_TEXT.get(name, name)
        self.console.print(f"{seconds:7.1f} s  {text}", highlight=False, soft_wrap=True)


class Pace:
    """Elapsed time and ETA from the reports' own clock: the pace measured since the first report
    this session saw, or, before a second report, the last report's step time."""

    def __init__(self) -> None:
        self.first: tuple[float, int] | None = None  # (unix time, step) of the first report
        self.elapsed_s: float | None = None
        self.eta_s: float | None = None

    def update(self, report: Report) -> None:
        at = report.time if report.time is not None else time.time()
        if self.first is None:
            self.first = (at, report.step)
        self.elapsed_s = report.figures.get("time/elapsed_s", at - self.first[0])
        remaining = (report.total_steps or report.step) - report.step
        then, step = self.first
        if report.step > step and at > then:
            self.eta_s = remaining * (at - then) / (report.step - step)
        elif "perf/step_time_s" in report.figures:
            self.eta_s = remaining * report.figures["perf/step_time_s"]

    def text(self) -> str:
        return f"elapsed {hms(self.elapsed_s)}  eta {hms(self.eta_s)}"


class ProgressDisplay:
    """Observer that shows step/total, epoch, loss, the task's metrics, samples/s, elapsed and ETA
    as reports arrive, and each validation."""

    def __init__(self, console: Console, clock: Callable[[], float] = time.monotonic) -> None:
        self.console = console
        self.clock = clock  # when plain lines are due
        self.live = console.is_terminal
        self.progress: Progress | None = None
        self.task_id: Any = None
        self.pace = Pace()
        self.last_line_at: float | None = None  # when the last plain progress line was printed
        self.announced: set[int] = set()  # steps whose validation start was printed
        self.validated: set[int] = set()  # steps whose validation result was printed

    def say(self, text: str) -> None:
        self.console.print(text, highlight=False, soft_wrap=True)

    def on_start(self, info: RunInfo) -> None:
        self.say(
            f"[bold]trainforge[/] run [cyan]{escape(info.name)}[/] · {info.workers} worker(s) on {info.cluster}"
            f" · output {escape(info.run_dir)}"
        )
        if self.live:
            self.progress = Progress(
                TextColumn("step {task.fields[steps]}"),
                BarColumn(),
                TextColumn("{task.description}"),
                TimeElapsedColumn(),
                TextColumn("eta {task.fields[eta]}"),
                console=self.console,
                transient=False,
            )
            self.progress.start()
            self.task_id = self.progress.add_task("starting workers…", total=None, steps="-", eta="?")

    def on_validation_start(self, started: ValidationStarted) -> None:
        if started.step not in self.announced:  # the last step's pass and the final one: said once
            self.announced.add(started.step)
            self.say(f"validating at step {started.step}…")

    def on_report(self, report: Report) -> None:
        for event in report.events:
            colour = COLOURS[event.level]
            self.say(f"[{colour}]{escape(redact_text(event.text))}[/]")
        for point in report.history:
            step = int(point["step"])
            metrics = validation_metrics(point)
            if metrics and step not in self.validated:
                self.validated.add(step)
                self.say(f"validation at step {step}: {metrics}")
        self.pace.update(report)
        step, total = report.step, report.total_steps
        line = describe(report.figures, epoch=report.epoch, currency=report.currency)
        if self.progress is not None:
            steps, eta = f"{step}/{total}", hms(self.pace.eta_s)
            self.progress.update(self.task_id, completed=step, total=total, description=line, steps=steps, eta=eta)
            return
        now = self.clock()
        due = self.last_line_at is None or now - self.last_line_at >= PLAIN_EVERY_S
        if due or report.status is not None or report.events:
            self.last_line_at = now
            self.say(f"step {step}/{total}  {line}  {self.pace.text()}")

    def on_hang(self, diagnosis: Any) -> None:
        """driver/hangs.Diagnosis: who did not arrive, where it is, what was done; in one line."""
        self.say(f"[yellow]{escape(redact_text(diagnosis.line))}[/]")

    def on_worker_error(self, failure: WorkerFailure) -> None:
        for rank, error in sorted(failure.errors.items()):
            self.say(f"[yellow]worker {rank} failed:[/] {escape(redact_text(error))}")

    def on_log(self, lines: list[LogLine]) -> None:
        """Warnings and errors from any worker; the rest is in workers.log."""
        for line in lines:
            if line.level >= logging.WARNING:
                colour = "red" if line.level >= logging.ERROR else "yellow"
                self.say(f"[{colour}]{escape(redact_text(line.text))}[/]")

    def on_end(self, summary: dict[str, Any]) -> None:
        if self.progress is not None:
            self.progress.stop()
        final = dict(summary.get("final_metrics", {}))
        currency = None
        cost = summary.get("cost")
        if isinstance(cost, dict):  # the whole session's bill, not the last report's
            final[SO_FAR_KEY], currency = cost["so_far"], cost["currency"]
            final.pop(PROJECTED_KEY, None)
        status = summary["status"]
        colour = {"finished": "green", "stopped": "yellow"}.get(status, "red")
        said = escape(ended_as(summary))
        line = describe(final, epoch=summary["epoch"], currency=currency)
        self.say(
            f"[{colour}]{said}[/] at step {summary['global_step']} in {summary['wall_time_s']:.1f} s · "
            f"{line} · {summary['throughput_samples_per_s']:,.0f} samples/s (steady)"
        )
