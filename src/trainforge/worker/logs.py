"""Worker log lines, each tagged with rank and node, shipped to the driver.

Every record a worker logs through ``logging`` (trainforge's INFO and up, any library's WARNING and
up, Python warnings) and every line it prints to stdout is formatted as
``2026-11-21 10:00:00,000 WARNING rank=1 node=10.0.0.2 trainforge.worker: ...`` and sent to the
driver's mailbox, which appends it to ``<run dir>/workers.log`` and shows warnings and errors on the
console. The driver's run directory is the one place every node's lines meet, whether or not the
nodes share a file system. Lines still go to the worker's own stderr (Ray's worker log files) too.

Shipping is fire-and-forget and batched: a warning or error is sent at once, other lines at most
once a second (or when 200 are waiting), and whatever is left when training ends.
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any, TextIO

from trainforge.protocol import LogBatch, LogLine
from trainforge.redact import redacting

BATCH_LINES = 200
BATCH_SECONDS = 1.0
MAX_LINE_CHARS = 4000


class ShippingHandler(logging.Handler):
    """Buffers formatted records and puts them into the driver's mailbox in batches."""

    def __init__(self, mailbox: Any) -> None:
        super().__init__(level=logging.INFO)
        self.mailbox = mailbox
        self.pending: list[LogLine] = []
        self.last_sent = time.monotonic()
        self.unsent = 0  # lines that could not be sent (the driver went away)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record)[:MAX_LINE_CHARS]
        except Exception:  # a bad format string in someone's log call must not break training
            self.handleError(record)
            return
        self.pending.append(LogLine(record.levelno, text))
        urgent = record.levelno >= logging.WARNING
        if urgent or len(self.pending) >= BATCH_LINES or time.monotonic() - self.last_sent >= BATCH_SECONDS:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        lines, self.pending = self.pending, []
        self.last_sent = time.monotonic()
        try:
            self.mailbox.put.remote(LogBatch(tuple(lines)))
        except Exception:
            self.unsent += len(lines)


class KeepLevel(logging.Filter):
    """trainforge's own loggers from INFO, everything else from WARNING."""

    def filter(self, record: logging.LogRecord) -> bool:
        own = record.name in ("trainforge", "stdout") or record.name.startswith("trainforge.")
        return record.levelno >= (logging.INFO if own else logging.WARNING)


class LineLogger(io.TextIOBase):
    """Stands in for sys.stdout: whole lines go to a logger, everything to the real stream.

    stderr is left alone: it carries Ray's own per-report log lines and tracebacks Ray reports anyway;
    warnings and errors arrive through ``logging`` and ``warnings`` instead."""

    def __init__(self, stream: TextIO, logger: logging.Logger, level: int) -> None:
        self.stream = stream
        self.logger = logger
        self.level = level
        self.partial = ""
        self.busy = threading.local()

    def write(self, text: str) -> int:
        self.stream.write(text)
        if getattr(self.busy, "on", False):  # a handler that writes to sys.stderr: no loop
            return len(text)
        self.busy.on = True
        try:
            self.partial += text
            *lines, self.partial = self.partial.split("\n")
            for line in lines:
                if line.strip():
                    self.logger.log(self.level, line.rstrip())
        finally:
            self.busy.on = False
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self.stream.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self.stream, "encoding", "utf-8")


def line_format(rank: int, node: str) -> logging.Formatter:
    return logging.Formatter(f"%(asctime)s %(levelname)s rank={rank} node={node} %(name)s: %(message)s")


@contextlib.contextmanager
def shipped_logs(mailbox: Any, rank: int, node: str) -> Iterator[ShippingHandler | None]:
    """Tag this worker's log lines with rank and node and ship them to ``mailbox`` while training."""
    if mailbox is None:
        yield None
        return
    root = logging.getLogger()
    local = logging.StreamHandler(sys.__stderr__)  # what Ray's worker log file keeps
    handler = ShippingHandler(mailbox)
    formatter = line_format(rank, node)
    for each in (handler, local):
        each.setFormatter(formatter)
        each.addFilter(KeepLevel())
        redacting(each)  # credentials in a URI a line quotes stay on the worker
    saved_level = root.level
    saved_stdout = sys.stdout
    # Our loggers propagate to the root, where both handlers sit; INFO must get that far.
    trainforge_logger = logging.getLogger("trainforge")
    saved_trainforge_level = trainforge_logger.level
    trainforge_logger.setLevel(logging.INFO)
    root.setLevel(min(saved_level or logging.INFO, logging.INFO))
    root.addHandler(handler)
    root.addHandler(local)
    # Printed lines reach the real stream already: they go to the driver only, not through the
    # root's other handlers (Ray's write to the worker's stderr log).
    printed = logging.getLogger("stdout")
    printed.addHandler(handler)
    printed.propagate = False
    logging.captureWarnings(True)
    sys.stdout = LineLogger(sys.stdout, logging.getLogger("stdout"), logging.INFO)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("default")  # each distinct warning once per location, as users expect
            yield handler
    finally:
        sys.stdout = saved_stdout
        logging.captureWarnings(False)
        root.removeHandler(handler)
        root.removeHandler(local)
        printed.removeHandler(handler)
        printed.propagate = True
        root.setLevel(saved_level)
        trainforge_logger.setLevel(saved_trainforge_level)
        handler.flush()
