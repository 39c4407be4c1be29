"""The search's two figures: the metric against each tuned hyperparameter, and every trial's
learning curve. matplotlib's object API on the Agg canvas, as the run report does (no pyplot)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from trainforge.report.data import ReportError, load_run
from trainforge.report.plots import loss_label
from trainforge.tune.space import Domain, SearchSpace

if TYPE_CHECKING:
    from trainforge.tune.trial import TrialOutcome

PLOTS_DIR = "plots"
STATUS_COLORS = {"finished": "#1f77b4", "stopped": "#ff7f0e", "failed": "#d62728", "unfinished": "#7f7f7f"}
BEST_COLOR = "#2ca02c"
DPI = 110


def write_plots(
    search_dir: Path, outcomes: list[TrialOutcome], space: SearchSpace, metric: str, best: TrialOutcome | None
) -> list[Path]:
    scored = [o for o in outcomes if o.last_metric is not None]
    if not scored:
        return []
    folder = search_dir / PLOTS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    return [
        metric_vs_hyperparameters(folder / "metric_vs_hyperparameters.png", scored, space, metric),
        learning_curves(folder / "learning_curves.png", outcomes, metric, best, metric_label(metric, scored)),
    ]


def metric_label(metric: str, outcomes: list[TrialOutcome]) -> str:
    """The metric's name; a loss also says which loss it is, by the trials' task, as the run report's
    loss axis does (report/plots.loss_label, from a trial's run directory)."""
    if not metric.endswith("loss"):
        return metric
    for outcome in outcomes:
        try:
            return f"{metric}: {loss_label(load_run(outcome.run_dir))}"
        except ReportError:
            continue
    return metric


def metric_vs_hyperparameters(path: Path, outcomes: list[TrialOutcome], space: SearchSpace, metric: str) -> Path:
    """One panel per tuned key: each trial's last metric at the value it ran with (the last value,
    for PBT trials whose values changed), coloured by how the trial ended."""
    count = len(space.domains)
    columns = min(count, 3)
    rows = math.ceil(count / columns)
    figure = Figure(figsize=(4.2 * columns, 3.2 * rows), dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    for index, domain in enumerate(space.domains):
        axes = figure.add_subplot(rows, columns, index + 1)
        xs = [position(domain, o.config.get(domain.key)) for o in outcomes]
        ys = [o.last_metric if o.last_metric is not None else math.nan for o in outcomes]
        colors = [STATUS_COLORS.get(o.status, "#7f7f7f") for o in outcomes]
        axes.scatter(xs, ys, c=colors, s=28, edgecolors="black", linewidths=0.4)
        axes.set_xlabel(domain.key)
        axes.set_ylabel(f"last {metric}")
        if domain.log_scale:
            axes.set_xscale("log")
        if domain.categorical:
            axes.set_xticks(range(len(domain.args)), [str(v) for v in domain.args])
            axes.set_xlim(-0.5, len(domain.args) - 0.5)
        axes.grid(alpha=0.3)
    handles = [
        figure.axes[0].scatter([], [], c=color, s=28, edgecolors="black", linewidths=0.4, label=status)
        for status, color in STATUS_COLORS.items()
        if any(o.status == status for o in outcomes)
    ]
    figure.legend(handles=handles, loc="outside lower center", ncols=len(handles), frameon=False)
    figure.savefig(path)
    return path


def position(domain: Domain, value: Any) -> float:
    """Where a value sits on its panel's x axis: its index for categorical domains."""
    if domain.categorical:
        return float(domain.args.index(value)) if value in domain.args else math.nan
    return float(value) if isinstance(value, (int, float)) else math.nan


def learning_curves(
    path: Path, outcomes: list[TrialOutcome], metric: str, best: TrialOutcome | None, label: str | None = None
) -> Path:
    learning_curves_figure(outcomes, metric, best, label).savefig(path)
    return path


def learning_curves_figure(
    outcomes: list[TrialOutcome], metric: str, best: TrialOutcome | None, label: str | None = None
) -> Figure:
    """The metric against the step for every trial that reported it, one line each; stopped trials
    dashed, the best one bold. A trial with one report (a scheduler stopped it at its first) is a
    marker: a line through one point draws nothing. ``label``: the y axis's, the metric's name by default."""
    figure = Figure(figsize=(9.0, 4.2), dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for outcome in outcomes:
        if not outcome.history:
            continue
        steps, values = zip(*outcome.history, strict=True)
        is_best = best is not None and outcome.trial_id == best.trial_id
        axes.plot(
            steps,
            values,
            linestyle="--" if outcome.stopped_early else "-",
            marker="o" if len(steps) == 1 else None,
            markersize=5 if is_best else 4,
            linewidth=2.4 if is_best else 1.0,
            color=BEST_COLOR if is_best else STATUS_COLORS.get(outcome.status, "#7f7f7f"),
            alpha=1.0 if is_best else 0.7,
            label=f"{outcome.trial_id} (best)" if is_best else None,
            gid=outcome.trial_id,  # the trial a line belongs to
        )
    axes.set_xlabel("step")
    axes.set_ylabel(label or metric)
    single = any(len(outcome.history) == 1 for outcome in outcomes)
    axes.set_title(f"{metric} per trial (dashed: stopped early{'; a dot: one report' if single else ''})")
    axes.grid(alpha=0.3)
    if best is not None:
        axes.legend(loc="best", frameon=False)
    return figure
