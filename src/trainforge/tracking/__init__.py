"""MLflow tracking, from the driver: one MLflow run per training job (docs/tracking.md).

Training runs: ``api.fit`` adds ``make_tracker(config, run_dir)`` to its observers, after the
report writer. The tracker logs the flattened config as params, tags (git commit, versions,
workers, accelerators), every report's numbers as metrics at the report's step, and the run
directory's files as artifacts at the end. All MLflow calls happen on a background thread
(``outbox.Outbox``); an unreachable server is retried, said once, and never stops training.
A training run resumed in the same run directory continues its MLflow run (``tracking.json``).

Hyperparameter search (for ``trainforge tune``)::

    from trainforge.tracking import SearchRun, make_tracker

    search = SearchRun.start(config, "search-name", {"space": space_text, "search": "optuna"})
    parent = search.run_id                       # waits for the store; None if it could not
    # each trial: a nested run in the same experiment (tag mlflow.parentRunId), either
    tracker = make_tracker(trial_config, trial_run_dir, parent_run_id=parent, run_name=trial_name)
    # or, for trials that run through trainforge.fit, set tracking.parent_run_id in the trial's config.
    search.log_metrics({"best/val_loss": 0.12}, step=trials_done)
    search.set_tags({"best_trial": trial_name})
    search.log_artifact(report_path)
    search.end("finished")                       # or "failed" / "stopped"; waits a bounded time

``SearchRun`` methods never block on the network except ``run_id`` (once) and ``end``.

Worker side: ``tracking.system.SystemMetrics`` samples each node's CPU, memory, network, disk and
GPUs into the report; it imports neither MLflow nor anything else from the driver.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["MlflowTracker", "SearchRun", "TrackingError", "make_tracker"]

if TYPE_CHECKING:
    from trainforge.tracking.search import SearchRun
    from trainforge.tracking.store import TrackingError
    from trainforge.tracking.tracker import MlflowTracker, make_tracker


def __getattr__(name: str) -> Any:
    # Lazy, so that workers importing tracking.system load none of the driver-side modules.
    if name in {"MlflowTracker", "make_tracker"}:
        from trainforge.tracking import tracker

        return getattr(tracker, name)
    if name == "SearchRun":
        from trainforge.tracking.search import SearchRun

        return SearchRun
    if name == "TrackingError":
        from trainforge.tracking.store import TrackingError

        return TrackingError
    raise AttributeError(name)
