"""How the driver watches a run: the controller forwards reports to a mailbox, observers consume them.

What crosses is typed (``trainforge.protocol``): the workers' ``Report`` (with its events), the
controller's ``WorkerFailure``, the workers' ``LogBatch``. Observers get typed callbacks, modelled
on Ray Train's ``UserCallback``; every one but ``on_log`` is required.

Firing order, for every observer, once per driver session:

1. ``on_start(RunInfo)``, before the workers start;
2. ``on_report(Report)`` per report of the workers (rank 0's figures, all-reduced, plus every
   node's ``system/...`` samples), in step order, the final one with ``status`` set; with a price
   set the report carries the driver's ``cost/...`` figures (driver/cost.py);
3. ``on_worker_error(WorkerFailure)`` when a worker group fails (Ray restarts it; the next report
   after the restore carries a ``Resumed`` event) and ``on_log(list[LogLine])`` (batches of worker
   log lines), interleaved with 2. as they happen;
4. ``on_end(summary)`` once, with summary.json's content, after it is written (not when ``fit``
   raises a user's error: the tracker's ``on_error`` covers that).

Observers run on the driver's main thread between mailbox drains (every 0.5 s). One that raises
is logged once and skipped from then on; observation never stops training.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any, Protocol

import ray
from ray.train.v2._internal.execution.callback import ControllerCallback, WorkerGroupCallback
from ray.train.v2.api.callback import UserCallback

from trainforge.driver.cost import CostMeter
from trainforge.driver.startup import Timeline
from trainforge.driver.summary import DRIVER_START, Recovery
from trainforge.protocol import (
    REPORT_KEY,
    LogBatch,
    LogLine,
    Report,
    RunInfo,
    StartupMarks,
    WorkerFailure,
    merge_reports,
)

log = logging.getLogger("trainforge")

Mail = Report | WorkerFailure | LogBatch | StartupMarks  # what the mailbox holds


def start_mailbox() -> Any:
    """A Mailbox on the driver's own node, like Ray Train's controller: it must outlive worker nodes."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
    return Mailbox.options(scheduling_strategy=here).remote()  # type: ignore[attr-defined]


@ray.remote(num_cpus=0)
class Mailbox:
    """A tiny actor the controller and the workers drop mail into and the driver drains."""

    def __init__(self) -> None:
        self.items: list[Mail] = []
        self.stop = False

    def put(self, item: Mail) -> None:
        self.items.append(item)

    def request_stop(self) -> None:
        """Ask the workers to checkpoint and stop at their next report (graceful stop)."""
        self.stop = True

    def stop_requested(self) -> bool:
        return self.stop

    def drain(self) -> list[Mail]:
        items, self.items = self.items, []
        return items


class ForwardingCallback(UserCallback):
    """Runs in the Ray Train controller; forwards rank 0's reports and worker failures to the driver."""

    def __init__(self, mailbox: Any) -> None:
        self.mailbox = mailbox

    def after_report(self, run_context: Any, metrics: list[dict[str, Any]], checkpoint: Any) -> None:
        merged = merge_reports([m.get(REPORT_KEY) for m in metrics])
        if merged is not None:
            self.mailbox.put.remote(merged)  # fire and forget: in order

    def after_exception(self, run_context: Any, worker_exceptions: dict[int, Exception]) -> None:
        errors = {
            int(rank): f"{type(err).__name__}: {err}".splitlines()[0][:500] for rank, err in worker_exceptions.items()
        }
        self.mailbox.put.remote(WorkerFailure(errors, time.time()))


class StartupCallback(ControllerCallback, WorkerGroupCallback):
    """Runs in the Ray Train controller; marks its phases of the run's first start (driver/startup.py).

    Ray Train runs the run config's callbacks after its own, so ``after_worker_group_start`` comes
    after the process group is set up (its BackendSetupCallback)."""

    def __init__(self, mailbox: Any) -> None:
        self.mailbox = mailbox
        self.sent = False

    def _send(self, **marks: float) -> None:
        if not self.sent:
            self.mailbox.put.remote(StartupMarks(tuple(marks.items())))

    def after_controller_start(self, train_run_context: Any) -> None:
        self._send(controller=time.time())

    def before_init_train_context(self, workers: list[Any]) -> dict[str, list[Any]]:
        self._send(workers=time.time())  # the actors are up: Ray Train read their metadata
        return {}

    def after_worker_group_start(self, worker_group: Any) -> None:
        self._send(process_group=time.time())
        self.sent = True  # a restarted group's start is recovery, not start-up


class Observer(Protocol):
    def on_start(self, info: RunInfo) -> None: ...
    def on_report(self, report: Report) -> None: ...
    def on_worker_error(self, failure: WorkerFailure) -> None: ...
    def on_end(self, summary: dict[str, Any]) -> None: ...

    # optional: def on_log(self, lines: list[LogLine]) -> None


class Observers:
    """Fans events out to every observer; failures in one are logged once and do not propagate."""

    def __init__(self, observers: list[Observer]) -> None:
        self.observers = observers
        self._failed: set[int] = set()

    def _each(self, method: str, *args: Any) -> None:
        for index, observer in enumerate(self.observers):
            handler = getattr(observer, method, None)
            if handler is None:  # optional methods (on_log)
                continue
            try:
                handler(*args)
            except Exception as err:  # an observer must never take training down
                if index not in self._failed:
                    log.warning("%s.%s failed: %s", type(observer).__name__, method, err)
                    self._failed.add(index)

    def on_start(self, info: RunInfo) -> None:
        self._each("on_start", info)

    def on_report(self, report: Report) -> None:
        self._each("on_report", report)

    def on_worker_error(self, failure: WorkerFailure) -> None:
        self._each("on_worker_error", failure)

    def on_log(self, lines: list[LogLine]) -> None:
        self._each("on_log", lines)

    def on_end(self, summary: dict[str, Any]) -> None:
        self._each("on_end", summary)


class Pump:
    """Drains the mailbox and dispatches events; the driver's main loop calls ``drain`` while it waits.

    It also keeps what the summary needs: the last report and ``recovery`` (restarts, and recovery
    times from a worker failure to the first completed step after the restore that followed it),
    the same ``summary.Recovery`` that a replay of metrics.jsonl gives.
    """

    def __init__(
        self, mailbox: Any, observers: Observers, cost: CostMeter | None = None, startup: Timeline | None = None
    ) -> None:
        self.mailbox = mailbox
        self.observers = observers
        self.cost = cost  # with a price set, every report gains cost/so_far and cost/projected_total
        self.last_report: Report | None = None
        self.recovery = Recovery()
        self.startup = startup if startup is not None else Timeline()  # the marks of the run's first start

    def drain(self) -> None:
        try:
            items = ray.get(self.mailbox.drain.remote(), timeout=30)
        except (ray.exceptions.RayError, TimeoutError) as err:
            log.debug("mailbox unavailable: %s", err)
            return
        for item in items:
            if isinstance(item, Report):
                self._on_report(item)
            elif isinstance(item, WorkerFailure):
                self.recovery.failed(item.time)
                self.observers.on_worker_error(item)
            elif isinstance(item, LogBatch):
                self.observers.on_log(list(item.lines))
            elif isinstance(item, StartupMarks):
                self.startup.add(dict(item.marks))

    def _on_report(self, report: Report) -> None:
        if self.cost is not None:
            report = self.cost.on_report(report)
        self.recovery.reported(report)
        self.last_report = report
        self.observers.on_report(report)

    @property
    def last_checkpoint(self) -> str | None:
        return self.last_report.checkpoint if self.last_report is not None else None


class MetricsLog:
    """Appends every report to ``<run dir>/metrics.jsonl`` (the source for reports and plots)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / "metrics.jsonl"

    def on_start(self, info: RunInfo) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # A driver session begins: a replay (driver/summary.RunLog) counts restarts from the last one on.
        self._append({"event": DRIVER_START, "time": time.time()})

    def on_report(self, report: Report) -> None:
        self._append(report.to_json())

    def on_worker_error(self, failure: WorkerFailure) -> None:
        self._append(failure.to_json())

    def _append(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")

    def on_end(self, summary: dict[str, Any]) -> None:
        pass


class WorkerLog:
    """Appends every worker's log lines (tagged with rank and node) to ``<run dir>/workers.log``."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / "workers.log"

    def on_start(self, info: RunInfo) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def on_report(self, report: Report) -> None:
        pass

    def on_worker_error(self, failure: WorkerFailure) -> None:
        pass

    def on_log(self, lines: list[LogLine]) -> None:
        with self.path.open("a") as handle:
            handle.writelines(line.text + "\n" for line in lines)

    def on_end(self, summary: dict[str, Any]) -> None:
        pass
