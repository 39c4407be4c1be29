"""The driver's side of the typed protocol without Ray (driver/events.py, observers/): the
controller callback takes each rank's Report out of Ray Train's metrics and merges the per-node
samples, the Pump hands each kind of mail to its typed callback, metrics.jsonl gets Report.to_json,
and the console colours an event by its level, not by its words."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from trainforge.driver import events as observe
from trainforge.observers import Observers
from trainforge.observers.console import ProgressDisplay
from trainforge.observers.metrics_log import MetricsLog
from trainforge.protocol import (
    REPORT_KEY,
    CheckpointSkipped,
    LogBatch,
    LogLine,
    Note,
    Report,
    Resumed,
    RunInfo,
    SaveFailed,
    ValidationStarted,
    WorkerFailure,
)


class Remote:
    """An actor method's ``.remote`` that records its calls."""

    def __init__(self) -> None:
        self.calls: list[Any] = []

    def remote(self, *args: Any) -> None:
        self.calls.append(args[0] if len(args) == 1 else args)


def rank_report(step: int, node: str, **figures: float) -> Report:
    return Report(step=step, world_size=2, figures={"train/loss": 0.5, f"system/{node}/cpu_percent": 10.0, **figures})


def test_the_controller_forwards_rank_0s_report_with_every_nodes_samples() -> None:
    mailbox = SimpleNamespace(put=Remote())
    callback = observe.ForwardingCallback(mailbox)
    callback.after_report(
        None, [{REPORT_KEY: rank_report(5, "10.0.0.1")}, {REPORT_KEY: rank_report(5, "10.0.0.2")}], None
    )
    callback.after_report(None, [{"loss": 1.0}], None)  # not a trainforge worker's report: nothing forwarded
    callback.after_exception(None, {1: RuntimeError("boom\nsecond line")})
    report, failure = mailbox.put.calls
    assert isinstance(report, Report) and report.step == 5
    assert report.figures == {
        "train/loss": 0.5,
        "system/10.0.0.1/cpu_percent": 10.0,
        "system/10.0.0.2/cpu_percent": 10.0,
    }
    assert isinstance(failure, WorkerFailure) and failure.errors == {1: "RuntimeError: boom"}
    assert observe.merge_reports([]) is None


class Recorder:
    """An observer that keeps what it was handed, by callback."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, Any]] = []

    def on_start(self, info: RunInfo) -> None:
        self.seen.append(("start", info))

    def on_report(self, report: Report) -> None:
        self.seen.append(("report", report))

    def on_worker_error(self, failure: WorkerFailure) -> None:
        self.seen.append(("worker_error", failure))

    def on_log(self, lines: list[LogLine]) -> None:
        self.seen.append(("log", lines))

    def on_validation_start(self, started: ValidationStarted) -> None:
        self.seen.append(("validation_start", started))

    def on_end(self, summary: dict[str, Any]) -> None:
        self.seen.append(("end", summary))


def test_the_pump_hands_each_kind_of_mail_to_its_callback(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    resumed = Report(step=11, time=1_790_000_009.5, events=(Resumed(10, "/c/checkpoint_000000010"),))
    lines = (LogLine(logging.WARNING, "2026 WARNING rank=1 node=10.0.0.2 x: careful"),)
    mail = [
        Report(step=5, time=1_790_000_000.0, checkpoint="/c/checkpoint_000000005"),
        WorkerFailure({0: "killed"}, 1_790_000_001.0),
        LogBatch(lines),
        ValidationStarted(10),
        resumed,
    ]
    monkeypatch.setattr(observe.ray, "get", lambda ref, timeout=None: ref)
    recorder, log = Recorder(), MetricsLog(tmp_path)
    pump = observe.Pump(SimpleNamespace(drain=SimpleNamespace(remote=lambda: list(mail))), Observers([recorder, log]))
    pump.drain()
    assert [kind for kind, _ in recorder.seen] == ["report", "worker_error", "log", "validation_start", "report"]
    assert recorder.seen[2][1] == list(lines)
    assert pump.last_report is resumed and pump.last_checkpoint is None
    assert (pump.recovery.restarts, pump.recovery.recovery_s) == (1, [8.5])
    written = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert written[1] == {"event": "worker_error", "errors": {"0": "killed"}, "time": 1_790_000_001.0}
    assert written[2]["events"][0]["kind"] == "resumed" and written[2]["events"][0]["step"] == 10


class Printed:
    """Stands in for rich's Console: keeps the markup it is asked to print."""

    is_terminal = False

    def __init__(self) -> None:
        self.lines: list[str] = []

    def print(self, text: str, **options: Any) -> None:
        self.lines.append(text)


def test_the_console_colours_an_event_by_its_level_not_its_words() -> None:
    printed = Printed()
    display = ProgressDisplay(printed)  # type: ignore[arg-type]
    display.on_report(
        Report(
            step=3,
            total_steps=10,
            events=(
                Resumed(2, "/runs/failed-skipped/checkpoint_000000002"),  # words that fooled the old colouring
                CheckpointSkipped("checkpoint_000000003", "a failed write"),
                SaveFailed(3, "disk full"),
                Note("out of memory with micro-batch 16: step retried", "warning"),
            ),
        )
    )
    assert printed.lines[:4] == [
        "[cyan]resumed from /runs/failed-skipped/checkpoint_000000002 at step 2[/]",
        "[yellow]skipped checkpoint checkpoint_000000003: a failed write[/]",
        "[red]checkpoint save at step 3 failed: disk full[/]",
        "[yellow]out of memory with micro-batch 16: step retried[/]",
    ]
    assert printed.lines[4].startswith("step 3/10  epoch 0")
