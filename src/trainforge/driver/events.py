"""How the driver watches a run: the controller forwards reports to a mailbox, the pump hands them
to the observers (observers/).

What crosses is typed (``trainforge.protocol``): the workers' ``Report`` (with its events), the
controller's ``WorkerFailure``, the workers' ``LogBatch``, the start-up phases' ``StartupMarks``,
rank 0's ``ValidationStarted``.
The observers' hooks and their firing order are ``observers/base.py``'s.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import ray
from ray.train.v2._internal.execution.callback import ControllerCallback, WorkerGroupCallback
from ray.train.v2.api.callback import UserCallback

from trainforge.driver.cost import CostMeter
from trainforge.driver.hangs import HangDoctor
from trainforge.driver.startup import Timeline
from trainforge.driver.summary import Recovery
from trainforge.observers.base import Observers
from trainforge.protocol import (
    REPORT_KEY,
    HangSuspected,
    LogBatch,
    Report,
    StartupMarks,
    ValidationStarted,
    WorkerFailure,
    WorkerIdentity,
    merge_reports,
)

log = logging.getLogger("trainforge")

# What the mailbox holds.
Mail = Report | WorkerFailure | LogBatch | StartupMarks | ValidationStarted | WorkerIdentity | HangSuspected


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


class Pump:
    """Drains the mailbox and dispatches events; the driver's main loop calls ``drain`` while it waits.

    It also keeps what the summary needs: the last report and ``recovery`` (restarts, and recovery
    times from a worker failure to the first completed step after the restore that followed it),
    the same ``summary.Recovery`` that a replay of metrics.jsonl gives.
    """

    def __init__(
        self,
        mailbox: Any,
        observers: Observers,
        cost: CostMeter | None = None,
        startup: Timeline | None = None,
        doctor: HangDoctor | None = None,
    ) -> None:
        self.mailbox = mailbox
        self.observers = observers
        self.cost = cost  # with a price set, every report gains cost/so_far and cost/projected_total
        self.last_report: Report | None = None
        self.recovery = Recovery()
        self.startup = startup if startup is not None else Timeline()  # the marks of the run's first start
        # Waiting for a worker group: from the start to the first report, and from a failure to the next.
        self.awaiting_group = True
        self.doctor = doctor  # the workers' hang reports, diagnosed (driver/hangs.py)

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
                self.awaiting_group = True
                if self.doctor is not None:
                    self.doctor.on_group_failed()
                self.observers.on_worker_error(item)
            elif isinstance(item, LogBatch):
                self.observers.on_log(list(item.lines))
            elif isinstance(item, StartupMarks):
                self.startup.add(dict(item.marks))
            elif isinstance(item, ValidationStarted):
                self.observers.on_validation_start(item)
            elif isinstance(item, WorkerIdentity) and self.doctor is not None:
                self.doctor.on_identity(item)
            elif isinstance(item, HangSuspected) and self.doctor is not None:
                self.doctor.on_suspected(item)
        diagnosis = self.doctor.poll() if self.doctor is not None else None
        if diagnosis is not None:
            self.observers.on_hang(diagnosis)

    def _on_report(self, report: Report) -> None:
        if self.cost is not None:
            report = self.cost.on_report(report)
        self.recovery.reported(report)
        self.awaiting_group = False
        self.last_report = report
        self.observers.on_report(report)

    @property
    def last_checkpoint(self) -> str | None:
        return self.last_report.checkpoint if self.last_report is not None else None
