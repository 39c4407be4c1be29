"""How the driver watches a run: the controller forwards reports to a mailbox, observers consume them.

Firing order, for every observer: ``on_start`` once, then ``on_report`` per report of rank 0's
metrics (in step order) with ``on_worker_error`` interleaved as failures happen, then ``on_end``
once with the summary. An observer that raises is logged and skipped; it never stops training.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any, Protocol

import ray
from ray.train.v2.api.callback import UserCallback

log = logging.getLogger("trainforge")


@ray.remote(num_cpus=0)
class Mailbox:
    """A tiny actor the controller drops events into and the driver drains."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []

    def put(self, item: dict[str, Any]) -> None:
        self.items.append(item)

    def drain(self) -> list[dict[str, Any]]:
        items, self.items = self.items, []
        return items


class ForwardingCallback(UserCallback):
    """Runs in the Ray Train controller; forwards rank 0's reports and worker failures to the driver."""

    def __init__(self, mailbox: Any) -> None:
        self.mailbox = mailbox

    def after_report(self, run_context: Any, metrics: list[dict[str, Any]], checkpoint: Any) -> None:
        event: dict[str, Any] = {"kind": "report", "metrics": dict(metrics[0]) if metrics else {}}
        if checkpoint is not None:
            event["checkpoint"] = checkpoint.path
        self.mailbox.put.remote(event)  # fire and forget: calls from one caller arrive in order

    def after_exception(self, run_context: Any, worker_exceptions: dict[int, Exception]) -> None:
        errors = {
            int(rank): f"{type(err).__name__}: {err}".splitlines()[0][:500] for rank, err in worker_exceptions.items()
        }
        self.mailbox.put.remote({"kind": "worker_error", "errors": errors})


class Observer(Protocol):
    def on_start(self, info: dict[str, Any]) -> None: ...
    def on_report(self, metrics: dict[str, Any]) -> None: ...
    def on_worker_error(self, errors: dict[int, str]) -> None: ...
    def on_end(self, summary: dict[str, Any]) -> None: ...


class Observers:
    """Fans events out to every observer; failures in one are logged once and do not propagate."""

    def __init__(self, observers: list[Observer]) -> None:
        self.observers = observers
        self._failed: set[int] = set()

    def _each(self, method: str, *args: Any) -> None:
        for index, observer in enumerate(self.observers):
            try:
                getattr(observer, method)(*args)
            except Exception as err:  # an observer must never take training down
                if index not in self._failed:
                    log.warning("%s.%s failed: %s", type(observer).__name__, method, err)
                    self._failed.add(index)

    def on_start(self, info: dict[str, Any]) -> None:
        self._each("on_start", info)

    def on_report(self, metrics: dict[str, Any]) -> None:
        self._each("on_report", metrics)

    def on_worker_error(self, errors: dict[int, str]) -> None:
        self._each("on_worker_error", errors)

    def on_end(self, summary: dict[str, Any]) -> None:
        self._each("on_end", summary)


class Pump:
    """A driver thread that drains the mailbox and dispatches events while ``fit`` blocks."""

    def __init__(self, mailbox: Any, observers: Observers, interval_s: float = 0.5) -> None:
        self.mailbox = mailbox
        self.observers = observers
        self.interval_s = interval_s
        self.last_metrics: dict[str, Any] = {}
        self.last_checkpoint: str | None = None
        self.worker_errors: list[dict[int, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trainforge-pump", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self.drain()  # whatever arrived after the last poll

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.drain()
            except ray.exceptions.RayError as err:
                log.debug("mailbox unavailable: %s", err)

    def drain(self) -> None:
        for event in ray.get(self.mailbox.drain.remote()):
            if event["kind"] == "report":
                self.last_metrics = event["metrics"]
                self.last_checkpoint = event.get("checkpoint", self.last_checkpoint)
                self.observers.on_report(event["metrics"])
            elif event["kind"] == "worker_error":
                self.worker_errors.append(event["errors"])
                self.observers.on_worker_error(event["errors"])


class MetricsLog:
    """Appends every report to ``<run dir>/metrics.jsonl`` (the source for reports and plots)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / "metrics.jsonl"

    def on_start(self, info: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def on_report(self, metrics: dict[str, Any]) -> None:
        with self.path.open("a") as handle:
            handle.write(json.dumps(metrics) + "\n")

    def on_worker_error(self, errors: dict[int, str]) -> None:
        with self.path.open("a") as handle:
            handle.write(json.dumps({"event": "worker_error", "errors": errors}) + "\n")

    def on_end(self, summary: dict[str, Any]) -> None:
        pass
