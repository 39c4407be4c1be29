"""The Python entry points: ``fit(config) -> RunResult`` and ``tune(config, space) -> TuneResult``.

The top of the driver's layers (pyproject.toml's import contracts): only the CLI and the package
root import it. ``fit`` is ``driver/run.train`` on a config file; ``tune`` is ``trainforge.tune.search.search``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from trainforge.config import Config, load_config
from trainforge.consoles import DataConsole
from trainforge.driver.run import train
from trainforge.driver.startup import Timeline
from trainforge.models import passed
from trainforge.observers import Observer
from trainforge.observers.console import StartupLines
from trainforge.tune.search import TuneResult
from trainforge.tune.search import search as tune

__all__ = ["RunResult", "TuneResult", "fit", "tune"]


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
    resume: str | None = None,
    model: Any = None,
    data: Any = None,
) -> RunResult:
    """Train the run a config describes; raises TrainforgeError for user errors and failed runs.

    ``observers``: more observers of the run's reports (driver/run.train adds the standard ones).
    ``train_callbacks``: extra Ray Train callbacks for the run's controller.
    ``lock_wait_s``: how long to wait for another run holding the run directory (driver/runlock.py) to
    end before giving up with RunLockedError.
    ``resume``: as ``trainforge train --resume``: ``auto``, ``none`` or a checkpoint path (sets
    checkpoint.resume). A run directory trained with a different config is refused (ConfigError
    naming the changed keys) unless ``resume`` is given: the run then continues with the new values.
    ``model``: an ``nn.Module``, or a function or class that builds one (called with model.kwargs),
    in place of model.name / model.factory; ``data``: a map-style ``Dataset`` of training pairs or a
    ``UserData``, in place of the data source. Both may be defined in the caller (a notebook cell,
    ``__main__``): they are pickled once and every worker trains on its own copy (models/passed.py).
    """
    startup = Timeline()  # from the call (the CLI's process start, where the CLI called)
    objects = passed.pack(model, data) if model is not None or data is not None else None
    resume_override = [f"checkpoint.resume={resume}"] if resume is not None else []
    source = passed.config_naming(config, model=model is not None, data=data is not None)
    resolved = load_config(source, [*overrides, *resume_override])
    startup.mark("cli")
    console = console or DataConsole(stderr=True)  # one console for the start-up lines and the progress
    startup.watch(StartupLines(console))
    with passed.installed(objects):
        summary = train(
            resolved,
            console=console,
            observers=observers,
            address=address,
            verbose=verbose,
            callbacks=train_callbacks,
            lock_wait_s=lock_wait_s,
            startup=startup,
            changed_config="refuse" if resume is None else "continue",
        )
    return RunResult(summary, resolved.run_dir)
