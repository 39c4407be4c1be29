"""The search's entry point: ``search(config, space) -> TuneResult``, which ``trainforge.tune(...)``
(the package, made callable) and ``trainforge.api.tune`` both are."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

    from trainforge.config import Config


@dataclass(frozen=True)
class TuneResult:
    """The outcome of a search: the tune_summary.json content plus where the search lives."""

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


def search(
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
    # Here, not at the top: the package stays light for what imports only space files or schedulers.
    from trainforge.config import load_config
    from trainforge.tune.runner import run_search
    from trainforge.tune.space import load_space, parse_space

    flags = {"num_trials": trials, "scheduler": scheduler, "search": search}
    resolved = load_config(config, [*overrides, *(f"tune.{k}={v}" for k, v in flags.items() if v is not None)])
    parsed = parse_space(space, resolved) if isinstance(space, Mapping) else load_space(Path(space), resolved)
    summary = run_search(resolved, parsed, address=address, verbose=verbose, console=console)
    return TuneResult(summary, resolved.run_dir)
