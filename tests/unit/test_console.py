"""The console (observers/console.py), fed reports in one process: start-up lines, progress on a
terminal and on a pipe, validation lines with the task's metrics, elapsed and ETA, the end."""

from __future__ import annotations

import io
import shlex
from pathlib import Path
from typing import Any

from rich.console import Console

from trainforge.cli.run import resume_command
from trainforge.config import load_config
from trainforge.driver.startup import Timeline
from trainforge.observers.console import PLAIN_EVERY_S, ProgressDisplay, StartupLines, validation_metrics
from trainforge.protocol import Note, Report, RunInfo, ValidationStarted

INFO = RunInfo("digits", 2, "a local Ray", "runs/digits")


def console(*, terminal: bool) -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=terminal, width=200, color_system=None), out


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def report(step: int, at: float, **extra: Any) -> Report:
    figures = {
        "train/loss": 1.0 / step,
        "perf/samples_per_s": 640.0,
        "perf/step_time_s": 0.05,
        **extra.pop("figures", {}),
    }
    return Report(step=step, epoch=step // 50, total_steps=200, time=at, figures=figures, **extra)


def summary(status: str, **extra: Any) -> dict[str, Any]:
    final = {"train/loss": 0.1, "val/loss": 0.2, "val/accuracy": 0.9}
    return {
        "status": status,
        "global_step": 120,
        "epoch": 2,
        "wall_time_s": 30.0,
        "throughput_samples_per_s": 600.0,
        "final_metrics": final,
        **extra,
    }


def test_plain_output_prints_a_line_per_interval_and_every_report_that_says_something() -> None:
    out_console, out = console(terminal=False)
    clock = Clock()
    display = ProgressDisplay(out_console, clock=clock)
    display.on_start(INFO)
    display.on_report(report(10, 1000.0))  # the first: printed
    clock.now = PLAIN_EVERY_S / 2
    display.on_report(report(20, 1001.0))  # too soon: not printed
    display.on_report(report(30, 1002.0, events=(Note("batch size 32 chosen"),)))  # an event: printed
    clock.now = PLAIN_EVERY_S * 2
    display.on_report(report(40, 1003.0))  # due again
    display.on_report(report(200, 1019.0, status="finished"))  # the last: always
    lines = out.getvalue().splitlines()
    steps = [line.split()[1] for line in lines if line.startswith("step ")]
    assert steps == ["10/200", "30/200", "40/200", "200/200"], lines
    assert "batch size 32 chosen" in lines


def test_the_progress_line_has_epoch_loss_samples_per_s_elapsed_and_eta() -> None:
    out_console, out = console(terminal=False)
    clock = Clock()
    display = ProgressDisplay(out_console, clock=clock)
    display.on_report(report(10, 1000.0, figures={"time/elapsed_s": 3.0}))
    clock.now = PLAIN_EVERY_S
    # 10 steps in 10 s since the first report: 1 s a step, 150 steps to go.
    display.on_report(report(50, 1040.0, figures={"time/elapsed_s": 43.0}))
    first, second = out.getvalue().splitlines()
    # Before a second report the ETA is the step time's: 190 steps of 0.05 s.
    assert first.endswith("elapsed 0:03  eta 0:10"), first
    assert second.startswith("step 50/200  epoch 1  loss 0.0200"), second
    assert "samples/s 640" in second and second.endswith("elapsed 0:43  eta 2:30"), second


def test_a_validation_line_names_each_of_the_tasks_metrics_once() -> None:
    out_console, out = console(terminal=False)
    display = ProgressDisplay(out_console)
    regression = {"step": 50, "val/loss": 0.0123, "val/mse": 0.0123, "val/mae": 0.0871, "val/r2": 0.874}
    display.on_validation_start(ValidationStarted(50))
    display.on_validation_start(ValidationStarted(50))  # the last step's pass and the final one: said once
    display.on_report(report(60, 1000.0, history=[{"step": 50, "train/loss": 0.5}, regression]))
    display.on_report(report(70, 1001.0, history=[regression]))  # the same pass again: said once
    lines = out.getvalue().splitlines()
    assert lines[0] == "validating at step 50…" and lines.count(lines[0]) == 1
    said = [line for line in lines if line.startswith("validation at")]
    assert said == ["validation at step 50: loss 0.0123  mse 0.0123  mae 0.0871  r2 0.8740"]
    assert validation_metrics({"val/accuracy": 0.91234, "val_ema/loss": 0.5}) == "accuracy 0.9123  val_ema/loss 0.5"


def test_a_terminal_gets_a_bar_with_step_total_and_eta() -> None:
    out_console, out = console(terminal=True)
    display = ProgressDisplay(out_console)
    display.on_start(INFO)
    assert display.progress is not None
    display.on_report(report(100, 1000.0))
    display.on_report(report(200, 1010.0, status="finished"))
    display.on_end(summary("finished"))
    text = out.getvalue()
    assert "step 200/200" in text and "eta 0:00" in text and "━" in text, text
    assert "finished at step 120 in 30.0 s" in text


def test_the_end_line_says_stopped_runs_are_resumable_and_early_ends_their_best_step() -> None:
    out_console, out = console(terminal=False)
    ProgressDisplay(out_console).on_end(summary("stopped"))
    early = {"step": 120, "best_step": 80, "best": 0.2, "metric": "val/loss"}
    ProgressDisplay(out_console).on_end(summary("finished", stopped_early=early))
    asked = {"source": "callback", "reason": "loss below 0.1", "step": 120}
    ProgressDisplay(out_console).on_end(summary("finished", stopped_by=asked))
    stopped, ended, callback = out.getvalue().splitlines()
    assert stopped.startswith("stopped (resumable) at step 120 in 30.0 s · epoch 2  loss 0.1000  val_loss 0.2000")
    assert ended.startswith("finished early (best val/loss 0.2 at step 80) at step 120")
    assert callback.startswith("finished early (loss below 0.1) at step 120")


def test_start_up_phases_are_printed_as_they_are_marked_in_order() -> None:
    out_console, out = console(terminal=False)
    timeline = Timeline(start=100.0)
    timeline.mark("cli", 100.3)
    timeline.watch(StartupLines(out_console))  # what was marked before is told at once
    timeline.mark("imports", 109.5)
    timeline.add({"first_step": 121.0, "controller": 112.0, "model": 118.25})  # rank 0's arrive together
    timeline.mark("imports", 130.0)  # a phase's first end is the one kept: not told again
    assert out.getvalue().splitlines() == [
        "    0.3 s  config read",
        "    9.5 s  torch and Ray imported",
        "   12.0 s  Ray Train controller started",
        "   18.2 s  model built",
        "   21.0 s  first step done",
    ]


def test_the_resume_command_is_the_run_s_own_with_secrets_masked(tmp_path: Path) -> None:
    sets = ["optim.lr=0.1", "tracking.uri=http://alice:S3CR3T@host:5000", "model.kwargs.api_token=abc"]
    config = {"model": {"name": "mlp"}, "train": {"max_steps": 5}, "run": {"output_dir": str(tmp_path)}}
    started_fresh = load_config({**config, "checkpoint": {"resume": "none"}}, env={})
    said = resume_command("my run.yaml", sets, "head:6379", True, started_fresh)
    assert shlex.split(said) == [
        "trainforge",
        "train",
        "my run.yaml",
        *("--set", "optim.lr=0.1", "--set", "tracking.uri=http://alice:***@host:5000"),
        *("--set", "model.kwargs.api_token=***", "--address", "head:6379", "--resume", "auto", "--verbose"),
    ]
    assert resume_command("c.yaml", None, None, False, load_config(config, env={})) == "trainforge train c.yaml"
