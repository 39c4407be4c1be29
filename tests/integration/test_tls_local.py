"""A local Ray started the way every run starts one (``driver/ray_session``) with ``cluster.tls``:
its GCS, raylet and object manager answer a TLS handshake and a task runs; without
``cluster.tls`` the same ports speak plain gRPC. Each in a fresh interpreter: Ray reads its TLS
variables when it is imported (driver/tls.py). On a cluster of several nodes:
tests/cluster/test_tls.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers.runs import tiny_run
from trainforge.driver.certs import create_certs, default_hosts

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
