"""A real Prometheus scrapes a real training run through Ray's metrics pipeline.

One module fixture: a local Ray started the way ``trainforge train`` starts it (driver/ray_session.ray_session,
which also writes Ray's service-discovery file), Debian's ``prometheus`` on loopback with the
shipped config (only paths and intervals substituted) and the shipped rules, and a short
two-worker run. The tests then read Prometheus' HTTP API: the training metrics with their
labels and values, every metric name the dashboards and rules reference, every expression
evaluated, and the alerts of a healthy run.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

import trainforge
from tests.helpers.runs import tiny_run
from tests.helpers.timing import scaled
from trainforge.config import Config, load_config
from trainforge.metrics import names
from trainforge.metrics.driver.promql import deploy_expressions, unresolved_names
from trainforge.metrics.driver.session import DISCOVERY_FILE

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "deploy" / "monitoring"
PROMETHEUS = shutil.which("prometheus")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(PROMETHEUS is None, reason="prometheus binary not installed (.ci/run installs Debian's)"),
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def render_config(discovery_file: Path, out: Path) -> Path:
    """The shipped prometheus.yml with test paths (discovery file, rule files) and 1 s intervals."""
    shipped = yaml.safe_load((MONITORING / "prometheus" / "prometheus.yml").read_text())
    config = json.loads(json.dumps(shipped))
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["rule_files"] = [str((MONITORING / "prometheus" / path).resolve()) for path in shipped["rule_files"]]
    (discovery,) = config["scrape_configs"][0]["file_sd_configs"]
    discovery.update(files=[str(discovery_file)], refresh_interval="1s")
    path = out / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


class Prometheus:
    """/usr/bin/prometheus on a free loopback port with its own TSDB directory."""

    def __init__(self, config: Path, workdir: Path) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = (workdir / "prometheus.log").open("w")
        self.process = subprocess.Popen(
            [
                str(PROMETHEUS),
                f"--config.file={config}",
                f"--storage.tsdb.path={workdir / 'tsdb'}",
                f"--web.listen-address={self.url.removeprefix('http://')}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        wait_for(lambda: self._ready(), 60, "Prometheus to start")

    def _ready(self) -> bool:
        if self.process.poll() is not None:
            raise RuntimeError(f"prometheus exited with {self.process.returncode}; see {self.log.name}")
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def api(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=scaled(30)) as response:
            body = json.loads(response.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        return list(self.api("query", query=expr)["result"])

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=scaled(30))
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()


def wait_for(condition: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + scaled(timeout_s)
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s} s for {what}")
        time.sleep(0.5)


@dataclass
class Monitored:
    prometheus: Prometheus
    config: Config
    result: trainforge.RunResult
    node_ip: str

    def last(self, expr: str, window: str = "10m") -> list[dict[str, Any]]:
        """Latest sample of every series, also of series that went stale when the workers exited."""
        return self.prometheus.query(f"last_over_time({expr}[{window}])")


@pytest.fixture(scope="module")
def monitored(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Monitored]:
    import ray

    from trainforge.driver.ray_session import ray_session

    tmp = tmp_path_factory.mktemp("prometheus")
    config = load_config(
        tiny_run(
            tmp,
            run={"name": "prom"},
            # 20 ms per step keeps the workers alive for several of Ray's 1 s metric exports.
            model={"name": None, "factory": "tests.helpers.user_models:paced_net", "kwargs": {"delay_s": 0.02}},
            train={"max_steps": 60, "eval_every_n_steps": 20},
            scaling={"num_workers": 2},
            checkpoint={"every_n_steps": 20},
            metrics={"export_interval_s": 1.0},
            tracking={"enabled": False},
            cost={"price_per_cpu_hour": 0.5},
        )
    )
    if ray.is_initialized():
        ray.shutdown()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        with ray_session(config, None, verbose=False):
            session_dir = Path(ray._private.worker.global_worker.node.get_session_dir_path())
            prometheus = Prometheus(render_config(session_dir / DISCOVERY_FILE, tmp), tmp)
            try:
                result = trainforge.fit(config)  # fit adds the driver's metrics observer itself
                monitored = Monitored(prometheus, config, result, ray.util.get_node_ip_address())
                ranks = 'count by (rank) (last_over_time(trainforge_global_step{run="prom"}[10m]))'
                wait_for(lambda: len(prometheus.query(ranks)) == 2, 60, "both ranks' metrics in Prometheus")
                yield monitored
            finally:
                prometheus.stop()


def values_by(results: list[dict[str, Any]], label: str) -> dict[str, float]:
    return {r["metric"].get(label, ""): float(r["value"][1]) for r in results}


def test_discovery_file_lists_the_local_metrics_agent(monitored: Monitored) -> None:
    (target,) = monitored.prometheus.api("targets")["activeTargets"]
    assert target["labels"]["job"] == "ray"
    assert target["health"] == "up"
    assert target["labels"]["instance"].startswith(f"{monitored.node_ip}:")


def test_training_metrics_carry_run_rank_and_node_labels(monitored: Monitored) -> None:
    steps = monitored.last('trainforge_global_step{run="prom"}')
    assert {s["metric"]["rank"] for s in steps} == {"0", "1"}
    assert {s["metric"]["node"] for s in steps} == {monitored.node_ip}
    assert all("trial" not in s["metric"] for s in steps)  # empty outside a search
    final_step = monitored.result.summary["global_step"]
    assert all(0 < float(s["value"][1]) <= final_step for s in steps)

    phases = monitored.last('trainforge_step_phase_seconds{run="prom", rank="1"}')
    assert {p["metric"]["phase"] for p in phases} == {"data", "compute", "optimizer"}
    step_time = values_by(monitored.last('trainforge_step_seconds{run="prom"}'), "rank")
    assert step_time.keys() == {"0", "1"} and all(v >= 0.02 for v in step_time.values())  # paced_net sleeps 20 ms
    own = values_by(monitored.last('trainforge_step_own_seconds{run="prom"}'), "rank")
    assert own.keys() == {"0", "1"} and all(v >= 0.02 for v in own.values())  # ... in its forward: own work
    scores = values_by(monitored.last('trainforge_straggler_score{run="prom"}'), "rank")
    assert scores.keys() == {"0", "1"} and all(v > 0 for v in scores.values())

    # Two workers: DDP's gradient all-reduce is timed on both; what the step waits for after
    # backward is part of the time an all-reduce is in flight.
    comm = values_by(monitored.last('trainforge_comm_seconds{run="prom"}'), "rank")
    assert comm.keys() == {"0", "1"} and all(v > 0 for v in comm.values())
    excess = monitored.prometheus.query(
        'max(max_over_time((trainforge_comm_exposed_seconds{run="prom"} - trainforge_comm_seconds)[10m:1s]))'
    )
    assert float(excess[0]["value"][1]) <= 1e-9


def test_checkpoint_metrics_come_from_rank_0_and_match_the_files(monitored: Monitored) -> None:
    sizes = monitored.last('trainforge_checkpoint_size_bytes{run="prom"}')
    assert [s["metric"]["rank"] for s in sizes] == ["0"]
    manifests = sorted(monitored.result.run_dir.glob("checkpoint_*/manifest.json"))
    assert manifests
    on_disk = {sum(f["size"] for f in json.loads(m.read_text())["files"].values()) for m in manifests}
    assert float(sizes[0]["value"][1]) in on_disk
    (failures,) = monitored.last('trainforge_checkpoint_save_failures{run="prom"}')
    assert float(failures["value"][1]) == 0
    (saved_at,) = monitored.last('trainforge_checkpoint_last_success_timestamp_seconds{run="prom"}')
    assert abs(float(saved_at["value"][1]) - time.time()) < 3600


def test_driver_exports_restarts_progress_and_the_run_s_end(monitored: Monitored) -> None:
    restarts = values_by(monitored.last('trainforge_restarts{run="prom"}'), "reason")
    assert restarts == dict.fromkeys(names.RESTART_REASONS, 0.0)
    assert monitored.result.summary["restarts"] == 0

    reports = (monitored.result.run_dir / "metrics.jsonl").read_text().splitlines()
    last_report = json.loads(reports[-1])["time/unix"]
    # The driver sets the gauge at the last report; Prometheus sees it at its next scrape of the
    # driver, which may come after the run returned: wait for that scrape, not for luck.
    last_seen = 'last_over_time(trainforge_run_last_report_timestamp_seconds{run="prom"}[10m])'

    def exported_last_report() -> float | None:
        samples = monitored.prometheus.query(last_seen)
        return float(samples[0]["value"][1]) if len(samples) == 1 else None

    wait_for(lambda: exported_last_report() == pytest.approx(last_report, abs=1e-3), 30, "the last report's scrape")
    (active,) = monitored.prometheus.query('max_over_time(trainforge_run_active{run="prom"}[10m])')
    assert float(active["value"][1]) == 1
    ended = 'last_over_time(trainforge_run_active{run="prom"}[10m]) == 0'
    wait_for(lambda: len(monitored.prometheus.query(ended)) == 1, 30, "the driver to export the run's end")


def test_the_cost_is_in_every_report_summary_json_the_report_and_prometheus(monitored: Monitored) -> None:
    run_dir = monitored.result.run_dir
    cost = json.loads((run_dir / "summary.json").read_text())["cost"]
    # 2 workers of 1 CPU each, billed for the driver's whole session at 0.5 per CPU-hour.
    assert cost["currency"] == "USD" and cost["price_per_cpu_hour"] == 0.5 and cost["gpu_hours"] == 0
    assert cost["cpu_hours"] > 0 and cost["so_far"] == pytest.approx(cost["cpu_hours"] * 0.5, rel=1e-4)
    assert cost["projected_total"] == cost["so_far"]  # finished: nothing left to project
    reports = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    billed = [r["cost/so_far"] for r in reports if "step" in r]
    assert billed and billed == sorted(billed) and billed[-1] <= cost["so_far"]
    assert "<h2>Cost</h2>" in (run_dir / "report" / "report.html").read_text()

    def exported() -> float | None:
        samples = monitored.last('trainforge_run_cost{run="prom",currency="USD"}')
        return float(samples[0]["value"][1]) if len(samples) == 1 else None

    wait_for(lambda: exported() == pytest.approx(cost["so_far"], rel=1e-9), 30, "the run's final cost")


def test_exported_values_are_the_reported_ones(monitored: Monitored) -> None:
    reports = [json.loads(line) for line in (monitored.result.run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train/loss"] for r in reports if "train/loss" in r]
    now = time.time()
    series = monitored.prometheus.api(
        "query_range", query='trainforge_train_loss{run="prom"}', start=str(now - 600), end=str(now), step="1"
    )["result"]
    exported = {float(value) for s in series for _, value in s["values"]}
    assert exported
    for value in exported:
        assert any(math.isclose(value, loss, rel_tol=1e-9) for loss in losses), value


def test_every_metric_the_dashboards_and_rules_read_is_exported_or_allowlisted(monitored: Monitored) -> None:
    exported = set(monitored.prometheus.api("label/__name__/values"))
    # The definitions are what the run exports (GPU gauges only exist on GPU nodes).
    defined = {m.name for m in names.ALL} - set(names.CONDITIONAL_NAMES["gpu"])
    assert defined <= exported, defined - exported
    allowlisted = {name for group in names.CONDITIONAL_NAMES.values() for name in group}
    assert not allowlisted & exported - set(names.CONDITIONAL_NAMES["gpu"])  # no stale allowlist entries here
    expressions = deploy_expressions(MONITORING)
    assert len(expressions) > 40
    assert unresolved_names(expressions, exported | allowlisted) == {}


GRAFANA_VARIABLES = {"__rate_interval": "1m", "__interval": "15s", "__range": "1h"}


def grafana_to_promql(expr: str) -> str:
    """Dashboard variables as Grafana would expand them: time variables to durations, the rest
    (used only in regex matchers) to match-all."""
    return re.sub(r"\$\{?(\w+)\}?", lambda m: GRAFANA_VARIABLES.get(m.group(1), ".*"), expr)


def test_every_dashboard_and_rule_expression_evaluates(monitored: Monitored) -> None:
    for expression in deploy_expressions(MONITORING):
        try:
            monitored.prometheus.query(grafana_to_promql(expression.expr))
        except urllib.error.HTTPError as err:
            pytest.fail(f"{expression.source}: {expression.expr}: {err.read().decode()}")
    groups = monitored.prometheus.api("rules")["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    assert {g["name"] for g in groups} >= {"trainforge.recording", "trainforge.training", "ray.cluster"}
    assert all(rule["health"] == "ok" for rule in rules), [r for r in rules if r["health"] != "ok"]
    recorded = monitored.last('trainforge:samples_per_second:run{run="prom"}')
    assert len(recorded) == 1 and float(recorded[0]["value"][1]) > 0


def test_no_alert_fires_for_a_healthy_run(monitored: Monitored) -> None:
    alerts = monitored.prometheus.api("alerts")["alerts"]
    assert [a for a in alerts if a["state"] == "firing"] == []
