"""One trial, inside Ray Tune's trial actor: a complete trainforge run with sampled hyperparameters.

The trial function is the Ray Train driver of its run (``driver/run.train``, as ``trainforge.fit``):
its own worker group, run directory ``<search dir>/<trial id>/``, checkpoints, restarts and summary. Reports reach Tune
through an observer on the run's report stream (``TuneReporter``), which forwards each report that
carries the search metric with ``step`` as Tune's time attribute.

Ray's ``TuneReportCallback`` forwards metrics only (and a Ray Train checkpoint's path, which
trainforge does not use); PBT needs a checkpoint it can hand to another trial. So under PBT the
reports at checkpoint steps carry a Tune checkpoint holding a verified copy of that step's
trainforge checkpoint (and ``trial.json`` naming whose it is). A trial restarted with a checkpoint
of *another* trial (PBT's exploit) adopts it: its own, abandoned checkpoints are deleted and the
run starts from the donor's copy (``checkpoint.resume`` = that path, verified like every restore),
with the trial's own, mutated hyperparameters in effect (worker/saving.restore_optimizer).
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import shutil
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from trainforge.checkpoint.names import parse_checkpoint_name, step_of_uri
from trainforge.checkpoint.storage import CheckpointStore
from trainforge.config import Config, validate
from trainforge.driver.run import train
from trainforge.protocol import Report, RunInfo, WorkerFailure
from trainforge.tune.placement import RecordPlacementGroups
from trainforge.tune.space import apply_params

log = logging.getLogger("trainforge")

TUNE_DIR_PREFIX = ".ray-"  # Tune's own trial folders (params, results, PBT checkpoints), beside the runs
TRIAL_FILE = "trial.json"  # in a Tune checkpoint: which trial's trainforge checkpoint it holds
ADOPTED_FILE = "adopted.json"  # in a run dir: the PBT exploits this trial went through
# A trial Tune restarts (PBT's exploit, a restored search) runs in the run dir of its previous
# actor, whose process may still be exiting: its run lock (driver/runlock.py) is waited for, not refused.
TRIAL_LOCK_WAIT_S = 60.0


@dataclass(frozen=True)
class TrialSetup:
    """What every trial needs besides its sampled values; pickled once into the trainable."""

    base: dict[str, Any]  # the search's resolved config; run.output_dir is the search dir
    metric: str
    pbt_every: int | None  # PBT: the trials' checkpoint interval (TuneReporter); None otherwise
    workdir: str  # the search driver's working directory: relative paths and model.factory modules
    ledger: Any = None  # placement.PlacementGroupLedger: the trial's worker groups, for release when it ends
    pool: Any = None  # driver/warm.WarmPool: warm worker groups the trials lease (tune.reuse_workers)


@dataclass
class TrialOutcome:
    """One trial as the summary lists it."""

    trial_id: str
    config: dict[str, Any]
    status: str  # finished, stopped, failed, unfinished
    stopped_early: bool
    last_metric: float | None
    best_metric: float | None
    steps: int
    budget_steps: int | None
    wall_time_s: float
    run_dir: str
    error: str | None = None
    started_at: float | None = None  # unix time the driver saw the trial start (this session)
    ended_at: float | None = None
    history: list[tuple[int, float]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("history")
        return data


def trial_config(setup: TrialSetup, params: dict[str, Any], trial_id: str) -> Config:
    """The base config with the sampled values, named after the trial, under the search dir."""
    raw = apply_params(setup.base, params)
    raw["run"]["name"] = trial_id
    raw["checkpoint"]["resume"] = "auto"
    raw["metrics"]["trial"] = trial_id  # Prometheus: the trial's series carry its id
    train = raw["train"]
    if setup.metric.startswith("val/") and train.get("eval_every_n_steps") is None:
        # Validate at every report interval, so that the schedulers see the metric at each report.
        train["eval_every_n_steps"] = train["log_every_n_steps"]
    return validate(raw)


def run_trial(params: dict[str, Any], setup: TrialSetup) -> None:
    """Tune's function trainable: run (or continue) this trial's training to its end."""
    from ray import tune
    from rich.console import Console

    if os.path.isdir(setup.workdir):
        # Tune moved this process into its trial folder; the run's paths are the search driver's.
        os.chdir(setup.workdir)
    trial_id = tune.get_context().get_trial_id()
    config = trial_config(setup, params, trial_id)
    donor = adopt(config, tune.get_checkpoint(), trial_id)
    if donor is not None:
        config = validate({**config.to_dict(), "checkpoint": {**config.to_dict()["checkpoint"], "resume": donor}})
    reporter = TuneReporter(setup.metric, trial_id, pbt_every=setup.pbt_every)
    recorder = [RecordPlacementGroups(setup.ledger, trial_id)] if setup.ledger is not None else []
    try:
        train(
            config,
            console=Console(quiet=True),
            observers=[reporter],
            callbacks=recorder,
            lock_wait_s=TRIAL_LOCK_WAIT_S,
            pool=setup.pool,
        )
    finally:
        reporter.finish()


class TuneReporter:
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

    def on_start(self, info: RunInfo) -> None:
        pass

    def on_worker_error(self, failure: WorkerFailure) -> None:
        pass

    def on_end(self, summary: dict[str, Any]) -> None:
        pass

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


def adopt(config: Config, tune_checkpoint: Any, trial_id: str) -> str | None:
    """The donor checkpoint to start from after a PBT exploit, or None to resume this trial's own.

    A Tune checkpoint of this trial (a restart, a restored search) changes nothing: the run resumes
    from its own newest valid checkpoint. One of another trial is adopted once: the trial's own
    checkpoints belong to a timeline PBT abandoned and are deleted, so that a later worker restart
    resumes from what this trial saved after the exploit.
    """
    if tune_checkpoint is None:
        return None
    where = Path(tune_checkpoint.path)
    info = json.loads((where / TRIAL_FILE).read_text())
    if info["trial_id"] == trial_id:
        return None
    record_path = config.run_dir / ADOPTED_FILE
    records = json.loads(record_path.read_text()) if record_path.is_file() else []
    if records and records[-1]["tune_checkpoint"] == str(where):
        return None  # adopted already; the run continues from what it saved since
    store = CheckpointStore.for_run(config.storage_path, config.run.name)
    abandoned = [entry.name for entry in store.entries()]
    for name in abandoned:
        store.delete(name)
    donor = str(where / info["checkpoint"])
    records.append(
        {
            "tune_checkpoint": str(where),
            "checkpoint": donor,
            "donor_trial": info["trial_id"],
            "donor_step": info["step"],
            "abandoned": abandoned,
            "time": time.time(),
        }
    )
    config.run_dir.mkdir(parents=True, exist_ok=True)
    record_path.write_text(json.dumps(records, indent=1))
    log.info("trial %s adopts %s (step %d) from trial %s", trial_id, donor, info["step"], info["trial_id"])
    return donor
