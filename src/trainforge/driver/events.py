"""How the driver watches a run: the controller forwards reports to a mailbox, observers consume them.

Firing order, for every observer: ``on_start`` once, then ``on_report`` per report of rank 0's
metrics (in step order) with ``on_worker_error`` and ``on_log`` (batches of worker log lines)
interleaved as they happen, then ``on_end`` once with the summary. ``on_log`` is optional. An
observer that raises is logged and skipped; it never stops training.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any, Protocol

import ray
from ray.train.v2.api.callback import UserCallback

from trainforge.driver.cost import CostMeter
from trainforge.driver.summary import DRIVER_START, Recovery

log = logging.getLogger("trainforge")


def start_mailbox() -> Any:
    """A Mailbox on the driver's own node, like Ray Train's controller: it must outlive worker nodes."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
    return Mailbox.options(scheduling_strategy=here).remote()  # type: ignore[attr-defined]


@ray.remote(num_cpus=0)
class Mailbox:
    """A tiny actor the controller drops events into and the driver drains."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.stop = False

    def put(self, item: dict[str, Any]) -> None:
        self.items.append(item)

    def request_stop(self) -> None:
        """Ask the workers to checkpoint and stop at their next report (graceful stop)."""
        self.stop = True

    def stop_requested(self) -> bool:
        return self.stop

    def drain(self) -> list[dict[str, Any]]:
        items, self.items = self.items, []
        return items


class ForwardingCallback(UserCallback):
    """Runs in the Ray Train controller; forwards rank 0's reports and worker failures to the driver."""

    def __init__(self, mailbox: Any) -> None:
        self.mailbox = mailbox

    def after_report(self, run_context: Any, metrics: list[dict[str, Any]], checkpoint: Any) -> None:
        self.mailbox.put.remote({"kind": "report", "metrics": merge_reports(metrics)})  # fire and forget: in order

    def after_exception(self, run_context: Any, worker_exceptions: dict[int, Exception]) -> None:
        errors = {
            int(rank): f"{type(err).__name__}: {err}".splitlines()[0][:500] for rank, err in worker_exceptions.items()
        }
        self.mailbox.put.remote({"kind": "worker_error", "errors": errors, "time": time.time()})


PER_NODE_PREFIX = "system/"


def merge_reports(metrics: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0's report (every rank reports the same all-reduced figures) plus the per-node
    ``system/<node>/...`` samples that each node's first worker adds to its own report."""
    merged = dict(metrics[0]) if metrics else {}
    for other in metrics[1:]:
        merged.update({k: v for k, v in other.items() if k.startswith(PER_NODE_PREFIX)})
    return merged


class Observer(Protocol):
    def on_start(self, info: dict[str, Any]) -> None: ...
    def on_report(self, metrics: dict[str, Any]) -> None: ...
    def on_worker_error(self, errors: dict[int, str], at: float | None = None) -> None: ...
    def on_end(self, summary: dict[str, Any]) -> None: ...


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

    def on_start(self, info: dict[str, Any]) -> None:
        self._each("on_start", info)

    def on_report(self, metrics: dict[str, Any]) -> None:
        self._each("on_report", metrics)

    def on_worker_error(self, errors: dict[int, str], at: float | None = None) -> None:
        """``at``: when the failure was seen (unix time), for recovery times."""
        self._each("on_worker_error", errors, at)

    def on_log(self, lines: list[dict[str, Any]]) -> None:
        self._each("on_log", lines)

    def on_end(self, summary: dict[str, Any]) -> None:
        self._each("on_end", summary)


class Pump:
    """Drains the mailbox and dispatches events; the driver's main loop calls ``drain`` while it waits.

    It also keeps what the summary needs: the last report and ``recovery`` (restarts, and recovery
    times from a worker failure to the first completed step after the restore that followed it),
    the same ``summary.Recovery`` that a replay of metrics.jsonl gives.
    """

    def __init__(self, mailbox: Any, observers: Observers, cost: CostMeter | None = None) -> None:
        self.mailbox = mailbox
        self.observers = observers
        self.cost = cost  # with a price set, every report gains cost/so_far and cost/projected_total
        self.last_metrics: dict[str, Any] = {}
        self.recovery = Recovery()

    def drain(self) -> None:
        try:
            events = ray.get(self.mailbox.drain.remote(), timeout=30)
        except (ray.exceptions.RayError, TimeoutError) as err:
            log.debug("mailbox unavailable: %s", err)
            return
        for event in events:
            if event["kind"] == "report":
                self._on_report(event["metrics"])
            elif event["kind"] == "worker_error":
                self.recovery.failed(event["time"])
                self.observers.on_worker_error(event["errors"], event["time"])
            elif event["kind"] == "log":
                self.observers.on_log(event["lines"])

    def _on_report(self, metrics: dict[str, Any]) -> None:
        if self.cost is not None:
            metrics = self.cost.on_report(metrics)
        self.recovery.reported(metrics)
        self.last_metrics = metrics
        self.observers.on_report(metrics)

    @property
    def last_checkpoint(self) -> str | None:
        return self.last_metrics.get("checkpoint/path")


class MetricsLog:
    """Appends every report to ``<run dir>/metrics.jsonl`` (the source for reports and plots)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / "metrics.jsonl"

    def on_start(self, info: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # A driver session begins: a replay (summary.RunLog) counts restarts from the last one on.
        self._append({"event": DRIVER_START, "time": time.time()})

    def on_report(self, metrics: dict[str, Any]) -> None:
        self._append(metrics)

    def on_worker_error(self, errors: dict[int, str], at: float | None = None) -> None:
        self._append({"event": "worker_error", "errors": errors, "time": at})

    def _append(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")

    def on_end(self, summary: dict[str, Any]) -> None:
        pass


class WorkerLog:
    """Appends every worker's log lines (tagged with rank and node) to ``<run dir>/workers.log``."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / "workers.log"

    def on_start(self, info: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def on_report(self, metrics: dict[str, Any]) -> None:
        pass

    def on_worker_error(self, errors: dict[int, str], at: float | None = None) -> None:
        pass

    def on_log(self, lines: list[dict[str, Any]]) -> None:
        with self.path.open("a") as handle:
            handle.writelines(line["text"] + "\n" for line in lines)

    def on_end(self, summary: dict[str, Any]) -> None:
        pass
