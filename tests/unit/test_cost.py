"""Cost tracking: the ``cost`` section, the arithmetic and its projection to the end of the run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow import MlflowClient

from tests.helpers.runs import tiny_run
from trainforge.config import load_config
from trainforge.driver.cost import CostMeter, Units, earlier_sessions_cost, hourly_rate, project, units_per_worker
from trainforge.driver.summary import Recovery, RunRecord, build_summary
from trainforge.errors import ConfigError
from trainforge.observers.console import describe
from trainforge.observers.mlflow import make_tracker
from trainforge.protocol import Report, Resumed, RunInfo
from trainforge.tracking.store import local_store_uri

BASE = {"model": {"name": "mlp"}, "train": {"max_steps": 10}}


def test_cost_is_off_by_default_and_takes_prices_and_a_currency() -> None:
    assert not load_config(BASE, env={}).cost.enabled
    config = load_config(BASE, ["cost.price_per_gpu_hour=2.5", "cost.currency=EUR"], env={})
    assert config.cost.enabled and config.cost.price_per_gpu_hour == 2.5 and config.cost.currency == "EUR"


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("cost.price_per_cpu_hour=-0.1", "cost.price_per_cpu_hour = -0.1: Input should be greater than or equal to 0"),
        ("cost.currency=usd", "cost.currency = 'usd': must be a 3-letter ISO 4217 currency code"),
        ("cost.currency=DOLLARS", "cost.currency = 'DOLLARS': must be a 3-letter"),
        ("cost.price_per_gpu_hour=cheap", "cost.price_per_gpu_hour = 'cheap'"),
    ],
)
def test_bad_cost_values_name_the_key(override: str, expected: str) -> None:
    with pytest.raises(ConfigError, match="^" + expected.replace("(", r"\(").replace(".", r"\.")):
        load_config(BASE, [override], env={})


def meter(overrides: list[str], now: float = 1000.0) -> CostMeter:
    found = CostMeter.for_config(load_config(BASE, overrides, env={}), now=now)
    assert found is not None
    return found


def test_units_per_worker_are_what_ray_reserves() -> None:
    def units(*overrides: str) -> Units:
        return units_per_worker(load_config(BASE, list(overrides), env={}).scaling)

    assert units() == Units(gpus=0.0, cpus=1.0)
    assert units("scaling.use_gpu=true") == Units(gpus=1.0, cpus=0.0)
    assert units("scaling.use_gpu=true", "scaling.resources_per_worker={CPU: 8}") == Units(gpus=1.0, cpus=8.0)
    assert units("scaling.resources_per_worker={CPU: 4}") == Units(gpus=0.0, cpus=4.0)


def test_cost_so_far_is_workers_times_units_times_hours_and_projects_to_the_end() -> None:
    bill = meter(["cost.price_per_cpu_hour=3.6", "scaling.num_workers=2", "scaling.resources_per_worker={CPU: 2}"])
    # 100 s of 2 workers x 2 CPUs at 3.6 per CPU-hour: 0.4; 10 of 40 steps done, 30 left at the
    # same pace take 300 s more at 14.4 per hour: 1.2.
    estimate = bill.estimate(1100.0, step=10, total_steps=40)
    assert estimate.so_far == pytest.approx(0.4)
    assert estimate.cpu_hours == pytest.approx(400 / 3600) and estimate.gpu_hours == 0
    assert estimate.projected_total == pytest.approx(1.6)
    # At the end the projection is the bill itself.
    assert bill.estimate(1400.0, step=40, total_steps=40).projected_total == pytest.approx(1.6)
    assert CostMeter.for_config(load_config(BASE, env={})) is None


def test_gpu_and_cpu_prices_add_up_and_an_elastic_worker_count_is_integrated() -> None:
    bill = meter(
        [
            "cost.price_per_gpu_hour=2",
            "cost.price_per_cpu_hour=0.5",
            "scaling.use_gpu=true",
            "scaling.resources_per_worker={CPU: 4, GPU: 1}",
            "scaling.num_workers=[1, 4]",
        ]
    )
    # 1 h at the configured maximum (4 workers) before the first report says 2, then 1 h at 2.
    bill.estimate(1000.0 + 3600, step=1, total_steps=None, workers=2)
    estimate = bill.estimate(1000.0 + 7200, step=2, total_steps=None, workers=2)
    assert estimate.gpu_hours == pytest.approx(6.0) and estimate.cpu_hours == pytest.approx(24.0)
    assert estimate.so_far == pytest.approx(6 * 2 + 24 * 0.5)
    assert estimate.projected_total is None  # no total to project to


def test_a_resumed_run_is_paced_from_its_first_report() -> None:
    bill = meter(["cost.price_per_cpu_hour=3.6"])
    resumed = bill.on_report(Report(step=501, total_steps=1000, events=(Resumed(500, "x"),)), now=1100.0).to_json()
    assert resumed["cost/so_far"] == pytest.approx(0.1) and "cost/projected_total" not in resumed
    later = bill.on_report(Report(step=601, total_steps=1000, world_size=1), now=1200.0).to_json()
    # 100 steps per 100 s, 399 left: 399 s more at 3.6 per hour.
    assert later["cost/projected_total"] == pytest.approx(0.2 + 0.399)
    assert later["cost/currency"] == "USD"


def test_a_resumed_run_carries_the_bill_of_its_earlier_sessions(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    assert earlier_sessions_cost(metrics) == 0.0  # a new run
    lines = [{"step": 10, "cost/so_far": 0.5}, {"event": "worker_error"}, {"step": 20, "cost/so_far": 1.25}]
    metrics.write_text("".join(json.dumps(line) + "\n" for line in lines) + '{"step": 30, "cost/so_')  # cut short
    assert earlier_sessions_cost(metrics) == pytest.approx(1.25)

    config = load_config(tiny_run(tmp_path, cost={"price_per_cpu_hour": 3.6}))
    config.run_dir.mkdir(parents=True)
    (config.run_dir / "metrics.jsonl").write_text(metrics.read_text())
    resumed = CostMeter.for_config(config, now=1000.0)
    assert resumed is not None
    first = resumed.on_report(Report(step=21, total_steps=40, events=(Resumed(20, "x"),)), now=1100.0)
    assert first.to_json()["cost/so_far"] == pytest.approx(1.25 + 0.1)  # earlier sessions + 100 s of one CPU at 3.6/h
    assert resumed.final(first, wall_time_s=200.0).so_far == pytest.approx(1.25 + 0.2)
    fresh = CostMeter.for_config(config, now=1000.0)
    assert fresh is not None  # the same directory, but the run started over: billed from zero
    restarted = fresh.on_report(Report(step=1, total_steps=40), now=1100.0)
    assert restarted.to_json()["cost/so_far"] == pytest.approx(0.1)


def test_project_needs_a_timed_step() -> None:
    assert project(1.0, 10.0, elapsed_s=0.0, steps_done=0, steps_left=5) is None
    assert project(1.0, 3600.0, elapsed_s=10.0, steps_done=10, steps_left=5) == pytest.approx(6.0)
    assert hourly_rate(load_config(BASE, ["cost.price_per_cpu_hour=2"], env={}).cost, Units(0, 3), 2) == 12


def test_the_progress_line_and_summary_show_the_cost() -> None:
    line = describe({"cost/so_far": 1.5, "cost/projected_total": 6.25}, epoch=1, currency="EUR")
    assert line.endswith("cost 1.50 EUR (projected 6.25)")
    estimate = meter(["cost.price_per_gpu_hour=1"]).estimate(1000.0, step=0, total_steps=10)
    record = RunRecord("finished", Report(step=10), Recovery(), 1.0, None, {}, 1, cost=estimate.to_dict())
    assert set(build_summary(record)["cost"]) == {
        "currency",
        "so_far",
        "projected_total",
        "price_per_gpu_hour",
        "price_per_cpu_hour",
        "gpu_hours",
        "cpu_hours",
    }
    assert "cost" not in build_summary(RunRecord("finished", None, Recovery(), 1.0, None, {}, 1))


def test_mlflow_gets_the_cost_as_metrics_and_params_and_the_profile_as_artifacts(tmp_path: Path) -> None:
    config = load_config(
        tiny_run(tmp_path, cost={"price_per_cpu_hour": 3.6, "currency": "EUR"}, tracking={"flush_timeout_s": 60}),
        env={},
    )
    bill = CostMeter.for_config(config, now=1000.0)
    tracker = make_tracker(config, config.run_dir)
    assert bill is not None and tracker is not None
    tracker.on_start(RunInfo("t", 1, "local", str(config.run_dir)))
    for step, now in ((5, 1100.0), (10, 1200.0)):  # what driver/events.Pump hands the observers
        tracker.on_report(bill.on_report(Report(step=step, total_steps=20, time=1.7e9 + step), now=now))
    profile = config.run_dir / "profile"
    profile.mkdir(parents=True)
    (profile / "rank0.summary.json").write_text(json.dumps({"rank": 0, "comm_share": 0.25, "top_operators": []}))
    (profile / "rank0.trace.json").write_text(json.dumps({"traceEvents": []}))
    final = bill.final(Report(step=20, total_steps=20), wall_time_s=400.0).to_dict()
    tracker.on_end({"status": "finished", "global_step": 20, "wall_time_s": 400.0, "restarts": 0, "cost": final})
    assert not tracker.leftover and tracker.outbox.opened is not None

    client = MlflowClient(local_store_uri(tmp_path))
    run_id = tracker.outbox.opened.run_id
    so_far = [(m.step, round(m.value, 6)) for m in client.get_metric_history(run_id, "cost/so_far")]
    assert so_far == [(5, 0.1), (10, 0.2), (20, 0.4)]
    assert client.get_metric_history(run_id, "profile/comm_share")[0].value == 0.25
    params = client.get_run(run_id).data.params
    assert params["cost.price_per_cpu_hour"] == "3.6" and params["cost.currency"] == "EUR"
    artifacts = {a.path for a in client.list_artifacts(run_id, "profile")}
    assert artifacts == {"profile/rank0.summary.json", "profile/rank0.trace.json"}
