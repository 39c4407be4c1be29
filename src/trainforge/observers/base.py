"""The observer interface every driver-side consumer of a run's reports implements, and its fan-out.

Modelled on Ray Train's ``UserCallback``: typed, narrow hooks. An observer subclasses ``Observer``
and overrides the hooks it needs (the others do nothing); an object that merely has the four
required methods is an observer too (``trainforge.fit(observers=...)``).

Firing order, for every observer, once per driver session (``driver/run.train``):

1. ``on_start(RunInfo)``, before the workers start;
2. ``on_report(Report)`` per report of the workers (rank 0's figures, all-reduced, plus every
   node's ``system/...`` samples), in step order, the final one with ``status`` set; with a price
   set the report carries the driver's ``cost/...`` figures (driver/cost.py);
3. ``on_worker_error(WorkerFailure)`` when a worker group fails (Ray restarts it; the next report
   after the restore carries a ``Resumed`` event), ``on_log(list[LogLine])`` (batches of worker
   log lines), ``on_validation_start(ValidationStarted)`` (rank 0 begins a validation pass,
   whose metrics come with a later report's history) and ``on_hang(Diagnosis)`` (the driver
   diagnosed a hung step, driver/hangs.py), interleaved with 2. as they happen;
4. either ``on_end(summary)`` once, with summary.json's content, after it is written; or
   ``on_error(error)`` once, when the run raised instead (a user's error the workers found, a
   failed preflight, Ctrl-C before the workers started; then possibly without an ``on_start``
   before it): nothing after that;
5. after ``on_end``: ``summary_entries()``, what the observer added to summary.json (merged into
   the summary ``train`` returns), then ``check_complete()``, which raises a ``TrainforgeError``
   when the observer's record of the run is incomplete and its config requires it complete
   (``tracking.required``). ``check_complete`` runs only for a run that did not fail.

Observers run on the driver's main thread between mailbox drains (every 0.5 s), in the order of
the registry (observers/registry.py). An observer that raises in 1.-5. (but ``check_complete``) is
logged once (the first time) and still gets the later calls: observation never stops training.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from trainforge.protocol import LogLine, Report, RunInfo, ValidationStarted, WorkerFailure

if TYPE_CHECKING:
    from rich.console import Console

    from trainforge.config import Config

log = logging.getLogger("trainforge")

# Hooks an observer may leave out; the fan-out looks each one up (see the firing order above).
OPTIONAL_HOOKS = ("on_log", "on_validation_start", "on_hang", "on_error", "summary_entries", "check_complete")


class Observer(Protocol):
    """One consumer of a run's reports. Subclass it and override what you need; the optional hooks
    (``on_log``, ``on_validation_start``, ``on_error``, ``summary_entries``, ``check_complete``) are
    looked up by name."""

    def on_start(self, info: RunInfo) -> None:
        return None

    def on_report(self, report: Report) -> None:
        return None

    def on_worker_error(self, failure: WorkerFailure) -> None:
        return None

    def on_end(self, summary: dict[str, Any]) -> None:
        return None

    # optional:
    # def on_log(self, lines: list[LogLine]) -> None
    # def on_validation_start(self, started: ValidationStarted) -> None
    # def on_hang(self, diagnosis: Diagnosis) -> None  (driver/hangs.py)
    # def on_error(self, error: BaseException) -> None
    # def summary_entries(self) -> dict[str, Any]
    # def check_complete(self) -> None


@dataclass(frozen=True)
class SinkSetup:
    """What a sink's factory (observers/registry.py) builds its observer from."""

    config: Config
    run_dir: Path
    console: Console


class Observers:
    """Fans events out to every observer, in order; failures in one are logged once and do not
    propagate (but ``check_complete``'s, which is the point of that hook)."""

    def __init__(self, observers: Iterable[Observer]) -> None:
        self.observers = list(observers)
        self._failed: set[int] = set()

    def _each(self, method: str, *args: Any) -> list[Any]:
        results = []
        for index, observer in enumerate(self.observers):
            handler = getattr(observer, method, None)
            if handler is None:  # an optional hook left out
                continue
            try:
                results.append(handler(*args))
            except Exception as err:  # an observer must never take training down
                if index not in self._failed:
                    log.warning("%s.%s failed: %s", type(observer).__name__, method, err)
                    self._failed.add(index)
        return results

    def on_start(self, info: RunInfo) -> None:
        self._each("on_start", info)

    def on_report(self, report: Report) -> None:
        self._each("on_report", report)

    def on_worker_error(self, failure: WorkerFailure) -> None:
        self._each("on_worker_error", failure)

    def on_log(self, lines: list[LogLine]) -> None:
        self._each("on_log", lines)

    def on_validation_start(self, started: ValidationStarted) -> None:
        self._each("on_validation_start", started)

    def on_hang(self, diagnosis: Any) -> None:
        self._each("on_hang", diagnosis)

    def on_end(self, summary: dict[str, Any]) -> None:
        self._each("on_end", summary)

    def on_error(self, error: BaseException) -> None:
        self._each("on_error", error)

    def summary_entries(self) -> dict[str, Any]:
        entries: dict[str, Any] = {}
        for part in self._each("summary_entries"):
            entries.update(part or {})
        return entries

    def check_complete(self) -> None:
        for observer in self.observers:
            check = getattr(observer, "check_complete", None)
            if check is not None:
                check()
