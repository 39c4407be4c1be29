"""The Python entry points: ``fit(config) -> RunResult`` (and, later, ``tune``)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from trainforge.config import Config, load_config
from trainforge.display import ProgressDisplay
from trainforge.launch import raise_if_failed, run_training
from trainforge.observe import MetricsLog, Observer, WorkerLog
from trainforge.report import ReportWriter
from trainforge.tracking import make_tracker


@dataclass(frozen=True)
class RunResult:
    """The outcome of ``fit``: the summary.json content plus where the run lives."""

    summary: dict[str, Any]
    run_dir: Path

    @property
    def status(self) -> str:
        return str(self.summary["status"])

    @property
    def metrics(self) -> dict[str, Any]:
        return dict(self.summary["final_metrics"])

    @property
    def checkpoint(self) -> str | None:
        return self.summary.get("checkpoint")

    @property
    def model_path(self) -> Path:
        return self.run_dir / "model.safetensors"


def fit(
    config: str | os.PathLike[str] | Mapping[str, Any] | Config,
    overrides: Iterable[str] = (),
    *,
    address: str | None = None,
    verbose: bool = False,
    console: Console | None = None,
    observers: Iterable[Observer] = (),
) -> RunResult:
    """Train the run a config describes; raises TrainforgeError for user errors and failed runs."""
    resolved = load_config(config, overrides)
    shown = console or Console(stderr=True)
    # The report comes after the others: it reads what they wrote; the tracker uploads the report.
    run_dir = resolved.run_dir
    tracker = make_tracker(resolved, run_dir)
    watchers: list[Observer] = [
        ProgressDisplay(shown),
        MetricsLog(run_dir),
        WorkerLog(run_dir),
        *observers,
        ReportWriter(run_dir),
        *([tracker] if tracker is not None else []),
    ]
    try:
        summary = run_training(resolved, watchers, address=address, verbose=verbose)
    except BaseException:
        if tracker is not None:
            tracker.on_error()
        raise
    raise_if_failed(summary, resolved.run_dir)
    if tracker is not None:
        tracker.raise_if_incomplete()
    return RunResult(summary, resolved.run_dir)
