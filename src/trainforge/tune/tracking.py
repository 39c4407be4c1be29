"""MLflow for a search: one parent run, and each trial's run nested under it (trainforge.tracking).

A trial is a ``trainforge.fit`` run, so its MLflow run is the ordinary training run (params, every
report's metrics, artifacts, final status); the search only points it at the parent
(``tracking.parent_run_id``) in the parent's store (``tracking.uri``). A trial Tune stopped never
reaches the end of ``fit``: the driver completes its run afterwards (params and tags, the reports
it had not sent, summary, files, status KILLED; FINISHED for one stopped while it was finishing).
Every trial's run gets the ``trainforge.stopped_early`` tag and ``tune/stopped_early`` metric; the
parent gets the search's settings, the best value after each trial, the best trial,
``tune_summary.json``, ``best.yaml`` and the plots.

A continued (restored) search reopens its parent run (``tracking.json`` in the search folder);
trials that resume continue their own runs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainforge.config import Config, load_config
from trainforge.driver.summary import SEARCH_DRIVER, RunLog
from trainforge.observers.mlflow import make_tracker
from trainforge.protocol import RunInfo
from trainforge.tracking import SearchRun
from trainforge.tracking.records import metric_points
from trainforge.tracking.runs import RESUME_FILE, end_call, tags_call

if TYPE_CHECKING:
    from trainforge.tune.schedulers import SearchSettings
    from trainforge.tune.space import SearchSpace
    from trainforge.tune.trial import TrialOutcome


def start_search_run(config: Config, settings: SearchSettings, space: SearchSpace, base: dict[str, Any]) -> SearchRun:
    """Open the parent run and point the trials' config (``base``, changed in place) at it."""
    search_dir = config.run_dir
    params = {
        "space": json.dumps({d.key: {d.kind: list(d.args)} for d in space.domains}),
        "search": settings.search,
        "scheduler": settings.scheduler,
        "scheduler_params": json.dumps(settings.scheduler_params),
        "metric": settings.metric,
        "mode": settings.mode,
        "num_trials": settings.num_trials,
    }
    search = SearchRun.start(config, config.run.name, params, log_dir=search_dir)
    parent = search.run_id
    if parent is None:
        return search
    base["tracking"]["uri"] = search.uri
    base["tracking"]["parent_run_id"] = parent
    return search


def finish_trial_runs(outcomes: list[TrialOutcome]) -> None:
    """Tag every trial's run with whether it stopped early and give it its final status. A stopped
    trial's actor ended before its tracker had sent everything: the params and tags it lacks, the
    reports MLflow lacks from the run's metrics.jsonl, then its summary and files, status KILLED.

    Tune may end a trial's actor at any point of its tracker's work: before the run was created,
    between creating it and remembering it (``tracking.json``), or before its params went out. The
    driver's tracker opens the same run in every case (the remembered one, else the parent's child
    tagged with the run directory, else a new one) and sends params and tags again: MLflow gets only
    those it lacks (``params_call``), so a run never ends without them, however early Tune stopped it."""
    for outcome in outcomes:
        run_dir = Path(outcome.run_dir)
        remembered = run_dir / RESUME_FILE
        if not (run_dir / "config.yaml").is_file():
            continue  # the trial never started
        summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() else {}
        cut_short = summary.get("written_by") == SEARCH_DRIVER  # Tune ended the trial's actor
        opened = remembered.is_file()
        if not (opened or cut_short):
            continue  # tracking off
        config = load_config(run_dir / "config.yaml")
        tracker = make_tracker(config, config.run_dir)  # the trial's own: its run is tagged with it
        if tracker is None:
            continue
        flag = outcome.stopped_early
        tracker.outbox.add_call("stopped_early tag", tags_call({"trainforge.stopped_early": str(flag).lower()}))
        tracker.outbox.add_points(metric_points({"step": outcome.steps, "tune/stopped_early": float(flag)}))
        if cut_short:
            sent = logged_up_to(tracker.uri, json.loads(remembered.read_text()).get("run_id")) if opened else -1
            for report in RunLog.read(run_dir).reports:
                if report.step > sent:
                    tracker.outbox.add_points(metric_points(report))
        tracker.on_start(RunInfo(config.run.name, config.scaling.max_workers, "search", str(run_dir)))
        if cut_short:
            tracker.on_end(summary)  # files and final status: what fit would have done had Tune let it
            continue
        # Reopening a run sets it RUNNING again: put back the status the trial ended with.
        tracker.outbox.add_call("final status", end_call(str(summary.get("status", "failed"))))
        tracker.outbox.close_and_say(config.tracking.flush_timeout_s, f"the run in {run_dir}")


def logged_up_to(uri: str, run_id: str | None) -> int:
    """The last step of a run's ``train/loss`` history in MLflow (-1 when none or unreadable)."""
    from mlflow import MlflowClient

    if not run_id:
        return -1
    try:
        history = MlflowClient(tracking_uri=uri).get_metric_history(run_id, "train/loss")
    except Exception:  # the store is away: send everything, the outbox retries
        return -1
    return max((int(point.step) for point in history), default=-1)


def finish_search_run(search: SearchRun, summary: dict[str, Any], outcomes: list[TrialOutcome], status: str) -> None:
    """The parent's record: best value after each finished trial, the best trial, the outputs."""
    metric = summary["metric"]
    better = min if summary["mode"] == "min" else max
    finals = [o.last_metric for o in sorted(outcomes, key=lambda o: o.trial_id) if o.last_metric is not None]
    for done in range(1, len(finals) + 1):
        search.log_metrics({f"best/{metric}": better(finals[:done])}, step=done)
    compute = summary["compute"]
    search.log_metrics({"tune/steps_run": compute["steps_run"], "tune/saved_fraction": compute["saved_fraction"]})
    if summary.get("best"):
        search.set_tags({"best_trial": summary["best"]["trial_id"]})
    search_dir = Path(summary["search_dir"])
    for name in ("tune_summary.json", "best.yaml"):
        if (search_dir / name).is_file():
            search.log_artifact(search_dir / name)
    if (search_dir / "plots").is_dir():
        search.log_artifact(search_dir / "plots", "plots")
    search.end(status)
