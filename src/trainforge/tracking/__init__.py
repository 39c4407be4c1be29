"""MLflow tracking, from the driver: one MLflow run per training job (docs/tracking.md).

Training runs: the run's MLflow observer (observers/mlflow.py's ``MlflowTracker``, made by
``make_tracker(config, run_dir)``) comes after the report writer among its observers. It logs
the flattened config as params, tags (git commit, versions, workers, accelerators), every
report's numbers as metrics at the report's step, and the run directory's files as artifacts at
the end. All MLflow calls happen on a background thread
(``outbox.Outbox``); an unreachable server is retried, said once, and never stops training.
A training run resumed in the same run directory continues its MLflow run (``tracking.json``).

Hyperparameter search (for ``trainforge tune``)::

    from trainforge.observers.mlflow import make_tracker
    from trainforge.tracking import SearchRun

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

Driver side only: nothing under trainforge.worker (or models, data, checkpoint) imports this
package or observers/ (pyproject.toml's import contracts). The per-node system figures it records come from a
worker hook, ``metrics.system``. MLflow itself is imported where a call is made, on the sender thread.
"""

from __future__ import annotations

from trainforge.tracking.search import SearchRun
from trainforge.tracking.store import TrackingError

__all__ = ["SearchRun", "TrackingError"]
