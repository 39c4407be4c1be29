"""The report's PNG plots: one figure per question, every timeline against the global step.

Figures are built with matplotlib's object API on the Agg canvas (no pyplot), so writing a report
never changes the backend or global state of a program that called ``trainforge.fit``.

Curves have one point per log interval (``train.log_every_n_steps``): a report carries the
intervals since the previous one in its ``history`` (``trainforge.protocol``); older run directories
without it give one point per report. After a restart the run replays the steps between its last
checkpoint and the failure. Curves are split at every resume so they restart at the resumed step
instead of folding back; the steps that were run and then lost are drawn faded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import EngFormatter, FuncFormatter, LogLocator, MaxNLocator, NullFormatter, PercentFormatter

from trainforge.protocol import curve_points
from trainforge.report.data import Marker, RunData, finite, is_resume, resume_point, step_of

TRAIN_COLOR, VAL_COLOR = "#1f77b4", "#d62728"
FAILURE_COLOR, RESUME_COLOR = "#b2182b", "#e08214"
PHASES = (
    ("perf/data_wait_s", "data wait", "#9ecae1"),
    ("perf/compute_s", "forward + backward", "#3182bd"),
    ("perf/optimizer_s", "optimizer", "#fd8d3c"),
)
LOG_SCALE_RATIO = 30.0  # a curve spanning more than this factor is drawn on a log axis
MARKERS_UP_TO = 40  # points per curve below which every point is drawn as a dot
LOST_ALPHA = 0.35
WIDTH_IN, HEIGHT_IN, DPI = 9.0, 3.4, 110
MARGINS_IN = (0.95, 0.2, 0.42, 0.55)  # left (tick labels + axis label), right, top (title, legend), bottom

Point = dict[str, Any]  # one log interval's figures, or a report's own (``curve_points``)
PLAIN = FuncFormatter(lambda value, _: f"{value:g}")


@dataclass(frozen=True)
class Plot:
    """A written PNG and what it shows."""

    title: str
    path: Path
    caption: str


@dataclass(frozen=True)
class Piece:
    """Consecutive points of one attempt; ``lost`` when a later restart replayed those steps."""

    points: list[Point]
    lost: bool
    start: int = 0  # the step the piece's first interval starts from (0, or the resumed step)


def pieces(data: RunData) -> list[Piece]:
    """Each attempt's points, cut where the next attempt resumed: kept steps, then lost steps."""
    segments = data.segments()
    out: list[Piece] = []
    for index, segment in enumerate(segments):
        start = resume_point(segment[0]) if is_resume(segment[0]) else 0
        points = [point for report in segment for point in curve_points(report)]
        if index + 1 == len(segments):
            out.append(Piece(points, lost=False, start=start))
            continue
        resumed_at = resume_point(segments[index + 1][0])
        kept = [p for p in points if step_of(p, 0) <= resumed_at]
        lost = [p for p in points if step_of(p, 0) > resumed_at]
        if kept:
            out.append(Piece(kept, lost=False, start=start))
        if lost:
            # Start the faded line at the last kept step (all its points: an interval's and its
            # report's) so that every curve stays continuous.
            last = step_of(kept[-1], 0) if kept else start
            bridge = [p for p in kept if step_of(p, 0) == last]
            out.append(Piece(bridge + lost, lost=True, start=last))
    return out


def xy(points: list[Point], key: str) -> tuple[list[int], list[float]]:
    """Steps and finite values of ``key`` (points without it, or with NaN, are left out)."""
    xs: list[int] = []
    ys: list[float] = []
    for point in points:
        value = finite(point.get(key))
        if value is not None and finite(point.get("step")) is not None:
            xs.append(int(point["step"]))
            ys.append(value)
    return xs, ys


def new_figure(title: str, ylabel: str) -> tuple[Figure, Axes]:
    """A timeline figure. Fixed margins, not a layout engine: every plot's axes sit at the same
    place, so the step axes line up down the page, and drawing costs half as much."""
    fig = Figure(figsize=(WIDTH_IN, HEIGHT_IN), dpi=DPI)
    left, right, top, bottom = MARGINS_IN
    fig.subplots_adjust(
        left=left / WIDTH_IN, right=1 - right / WIDTH_IN, top=1 - top / HEIGHT_IN, bottom=bottom / HEIGHT_IN
    )
    ax = fig.add_subplot()
    ax.set_title(title, loc="left", fontsize=12, fontweight="bold")
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(ylabel)
    ax.grid(True, color="#e5e5e5", linewidth=0.8)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    return fig, ax


def draw_series(ax: Axes, data: RunData, key: str, label: str, color: str, *, linestyle: str = "-") -> bool:
    """One metric over all attempts in one color; returns False when the run never reported it."""
    parts = [(piece, *xy(piece.points, key)) for piece in pieces(data)]
    total = sum(len(xs) for _, xs, _ in parts)
    if total == 0:
        return False
    marker = "o" if total <= MARKERS_UP_TO else None
    labelled = False
    for piece, xs, ys in parts:
        if not xs:
            continue
        ax.plot(
            xs,
            ys,
            color=color,
            marker=marker,
            markersize=3.5,
            linewidth=1.6,
            alpha=LOST_ALPHA if piece.lost else 1.0,
            linestyle=":" if piece.lost else linestyle,
            label=None if labelled or piece.lost else label,
        )
        labelled = labelled or not piece.lost
    return True


def values(data: RunData, *keys: str) -> list[float]:
    return [v for point in data.points() for key in keys if (v := finite(point.get(key))) is not None]


def maybe_log_scale(ax: Axes, numbers: list[float]) -> bool:
    """Log y when all values are positive and span more than LOG_SCALE_RATIO (loss over decades)."""
    if numbers and min(numbers) > 0 and max(numbers) / min(numbers) > LOG_SCALE_RATIO:
        ax.set_yscale("log")
        # Plain numbers at 1-2-5 steps read better than bare powers of ten.
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(PLAIN)
        ax.yaxis.set_minor_formatter(NullFormatter())
        return True
    return False


def mark_restarts(ax: Axes, markers: list[Marker]) -> None:
    """Vertical lines at failures (solid red) and resumes (dashed orange), each with a short label.

    Failure labels sit right of their line and resume labels left of it: a failure usually comes
    after the resume point it goes back to, so the two labels face away from each other (near an
    edge of the plot a label flips inwards). Labels closer than 4% of the axis to the previous one
    of the same kind are dropped; the line stays.
    """
    if not markers:
        return
    for marker in markers:
        failure = marker.kind == "failure"
        ax.axvline(
            marker.step,
            color=FAILURE_COLOR if failure else RESUME_COLOR,
            linestyle="-" if failure else "--",
            linewidth=1.3,
            zorder=1.5,
        )
    low, high = ax.get_xlim()
    span = max(high - low, 1e-9)
    last_at: dict[str, float] = {}
    for marker in sorted(markers, key=lambda m: m.step):
        failure = marker.kind == "failure"
        at = (marker.step - low) / span
        if marker.kind in last_at and at - last_at[marker.kind] < 0.04:
            continue
        last_at[marker.kind] = at
        right = (failure or at < 0.06) and at < 0.94
        ax.annotate(
            marker.label,
            xy=(marker.step, 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(3 if right else -3, -4),
            textcoords="offset points",
            rotation=90,
            ha="left" if right else "right",
            va="top",
            fontsize=8,
            color=FAILURE_COLOR if failure else RESUME_COLOR,
            bbox={"boxstyle": "square,pad=0.15", "facecolor": "white", "edgecolor": "none", "alpha": 0.7},
            zorder=5,
        )


def finish(fig: Figure, ax: Axes, data: RunData, path: Path, *, faded_lost: bool = True) -> None:
    """Restart markers (labelled in place, so not in the legend), one legend above the plot, save."""
    ax.set_xlim(left=0)  # every timeline starts at step 0, whatever the first report
    mark_restarts(ax, data.markers)
    handles, labels = ax.get_legend_handles_labels()
    if faded_lost and any(piece.lost for piece in pieces(data)):
        handles.append(Line2D([], [], color="#777777", linestyle=":", alpha=LOST_ALPHA + 0.2))
        labels.append("lost to a restart")
    if handles:
        # Above the plot, right-aligned on the title's line: never over the curves.
        ax.legend(
            handles,
            labels,
            loc="lower right",
            bbox_to_anchor=(1.0, 1.0),
            ncols=len(handles),
            fontsize=8.5,
            frameon=False,
            borderaxespad=0.2,
        )
    fig.savefig(path, format="png", facecolor="white")


LOSS_LABELS = {
    "classification": "cross-entropy loss",
    "causal_lm": "cross-entropy loss per token",
    "masked_lm": "cross-entropy loss per masked token",
    "custom": "loss (the model's training_step)",
    "hf": "loss (the model's own)",
}


def loss_label(data: RunData) -> str:
    """What the run's loss is, by its task (``model.task``, else what its metrics show: a
    regression reports mse): the loss axis's label."""
    model = data.model_section()
    task = model.get("task")
    if task == "regression" or (task is None and (data.has("val/mse") or data.has("train/mse"))):
        return "mean absolute error (L1)" if model.get("loss") == "l1" else "mean squared error"
    if task is None:
        return (
            LOSS_LABELS["causal_lm"]
            if data.has("train/perplexity") or data.has("val/perplexity")
            else "cross-entropy loss"
        )
    return LOSS_LABELS.get(str(task), "loss")


def plot_loss(data: RunData, out: Path) -> Plot | None:
    fig, ax = new_figure("Loss", loss_label(data))
    train = draw_series(ax, data, "train/loss", "train", TRAIN_COLOR)
    val = draw_series(ax, data, "val/loss", "validation", VAL_COLOR)
    if not (train or val):
        return None
    log = maybe_log_scale(ax, values(data, "train/loss", "val/loss"))
    path = out / "loss.png"
    finish(fig, ax, data, path)
    scale = " (log scale)" if log else ""
    return Plot("Loss", path, f"Training loss per log interval and validation loss after each pass{scale}.")


def plot_perplexity(data: RunData, out: Path) -> Plot | None:
    fig, ax = new_figure("Perplexity", "perplexity")
    train = draw_series(ax, data, "train/perplexity", "train", TRAIN_COLOR)
    val = draw_series(ax, data, "val/perplexity", "validation", VAL_COLOR)
    if not (train or val):
        return None
    maybe_log_scale(ax, values(data, "train/perplexity", "val/perplexity"))
    path = out / "perplexity.png"
    finish(fig, ax, data, path)
    return Plot("Perplexity", path, "exp(per-token loss); lower is better.")


def plot_accuracy(data: RunData, out: Path) -> Plot | None:
    fig, ax = new_figure("Accuracy", "accuracy")
    train = draw_series(ax, data, "train/accuracy", "train", TRAIN_COLOR)
    val = draw_series(ax, data, "val/accuracy", "validation", VAL_COLOR)
    if not (train or val):
        return None
    numbers = values(data, "train/accuracy", "val/accuracy")
    ax.yaxis.set_major_formatter(PercentFormatter(xmax=1.0))
    # Never a tick above 100 %; a little headroom so points at 100 % stay visible.
    ax.set_ylim(max(0.0, min(numbers) - 0.05), min(1.0, max(numbers) + 0.02) + 0.005)
    path = out / "accuracy.png"
    finish(fig, ax, data, path)
    return Plot("Accuracy", path, "Share of correct predictions: training per log interval, validation per pass.")


def plot_throughput(data: RunData, out: Path) -> Plot | None:
    fig, ax = new_figure("Throughput", "samples / s (all workers)")
    ax.yaxis.set_major_formatter(EngFormatter(sep=""))
    interval = draw_series(ax, data, "perf/samples_per_s", "per log interval", "#2ca02c")
    steady = draw_series(ax, data, "perf/steady_samples_per_s", "steady (since warm-up)", "#555555", linestyle="--")
    if not (interval or steady):
        return None
    ax.set_ylim(bottom=0)
    path = out / "throughput.png"
    finish(fig, ax, data, path)
    return Plot(
        "Throughput",
        path,
        "Samples per second over all workers; the steady figure excludes the first steps and validation.",
    )


def plot_step_time(data: RunData, out: Path) -> Plot | None:
    """Stacked bars, one per log interval, as wide as the steps it covers: where a step's time went."""
    if not any(data.has(key) for key, _, _ in PHASES):
        return None
    slowest = max(values(data, "perf/step_time_s", *(key for key, _, _ in PHASES)))
    unit, scale = ("s", 1.0) if slowest >= 1.0 else ("ms", 1000.0)
    fig, ax = new_figure("Step time", f"{unit} per step (interval mean)")
    # Steps lost to a restart are left out: their replay covers the same stretch of the axis.
    for piece in pieces(data):
        if not piece.lost:
            _draw_phase_bars(ax, piece, scale)
    path = out / "step_time.png"
    for _, label, color in PHASES:
        ax.bar([0], [0], width=0, color=color, label=label)  # legend entries, once
    finish(fig, ax, data, path, faded_lost=False)
    return Plot(
        "Step time",
        path,
        "Mean time per step in each log interval: waiting for data, forward and backward, optimizer step. "
        "Reports, checkpoint stalls and validation are not in these bars; steps lost to a restart are left out.",
    )


def _draw_phase_bars(ax: Axes, piece: Piece, scale: float) -> None:
    lefts: list[float] = []
    widths: list[float] = []
    stacks: list[list[float]] = [[] for _ in PHASES]
    previous = piece.start
    for point in piece.points:
        step = step_of(point, -1)
        if step < 0 or not any(key in point for key, _, _ in PHASES):
            continue  # a report's own point after its history: the intervals already have the bars
        lefts.append(previous)
        widths.append(max(step - previous, 1))
        for column, (key, _, _) in enumerate(PHASES):
            stacks[column].append((finite(point.get(key)) or 0.0) * scale)
        previous = step
    bottom = [0.0] * len(lefts)
    for column, (_, _, color) in enumerate(PHASES):
        ax.bar(
            lefts,
            stacks[column],
            width=widths,
            bottom=bottom,
            align="edge",
            color=color,
            linewidth=0,
        )
        bottom = [b + h for b, h in zip(bottom, stacks[column], strict=True)]


COMM = (
    ("perf/compute_s", "forward + backward", "#3182bd", "-"),
    ("perf/comm_s", "all-reduce in flight", "#9467bd", "--"),
    ("perf/comm_exposed_s", "all-reduce exposed", "#d62728", "-"),
)


def plot_comm(data: RunData, out: Path) -> Plot | None:
    """Rank 0's gradient communication per step, per report, against the compute it hides behind."""
    if not any(v > 0 for v in values(data, "perf/comm_s")):
        return None  # not timed, or one worker (nothing sent)
    unit, scale = ("s", 1.0) if max(values(data, *(key for key, *_ in COMM))) >= 1.0 else ("ms", 1000.0)
    fig, ax = new_figure("Gradient communication", f"{unit} per step (report mean)")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value * scale:g}"))
    for key, label, color, style in COMM:
        draw_series(ax, data, key, label, color, linestyle=style)
    ax.set_ylim(bottom=0)
    path = out / "communication.png"
    finish(fig, ax, data, path)
    return Plot(
        "Gradient communication",
        path,
        "Rank 0's gradient all-reduce per step over each report: in flight (overlapping the backward) and "
        "exposed (the step waiting for it after compute, inside forward + backward's time).",
    )


STRAGGLER_RANKS = 8  # lines at most: the ranks with the highest scores
STRAGGLER_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf")


def straggler_keys(data: RunData) -> list[str]:
    """``straggler/rank<R>/score`` of the ranks the plot draws: all of them up to STRAGGLER_RANKS,
    else those with the highest peaks (the straggler among them), in rank order."""
    keys = {
        key for point in data.points() for key in point if key.startswith("straggler/rank") and key.endswith("/score")
    }
    peaks = {key: max(values(data, key), default=0.0) for key in keys}
    chosen = sorted(keys, key=lambda key: -peaks[key])[:STRAGGLER_RANKS]
    return sorted(chosen, key=lambda key: int(key.split("/")[1].removeprefix("rank") or 0))


def plot_stragglers(data: RunData, out: Path) -> Plot | None:
    """Each rank's straggler score (worker/straggler.py) per report; a run of one worker has none."""
    keys = straggler_keys(data)
    if not keys:
        return None
    fig, ax = new_figure("Stragglers", "own time per step / other ranks' median")
    for key, color in zip(keys, STRAGGLER_COLORS, strict=False):
        draw_series(ax, data, key, key.split("/")[1].replace("rank", "rank "), color)
    ax.axhline(1.0, color="#999999", linewidth=0.8)
    ax.set_ylim(bottom=0)
    path = out / "stragglers.png"
    finish(fig, ax, data, path)
    return Plot(
        "Stragglers",
        path,
        "Each rank's own time per step (data wait and forward, no peer waited for) over the other ranks' median, "
        "per report: 1 is typical; a rank above failure.straggler.threshold for its window is named in the events.",
    )


def plot_lr(data: RunData, out: Path) -> Plot | None:
    fig, ax = new_figure("Learning rate", "learning rate")
    if not draw_series(ax, data, "train/lr", "learning rate (first parameter group)", "#6a3d9a"):
        return None
    ax.yaxis.set_major_formatter(PLAIN)
    ax.set_ylim(bottom=0)
    path = out / "lr.png"
    finish(fig, ax, data, path)
    return Plot("Learning rate", path, "Learning rate at the end of each log interval, after warm-up and schedule.")


PLOTTERS: list[Callable[[RunData, Path], Plot | None]] = [
    plot_loss,
    plot_perplexity,
    plot_accuracy,
    plot_throughput,
    plot_step_time,
    plot_comm,
    plot_stragglers,
    plot_lr,
]


def render_plots(data: RunData, out: Path) -> list[Plot]:
    """Write every plot the run has data for into ``out``; a metric the run never reported gets no plot."""
    written: list[Plot] = []
    for plotter in PLOTTERS:
        plot = plotter(data, out)
        if plot is not None:
            written.append(plot)
    return written
