"""One trial, inside Ray Tune's trial actor: a complete trainforge run with sampled hyperparameters.

The trial function is the Ray Train driver of its run (``driver/run.train``, as ``trainforge.fit``):
its own worker group, run directory ``<search dir>/<trial id>/``, checkpoints, restarts and summary. Reports reach Tune
through an observer on the run's report stream (observers/tune.py's ``TuneReporter``), which forwards each report that
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
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from trainforge.checkpoint.storage import CheckpointStore
from trainforge.config import Config, validate
from trainforge.driver.run import train
from trainforge.observers.tune import TRIAL_FILE, TuneReporter
from trainforge.tune.placement import RecordPlacementGroups
from trainforge.tune.space import apply_params

log = logging.getLogger("trainforge")

TUNE_DIR_PREFIX = ".ray-"  # Tune's own trial folders (params, results, PBT checkpoints), beside the runs
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
