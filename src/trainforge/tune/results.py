"""What a search leaves behind: ``tune_summary.json``, ``best.yaml``, plots, and a line per trial.

Each trial's numbers come from its own run directory (``metrics.jsonl``, ``summary.json``), which
holds every report, including those after the last one Tune saw; Tune's results add the status
(errors) and the sampled values. A trial a scheduler stopped never reaches the end of ``fit``
(Tune ends its actor), so its ``summary.json`` is written here through ``trainforge.driver.summary``
(``written_by: trainforge tune``),
with ``stopped_by: {source: scheduler, ...}``; so is that of a trial stopped while it was finishing.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from rich.console import Console
from rich.table import Table

from trainforge.checkpoint.format import write_json_atomic
from trainforge.checkpoint.storage import CheckpointStore
from trainforge.config import Config
from trainforge.driver.summary import SEARCH_DRIVER, RunLog, RunRecord, finish_run_dir
from trainforge.errors import TrainingFailed
from trainforge.protocol import Report
from trainforge.redact import redact_config
from trainforge.tune.schedulers import SearchSettings
from trainforge.tune.space import SearchSpace
from trainforge.tune.table import TrialWatch, fmt_value, short_names
from trainforge.tune.tracking import finish_search_run, finish_trial_runs
from trainforge.tune.trial import TUNE_DIR_PREFIX, TrialOutcome, TrialSetup, trial_config

if TYPE_CHECKING:
    from trainforge.tracking import SearchRun

SUMMARY_FILE = "tune_summary.json"
BEST_FILE = "best.yaml"


def outcome_of(
    result: Any, run_dir: Path, settings: SearchSettings, watch: TrialWatch, deadline: float | None
) -> TrialOutcome:
    """One trial's outcome. ``deadline``: when the search's time budget ran out, if it did; a trial
    still running then was cut by the budget, not stopped early."""
    trial_id = run_dir.name
    reports = RunLog.read(run_dir).reports
    row = watch.rows.get(trial_id)
    history = [(r.step, v) for r in reports if (v := r.value(settings.metric)) is not None and math.isfinite(v)]
    if not history and row is not None:
        history = list(row.history)  # no metrics.jsonl here (a run directory on another node): what Tune saw
    values = [v for _, v in history]
    steps = reports[-1].step if reports else (history[-1][0] if history else 0)
    last_total = reports[-1].total_steps if reports else None
    total = last_total if last_total is not None else settings.budget_steps
    if row is not None and row.started_at and row.ended_at:
        wall = row.ended_at - row.started_at
    else:
        wall = float((result.metrics or {}).get("time_total_s", 0.0))
    error = None
    if result.error is not None:
        status, error = "failed", str(result.error).strip().splitlines()[-1][:500]
    elif _read_json(run_dir / "summary.json").get("status") == "finished" or ended_training(reports):
        status = "finished"
    elif deadline is not None and (row is None or row.ended_at is None or row.ended_at >= deadline):
        status = "unfinished"
    elif total is not None and 0 < steps < total:
        status = "stopped"
    else:
        status = "unfinished"
    return TrialOutcome(
        trial_id=trial_id,
        config=dict(result.config or {}),
        status=status,
        stopped_early=status == "stopped",
        last_metric=values[-1] if values else None,
        best_metric=(min(values) if settings.mode == "min" else max(values)) if values else None,
        steps=steps,
        budget_steps=total,
        wall_time_s=round(wall, 3),
        run_dir=str(run_dir),
        error=error,
        started_at=row.started_at if row is not None else None,
        ended_at=row.ended_at if row is not None else None,
        history=history,
    )


def ended_training(reports: list[Report]) -> bool:
    """The run's final report is in: Tune may have stopped the trial while it wrote its summary."""
    return bool(reports) and reports[-1].status == "finished"


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def complete_run_dir(outcome: TrialOutcome) -> bool:
    """Write the run's summary.json (and final weights) when Tune ended the trial's actor before
    ``fit`` could: a trial a scheduler stopped, or one stopped while it was finishing. True if written.
    The record is the run's metrics.jsonl, read back (driver/summary.RunLog)."""
    run_dir = Path(outcome.run_dir)
    ran = RunLog.read(run_dir)
    # The reports the search counted (outcome.steps): a stopped trial's process may still be
    # appending to metrics.jsonl until Ray ends it, and the two summaries must agree.
    reports = [r for r in ran.reports if r.step <= outcome.steps]
    if not reports or (run_dir / "summary.json").is_file() or outcome.status not in ("stopped", "finished"):
        return False
    last = reports[-1]
    checkpoint = next((r.checkpoint for r in reversed(reports) if r.checkpoint), None)
    config_path = run_dir / "config.yaml"
    config = yaml.safe_load(config_path.read_text()) if config_path.is_file() else {}
    record = RunRecord(
        status=outcome.status,
        final=last,
        recovery=ran.recovery,
        wall_time_s=outcome.wall_time_s,
        checkpoint=checkpoint,
        config=config,
        num_workers=int(config.get("scaling", {}).get("num_workers", 1)) if isinstance(config, dict) else 1,
        stopped_by_scheduler=outcome.stopped_early,
        written_by=SEARCH_DRIVER,
    )
    # The run's config.yaml is redacted: the checkpoint's own URI (credentials from the environment) it is.
    store = CheckpointStore.for_checkpoint(checkpoint)[0] if checkpoint else None
    weights = run_dir / "model.safetensors"  # the model component's export (worker/components/weights.py)
    finish_run_dir(run_dir, record, None if weights.is_file() else store)
    return True


def pick_best(outcomes: list[TrialOutcome], mode: str) -> TrialOutcome | None:
    """The trial whose last reported metric is best (its state at the end, not a passing low)."""
    scored = [o for o in outcomes if o.last_metric is not None]
    if not scored:
        return None
    sign = 1.0 if mode == "min" else -1.0
    return min(scored, key=lambda o: sign * (o.last_metric or 0.0))


def compute_saved(outcomes: list[TrialOutcome]) -> dict[str, Any]:
    """Optimizer steps the trials ran against the steps they would have run without early stopping."""
    run = sum(o.steps for o in outcomes)
    budget = sum(o.budget_steps or o.steps for o in outcomes)
    return {
        "steps_run": run,
        "steps_budget": budget,
        "saved_fraction": round(1 - run / budget, 4) if budget else 0.0,
    }


def write_best_yaml(config: Config, setup: TrialSetup, best: TrialOutcome, search_dir: Path) -> Path:
    """A complete config with the best trial's values that ``trainforge train`` runs as is."""
    chosen = trial_config(setup, best.config, f"{config.run.name}-best")
    raw = chosen.to_dict()
    raw["run"]["output_dir"] = config.run.output_dir
    raw["tracking"] = config.to_dict()["tracking"]  # a run of its own, not a trial of the search
    path = search_dir / BEST_FILE
    header = f"# best trial {best.trial_id} of search {config.run.name}: {json.dumps(best.config)}\n"
    # Credentials in URIs are masked: a user re-supplies them (--set, TRAINFORGE_ environment).
    path.write_text(header + yaml.safe_dump(redact_config(raw), sort_keys=False))
    return path


def write_outputs(
    *,
    config: Config,
    space: SearchSpace,
    settings: SearchSettings,
    setup: TrialSetup,
    grid: Any,
    watch: TrialWatch,
    started_at: float,
    wall_time_s: float,
    concurrency: int,
    console: Console,
    search_run: SearchRun | None = None,
) -> dict[str, Any]:
    from trainforge.tune.plots import write_plots  # matplotlib: only when there is something to plot

    search_dir = config.run_dir
    budget_s = config.tune.time_budget_s
    deadline = started_at + budget_s if budget_s is not None and wall_time_s >= budget_s else None
    outcomes = []
    for result in grid:
        trial_id = Path(result.path).name.removeprefix(TUNE_DIR_PREFIX)
        outcomes.append(outcome_of(result, search_dir / trial_id, settings, watch, deadline))
    outcomes.sort(key=lambda o: o.trial_id)
    for outcome in outcomes:
        complete_run_dir(outcome)
    best = pick_best(outcomes, settings.mode)
    best_yaml = write_best_yaml(config, setup, best, search_dir) if best else None
    plots = write_plots(search_dir, outcomes, space, settings.metric, best)
    summary = {
        "name": config.run.name,
        "search_dir": str(search_dir),
        "metric": settings.metric,
        "mode": settings.mode,
        "search": settings.search,
        "scheduler": settings.scheduler,
        "scheduler_params": settings.scheduler_params,
        "num_trials": len(outcomes),
        "max_concurrent": concurrency,
        "space": {d.key: d.describe() for d in space.domains},
        "trials": [o.to_json() for o in outcomes],
        "best": {**best.to_json(), "best_yaml": str(best_yaml)} if best else None,
        "compute": compute_saved(outcomes),
        "wall_time_s": round(wall_time_s, 3),
        "plots": [str(p) for p in plots],
    }
    write_json_atomic(search_dir / SUMMARY_FILE, summary)
    print_outcome(console, summary, space.keys)
    if search_run is not None:
        finish_trial_runs(outcomes)
        status = "failed" if all(o.status == "failed" for o in outcomes) else "finished"
        if any(o.status == "unfinished" for o in outcomes):
            status = "stopped"
        finish_search_run(search_run, summary, outcomes, status)
    if outcomes and all(o.status == "failed" for o in outcomes):
        raise TrainingFailed(f"every trial failed; the first: {outcomes[0].error} (details: {search_dir})")
    if best is None:
        raise TrainingFailed(
            f"no trial reported tune.metric {settings.metric}; see the trials' metrics.jsonl under {search_dir} "
            "for the keys they report"
        )
    return summary


def print_outcome(console: Console, summary: dict[str, Any], keys: list[str]) -> None:
    metric = summary["metric"]
    table = Table(title=f"search {summary['name']}: {summary['num_trials']} trial(s), {metric} ({summary['mode']})")
    names = short_names(keys)
    for column in ("trial", "status", *(names[k] for k in keys), "steps", f"last {metric}", f"best {metric}", "wall s"):
        table.add_column(column, justify="left" if column in ("trial", "status") else "right")
    best_id = (summary.get("best") or {}).get("trial_id")
    for trial in summary["trials"]:
        table.add_row(
            trial["trial_id"] + (" *" if trial["trial_id"] == best_id else ""),
            trial["status"],
            *(fmt_value(trial["config"].get(key)) for key in keys),
            f"{trial['steps']}/{trial['budget_steps'] or '?'}",
            fmt_value(trial["last_metric"]),
            fmt_value(trial["best_metric"]),
            f"{trial['wall_time_s']:.0f}",
        )
    console.print(table)  # whole in a file or pipe too, on a consoles.make_console console
    compute = summary["compute"]
    console.print(
        f"steps run {compute['steps_run']:,} of {compute['steps_budget']:,} without early stopping "
        f"({compute['saved_fraction']:.0%} saved) · {summary['wall_time_s']:.0f} s",
        highlight=False,
    )
    best = summary.get("best")
    if best:
        console.print(f"best: {best_id} {metric} {fmt_value(best['last_metric'])} -> {best['best_yaml']}")
