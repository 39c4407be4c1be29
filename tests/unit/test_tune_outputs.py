"""What a search prints and draws, from synthetic trials (no Ray run): the summary table whole in a
pipe, one learning curve per trial that reported (a single report as a marker), the loss axis
named by the task, and a trial's curve from Tune's results when its run directory has no metrics."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from matplotlib.lines import Line2D
from rich.console import Console

import trainforge
from trainforge.config import load_config
from trainforge.tune.plots import learning_curves_figure, metric_label, write_plots
from trainforge.tune.results import outcome_of, print_outcome
from trainforge.tune.schedulers import SearchSettings
from trainforge.tune.space import load_space
from trainforge.tune.table import TrialRow, TrialWatch
from trainforge.tune.trial import TrialOutcome

CONFIGS = Path(trainforge.__file__).parent / "configs"
LONG_ID = "trial-with-a-rather-long-identifier-00012"
LONG_VALUE = "adamw_with_a_very_long_optimizer_name_nobody_shortens"


def outcome(
    trial_id: str, history: list[tuple[int, float]], status: str = "finished", **fields: object
) -> TrialOutcome:
    values = [v for _, v in history]
    defaults: dict[str, object] = {
        "config": {"optim.lr": 0.01, "optim.name": "adamw"},
        "status": status,
        "stopped_early": status == "stopped",
        "last_metric": values[-1] if values else None,
        "best_metric": min(values) if values else None,
        "steps": history[-1][0] if history else 0,
        "budget_steps": 400,
        "wall_time_s": 12.5,
        "run_dir": f"/nowhere/{trial_id}",
        "history": history,
    }
    return TrialOutcome(trial_id=trial_id, **{**defaults, **fields})  # type: ignore[arg-type]


def test_the_summary_table_keeps_every_column_whole_in_a_pipe(monkeypatch: pytest.MonkeyPatch) -> None:
    """Written to a file (not a terminal), the table is as wide as its cells: nothing cut to "…"."""
    from trainforge.consoles import make_console

    monkeypatch.delenv("COLUMNS", raising=False)
    out = io.StringIO()
    trial = outcome(LONG_ID, [(25, 2.29), (50, 1.1234567)], config={"optim.lr": 0.000123, "optim.name": LONG_VALUE})
    summary = {
        "name": "a-search-named-at-length",
        "metric": "val/loss",
        "mode": "min",
        "num_trials": 1,
        "trials": [trial.to_json()],
        "best": {**trial.to_json(), "best_yaml": "/somewhere/best.yaml"},
        "compute": {"steps_run": 50, "steps_budget": 400, "saved_fraction": 0.875},
        "wall_time_s": 30.0,
    }
    print_outcome(make_console(file=out), summary, ["optim.lr", "optim.name"])
    text = out.getvalue()
    assert "…" not in text
    table_rows = [line for line in text.splitlines() if LONG_ID in line]
    assert table_rows and LONG_VALUE in table_rows[0]  # the trial's row holds both, on one line
    for whole in ("0.000123", "last val/loss", "best val/loss", "50/400", "1.12"):
        assert whole in text
    assert max(len(line) for line in text.splitlines()) > 80  # wider than rich's default for a pipe

    # A plain rich console on the same kind of output: what the CLI printed before (the contrast).
    narrow = io.StringIO()
    print_outcome(Console(file=narrow), summary, ["optim.lr", "optim.name"])
    assert "…" in narrow.getvalue()


def test_a_user_columns_setting_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    from trainforge.consoles import make_console

    monkeypatch.setenv("COLUMNS", "100")
    assert make_console(file=io.StringIO()).width == 100


def test_cli_tables_on_a_pipe_are_whole(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI's stdout console (ckpt, plan, bench, jobs list): a cell wider than 200 columns stays whole."""
    from rich.table import Table

    from trainforge.cli.common import wide_console

    monkeypatch.delenv("COLUMNS", raising=False)
    table = Table(title="checkpoints")
    table.add_column("location")
    table.add_column("status")
    location = "s3://bucket/" + "/".join(f"folder-{i:02d}" for i in range(24))  # 250 characters
    table.add_row(location, "valid")
    wide_console().print(table)
    out = capsys.readouterr().out
    assert location in out and "valid" in out and "…" not in out


def line_of(figure: object, trial_id: str) -> Line2D:
    (line,) = [artist for artist in figure.axes[0].lines if artist.get_gid() == trial_id]  # type: ignore[attr-defined]
    return line


def test_every_trial_that_reported_has_a_curve_single_reports_as_markers() -> None:
    outcomes = [
        outcome("t0", [(25, 2.3), (50, 1.9), (75, 1.2)]),
        outcome("t1", [(25, 2.29)], status="stopped"),  # stopped by ASHA at its first report
        outcome("t2", [(25, 2.31)], status="stopped"),
        outcome("t3", [], status="failed"),  # never reported: nothing to draw
    ]
    figure = learning_curves_figure(outcomes, "val/loss", outcomes[0])
    axes = figure.axes[0]
    assert sorted(line.get_gid() for line in axes.lines) == ["t0", "t1", "t2"]
    for trial_id in ("t1", "t2"):
        single = line_of(figure, trial_id)
        assert single.get_marker() == "o" and list(single.get_xdata()) == [25]
        assert single.get_linestyle() == "--"  # stopped early
    full = line_of(figure, "t0")
    assert full.get_marker() in (None, "None", "") and list(full.get_ydata()) == [2.3, 1.9, 1.2]
    assert "a dot: one report" in axes.get_title()
    assert axes.get_legend() is not None and [t.get_text() for t in axes.get_legend().get_texts()] == ["t0 (best)"]


def write_run(run_dir: Path, model: dict[str, object], reports: list[dict[str, object]]) -> Path:
    run_dir.mkdir(parents=True)
    (run_dir / "summary.json").write_text(json.dumps({"config": {"model": model}}))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in reports))
    return run_dir


@pytest.mark.parametrize(
    ("model", "metrics", "expected"),
    [
        ({"name": "mlp", "task": "classification"}, {"val/accuracy": 0.5}, "val/loss: cross-entropy loss"),
        ({"name": "mlp", "task": "regression"}, {"val/mse": 0.2}, "val/loss: mean squared error"),
        ({"name": "mlp"}, {"val/mse": 0.2}, "val/loss: mean squared error"),  # no task: its metrics say
    ],
)
def test_the_tune_loss_axis_names_the_loss_by_task(
    tmp_path: Path, model: dict[str, object], metrics: dict[str, float], expected: str
) -> None:
    run_dir = write_run(tmp_path / "t0", model, [{"step": 25, "val/loss": 0.4, **metrics}])
    trials = [outcome("t0", [(25, 0.4)], run_dir=str(run_dir))]
    assert metric_label("val/loss", trials) == expected
    assert metric_label("val/accuracy", trials) == "val/accuracy"  # not a loss: its key
    assert learning_curves_figure(trials, "val/loss", None, expected).axes[0].get_ylabel() == expected


def test_outcomes_read_the_run_dir_and_fall_back_to_what_tune_saw(tmp_path: Path) -> None:
    """A trial's curve comes from its run's metrics.jsonl (every report, past the last one Tune
    saw); with no run directory here (it is on another node), from the results Tune relayed."""
    from ray.tune import Result

    settings = SearchSettings("val/loss", "min", "random", "asha", 2, 2, 400, {}, 0)
    watch = TrialWatch(Console(file=io.StringIO()), "val/loss", "min", ["optim.lr"])
    watch.rows["here"] = TrialRow("here", {}, history=[(25, 2.0)])
    watch.rows["away"] = TrialRow("away", {}, history=[(25, 2.2), (50, 1.7)])
    write_run(tmp_path / "here", {"name": "mlp"}, [{"step": s, "val/loss": v} for s, v in ((25, 2.0), (50, 1.5))])

    def result(trial_id: str) -> Result:
        return Result(metrics={}, checkpoint=None, error=None, path=str(tmp_path / f".ray-{trial_id}"))

    here = outcome_of(result("here"), tmp_path / "here", settings, watch, None)
    away = outcome_of(result("away"), tmp_path / "away", settings, watch, None)
    assert here.history == [(25, 2.0), (50, 1.5)] and here.last_metric == 1.5
    assert away.history == [(25, 2.2), (50, 1.7)] and away.last_metric == 1.7 and away.steps == 50

    space_file = tmp_path / "space.yaml"
    space_file.write_text("optim.lr: {loguniform: [1.0e-4, 0.1]}\n")
    space = load_space(space_file, load_config(CONFIGS / "tune_digits.yaml"))
    written = write_plots(tmp_path, [here, away], space, "val/loss", here)
    assert [path.name for path in written] == ["metric_vs_hyperparameters.png", "learning_curves.png"]
    assert all(path.stat().st_size > 1000 for path in written)
