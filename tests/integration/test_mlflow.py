"""MLflow tracking end to end: a real ``mlflow server`` on loopback, real Ray workers, the run read
back through MlflowClient; resume continues the run; the server dying mid-run stops nothing."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mlflow import MlflowClient

import trainforge
from tests.helpers.faults import Fault, free_port, paced_run, reports, wait_until
from tests.helpers.runs import tiny_run
from tests.helpers.user_models import held_marker
from trainforge.protocol import curve_points
from trainforge.tracking.runs import RESUME_FILE

pytestmark = [pytest.mark.usefixtures("ray_local"), pytest.mark.slow]

RUN_FILES = {"config.yaml", "summary.json", "metrics.jsonl", "model.safetensors", "report"}


class MlflowServer:
    """``mlflow server`` (sqlite backend, proxied artifacts) in its own process group, so that a
    test can SIGKILL all of it and start it again on the same port and store."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> MlflowServer:
        command = [
            str(Path(sys.executable).with_name("mlflow")),
            "server",
            "--backend-store-uri",
            f"sqlite:///{self.root / 'mlflow.db'}",
            "--artifacts-destination",
            str(self.root / "artifacts"),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--workers",
            "1",
        ]
        with (self.root / "server.log").open("ab") as out:
            # No Huey job consumers (seven processes MLflow 3 starts for its GenAI jobs): the runs
            # trainforge logs need none, and on 2 cores they slow everything beside them.
            env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
            self.proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        return self

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as answer:
                return bool(answer.status == 200)
        except OSError:
            return False

    def wait_healthy(self, timeout_s: float = 360) -> None:
        wait_until(self.healthy, timeout_s, f"mlflow server at {self.url} (log: {self.root / 'server.log'})", 0.5)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None


@pytest.fixture(scope="module", autouse=True)
def server_starting(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    """Started with the module, not waited for: it boots while the first test (the local store,
    which needs no server) trains."""
    started = MlflowServer(tmp_path_factory.mktemp("mlflow-server")).start()
    try:
        yield started
    finally:
        started.kill()


@pytest.fixture
def server(server_starting: MlflowServer) -> MlflowServer:
    server_starting.wait_healthy()
    return server_starting


def only_run(client: MlflowClient, experiment: str) -> Any:
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"no experiment {experiment}"
    runs = client.search_runs([found.experiment_id])
    assert len(runs) == 1, f"{len(runs)} runs in {experiment}"
    return runs[0]


def steps(client: MlflowClient, run_id: str, key: str = "train/loss") -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def reported_steps(run_dir: Path) -> list[int]:
    """Steps of every train/loss point in metrics.jsonl: one per log interval, from the reports'
    history (both runs of a resumed run directory)."""
    points = (point for report in reports(run_dir) if "step" in report for point in curve_points(report))
    return sorted(point["step"] for point in points if "train/loss" in point)


def test_without_a_uri_the_run_lands_in_the_local_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with caplog.at_level(logging.INFO, logger="trainforge"):
        result = trainforge.fit(tiny_run(tmp_path, tracking={"register_model": "digits-mlp"}))
    store = f"sqlite:///{tmp_path.resolve()}/mlflow.db"
    assert f"mlflow ui --backend-store-uri {store}" in caplog.text
    client = MlflowClient(store)
    run = only_run(client, "trainforge")
    assert run.info.status == "FINISHED" and run.info.run_name == result.run_dir.name
    assert steps(client, run.info.run_id) == [5, 10, 15, 20]
    assert {a.path for a in client.list_artifacts(run.info.run_id)} >= RUN_FILES
    assert run.info.artifact_uri.startswith((tmp_path.resolve() / "mlartifacts").as_uri())
    # tracking.register_model through fit: version 1, recorded in the result and in summary.json
    record = result.summary["registered_model"]
    assert record["version"] == 1 and record["run_id"] == run.info.run_id and record["step"] == 20
    assert json.loads((result.run_dir / "summary.json").read_text())["registered_model"] == record
    version = client.get_model_version("digits-mlp", "1")
    assert float(version.tags["metric.val/accuracy"]) == result.metrics["val/accuracy"]


def test_two_workers_make_one_run_and_a_resume_continues_it_through_a_server_outage(
    tmp_path: Path, server: MlflowServer, caplog: pytest.LogCaptureFixture
) -> None:
    """One run of 2 workers, then the same run directory with more steps: the resume continues the
    MLflow run, and the server dying mid-way through it stops nothing (what was buffered arrives
    when it is back). The resume and the outage share one fit, on the first fit's warm worker group."""
    tracking = {"uri": server.url, "experiment": "two-workers", "flush_timeout_s": 400}
    # Both fits train held_net: free while `hold` is absent; the resumed run's workers wait at their
    # first step while it exists, so the server dies mid-run however loaded the machine is.
    hold = tmp_path / "hold"
    held_kwargs = {"delay_s": 0.05, "hold_file": str(hold)}
    held = {"factory": "tests.helpers.user_models:held_net", "kwargs": held_kwargs}
    # The resume runs on the first fit's worker group, kept warm (scaling.reuse_workers): tracking is
    # the driver's, the same whichever group trains.
    two = {"scaling": {"num_workers": 2, "reuse_workers": True}, "tracking": tracking, "model": held}
    result = trainforge.fit(paced_run(tmp_path, train={"max_steps": 20}, **two))
    assert result.status == "finished"
    client = MlflowClient(server.url)
    run = only_run(client, "two-workers")
    run_id = run.info.run_id
    assert json.loads((result.run_dir / RESUME_FILE).read_text())["run_id"] == run_id
    assert run.info.status == "FINISHED"
    assert run.data.params["optim.lr"] == "0.003"
    assert run.data.params["scaling.num_workers"] == "2"
    assert run.data.params["tracking.uri"] == server.url
    tags = run.data.tags
    assert tags["trainforge.world_size"] == "2" and tags["trainforge.accelerator"] == "cpu"
    assert tags["trainforge.version.ray"] and tags["trainforge.cluster.nodes"] == "1"
    assert steps(client, run_id) == [5, 10, 15, 20]
    assert {"val/accuracy", "train/lr", "train/grad_norm", "perf/samples_per_s", "perf/data_wait_s"} <= set(
        run.data.metrics
    )
    system = [key for key in run.data.metrics if key.startswith("system/")]
    assert any(key.endswith("/cpu_percent") for key in system) and any(key.endswith("/net_recv_mb_s") for key in system)
    assert {a.path for a in client.list_artifacts(run_id)} >= RUN_FILES
    assert {"report/report.html", "report/loss.png"} <= {a.path for a in client.list_artifacts(run_id, "report")}

    # The same run directory with more steps: training resumes from step 20, tracking continues the
    # run; once the resumed run's workers are at their first step (held), the server is killed and
    # started again.
    run_dir = result.run_dir

    def resumed_and_training() -> bool:
        return held_marker(hold).exists()

    def said_unreachable() -> list[logging.LogRecord]:
        return [r for r in caplog.records if "is unreachable" in r.getMessage()]

    def kill_and_restart() -> dict[str, Any]:
        server.kill()
        killed = time.time()
        hold.unlink()  # steps 21-70 train after the server died
        # Started again once trainforge has said it is down: a server back within the HTTP client's
        # own retries (seconds on a quiet machine) would be an outage nobody saw.
        wait_until(said_unreachable, 120, "trainforge to say the MLflow server is unreachable")
        server.start()  # training does not wait for it
        return {"at": killed}

    longer = paced_run(tmp_path, train={"max_steps": 70}, **two)
    hold.touch()
    with caplog.at_level(logging.INFO, logger="trainforge"), Fault(resumed_and_training, kill_and_restart) as fault:
        resumed = trainforge.fit(longer, resume="auto")  # more steps: a changed config, continued
        killed_at = fault.join()["at"]
    assert resumed.status == "finished" and resumed.summary["global_step"] == 70
    assert any(r.get("time/unix", 0) > killed_at for r in reports(run_dir)), "training stopped with the server"
    unreachable = said_unreachable()
    assert len(unreachable) == 1, [r.getMessage() for r in unreachable]
    assert "training continues" in unreachable[0].getMessage()

    # on_end waited for the server: the one run holds both fits' points, those buffered during the
    # outage included.
    run = only_run(client, "two-workers")
    assert run.info.run_id == run_id and run.info.status == "FINISHED"
    assert steps(client, run_id) == reported_steps(run_dir) and max(steps(client, run_id)) == 70
    assert run.data.tags["trainforge.resume_changed.train.max_steps"] == "70 (was 20)"
    assert {a.path for a in client.list_artifacts(run_id)} >= RUN_FILES
