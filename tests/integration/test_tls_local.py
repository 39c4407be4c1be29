"""A local Ray started the way every run starts one (``driver/ray_session``) with ``cluster.tls``:
its GCS, raylet and object manager answer a TLS handshake and a task runs; without
``cluster.tls`` the same ports speak plain gRPC. Each in a fresh interpreter: Ray reads its TLS
variables when it is imported (driver/tls.py). On a cluster of several nodes:
tests/cluster/test_tls.py."""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from cryptography import x509

from tests.helpers.certs import replace_cert
from tests.helpers.cli import trainforge_command
from tests.helpers.faults import paced_run, reports, signal_a_worker, wait_until
from tests.helpers.runs import tiny_run
from tests.helpers.timing import rescaled, scaled
from trainforge.driver.certs import CertFiles, create_certs, default_hosts

pytestmark = pytest.mark.slow

SESSION = """
import json, sys
from trainforge.config import load_config
from trainforge.driver.tls import speaks_tls, use_tls
config = load_config(sys.argv[1], [])
use_tls(config.cluster.tls)  # as trainforge train does, before Ray is imported
import ray
from trainforge.driver.ray_session import ray_session
with ray_session(config, None, verbose=False):
    (node,) = ray.nodes()
    gcs = ray._private.worker.global_worker.node.gcs_address
    ports = {"gcs": int(gcs.rsplit(":", 1)[1]), "raylet": node["NodeManagerPort"]}
    ports["object manager"] = node["ObjectManagerPort"]
    answers = {name: speaks_tls(node["NodeManagerAddress"], port, 5.0) for name, port in ports.items()}
    ran = ray.get(ray.remote(lambda: 42).remote())
print(json.dumps({"tls": answers, "ran": ran}))
"""


def session(tmp_path: Path, tls: dict[str, str] | None, bind: str = "127.0.0.1") -> dict[str, object]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    config = tiny_run(tmp_path, cluster={"num_cpus": 2, "bind_address": bind, **({"tls": tls} if tls else {})})
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_TLS", "RAY_USE_TLS", "RAY_ADDRESS"))}
    done = subprocess.run(
        [sys.executable, "-c", SESSION, str(tmp_path / "run.yaml")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def test_a_local_ray_with_cluster_tls_speaks_tls_on_every_port_and_runs_tasks(tmp_path: Path) -> None:
    files = create_certs(tmp_path / "certs", ["localhost", "127.0.0.1"])
    tls = {"ca": str(files.ca), "cert": str(files.cert), "key": str(files.key)}
    assert session(tmp_path / "tls", tls) == {"tls": {"gcs": True, "raylet": True, "object manager": True}, "ran": 42}
    assert session(tmp_path / "plain", None) == {
        "tls": {"gcs": False, "raylet": False, "object manager": False},
        "ran": 42,
    }


def test_the_default_certificate_serves_a_local_ray_on_every_interface(tmp_path: Path) -> None:
    """``cluster.bind_address: 0.0.0.0``: Ray's node address is then this machine's routable one,
    which ``certs create``'s default hosts name (gRPC checks the address it dials)."""
    files = create_certs(tmp_path / "certs", default_hosts())
    tls = {"ca": str(files.ca), "cert": str(files.cert), "key": str(files.key)}
    found = session(tmp_path / "tls", tls, bind="0.0.0.0")
    assert found == {"tls": {"gcs": True, "raylet": True, "object manager": True}, "ran": 42}


def tls_run(tmp_path: Path, files: CertFiles, margin_s: float) -> Path:
    """A run of 2 paced workers on a local Ray with ``cluster.tls`` that would train for hours."""
    tls = {"ca": str(files.ca), "cert": str(files.cert), "key": str(files.key), "stop_before_expiry_s": margin_s}
    config = paced_run(
        tmp_path,
        cluster={"num_cpus": 4, "bind_address": "127.0.0.1", "tls": tls},
        train={"max_steps": 1_000_000, "log_every_n_steps": 5},
        scaling={"num_workers": 2},
        failure={"max_failures": 3},
    )
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def start_train(config: Path) -> subprocess.Popen[bytes]:
    """``trainforge train`` in a fresh interpreter (Ray reads its TLS variables when imported), its
    output to files beside the config (a pipe left unread would fill and stop it)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_TLS", "RAY_USE_TLS", "RAY_ADDRESS"))}
    argv = [*trainforge_command(), "train", str(config)]
    with open(config.with_suffix(".out"), "wb") as out, open(config.with_suffix(".err"), "wb") as err:
        return subprocess.Popen(argv, stdout=out, stderr=err, env=env)


def ended(process: subprocess.Popen[bytes], config: Path, timeout_s: float) -> str:
    """The command's stderr once it has exited (killed after ``timeout_s``, rescaled)."""
    try:
        process.wait(timeout=rescaled(timeout_s))
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    return config.with_suffix(".err").read_text()


def utc_now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def test_a_worker_lost_after_the_certificate_expired_ends_the_run_in_one_line_instead_of_waiting(
    tmp_path: Path,
) -> None:
    """Issue 36: a certificate that expired while the run trained left the restarted worker group
    waiting for ever (its new processes' handshakes fail and are retried). Now the driver sees the
    failure, finds the files no longer pass, and ends the run at once."""
    files = create_certs(tmp_path / "certs", ["localhost", "127.0.0.1"])
    config = tls_run(tmp_path, files, margin_s=0)
    process = start_train(config)
    try:
        wait_until(lambda: [r for r in reports(tmp_path / "t") if "step" in r], 240, "the run's first report")
    except TimeoutError:
        process.kill()
        raise
    # The node certificate expires (replaced by one that did): the processes running keep their
    # connections; a process started now cannot make one.
    replace_cert(files, utc_now() - datetime.timedelta(hours=1), utc_now() - datetime.timedelta(minutes=1))
    killed = signal_a_worker(signal.SIGKILL)
    stderr = ended(process, config, 120)
    ended_after_s = time.time() - killed["at"]
    assert process.returncode == 1, stderr[-3000:]
    (line,) = [text for text in stderr.splitlines() if "cannot start" in text]  # the command's error line
    assert line.startswith("error: training failed: the worker group cannot start")
    assert "cluster.tls.cert" in line and "expired" in line and "--resume" in line
    summary = json.loads((tmp_path / "t" / "summary.json").read_text())
    assert summary["status"] == "failed" and "cannot start" in summary["error"]
    print(f"from the kill to the run's exit: {ended_after_s:.1f} s")


def test_a_run_checkpoints_and_stops_before_its_certificate_expires_and_says_why(tmp_path: Path) -> None:
    files = create_certs(tmp_path / "certs", ["localhost", "127.0.0.1"])
    replace_cert(files, utc_now() - datetime.timedelta(hours=1), utc_now() + datetime.timedelta(hours=1))
    expires = x509.load_pem_x509_certificate(files.cert.read_bytes()).not_valid_after_utc
    # The stop comes `lead` seconds from now: after the command's checks (refused if the margin were
    # already reached), before or after its first step (a stop asked before the first report is
    # taken at that report).
    lead = scaled(15)
    margin = (expires - utc_now()).total_seconds() - lead
    config = tls_run(tmp_path, files, margin_s=round(margin))
    process = start_train(config)
    stderr = ended(process, config, 240)
    assert process.returncode == 3, stderr[-3000:]
    assert "the workers checkpoint and stop at their next report" in stderr
    summary = json.loads((tmp_path / "t" / "summary.json").read_text())
    assert summary["status"] == "stopped" and summary["checkpoint"]
    assert summary["stopped_by"]["source"] == "tls" and "cluster.tls.cert" in summary["stopped_by"]["reason"]
    assert summary["stopped_by"]["step"] == summary["global_step"] > 0
