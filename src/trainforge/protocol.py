"""A report's ``history``: one point per ``train.log_every_n_steps`` interval, and how a report
turns into curve points.

Each ``ray.train.report`` is a barrier across ranks served by the Ray Train controller, so reports
are stretched to ``train.report_min_interval_s`` apart; a curve with one point per report would
have a handful of points. A report therefore carries the log intervals it spans::

    {"step": 60, "train/loss": 0.41, ..., "history": [
        {"step": 40, "time/unix": ..., "train/loss": 0.45, "train/lr": ..., "perf/samples_per_s": ...},
        {"step": 50, ...}, {"step": 60, ...}]}

in step order, the last at the report's own step, together with a point per validation pass
since the previous report (``val/*`` at the step it ran). The report's top-level figures stay the
aggregate over its whole span (what summary.json's ``final_metrics`` holds). Pure Python, so the
worker that builds the points and the driver-side writers (MLflow, the run report) share it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

HISTORY_KEY = "history"
# The report keys the driver adds to every report when a price is set (driver/cost.py), for the
# progress line, MLflow, metrics.jsonl and Prometheus.
SO_FAR_KEY = "cost/so_far"
PROJECTED_KEY = "cost/projected_total"
CURRENCY_KEY = "cost/currency"
# Keys that place a point rather than measure something.
COORDINATES = frozenset({"step", "time/unix"})


def curve_points(report: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The report as points for curves, in step order: its history points, then the report itself
    without the keys that its history already covers (validation, checkpoint and run figures stay,
    at the report's step). A report without history is one point: itself.

    Reports read back from metrics.jsonl are not trusted: history entries that are not mappings
    with a numeric ``step`` are left out.
    """
    history = report.get(HISTORY_KEY)
    own = {key: value for key, value in report.items() if key != HISTORY_KEY}
    if not isinstance(history, list):
        return [own]
    points = [dict(point) for point in history if isinstance(point, Mapping) and _is_step(point.get("step"))]
    covered = {key for point in points for key in point} - COORDINATES
    return [*points, {key: value for key, value in own.items() if key not in covered}]


def merge_points(*series: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Several series of points (log intervals, validation passes) as one list in step order;
    points at the same step become one."""
    by_step: dict[Any, dict[str, Any]] = {}
    for points in series:
        for point in points:
            by_step.setdefault(point["step"], {}).update(point)
    return [by_step[step] for step in sorted(by_step)]


def _is_step(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
