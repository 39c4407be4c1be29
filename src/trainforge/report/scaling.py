"""``trainforge bench scaling``'s report: efficiency against workers and where a step's time goes.

One self-contained page (``report.html`` in the bench's folder, the run report's style) with two
plots and the table of figures; ``result`` is the bench's JSON (bench/scaling.py).
"""

from __future__ import annotations

from html import escape
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import PercentFormatter

from trainforge.report.html import STYLE, figures_html, now
from trainforge.report.plots import Plot, new_figure

# (key, label, color), stacked bottom to top: the parts of a step
BREAKDOWN = (
    ("data_wait_s", "data wait", "#9ecae1"),
    ("compute_s", "forward + backward (compute)", "#3182bd"),
    ("comm_exposed_s", "exposed communication", "#d62728"),
    ("optimizer_s", "optimizer", "#fd8d3c"),
)


def _figure(title: str, ylabel: str) -> tuple[Figure, Axes]:
    """The run report's figure (``plots.new_figure``) with workers, not steps, along x."""
    fig, ax = new_figure(title, ylabel)
    ax.set_xlabel("workers")
    return fig, ax


def plot_efficiency(points: list[dict[str, Any]], out: Path) -> Plot:
    workers = [p["workers"] for p in points]
    fig, ax = _figure("Scaling efficiency", "efficiency against linear")
    ax.axhline(1.0, color="#888888", linestyle=":", linewidth=1.2, label="linear")
    ax.plot(workers, [p["efficiency"] for p in points], marker="o", color="#2ca02c", linewidth=1.8, label="measured")
    if all(p.get("predicted_efficiency") is not None for p in points):
        predicted = [p["predicted_efficiency"] for p in points]
        ax.plot(workers, predicted, marker="s", color="#6a3d9a", linestyle="--", linewidth=1.4, label="predicted")
    ax.set_xticks(workers)
    ax.set_ylim(0, max(1.05, *(p["efficiency"] + 0.05 for p in points)))
    ax.yaxis.set_major_formatter(PercentFormatter(xmax=1.0))
    ax.legend(loc="lower left", fontsize=8.5, frameon=False)
    path = out / "efficiency.png"
    fig.savefig(path, format="png", facecolor="white")
    return Plot(
        "Scaling efficiency",
        path,
        "Samples/s at each worker count over linear scaling of the smallest count's (per-worker batch fixed).",
    )


def plot_breakdown(points: list[dict[str, Any]], out: Path) -> Plot:
    slowest = max(sum(p[key] for key, _, _ in BREAKDOWN) for p in points)
    unit, scale = ("s", 1.0) if slowest >= 1.0 else ("ms", 1000.0)
    fig, ax = _figure("Where a step's time goes", f"{unit} per step")
    labels = [str(p["workers"]) for p in points]
    bottom = [0.0] * len(points)
    for key, label, color in BREAKDOWN:
        heights = [p[key] * scale for p in points]
        ax.bar(labels, heights, bottom=bottom, color=color, label=label, width=0.6)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ax.legend(loc="upper left", fontsize=8.5, frameon=False)
    ax.set_ylim(0, max(bottom) * 1.3 if max(bottom) > 0 else 1)
    path = out / "breakdown.png"
    fig.savefig(path, format="png", facecolor="white")
    return Plot(
        "Where a step's time goes",
        path,
        "Mean time per step after warm-up: data wait, compute, the all-reduce the step waited for after its "
        "backward (rank 0's), optimizer. Communication that overlaps the backward is inside compute.",
    )


def table_html(points: list[dict[str, Any]]) -> str:
    predicted = all(p.get("predicted_efficiency") is not None for p in points)
    heads = ["workers", "samples/s", "efficiency", "step", "data wait", "compute", "comm exposed", "comm in flight"]
    heads += ["predicted", "error"] if predicted else []
    rows = []
    for p in points:
        cells = [str(p["workers"]), f"{p['samples_per_s']:,.1f}", f"{p['efficiency']:.1%}"]
        keys = ("step_time_s", "data_wait_s", "compute_s", "comm_exposed_s", "comm_s")
        cells += [f"{p[key] * 1e3:,.1f} ms" for key in keys]
        if predicted:
            cells += [f"{p['predicted_efficiency']:.1%}", f"{p['error_points']:+.1f} pts"]
        rows.append("<tr>" + "".join(f'<td class="num">{escape(c)}</td>' for c in cells) + "</tr>")
    header = "".join(f"<th>{escape(h)}</th>" for h in heads)
    return f"<table><tr>{header}</tr>{''.join(rows)}</table>"


def write_scaling_report(result: dict[str, Any], folder: Path) -> Path:
    """Write ``folder``/report.html (and its two PNGs); return the page's path."""
    points = result["points"]
    plots = [plot_efficiency(points, folder), plot_breakdown(points, folder)]
    link = result.get("link")
    link_line = (
        f"<p>Predicted with link <code>{escape(str(link['name']))}</code> ({escape(str(link['source']))}), "
        f"{int(link['workers_per_node'])} worker(s) per node: each count's measured compute plus the "
        "predicted communication.</p>"
        if link
        else ""
    )
    machine = result.get("machine", {})
    page = "\n".join(
        [
            "<!DOCTYPE html>",
            '<html lang="en"><head><meta charset="utf-8">',
            '<meta name="viewport" content="width=device-width, initial-scale=1">',
            f"<title>{escape(str(result['config']))} · trainforge bench scaling</title>",
            f"<style>{STYLE}</style></head><body><main>",
            f"<h1>{escape(str(result['config']))}: scaling</h1>",
            f'<p class="sub">{escape(str(folder))}</p>',
            f"<p>{int(result['steps'])} steps per worker count on {escape(str(result['cluster']))}; "
            f"driver machine: {escape(str(machine.get('cpu', '?')))}, {machine.get('cores', '?')} cores. "
            "Each count's run directory is in this folder.</p>",
            link_line,
            "<h2>Figures</h2>",
            table_html(points),
            "<h2>Plots</h2>",
            figures_html(plots),
            f"<footer>Written by <code>trainforge bench scaling</code> on {now()}.</footer>",
            "</main></body></html>",
        ]
    )
    path = folder / "report.html"
    path.write_text(page + "\n")
    return path
