"""summary.json is built in one place (trainforge/summary.py): the run's driver (launch, at the end of
``fit``) and a search's driver (tune/results.py, for a trial Tune cut short) describe the same run
record the same way. No Ray: the driver's Pump is fed the events as its mailbox would deliver them."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.helpers.runs import tiny_run
from trainforge.config import Config, to_yaml, validate
from trainforge.driver import events as observe
from trainforge.driver.run import Outcome, run_record
from trainforge.driver.summary import (
    DRIVER_START,
    RUN_DRIVER,
    SEARCH_DRIVER,
    Recovery,
    RunLog,
    RunRecord,
    build_summary,
)
from trainforge.observers import Observers
from trainforge.protocol import Report, Resumed, WorkerFailure
from trainforge.tune.results import complete_run_dir
from trainforge.tune.trial import TrialOutcome

T0 = 1_790_000_000.0
SECRET_CONFIG = {"checkpoint": {"storage_path": "s3://KEY:SECRET@bucket/runs"}}


def report(step: int, at: float, **extra: Any) -> Report:
    figures = {"train/loss": 1.0 / step, "perf/steady_samples_per_s": 250.0}
    return Report(step=step, epoch=step // 10, world_size=2, time=at, figures=figures, **extra)


RESUMED = (Resumed(10, "checkpoint_000000010"),)

# One run as the driver saw it: two reports, a worker-group failure, the resume, a second failure
# and its resume, the final report. Failure times are the controller callback's (driver/events.py).
EVENTS: list[Report | WorkerFailure] = [
    report(5, T0 + 1),
    report(10, T0 + 2, checkpoint="/c/t/checkpoint_000000010"),
    WorkerFailure({1: "killed"}, T0 + 3),
    report(15, T0 + 9.5, events=RESUMED),
    WorkerFailure({0: "killed"}, T0 + 10),
    report(20, T0 + 12.25, events=RESUMED),
]


def metrics_log_lines(events: list[Report | WorkerFailure]) -> list[str]:
    """metrics.jsonl as observers/metrics_log.MetricsLog appends it, with each failure's time."""
    return [json.dumps(event.to_json()) for event in events]


def pump_fed(events: list[Report | WorkerFailure], monkeypatch: pytest.MonkeyPatch) -> observe.Pump:
    """The driver's real Pump, drained once from a mailbox that holds ``events``."""
    monkeypatch.setattr(observe.ray, "get", lambda ref, timeout=None: ref)
    mailbox = SimpleNamespace(drain=SimpleNamespace(remote=lambda: list(events)))
    pump = observe.Pump(mailbox, Observers([]))
    pump.drain()
    return pump


def config_for(tmp_path: Path) -> Config:
    return validate(tiny_run(tmp_path, scaling={"num_workers": 2}, **SECRET_CONFIG))


def test_the_run_driver_and_the_search_driver_write_the_same_summary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = config_for(tmp_path)
    run_dir = config.run_dir
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(to_yaml(config))
    (run_dir / "metrics.jsonl").write_text("\n".join(metrics_log_lines(EVENTS)) + "\n")
    pump = pump_fed(EVENTS, monkeypatch)
    last = EVENTS[-1]
    assert isinstance(last, Report)
    checkpoint = "/c/t/checkpoint_000000010"

    by_run_driver = build_summary(run_record(config, Outcome("stopped", None, checkpoint, 12.0), pump))
    trial = TrialOutcome(
        trial_id="t",
        config={},
        status="stopped",
        stopped_early=True,
        last_metric=None,
        best_metric=None,
        steps=last.step,
        budget_steps=20,
        wall_time_s=12.0,
        run_dir=str(run_dir),
    )
    # The checkpoint's weights are already in the run directory: nothing to copy out of storage.
    (run_dir / "model.safetensors").write_bytes(b"")
    assert complete_run_dir(trial)
    by_search_driver = json.loads((run_dir / "summary.json").read_text())

    assert set(by_run_driver) == set(by_search_driver)
    assert by_run_driver["restarts"] == by_search_driver["restarts"] == 2
    assert by_run_driver["recovery_s"] == by_search_driver["recovery_s"] == [6.5, 2.25]
    assert (by_run_driver["written_by"], by_search_driver["written_by"]) == (RUN_DRIVER, SEARCH_DRIVER)
    assert by_run_driver["stopped_by"] is None
    assert by_search_driver["stopped_by"] == {
        "source": "scheduler",
        "reason": "the search's scheduler stopped the trial",
        "step": 20,
    }
    assert by_run_driver["stopped_early"] is None is by_search_driver["stopped_early"]
    same = {k for k in by_run_driver if k not in ("written_by", "stopped_by")}
    assert {k: by_run_driver[k] for k in same} == {k: by_search_driver[k] for k in same}
    assert by_run_driver["global_step"] == 20 and by_run_driver["num_workers"] == 2
    assert "SECRET" not in json.dumps(by_run_driver) and "SECRET" not in json.dumps(by_search_driver)


def test_a_failure_of_unknown_time_is_a_restart_without_a_recovery_time() -> None:
    lines = metrics_log_lines(EVENTS)
    lines[2] = json.dumps({"event": "worker_error", "errors": {"1": "killed"}})  # no time
    ran = RunLog.replay([*lines[:3], '{"step": 1', *lines[3:]])  # and a line cut short
    assert ran.recovery.restarts == 2
    assert ran.recovery.recovery_s == [2.25]
    assert [r.step for r in ran.reports] == [5, 10, 15, 20]


def test_a_replay_counts_the_last_driver_session_as_the_driver_does() -> None:
    earlier = metrics_log_lines(EVENTS[:4])  # a session with one failure, then the driver stopped
    later = metrics_log_lines(EVENTS[4:])  # the run resumed by a new driver: one more failure
    start = json.dumps({"event": DRIVER_START, "time": T0 + 9.8})
    ran = RunLog.replay([start, *earlier, start, *later])
    assert (ran.recovery.restarts, ran.recovery.recovery_s) == (1, [2.25])
    assert len(ran.reports) == 4


def test_the_summary_keeps_the_design_contract(tmp_path: Path) -> None:
    config = config_for(tmp_path)
    record = RunRecord(
        status="failed",
        final=Report.from_json(
            {"step": 3, "train/loss": float("nan"), "val/accuracy": 0.5, "flag/x": True, "note": "x"}
        ),
        recovery=Recovery(),
        wall_time_s=1.23456,
        checkpoint=None,
        config=config.to_dict(),
        num_workers=config.scaling.max_workers,
        error="Traceback ...\nRuntimeError: boom at s3://KEY:SECRET@bucket/x\n",
    )
    summary = build_summary(record)
    assert {
        "status",
        "global_step",
        "epoch",
        "num_workers",
        "restarts",
        "recovery_s",
        "final_metrics",
        "throughput_samples_per_s",
        "wall_time_s",
        "checkpoint",
        "config",
        "error",
    } <= set(summary)
    assert summary["num_workers"] == 2 and summary["restarts"] == 0 and summary["recovery_s"] == []
    assert set(summary["final_metrics"]) == {"train/loss", "val/accuracy"}  # numbers only, a NaN loss kept
    assert summary["wall_time_s"] == 1.235
    assert summary["error"].startswith("RuntimeError: boom") and "SECRET" not in summary["error"]
    assert "SECRET" not in json.dumps(summary["config"])


def test_the_summary_records_what_auto_batch_size_chose(tmp_path: Path) -> None:
    config = validate(tiny_run(tmp_path, train={"batch_size": "auto", "global_batch_size": 64}))
    batch = {"batch/micro_batch_size": 8, "batch/grad_accum_steps": 8, "batch/oom_retries": 1}
    record = RunRecord("finished", Report(step=5, figures=batch), Recovery(), 1.0, None, config.to_dict(), 1)
    assert build_summary(record)["batch"] == {
        "micro_batch_size": 8,
        "grad_accum_steps": 8,
        "global_batch_size": 64,
        "oom_retries": 1,
    }
    assert "batch" not in build_summary(RunRecord("finished", Report(step=5), Recovery(), 1.0, None, {}, 1))
