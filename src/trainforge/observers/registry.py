"""The run's sinks, in the order they observe it: one factory per sink, None when its config leaves it off.

Adding a sink is one module in observers/ (an ``Observer`` and its ``sink(setup)`` factory) and one
line here. ``driver/run.train`` builds the list once per run (``build_observers``) and fans every
event out to it (base.Observers).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from trainforge.observers import metrics_log, mlflow, prometheus, report, tensorboard, worker_log
from trainforge.observers.base import Observer, SinkSetup
from trainforge.observers.console import ProgressDisplay

Sink = Callable[[SinkSetup], Observer | None]


def console(setup: SinkSetup) -> Observer:
    return ProgressDisplay(setup.console)


SINKS: tuple[Sink, ...] = (
    console,
    metrics_log.sink,
    worker_log.sink,
    prometheus.sink,
    tensorboard.sink,
)

# After the caller's observers: these read (the report) or upload (MLflow, which also sends the
# report) what the others wrote by the end of the run.
CLOSING_SINKS: tuple[Sink, ...] = (
    report.sink,
    mlflow.sink,
)


def build_observers(setup: SinkSetup, extra: Iterable[Observer] = ()) -> list[Observer]:
    """The run's observers: the sinks its config turns on, with ``extra`` (``trainforge.fit``'s
    ``observers``, a search trial's Tune reporter) before the closing ones. Sinks that check
    something before the run starts do it here (``tracking.required`` probes the MLflow store)."""
    made = [sink(setup) for sink in SINKS]
    closing = [sink(setup) for sink in CLOSING_SINKS]
    return [observer for observer in (*made, *extra, *closing) if observer is not None]
