"""The Python entry points: ``fit(config) -> RunResult`` and ``tune(config, space) -> TuneResult``."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from trainforge.config import Config, load_config
from trainforge.display import ProgressDisplay
from trainforge.launch import raise_if_failed, run_training
from trainforge.metrics.observer import metrics_observers
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
    train_callbacks: Sequence[Any] = (),
    lock_wait_s: float = 0.0,
) -> RunResult:
    """Train the run a config describes; raises TrainforgeError for user errors and failed runs.

    ``train_callbacks``: extra Ray Train callbacks for the run's controller (used by tune's trials).
    ``lock_wait_s``: how long to wait for another run holding the run directory (runlock.py) to
    end before giving up with RunLockedError; a restarted tune trial waits for its previous process.
    """
    resolved = load_config(config, overrides)
    shown = console or Console(stderr=True)
    # The report comes after the others: it reads what they wrote; the tracker uploads the report.
    run_dir = resolved.run_dir
    tracker = make_tracker(resolved, run_dir)
    watchers: list[Observer] = [
        ProgressDisplay(shown),
        MetricsLog(run_dir),
        WorkerLog(run_dir),
        *metrics_observers(resolved),
        *observers,
        ReportWriter(run_dir),
        *([tracker] if tracker is not None else []),
    ]
    try:
        summary = run_training(
            resolved, watchers, address=address, verbose=verbose, callbacks=train_callbacks, lock_wait_s=lock_wait_s
        )
    except BaseException:
        if tracker is not None:
            tracker.on_error()
        raise
    raise_if_failed(summary, resolved.run_dir)
    if tracker is not None:
        tracker.raise_if_incomplete()
    return RunResult(summary, resolved.run_dir)


@dataclass(frozen=True)
class TuneResult:
    """The outcome of ``tune``: the tune_summary.json content plus where the search lives."""

    summary: dict[str, Any]
    search_dir: Path

    @property
    def trials(self) -> list[dict[str, Any]]:
        return list(self.summary["trials"])

    @property
    def best(self) -> dict[str, Any] | None:
        return self.summary.get("best")

    @property
    def best_config(self) -> Path | None:
        """best.yaml: the best trial's complete config, which ``trainforge train`` runs as is."""
        best = self.best
        return Path(best["best_yaml"]) if best else None


def tune(
    config: str | os.PathLike[str] | Mapping[str, Any] | Config,
    space: str | os.PathLike[str] | Mapping[str, Any],
    overrides: Iterable[str] = (),
    *,
    trials: int | None = None,
    scheduler: str | None = None,
    search: str | None = None,
    address: str | None = None,
    verbose: bool = False,
    console: Console | None = None,
) -> TuneResult:
    """Search hyperparameters: every trial a complete run under ``<run.output_dir>/<run.name>/``.

    ``space`` is a space file or a mapping of config keys to domains (trainforge/tune/space.py);
    ``trials``, ``scheduler`` and ``search`` set ``tune.num_trials``, ``tune.scheduler`` and
    ``tune.search``. Re-running the same search continues it. Raises TrainforgeError for user
    errors and TrainingFailed when no trial produced the metric.
    """
    from trainforge.tune.runner import run_search
    from trainforge.tune.space import load_space, parse_space

    flags = {"num_trials": trials, "scheduler": scheduler, "search": search}
    resolved = load_config(config, [*overrides, *(f"tune.{k}={v}" for k, v in flags.items() if v is not None)])
    parsed = parse_space(space, resolved) if isinstance(space, Mapping) else load_space(Path(space), resolved)
    summary = run_search(resolved, parsed, address=address, verbose=verbose, console=console)
    return TuneResult(summary, resolved.run_dir)
