"""Tune: a search trial's reports to Ray Tune, from the observers of the trial's run (tune/trial.py
adds a ``TuneReporter`` to the run it starts; Tune's trial actor is that run's driver).

Ray's ``TuneReportCallback`` forwards metrics only (and a Ray Train checkpoint's path, which
trainforge does not use); PBT needs a checkpoint it can hand to another trial. So under PBT the
reports at checkpoint steps carry a Tune checkpoint holding a verified copy of that step's
trainforge checkpoint (and ``trial.json`` naming whose it is; tune/trial.adopt reads it).
"""

from __future__ import annotations

import json
import logging
import math
import queue
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

from trainforge.checkpoint.names import parse_checkpoint_name, step_of_uri
from trainforge.checkpoint.storage import CheckpointStore
from trainforge.observers.base import Observer
from trainforge.protocol import Report

log = logging.getLogger("trainforge")

TRIAL_FILE = "trial.json"  # in a Tune checkpoint: which trial's trainforge checkpoint it holds


class TuneReporter(Observer):
    """Observer that forwards the run's reports to Tune.

    Only reports that carry the search metric go to Tune, each with ``step`` as the time attribute.
    ``tune.report`` waits until Tune asks for the next result, so a sender thread makes the calls:
    the run's other observers (metrics.jsonl, MLflow) never wait on Tune, and a trial Tune stops
    has logged everything up to the moment its actor ends. The final report is held back until the
    run has written its summary (stopping ends the trial's actor at once) and goes marked done.

    Under PBT (``pbt_every``: the checkpoint interval, a divisor of the perturbation interval)
    Tune sees only the reports at checkpoint steps, each with a Tune checkpoint holding that very
    checkpoint: the run reports first and saves after, so the report at step s waits until a later
    report names the checkpoint of step s. PBT then judges and hands out matching states.
    """

    def __init__(self, metric: str, trial_id: str, *, pbt_every: int | None = None) -> None:
        self.metric = metric
        self.trial_id = trial_id
        self.pbt_every = pbt_every
        self.final: Report | None = None
        self.pending: Report | None = None  # PBT: a checkpoint-step report awaiting its checkpoint
        self.outbox: queue.Queue[tuple[Report, str | None, bool] | None] = queue.Queue()
        self.sender = threading.Thread(target=self._send_all, name="trainforge-tune-report", daemon=True)
        self.sender.start()

    def on_report(self, report: Report) -> None:
        if report.value(self.metric) is None:
            return
        if report.status is not None:
            self.final = report
        elif self.pbt_every is None:
            self.outbox.put((report, None, False))
        else:
            self.pace(report, self.pbt_every)

    def pace(self, report: Report, every: int) -> None:
        if self.pending is not None and report.checkpoint and checkpoint_step(report) >= self.pending.step:
            self.outbox.put((self.pending, report.checkpoint, False))
            self.pending = None
        if report.step % every == 0:
            self.pending = report

    def finish(self) -> None:
        """After fit: the final report, marked done (Tune then ends the trial without asking the
        scheduler; PBT would otherwise exploit a trial that has used its budget); waits until sent."""
        final = self.final
        if final is not None:
            checkpoint = final.checkpoint if self.pbt_every is not None else None
            if self.pending is not None and checkpoint:
                self.outbox.put((self.pending, checkpoint, False))
            self.outbox.put((final, checkpoint, True))
        self.outbox.put(None)
        self.sender.join()

    def _send_all(self) -> None:
        while (item := self.outbox.get()) is not None:
            report, checkpoint, done = item
            send(report, checkpoint=checkpoint, trial_id=self.trial_id, done=done)


def checkpoint_step(report: Report) -> int:
    """The step of the checkpoint a report names; -1 when it names none."""
    step = step_of_uri(report.checkpoint) if report.checkpoint else None
    return -1 if step is None else step


def send(report: Report, *, checkpoint: str | None = None, trial_id: str = "", done: bool = False) -> None:
    """One Tune result: the report's finite numbers (and done), with a Tune checkpoint holding a
    verified copy of ``checkpoint`` when given (left out when the copy fails)."""
    from ray import tune

    result: dict[str, Any] = {k: v for k, v in report.scalars().items() if math.isfinite(v)}
    if done:
        result["done"] = True
    if checkpoint is None:
        tune.report(result)
        return
    with tempfile.TemporaryDirectory(prefix="trainforge-tune-ckpt-") as scratch:
        packed = pack_checkpoint(checkpoint, trial_id, Path(scratch))
        tune.report(result, checkpoint=tune.Checkpoint.from_directory(str(packed)) if packed else None)


def pack_checkpoint(source: str, trial_id: str, scratch: Path) -> Path | None:
    """A Tune checkpoint directory holding a verified copy of a trainforge checkpoint; None if the
    checkpoint was rotated away or does not verify (the report then goes without one)."""
    store, name = CheckpointStore.for_checkpoint(source)
    packed = scratch / "tune"
    try:
        with tempfile.TemporaryDirectory(prefix="fetch-", dir=scratch) as fetched:
            shutil.copytree(store.fetch(name, Path(fetched)), packed / name)
    except (OSError, shutil.Error) as err:
        log.warning("no Tune checkpoint for %s: %s", source, err)
        return None
    copy = CheckpointStore.from_uri(str(packed))
    check = copy.verify(name)
    if not check.ok:
        log.warning("no Tune checkpoint for %s: the copy does not verify (%s)", source, "; ".join(check.problems))
        return None
    step = parse_checkpoint_name(name)
    (packed / TRIAL_FILE).write_text(json.dumps({"trial_id": trial_id, "checkpoint": name, "step": step}))
    return packed
