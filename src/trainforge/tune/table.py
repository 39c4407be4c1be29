"""The search's live view: a rich table of trials on a terminal, one line per trial event elsewhere.

``TrialWatch`` receives Ray Tune's callback hooks (through ``relay.Relay``) in the search driver's
Tune loop and sees every trial's results as Tune does (only reports that carry the search metric
reach Tune). It also keeps when each trial started and ended, as the driver saw it, for the
summary and the benchmarks.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.table import Table


@dataclass
class TrialRow:
    trial_id: str
    params: dict[str, Any]
    status: str = "pending"
    step: int = 0
    total_steps: int | None = None
    last: float | None = None
    best: float | None = None
    started_at: float | None = None  # unix time of the first start seen by this driver
    ended_at: float | None = None
    starts: int = 0  # starts and restarts (PBT exploits, resumed searches)
    history: list[tuple[int, float]] = field(default_factory=list)


def fmt_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def short_names(keys: list[str]) -> dict[str, str]:
    """Column headers: a key's last part (optim.lr -> lr) where that is unambiguous."""
    last = [key.rsplit(".", 1)[-1] for key in keys]
    return {key: name if last.count(name) == 1 else key for key, name in zip(keys, last, strict=True)}


class TrialWatch:
    """Trial rows, shown live (terminal) or as event lines (CI, files)."""

    def __init__(self, console: Console, metric: str, mode: str, keys: list[str]) -> None:
        self.console = console
        self.metric = metric
        self.better = min if mode == "min" else max
        self.keys = keys
        self.rows: dict[str, TrialRow] = {}
        self.live: Live | None = None

    # -- Tune hooks, through relay.Relay (driver side) ------------------------------------------
    def setup(self) -> None:
        if self.console.is_terminal and self.live is None:
            self.live = Live(self.render(), console=self.console, refresh_per_second=2, transient=False)
            self.live.start()

    def on_trial_start(self, trial: Any) -> None:
        row = self.row(trial)
        row.params = dict(trial.config)  # PBT restarts an exploiting trial with new values
        row.status = "running"
        row.starts += 1
        row.started_at = row.started_at or time.time()
        what = "started" if row.starts == 1 else "restarted"
        self.event(f"trial {trial.trial_id} {what}: {self.params_text(row)}")

    def on_trial_result(self, trial: Any, result: dict[str, Any]) -> None:
        row = self.row(trial)
        row.params = dict(trial.config)  # PBT changes a trial's config when it exploits another
        row.step = int(result.get("step", row.step))
        row.total_steps = int(result["total_steps"]) if "total_steps" in result else row.total_steps
        value = result.get(self.metric)
        if isinstance(value, (int, float)) and math.isfinite(value):
            row.last = float(value)
            row.best = float(value) if row.best is None else self.better(row.best, float(value))
            row.history.append((row.step, float(value)))
        self.refresh()

    def on_trial_complete(self, trial: Any) -> None:
        row = self.row(trial)
        row.ended_at = time.time()
        early = row.total_steps is not None and row.step < row.total_steps
        row.status = "stopped" if early else "finished"
        self.event(f"trial {trial.trial_id} {row.status} at step {row.step}: {self.metric} {fmt_value(row.last)}")

    def on_trial_error(self, trial: Any) -> None:
        row = self.row(trial)
        row.ended_at = time.time()
        row.status = "failed"
        self.event(f"[red]trial {trial.trial_id} failed[/] at step {row.step}")

    # -- rendering -------------------------------------------------------------------------------
    def row(self, trial: Any) -> TrialRow:
        if trial.trial_id not in self.rows:
            self.rows[trial.trial_id] = TrialRow(trial.trial_id, dict(trial.config))
        return self.rows[trial.trial_id]

    def params_text(self, row: TrialRow) -> str:
        return ", ".join(f"{key}={fmt_value(row.params.get(key))}" for key in self.keys)

    def event(self, text: str) -> None:
        if self.live is not None:
            self.live.console.print(text, highlight=False, soft_wrap=True)
            self.refresh()
        else:
            self.console.print(text, highlight=False, soft_wrap=True)

    def refresh(self) -> None:
        if self.live is not None:
            self.live.update(self.render())

    def render(self) -> Table:
        best = self.best_row()
        table = Table(title=f"trials ({self.metric}, {'lower' if self.better is min else 'higher'} is better)")
        names = short_names(self.keys)
        for column in ("trial", "status", *(names[k] for k in self.keys), "step", self.metric, "best"):
            table.add_column(column, justify="right" if column not in ("trial", "status") else "left")
        for row in self.rows.values():
            steps = f"{row.step}/{row.total_steps}" if row.total_steps else str(row.step)
            mark = " *" if best is row else ""
            table.add_row(
                row.trial_id + mark,
                row.status,
                *(escape(fmt_value(row.params.get(key))) for key in self.keys),
                steps,
                fmt_value(row.last),
                fmt_value(row.best),
            )
        return table

    def best_row(self) -> TrialRow | None:
        scored = [row for row in self.rows.values() if row.last is not None]
        if not scored:
            return None
        pick = self.better(row.last for row in scored if row.last is not None)
        return next(row for row in scored if row.last == pick)

    def close(self) -> None:
        if self.live is not None:
            self.live.update(self.render())
            self.live.stop()
            self.live = None
