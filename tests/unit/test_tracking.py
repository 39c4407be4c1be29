"""MLflow tracking without Ray: names and values MLflow accepts, the fail-soft sender against a
real unreachable port, runs in a real sqlite store (open, resume, nest, refuse), system samples."""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from mlflow import MlflowClient

from tests.helpers.faults import free_port
from tests.helpers.runs import tiny_run
from tests.helpers.timing import scaled
from trainforge.config import load_config, to_yaml, validate
from trainforge.errors import ConfigError
from trainforge.metrics.nvml import Gpus
from trainforge.metrics.worker.system import SystemMetrics
from trainforge.observers.mlflow import make_tracker
from trainforge.protocol import Report, RunInfo, WorkerFailure
from trainforge.tracking import SearchRun, TrackingError
from trainforge.tracking.outbox import Outbox, is_transient
from trainforge.tracking.records import (
    MAX_KEY_LENGTH,
    MAX_PARAM_VALUE_LENGTH,
    cluster_tags,
    config_params,
    git_tags,
    metric_points,
    sanitize_key,
    scaling_tags,
)
from trainforge.tracking.runs import (
    EXPERIMENT_KIND_TAG,
    RESUME_FILE,
    TRAINING_KIND,
    RunPlan,
    ensure_experiment,
    open_run,
)
from trainforge.tracking.store import artifact_location, connect, local_store_uri, resolve_uri, run_link

REPORT = {"step": 10, "time/unix": 1_790_000_000.5, "train/loss": 0.5, "epoch": 1, "events": ["x"], "ok": True}


@pytest.fixture(autouse=True)
def one_http_try(monkeypatch: pytest.MonkeyPatch) -> None:
    """A refused connection fails at once instead of after MLflow's own retries."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")


def config(tmp_path: Path, **tracking: Any) -> Any:
    return load_config(tiny_run(tmp_path, tracking=tracking))


def client_for(tmp_path: Path) -> MlflowClient:
    return MlflowClient(local_store_uri(tmp_path))


def test_params_are_the_flattened_config_within_mlflow_limits() -> None:
    params = config_params(
        {
            "optim": {"lr": 0.1, "betas": [0.9, 0.99]},
            "model": {"kwargs": {}, "name": "mlp"},
            "seed": None,
            "x": "y" * 9000,
        }
    )
    assert params["optim.lr"] == "0.1"
    assert params["optim.betas"] == "[0.9, 0.99]"
    assert params["model.kwargs"] == "{}"
    assert params["model.name"] == "mlp"
    assert params["seed"] == "null"
    assert len(params["x"]) == MAX_PARAM_VALUE_LENGTH and params["x"].endswith("[truncated]")


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("train/loss", "train/loss"),
        ("system/10.0.0.1/cpu_percent", "system/10.0.0.1/cpu_percent"),
        ("a b:c-d.e", "a b:c-d.e"),
        ("loss(ema)@2", "loss_ema__2"),
        ("/lead//double/", "lead/double"),
        ("x/../y/./z", "x/__/y/_/z"),
        ("", "_"),
    ],
)
def test_metric_names_become_ones_mlflow_accepts(name: str, expected: str) -> None:
    assert sanitize_key(name) == expected


def test_long_names_are_cut_and_stay_distinct() -> None:
    first, second = sanitize_key("k" * 300 + "a"), sanitize_key("k" * 300 + "b")
    assert len(first) == len(second) == MAX_KEY_LENGTH
    assert first != second


def test_metric_points_take_every_number_at_the_reports_step_and_time() -> None:
    points = metric_points(REPORT)
    assert sorted(points) == [("epoch", 1.0, 1_790_000_000_500, 10), ("train/loss", 0.5, 1_790_000_000_500, 10)]


def test_metric_points_take_one_point_per_log_interval_from_the_history() -> None:
    history = [
        {"step": 10, "time/unix": 1_790_000_000.1, "train/loss": 0.7},
        {"step": 20, "time/unix": 1_790_000_000.2, "train/loss": 0.6},
        {"step": 30, "time/unix": 1_790_000_000.5, "train/loss": 0.55},
    ]
    points = metric_points({**REPORT, "step": 30, "val/loss": 0.9, "history": history})
    # Each interval at its own step and time; the report's own train/loss (its whole span) is not
    # logged a second time at step 30.
    assert [(step, value, stamp) for key, value, stamp, step in points if key == "train/loss"] == [
        (10, 0.7, 1_790_000_000_100),
        (20, 0.6, 1_790_000_000_200),
        (30, 0.55, 1_790_000_000_500),
    ]
    assert sorted((key, step) for key, _, _, step in points if key != "train/loss") == [("epoch", 30), ("val/loss", 30)]


def test_scaling_and_cluster_tags() -> None:
    assert scaling_tags({"num_workers": [2, 4], "use_gpu": True}) == {
        "trainforge.workers": "2-4",
        "trainforge.accelerator": "gpu",
    }
    tags = cluster_tags({"CPU": 16.0, "GPU": 2.0, "accelerator_type:H100": 1.0}, nodes=2)
    assert tags["trainforge.cluster.gpus"] == "2"
    assert tags["trainforge.cluster.accelerator_types"] == "H100"
    assert tags["trainforge.cluster.nodes"] == "2"


def test_git_tags_name_the_commit_and_whether_the_tree_is_dirty(tmp_path: Path) -> None:
    assert git_tags(tmp_path) == {}  # not a repository
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "f").write_text("1")
    subprocess.run([*git, "add", "f"], cwd=tmp_path, check=True)
    subprocess.run([*git, "commit", "-qm", "c"], cwd=tmp_path, check=True)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()
    assert git_tags(tmp_path) == {"mlflow.source.git.commit": head, "trainforge.git_dirty": "false"}
    (tmp_path / "f").write_text("2")
    assert git_tags(tmp_path)["trainforge.git_dirty"] == "true"


def test_the_default_store_is_sqlite_under_the_output_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert resolve_uri(None, tmp_path) == f"sqlite:///{tmp_path.resolve()}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://tracking:5000")
    assert resolve_uri(None, tmp_path) == "http://tracking:5000"
    assert resolve_uri("http://explicit:5000", tmp_path) == "http://explicit:5000"
    assert run_link(local_store_uri(tmp_path), "1", "abc").endswith(
        f"mlflow ui --backend-store-uri sqlite:///{tmp_path}/mlflow.db"
    )
    assert run_link("http://tracking:5000/", "1", "abc") == "MLflow run: http://tracking:5000/#/experiments/1/runs/abc"


def test_a_new_local_store_is_a_copy_of_one_empty_store_and_takes_runs_and_its_own_default_experiment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The migrations run once per MLflow version (in the cache); each store is a copy of that, opened
    by MLflow as its own: the default experiment under its own artifact root, runs logged and read back."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    uris = [local_store_uri(tmp_path / name) for name in ("a", "b")]
    for uri in uris:
        client = connect(uri)
        default = client.get_experiment("0")
        assert default.name == "Default"
        experiment = client.create_experiment("e", artifact_location=artifact_location(uri))
        run = client.create_run(experiment)
        client.log_metric(run.info.run_id, "loss", 0.5, step=3)
        assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss")] == [(3, 0.5)]
    empty = list((tmp_path / "cache" / "trainforge").glob("mlflow-*-empty.db"))
    assert len(empty) == 1
    assert sqlite3.connect(empty[0]).execute("SELECT count(*) FROM experiments").fetchone() == (0,)
    assert [p.name for p in (tmp_path / "b").iterdir()] == ["mlflow.db"]  # no copy left beside it
    # A cache that cannot be written: MLflow makes the store itself.
    (tmp_path / "ro").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "ro"))
    assert connect(local_store_uri(tmp_path / "c")).get_experiment("0").name == "Default"


@pytest.mark.parametrize("uri", ["/srv/mlruns", "file:///srv/mlruns", "./mlruns"])
def test_a_file_store_uri_is_a_config_error(tmp_path: Path, uri: str) -> None:
    with pytest.raises(ConfigError, match=r"tracking\.uri .* is MLflow's file store, which MLflow 3 refuses"):
        make_tracker(config(tmp_path, uri=uri), tmp_path)


def test_required_and_unreachable_is_one_line_and_exit_code_2_before_ray_starts(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(tiny_run(tmp_path)))
    uri = f"http://127.0.0.1:{free_port()}"
    cli = str(Path(sys.executable).with_name("trainforge"))
    done = subprocess.run(
        [cli, "train", str(path), "--set", "tracking.required=true", "--set", f"tracking.uri={uri}"],
        capture_output=True,
        text=True,
        timeout=scaled(300),
        env={**os.environ, "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"},
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"tracking.uri {uri} cannot be reached" in errors[0], done.stderr
    assert not (tmp_path / "t" / "ray.log").exists()  # stopped before Ray started


def test_mlflow_refusals_are_not_retried_and_outages_are() -> None:
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE, TEMPORARILY_UNAVAILABLE

    assert not is_transient(MlflowException("bad", error_code=INVALID_PARAMETER_VALUE))
    assert is_transient(MlflowException("busy", error_code=TEMPORARILY_UNAVAILABLE))
    assert is_transient(MlflowException("API request to http://x failed with exception ConnectionError"))
    assert is_transient(ConnectionRefusedError())
    assert not is_transient(FileNotFoundError())


def test_unreachable_server_buffers_warns_once_drops_oldest_past_the_bound_and_says_what_was_lost(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    plan = RunPlan(uri=uri, experiment="e", run_name="r", tags={})
    outbox = Outbox(uri, lambda client: open_run(client, plan), max_points=10).start()
    with caplog.at_level(logging.INFO, logger="trainforge"):
        for step in range(5):  # 5 reports of 5 points: 25 points, 10 kept
            outbox.add_points([(f"m{i}", float(i), 0, step) for i in range(5)])
        outbox.add_call("artifact x", lambda client, run_id: None)
        assert outbox.wait_open(2.0) is None
        left = outbox.close(timeout_s=2.0)
    unreachable = [r for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(unreachable) == 1 and "training continues" in unreachable[0].getMessage()
    assert sum("buffer full" in r.getMessage() for r in caplog.records) == 1
    assert left.dropped == 15
    assert left.points == 10
    assert "artifact x" in left.calls and "the run itself (never created)" in left.calls
    assert "15 oldest metric points dropped" in left.describe()


def test_tracking_keys_bound_the_buffer_and_the_wait_at_the_end(tmp_path: Path) -> None:
    cfg = config(tmp_path, uri=f"http://127.0.0.1:{free_port()}", max_buffered_points=3, flush_timeout_s=0.5)
    tracker = make_tracker(cfg, cfg.run_dir)
    assert tracker is not None
    drive(tracker, [{**REPORT, "step": step} for step in (1, 2, 3)])  # 2 points each, then 2 at the end
    assert tracker.leftover is not None
    assert (tracker.leftover.points, tracker.leftover.dropped) == (3, 5)
    assert "final status finished" in tracker.leftover.calls
    tracker.settings.required = True
    with pytest.raises(TrackingError, match=r"tracking\.required is set and MLflow at http://127\.0\.0\.1"):
        tracker.check_complete()


def test_required_tracking_fails_before_training_when_the_store_is_unreachable(tmp_path: Path) -> None:
    cfg = config(tmp_path, uri=f"http://127.0.0.1:{free_port()}", required=True)
    with pytest.raises(TrackingError, match=r"tracking\.uri http://127\.0\.0\.1:\d+ cannot be reached"):
        make_tracker(cfg, cfg.run_dir)
    assert make_tracker(config(tmp_path, enabled=False), cfg.run_dir) is None


def as_report(record: dict[str, Any]) -> Report:
    """A report as metrics.jsonl holds it, as the observers get it."""
    report = Report.from_json(record)
    assert report is not None
    return report


STARTED = RunInfo("t", 1, "local", "/tmp/t")


def drive(tracker: Any, reports: list[dict[str, Any]], status: str = "finished") -> None:
    """What driver/events.Pump and driver/run.run_training do with an observer, without Ray."""
    tracker.on_start(STARTED)
    for report in reports:
        tracker.on_report(as_report(report))
    tracker.on_worker_error(WorkerFailure({1: "ActorDiedError: gone"}))
    tracker.run_dir.mkdir(parents=True, exist_ok=True)
    (tracker.run_dir / "summary.json").write_text(json.dumps({"status": status}))
    tracker.on_end({"status": status, "global_step": reports[-1]["step"], "wall_time_s": 1.0, "restarts": 1})


def test_a_run_in_the_local_store_and_its_resume(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = config(tmp_path, flush_timeout_s=60)
    first = make_tracker(cfg, cfg.run_dir)
    assert first is not None
    with caplog.at_level(logging.INFO, logger="trainforge"):
        drive(first, [{**REPORT, "step": s, "train/loss": 1.0 / s} for s in (5, 10)], status="stopped")
    assert not first.leftover
    assert "mlflow ui --backend-store-uri sqlite:///" in caplog.text
    run_id = json.loads((cfg.run_dir / RESUME_FILE).read_text())["run_id"]

    # The same run directory again, with more steps: the same MLflow run continues.
    more = load_config(tiny_run(tmp_path, train={"max_steps": 40}, tracking={"flush_timeout_s": 60}))
    second = make_tracker(more, more.run_dir)
    assert second is not None
    drive(second, [{**REPORT, "step": 15, "train/loss": 0.05}])
    assert not second.leftover

    client = client_for(tmp_path)
    runs = client.search_runs([client.get_experiment_by_name("trainforge").experiment_id])
    assert [run.info.run_id for run in runs] == [run_id]
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.data.params["train.max_steps"] == "20"  # the first value stays; the change is a tag
    assert run.data.tags["trainforge.resume_changed.train.max_steps"] == "40 (was 20)"
    assert run.data.tags["trainforge.restarts"] == "1"
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "train/loss")] == [
        (5, 0.2),
        (10, 0.1),
        (15, 0.05),
    ]
    assert "summary.json" in {a.path for a in client.list_artifacts(run_id)}
    assert (cfg.run_dir / "tracking.log").is_file()


def test_a_training_run_has_a_point_per_log_interval_in_a_model_training_experiment(tmp_path: Path) -> None:
    cfg = config(tmp_path, flush_timeout_s=60)
    tracker = make_tracker(cfg, cfg.run_dir)
    assert tracker is not None
    reports = [
        {**REPORT, "step": end, "history": [{"step": s, "train/loss": 1.0 / s} for s in range(end - 25, end + 1, 5)]}
        for end in (30, 60)
    ]
    drive(tracker, reports)
    assert not tracker.leftover and tracker.outbox.opened is not None
    client = client_for(tmp_path)
    curve = client.get_metric_history(tracker.outbox.opened.run_id, "train/loss")
    assert [(m.step, m.value) for m in curve] == [(s, 1.0 / s) for s in range(5, 61, 5)]
    # MLflow's UI shows it as model training (runs and charts), not GenAI development.
    experiment = client.get_experiment_by_name("trainforge")
    assert experiment.tags[EXPERIMENT_KIND_TAG] == TRAINING_KIND == "custom_model_development"


def test_an_existing_experiment_gets_the_training_kind_unless_it_has_one(tmp_path: Path) -> None:
    client = client_for(tmp_path)
    uri = local_store_uri(tmp_path)
    untagged = client.create_experiment("older")
    chosen = client.create_experiment("chosen", tags={EXPERIMENT_KIND_TAG: "genai_development"})
    assert ensure_experiment(client, "older", uri) == untagged
    assert ensure_experiment(client, "chosen", uri) == chosen
    assert client.get_experiment(untagged).tags[EXPERIMENT_KIND_TAG] == TRAINING_KIND
    assert client.get_experiment(chosen).tags[EXPERIMENT_KIND_TAG] == "genai_development"  # someone chose it


def test_a_run_that_raised_before_its_end_is_marked_failed(tmp_path: Path) -> None:
    cfg = config(tmp_path, flush_timeout_s=60)
    tracker = make_tracker(cfg, cfg.run_dir)
    assert tracker is not None
    tracker.on_error(RuntimeError("before the start"))  # before on_start: no run was opened, nothing to end
    assert tracker.leftover is None
    tracker.on_start(STARTED)
    tracker.on_report(as_report(REPORT))
    tracker.on_error(RuntimeError("a user error the workers found"))
    assert tracker.leftover is not None and not tracker.leftover
    assert tracker.outbox.opened is not None
    run = client_for(tmp_path).get_run(tracker.outbox.opened.run_id)
    assert run.info.status == "FAILED"
    assert run.data.metrics["train/loss"] == 0.5


def test_a_record_the_store_refuses_is_dropped_and_the_rest_still_arrives(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    uri = local_store_uri(tmp_path)
    plan = RunPlan(uri=uri, experiment="refusals", run_name="r", tags={})
    outbox = Outbox(uri, lambda client: open_run(client, plan), max_points=100).start()
    with caplog.at_level(logging.WARNING, logger="trainforge"):
        outbox.add_call("a bad param", lambda client, run_id: client.log_param(run_id, "x" * 300, 1))
        outbox.add_points([("after", 1.0, 0, 1)])
        outbox.add_call("a good tag", lambda client, run_id: client.set_tag(run_id, "good", "yes"))
        left = outbox.close(timeout_s=scaled(60))
    assert left.calls == ["a bad param (refused)"]
    assert "MLflow refused a bad param" in caplog.text
    assert outbox.opened is not None
    run = client_for(tmp_path).get_run(outbox.opened.run_id)
    assert run.data.metrics == {"after": 1.0}
    assert run.data.tags["good"] == "yes"


def test_search_run_nests_its_trials_in_its_own_experiment(tmp_path: Path) -> None:
    cfg = config(tmp_path, experiment="search", flush_timeout_s=60)
    search = SearchRun.start(cfg, "lr-search", {"space": {"optim.lr": "loguniform(1e-4, 1e-1)"}, "trials": 2})
    parent = search.run_id
    assert parent is not None
    trial_cfg = load_config(tiny_run(tmp_path, run={"name": "trial0"}, tracking={"experiment": "elsewhere"}))
    trial = make_tracker(trial_cfg, trial_cfg.run_dir, parent_run_id=parent, run_name="trial0")
    # A trial that runs through fit: the parent comes from its config.
    keyed_cfg = load_config(tiny_run(tmp_path, run={"name": "trial1"}, tracking={"parent_run_id": parent}))
    keyed = make_tracker(keyed_cfg, keyed_cfg.run_dir)
    assert trial is not None and keyed is not None
    drive(trial, [REPORT])
    drive(keyed, [REPORT])
    search.log_metrics({"best/train_loss": 0.5}, step=1)
    search.set_tags({"best_trial": "trial0"})
    assert not search.end("finished")

    client = client_for(tmp_path)
    parent_run, child = client.get_run(parent), client.get_run(trial.outbox.opened.run_id)
    assert parent_run.info.status == "FINISHED"
    assert parent_run.data.params["trials"] == "2"
    assert parent_run.data.params["base.optim.lr"] == "0.05"
    assert parent_run.data.metrics["best/train_loss"] == 0.5
    assert parent_run.data.tags["best_trial"] == "trial0"
    assert child.data.tags["mlflow.parentRunId"] == parent
    assert child.info.experiment_id == parent_run.info.experiment_id
    assert child.info.run_name == "trial0"
    assert client.get_run(keyed.outbox.opened.run_id).data.tags["mlflow.parentRunId"] == parent


def test_a_continued_search_reopens_its_parent_run(tmp_path: Path) -> None:
    cfg = config(tmp_path, experiment="search", flush_timeout_s=60)
    first = SearchRun.start(cfg, "lr-search", {"trials": 2}, log_dir=tmp_path)
    parent = first.run_id
    assert parent is not None
    first.end("stopped")  # the driver was interrupted
    again = SearchRun.start(cfg, "lr-search", {"trials": 2}, log_dir=tmp_path)
    assert again.run_id == parent
    assert not again.end("finished")

    client = client_for(tmp_path)
    assert client.get_run(parent).info.status == "FINISHED"
    experiment = client.get_experiment_by_name("search")
    assert experiment is not None
    assert len(client.search_runs([experiment.experiment_id])) == 1


def test_a_disabled_search_run_accepts_everything_and_does_nothing(tmp_path: Path) -> None:
    search = SearchRun.start(config(tmp_path, enabled=False), "s")
    search.log_metrics({"a": 1.0})
    assert search.run_id is None
    assert search.end() is None
    assert not (tmp_path / "mlflow.db").exists()


def test_system_sample_has_every_key_for_the_node() -> None:
    hook = SystemMetrics("10.1.2.3")
    report = Report(step=1)
    hook.on_report(report, {})
    hook.close()
    node = {k.removeprefix("system/10.1.2.3/"): v for k, v in report.figures.items() if k.startswith("system/")}
    assert {"cpu_percent", "memory_used_gb", "memory_percent"} <= node.keys()
    assert 0.0 <= node["cpu_percent"] <= 100.0
    assert 0.0 < node["memory_percent"] <= 100.0 and node["memory_used_gb"] > 0
    assert all(v >= 0 for k, v in node.items() if k.endswith("_mb_s"))
    gpu_keys = {k for k in node if k.startswith("gpu")}
    assert bool(gpu_keys) == bool(Gpus().handles)


def test_a_trial_stopped_before_its_tracker_opened_its_run_still_gets_its_mlflow_run(tmp_path: Path) -> None:
    """On a warm worker group a trial reports within a second and ASHA may stop it at once, before
    its tracker's thread opened the MLflow run: the search driver opens it afterwards, with the
    trial's params, the reports of its metrics.jsonl and status KILLED."""
    from trainforge.observers.metrics_log import MetricsLog
    from trainforge.tune.results import complete_run_dir
    from trainforge.tune.tracking import finish_trial_runs
    from trainforge.tune.trial import TrialOutcome

    _, client, parent, run_dir = search_trial_dir(tmp_path)
    log = MetricsLog(run_dir)
    log.on_start(RunInfo("trial-1", 1, "local", str(run_dir)))
    for step in (10, 20):
        log.on_report(Report(step=step, total_steps=60, time=time.time(), figures={"train/loss": 2.0 / step}))
    outcome = TrialOutcome("trial-1", {"optim.lr": 0.05}, "stopped", True, None, None, 20, 60, 1.0, str(run_dir))
    assert complete_run_dir(outcome) and not (run_dir / "tracking.json").exists()

    finish_trial_runs([outcome])

    (run,) = client.search_runs(
        [client.get_experiment_by_name("search").experiment_id], f"tags.`mlflow.parentRunId` = '{parent}'"
    )
    assert run.info.status == "KILLED" and run.info.run_name == "trial-1"
    assert float(run.data.params["optim.lr"]) == 0.05
    assert [p.step for p in client.get_metric_history(run.info.run_id, "train/loss")] == [10, 20]
    assert run.data.tags["trainforge.stopped_early"] == "true"


@pytest.mark.parametrize("remembered", [True, False], ids=["remembered", "not-remembered"])
def test_a_trial_stopped_after_its_tracker_created_its_run_gets_its_params(tmp_path: Path, remembered: bool) -> None:
    """Tune ended the trial's actor after its tracker created the MLflow run and before the params
    went out, with the run remembered in tracking.json or not yet: the search driver completes that
    same run (found by the run directory it was tagged with), params and all, and makes no second."""
    from trainforge.observers.metrics_log import MetricsLog
    from trainforge.tracking.runs import RunPlan, open_run
    from trainforge.tune.results import complete_run_dir
    from trainforge.tune.tracking import finish_trial_runs
    from trainforge.tune.trial import TrialOutcome

    uri, client, parent, run_dir = search_trial_dir(tmp_path)
    # What the trial's tracker got done before its actor ended: the run created (as MlflowTracker
    # plans it), nothing sent to it.
    plan = RunPlan(uri, "search", "trial-1", {}, parent, run_dir / RESUME_FILE if remembered else None, run_dir)
    created = open_run(client, plan).run_id
    assert (run_dir / RESUME_FILE).is_file() == remembered
    log = MetricsLog(run_dir)
    log.on_start(RunInfo("trial-1", 1, "local", str(run_dir)))
    log.on_report(Report(step=10, total_steps=60, time=time.time(), figures={"train/loss": 0.2}))
    outcome = TrialOutcome("trial-1", {"optim.lr": 0.05}, "stopped", True, None, None, 10, 60, 1.0, str(run_dir))
    assert complete_run_dir(outcome)

    finish_trial_runs([outcome])

    experiment = client.get_experiment_by_name("search").experiment_id
    (run,) = client.search_runs([experiment], f"tags.`mlflow.parentRunId` = '{parent}'")
    assert run.info.run_id == created and run.info.status == "KILLED"
    assert float(run.data.params["optim.lr"]) == 0.05
    assert [p.step for p in client.get_metric_history(run.info.run_id, "train/loss")] == [10]
    assert run.data.tags["trainforge.stopped_early"] == "true"


def search_trial_dir(tmp_path: Path) -> tuple[str, MlflowClient, str, Path]:
    """A search's MLflow store with its parent run, and trial-1's run directory with its config:
    (tracking uri, client, parent run id, run directory)."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    experiment = client.create_experiment("search", artifact_location=(tmp_path / "artifacts").as_uri())
    parent = client.create_run(experiment).info.run_id
    raw = tiny_run(tmp_path, run={"name": "trial-1", "output_dir": str(tmp_path)})
    raw["tracking"] = {"enabled": True, "uri": uri, "experiment": "search", "parent_run_id": parent}
    config = validate(raw)
    config.run_dir.mkdir()
    (config.run_dir / "config.yaml").write_text(to_yaml(config))
    return uri, client, parent, config.run_dir
