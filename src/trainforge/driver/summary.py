"""summary.json and the final weights: what a run directory holds once its run has ended.

Two drivers end runs: the run's own (``launch``, at the end of ``fit``) and a search's
(``tune.results``, for a trial whose actor Tune ended before ``fit`` could). Both describe the run
with a ``RunRecord`` and write it with ``finish_run_dir``, so summary.json has one shape and
``restarts``/``recovery_s`` one meaning (``Recovery``) whoever writes it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainforge.checkpoint.format import write_json_atomic
from trainforge.checkpoint.names import checkpoint_name, name_of_uri, step_of_uri
from trainforge.checkpoint.storage import CheckpointStore
from trainforge.errors import CheckpointError
from trainforge.observers.metrics_log import DRIVER_START
from trainforge.protocol import BestValidation, EndedEarly, Report, Resumed, Straggler, WorkerFailure
from trainforge.redact import redact_config, redact_text

log = logging.getLogger("trainforge")

SUMMARY_FILE = "summary.json"
RUN_DRIVER = "trainforge"  # ``written_by``: the run's own driver, at the end of fit
SEARCH_DRIVER = "trainforge tune"  # ``written_by``: a search's driver, for a trial Tune cut short


@dataclass
class Recovery:
    """Worker-group failures and how long each took to recover: from the failure to the first
    report after the restore that followed it. A failure with no known time counts as a restart
    whose recovery was not measured. ``excluded_nodes``: the nodes ``failure.straggler.action:
    exclude`` took out of the run, as its ``Straggler`` events name them."""

    restarts: int = 0
    recovery_s: list[float] = field(default_factory=list)
    failed_at: float | None = None
    excluded_nodes: list[dict[str, Any]] = field(default_factory=list)

    def failed(self, at: float | None) -> None:
        self.restarts += 1
        if self.failed_at is None:
            self.failed_at = at

    def reported(self, report: Report) -> None:
        self.excluded_nodes.extend(
            {"node_id": event.node_id, "node": event.node, "rank": event.rank, "step": event.step, "score": event.score}
            for event in report.events
            if isinstance(event, Straggler) and event.action == "exclude"
        )
        resumed = any(isinstance(event, Resumed) for event in report.events)
        if resumed and self.failed_at is not None and report.time is not None:
            self.recovery_s.append(round(report.time - self.failed_at, 3))
            self.failed_at = None


@dataclass
class RunLog:
    """A run's ``metrics.jsonl`` read back: its reports and their recovery from failures."""

    reports: list[Report] = field(default_factory=list)
    recovery: Recovery = field(default_factory=Recovery)

    @property
    def last(self) -> Report | None:
        return self.reports[-1] if self.reports else None

    @classmethod
    def replay(cls, lines: Iterable[str]) -> RunLog:
        """The lines observers/metrics_log.MetricsLog appended, in order; a line cut short (a stopped trial's
        actor ended mid-write) or of another shape is skipped (``Report.from_json``: events by
        kind, a run's from before events had kinds as plain notes). ``restarts`` and ``recovery_s``
        cover the last driver session (from the last ``DRIVER_START`` line on), as the driver's
        own summary does; without such lines, the whole file."""
        found = cls()
        for line in lines:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not isinstance(record, dict):
                continue
            if record.get("event") == DRIVER_START:
                found.recovery = Recovery()
            elif record.get("event") == "worker_error":
                found.recovery.failed(WorkerFailure.from_json(record).time)
            elif (report := Report.from_json(record)) is not None:
                found.recovery.reported(report)
                found.reports.append(report)
        return found

    @classmethod
    def read(cls, run_dir: Path) -> RunLog:
        path = run_dir / "metrics.jsonl"
        return cls.replay(path.read_text().splitlines()) if path.is_file() else cls()


@dataclass
class RunRecord:
    """Everything summary.json is built from, whichever driver ends the run.

    ``final``: the run's last report (or what rank 0 returned; None before any); ``config``: the
    resolved config as a dict (redacted here); ``num_workers``: the worker count to state when
    ``final`` has none.
    """

    status: str  # finished, stopped (resumable), failed, aborted
    final: Report | None
    recovery: Recovery
    wall_time_s: float
    checkpoint: str | None
    config: Mapping[str, Any]
    num_workers: int
    error: str | None = None
    stopped_by_scheduler: bool = False  # a search's scheduler stopped the trial before its budget
    written_by: str = RUN_DRIVER
    cost: Mapping[str, Any] | None = None  # cost.CostEstimate.to_dict(), when a price is set
    startup: Mapping[str, Any] | None = None  # startup.Timeline.to_dict(): seconds to the first step, by phase
    stopped_by: Mapping[str, Any] | None = None  # the driver's own stop (a certificate about to expire)


def build_summary(record: RunRecord) -> dict[str, Any]:
    """summary.json's content (DESIGN's contract plus ``recovery_s``, ``stopped_by``, ``stopped_early``,
    ``written_by``, ``parameters``: the model's trainable and frozen parameter elements, as the
    workers counted, under ``train.anomaly``, ``anomalies``: ``anomaly_counts``, and
    ``excluded_nodes``: ``Recovery.excluded_nodes``, when a straggler's node was excluded).

    ``stopped_by``: why the run ended before its budget as a finished run (``source``: callback or
    early_stopping) or, for a search's trial, ``source: scheduler``; None otherwise.
    ``stopped_early``: ``{step, best_step, best, metric}`` when ``train.early_stopping`` ended it."""
    final = record.final if record.final is not None else Report(step=0)
    figures = final.scalars()
    return {
        "status": record.status,
        "global_step": final.step,
        "epoch": final.epoch or 0,
        "num_workers": final.world_size if final.world_size is not None else record.num_workers,
        "restarts": record.recovery.restarts,
        "recovery_s": list(record.recovery.recovery_s),
        "final_metrics": {k: v for k, v in figures.items() if "/" in k},
        "throughput_samples_per_s": float(final.figures.get("perf/steady_samples_per_s", 0.0)),
        "wall_time_s": round(record.wall_time_s, 3),
        "checkpoint": redact_text(record.checkpoint) if record.checkpoint else None,
        "config": redact_config(dict(record.config)),
        "stopped_by": stopped_by(record, final),
        "stopped_early": stopped_early(final),
        "written_by": record.written_by,
        **({"parameters": final.parameters.to_json()} if final.parameters is not None else {}),
        **({"batch": batch_choice(final, record.config)} if "batch/micro_batch_size" in final.figures else {}),
        **({"anomalies": anomaly_counts(final)} if "anomaly/skipped" in final.figures else {}),
        **({"excluded_nodes": list(record.recovery.excluded_nodes)} if record.recovery.excluded_nodes else {}),
        **({"cost": dict(record.cost)} if record.cost is not None else {}),
        **({"startup": dict(record.startup)} if record.startup is not None else {}),
        **({"error": redact_text(record.error.strip().splitlines()[-1])} if record.error else {}),
    }


def stopped_by(record: RunRecord, final: Report) -> dict[str, Any] | None:
    ended = next((event for event in final.events if isinstance(event, EndedEarly)), None)
    if ended is not None:
        return {"source": ended.source, "reason": ended.reason, "step": ended.step}
    if record.stopped_by_scheduler:
        return {"source": "scheduler", "reason": "the search's scheduler stopped the trial", "step": final.step}
    return dict(record.stopped_by) if record.stopped_by is not None else None


def stopped_early(final: Report) -> dict[str, Any] | None:
    """``train.early_stopping``'s stop: where, and the best pass before it."""
    ended = next((event for event in final.events if isinstance(event, EndedEarly)), None)
    best = best_validation(final)
    if ended is None or ended.source != "early_stopping" or best is None:
        return None
    return {"step": ended.step, "best_step": best.best_step, "best": best.best, "metric": best.metric}


def best_validation(final: Report | None) -> BestValidation | None:
    events = final.events if final is not None else ()
    return next((event for event in events if isinstance(event, BestValidation)), None)


def batch_choice(final: Report, config: Mapping[str, Any]) -> dict[str, int]:
    """How ``train.global_batch_size`` was split, as the run's last report states it: derived
    for the last start's worker count, or chosen by ``train.batch_size: auto`` (a late
    out-of-memory retry may have lowered the micro-batch the run started with)."""
    figures = final.figures
    return {
        "micro_batch_size": int(figures["batch/micro_batch_size"]),
        "grad_accum_steps": int(figures.get("batch/grad_accum_steps", 1)),
        "global_batch_size": int(config.get("train", {}).get("global_batch_size") or 0),
        "oom_retries": int(figures.get("batch/oom_retries", 0)),
    }


def anomaly_counts(final: Report) -> dict[str, Any]:
    """``train.anomaly``'s steps over the whole run, as the workers' guard counts them (restarts
    included: the counts are checkpointed): skipped or rolled back, and whom the re-run blamed."""
    figures = final.figures
    return {
        "skipped": int(figures["anomaly/skipped"]),
        "rolled_back": int(figures.get("anomaly/rolled_back", 0)),
        "attributed": {
            "data": int(figures.get("anomaly/data", 0)),
            "not_data": int(figures.get("anomaly/not_data", 0)),
        },
    }


def finish_run_dir(run_dir: Path, record: RunRecord, store: CheckpointStore | None) -> dict[str, Any]:
    """Write ``model.safetensors`` (out of the record's checkpoint, from ``store``; None: leave the
    run directory's weights as they are), then ``summary.json``; the summary."""
    summary = build_summary(record)
    if record.checkpoint and store is not None:
        best = best_checkpoint(record, store)
        source = best or record.checkpoint
        step = export_final_weights(store, source, run_dir, summary["global_step"], best=best is not None)
        summary["model_weights_step"] = step
    write_json_atomic(run_dir / SUMMARY_FILE, summary)
    return summary


def best_checkpoint(record: RunRecord, store: CheckpointStore) -> str | None:
    """``train.early_stopping.restore_best``: the checkpoint of the best validation pass (the
    workers saved it at that pass; rotation kept it), when it is there; None otherwise."""
    train = record.config.get("train")
    early = train.get("early_stopping") if isinstance(train, Mapping) else None
    best = best_validation(record.final)
    if not isinstance(early, Mapping) or not early.get("restore_best") or best is None or best.best_step is None:
        return None
    name = checkpoint_name(best.best_step)
    try:
        present = any(entry.name == name for entry in store.entries()) and bool(store.exports(name))
    except OSError as err:
        log.warning("train.early_stopping.restore_best: cannot list the run's checkpoints: %s", err)
        present = False
    if not present:
        log.warning(
            "train.early_stopping.restore_best: no checkpoint of the best validation (step %d); "
            "model.safetensors holds the last checkpoint's weights",
            best.best_step,
        )
        return None
    return store.uri(name)


def export_final_weights(
    store: CheckpointStore, checkpoint_uri: str, run_dir: Path, final_step: int, *, best: bool = False
) -> int | None:
    """Copy the weights files (model.safetensors, and what other components export, such as
    model_ema.safetensors) out of the run's last valid checkpoint (local or object store); the
    step they hold, which is older than the final step when the final save failed (said in the log).
    An encrypted checkpoint's weights are decrypted with ``store``'s key: the run directory holds
    the run's product in plaintext, for use (docs/security.md).
    ``store`` is the run's own, opened from the config: the checkpoint's URI as the workers report
    it names bucket and key only, not the credentials or endpoint the storage path may carry."""
    name = name_of_uri(checkpoint_uri)
    step = step_of_uri(checkpoint_uri)
    try:
        for target, source in store.exports(name).items():
            store.copy_out(name, source, run_dir / target)  # decrypted, if checkpoint.encryption sealed it
    except (OSError, CheckpointError) as err:
        log.error("could not copy the final weights out of %s: %s", redact_text(checkpoint_uri), err)
        return None
    if best:
        log.info("model.safetensors holds the weights of step %s, the best validation (restore_best)", step)
    elif step is not None and step != final_step:
        log.warning("model.safetensors holds the weights of step %s, the last checkpoint that was saved", step)
    return step
