"""A background sender for one MLflow run: callers enqueue, one thread talks to the store.

The driver's main loop (``driver/events.Pump``) hands reports to observers; nothing there may wait on
the network. ``Outbox`` takes metric points and calls into bounded in-memory queues and returns;
its thread opens the run, sends metrics in batches of up to 1000 points, then the queued calls, in
order. A call that fails for a reason that can pass (connection refused, timeout, 5xx, a locked
database) is retried with backoff and nothing is lost but time: the first outage is said once on
the ``trainforge`` logger, the return of the server once more. When more points wait than the
bound allows, the oldest are dropped and counted. A record the store refuses (4xx) is dropped with
a warning. ``close`` waits a bounded time and returns what could not be sent.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainforge.tracking.records import Point
from trainforge.tracking.store import MLFLOW_LOGS, SENDER_THREAD, connect, first_line, run_link

if TYPE_CHECKING:
    from mlflow import MlflowClient

log = logging.getLogger("trainforge")

BATCH_POINTS = 1000  # MLflow's limit on metrics per log_batch request
BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 15.0, 30.0)
CLOSING_BACKOFF_S = 1.0  # while close() waits, retry often: its time is bounded anyway


@dataclass(frozen=True)
class OpenedRun:
    run_id: str
    experiment_id: str


Opener = Callable[["MlflowClient"], OpenedRun]
Call = Callable[["MlflowClient", str], None]  # (client, run_id)


@dataclass
class Leftover:
    """What a closed outbox did not get into the store."""

    points: int = 0  # still queued when close() gave up
    dropped: int = 0  # oldest points dropped because the buffer was full
    refused: int = 0  # points the store refused (bad values)
    calls: list[str] = field(default_factory=list)  # descriptions of calls not made
    disabled: str | None = None  # why the outbox stopped trying altogether

    def __bool__(self) -> bool:
        return bool(self.points or self.dropped or self.refused or self.calls or self.disabled)

    def describe(self) -> str:
        parts = []
        if self.points:
            parts.append(f"{self.points} metric points")
        if self.dropped:
            parts.append(f"{self.dropped} oldest metric points dropped while the server was away (buffer full)")
        if self.refused:
            parts.append(f"{self.refused} metric points the store refused")
        parts.extend(self.calls)
        if self.disabled:
            parts.append(self.disabled)
        return "; ".join(parts)


def is_transient(err: BaseException) -> bool:
    """True when retrying can help: no answer, a server error, rate limiting, a locked database.

    MLflow reports a refused request as an ``MlflowException`` whose code maps to a 4xx status;
    connection failures reach us as ``MlflowException`` with status 500, or as OS errors.
    """
    status = getattr(err, "get_http_status_code", None)
    if callable(status):
        code = int(status())
        return code >= 500 or code == 429
    return not isinstance(err, (FileNotFoundError, ValueError, TypeError, KeyError, AttributeError))


class Outbox:
    """Bounded queues drained by one daemon thread into one MLflow run."""

    def __init__(
        self, uri: str, opener: Opener, *, max_points: int, label: str = "run", log_path: Path | None = None
    ) -> None:
        """``log_path``: where MLflow's own log lines go while this outbox runs (else nowhere)."""
        self.uri = uri
        self.log_path = log_path
        self._log_handler: logging.Handler | None = None
        self.opener = opener
        self.max_points = max_points
        self.label = label
        self.opened: OpenedRun | None = None
        self._points: deque[Point] = deque()
        self._calls: deque[tuple[str, Call]] = deque()
        self._inflight_points: list[Point] = []
        self._inflight_call: tuple[str, Call] | None = None
        self._cond = threading.Condition()
        self._closing = False
        self._abandoned = False
        self._is_open = threading.Event()
        self._leftover = Leftover()
        self._down_since: float | None = None
        self._warned_down = self._warned_full = self._warned_refused = False
        self._thread = threading.Thread(target=self._run, name=f"{SENDER_THREAD}-{label}", daemon=True)

    # ---- the caller's side: never blocks on the network --------------------------------------

    def start(self) -> Outbox:
        if self.log_path is not None:
            self._log_handler = MLFLOW_LOGS.route_to(self.log_path)
        self._thread.start()
        return self

    @property
    def started(self) -> bool:
        return self._thread.ident is not None

    def add_points(self, points: list[Point]) -> None:
        if not points:
            return
        with self._cond:
            if self._leftover.disabled:
                return
            self._points.extend(points)
            over = len(self._points) + len(self._inflight_points) - self.max_points
            if over > 0:
                dropped = min(over, len(self._points))
                for _ in range(dropped):
                    self._points.popleft()
                self._leftover.dropped += dropped
                if not self._warned_full:
                    self._warned_full = True
                    log.warning(
                        "MLflow buffer full (%d points, tracking.max_buffered_points): dropping the oldest points "
                        "until %s answers again",
                        self.max_points,
                        self.uri,
                    )
            self._cond.notify_all()

    def add_call(self, what: str, call: Call) -> None:
        with self._cond:
            if self._leftover.disabled:
                return
            self._calls.append((what, call))
            self._cond.notify_all()

    def wait_open(self, timeout_s: float) -> OpenedRun | None:
        """The run once the store has created it; None if that did not happen within ``timeout_s``."""
        self._is_open.wait(timeout_s)
        return self.opened

    def close(self, timeout_s: float) -> Leftover:
        """Send what is queued, waiting at most ``timeout_s``; what was not sent."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
        with self._cond:
            self._abandoned = True
            self._cond.notify_all()
            left = self._leftover
            left.points = len(self._points) + len(self._inflight_points)
            calls = ([self._inflight_call] if self._inflight_call else []) + list(self._calls)
            left.calls.extend(what for what, _ in calls)
            if not self.opened and not left.disabled and (left.points or left.calls):
                left.calls.insert(0, "the run itself (never created)")
            self._points.clear()
            self._calls.clear()
        if self._log_handler is not None:
            MLFLOW_LOGS.release(self._log_handler)
            self._log_handler = None
        return left

    def close_and_say(self, timeout_s: float, what: str) -> Leftover:
        """``close``, then one line: where to see the run, or what it lacks."""
        left = self.close(timeout_s)
        if left:
            log.warning("MLflow at %s did not get everything of %s: %s", self.uri, what, left.describe())
        elif self.opened is not None:
            log.info("%s", run_link(self.uri, self.opened.experiment_id, self.opened.run_id))
        return left

    # ---- the sender thread ---------------------------------------------------------------------

    def _run(self) -> None:
        client: Any = None
        attempt = 0
        while True:
            with self._cond:
                job = self._next_job()
            if job is None:
                return
            try:
                if client is None:
                    client = connect(self.uri)
                job(client)
            except Exception as err:
                with self._cond:
                    if self._abandoned:
                        return
                    if is_transient(err):
                        self._requeue()
                        self._outage(err)
                        self._back_off(BACKOFF_S[min(attempt, len(BACKOFF_S) - 1)])
                        attempt += 1
                        continue
                    self._refuse(err)
            else:
                attempt = 0
                with self._cond:
                    self._sent()

    def _back_off(self, delay_s: float) -> None:
        """Under the lock: sleep before the next attempt; new data does not cut it short, close() does."""
        started = time.monotonic()
        while not self._abandoned:
            limit = min(delay_s, CLOSING_BACKOFF_S) if self._closing else delay_s
            remaining = started + limit - time.monotonic()
            if remaining <= 0:
                return
            self._cond.wait(remaining)

    def _next_job(self) -> Callable[[Any], None] | None:
        """Under the lock: wait for work; the next thing to send, or None when done."""
        while True:
            if self._abandoned or self._leftover.disabled:
                return None
            if self.opened is None:
                return self._open
            if self._points:
                batch = [self._points.popleft() for _ in range(min(BATCH_POINTS, len(self._points)))]
                self._inflight_points = batch
                return lambda client: self._send_points(client, batch)
            if self._calls:
                self._inflight_call = self._calls.popleft()
                call = self._inflight_call[1]
                run_id = self.opened.run_id
                return lambda client: call(client, run_id)
            if self._closing:
                return None
            self._cond.wait()

    def _open(self, client: MlflowClient) -> None:
        opened = self.opener(client)
        with self._cond:
            self.opened = opened
        self._is_open.set()

    def _send_points(self, client: MlflowClient, batch: list[Point]) -> None:
        from mlflow.entities import Metric

        assert self.opened is not None
        metrics = [Metric(key, value, stamp, step) for key, value, stamp, step in batch]
        client.log_batch(self.opened.run_id, metrics=metrics, synchronous=True)

    def _requeue(self) -> None:
        """Under the lock: a failed batch or call goes back to the front, oldest first."""
        self._points.extendleft(reversed(self._inflight_points))
        self._inflight_points = []
        if self._inflight_call is not None:
            self._calls.appendleft(self._inflight_call)
            self._inflight_call = None

    def _sent(self) -> None:
        self._inflight_points = []
        self._inflight_call = None
        if self._down_since is not None:
            log.info(
                "MLflow at %s answers again after %.0f s; sending what was buffered",
                self.uri,
                time.monotonic() - self._down_since,
            )
            self._down_since = None

    def _outage(self, err: BaseException) -> None:
        if self._down_since is None:
            self._down_since = time.monotonic()
        if not self._warned_down:
            self._warned_down = True
            log.warning(
                "MLflow at %s is unreachable (%s); training continues, tracking data is kept in memory and retried",
                self.uri,
                first_line(err),
            )

    def _refuse(self, err: BaseException) -> None:
        """Under the lock: the store said no. A refused run disables the outbox; a refused record is dropped."""
        if self.opened is None:
            self._leftover.disabled = f"MLflow refused to open the {self.label} run: {first_line(err)}"
            log.warning("%s; tracking is off for this run, training continues", self._leftover.disabled)
            self._is_open.set()
            return
        what = f"{len(self._inflight_points)} metric points" if self._inflight_points else None
        if self._inflight_call is not None:
            what = self._inflight_call[0]
        self._leftover.refused += len(self._inflight_points)
        if self._inflight_call is not None:
            self._leftover.calls.append(f"{self._inflight_call[0]} (refused)")
        self._inflight_points = []
        self._inflight_call = None
        if not self._warned_refused:
            self._warned_refused = True
            log.warning("MLflow refused %s: %s", what, first_line(err))
        else:
            log.debug("MLflow refused %s: %s", what, first_line(err))
