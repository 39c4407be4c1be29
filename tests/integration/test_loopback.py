"""A local Ray started the way every run starts one (``driver/ray_session.ray_session``) listens on loopback
only, unless ``cluster.bind_address: 0.0.0.0`` (docs/security.md, table 6).

Every listening TCP socket of this process and its descendants (GCS, raylet, object manager,
workers, dashboard agent with the metrics export port, runtime-env agent) is read from the
kernel's table while the session is up.
"""

from __future__ import annotations

import ipaddress
import json
import urllib.request
from pathlib import Path

import psutil
import pytest
import ray

from trainforge.config import load_config
from trainforge.driver.ray_session import ray_session

pytestmark = pytest.mark.slow

QUICK = {"model": {"name": "mlp"}, "train": {"max_steps": 1}, "cluster": {"num_cpus": 2}}


def listening() -> dict[int, tuple[str, str]]:
    """port -> (address, process name) of every listening TCP socket of this process tree."""
    me = psutil.Process()
    tree = {me.pid: "driver"}
    for child in me.children(recursive=True):
        try:
            tree[child.pid] = child.name()
        except psutil.Error:
            continue
    found = {}
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.pid in tree:
            found[conn.laddr.port] = (conn.laddr.ip, tree[conn.pid])
    return found


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def ray_ports() -> dict[str, int]:
    (info,) = ray.nodes()
    gcs = ray._private.worker.global_worker.node.gcs_address
    return {
        "gcs": int(gcs.rsplit(":", 1)[1]),
        "raylet": int(info["NodeManagerPort"]),
        "object manager": int(info["ObjectManagerPort"]),
        "metrics export": int(info["MetricsExportPort"]),
    }


def test_a_local_ray_listens_on_loopback_only_and_prometheus_finds_it_there() -> None:
    if ray.is_initialized():
        ray.shutdown()
    config = load_config(QUICK)
    with ray_session(config, None, verbose=False) as where:
        assert "listening on 127.0.0.1" in where
        sockets = listening()
        ports = ray_ports()
        assert ray.nodes()[0]["NodeManagerAddress"] == "127.0.0.1"
        exposed = {port: seen for port, seen in sockets.items() if not is_loopback(seen[0])}
        assert not exposed, f"listening beyond loopback: {exposed}"
        for name, port in ports.items():
            assert port in sockets, f"{name} port {port} is not among the listening sockets {sockets}"
        # Prometheus' service discovery names the agent where it listens, and /metrics answers there.
        node = ray._private.worker.global_worker.node
        discovery = json.loads((Path(node.get_session_dir_path()) / "prom_metrics_service_discovery.json").read_text())
        target = f"127.0.0.1:{ports['metrics export']}"
        assert discovery[0]["targets"] == [target]
        with urllib.request.urlopen(f"http://{target}/metrics", timeout=30) as reply:
            assert reply.status == 200
    assert not ray.is_initialized()


def test_bind_address_0_0_0_0_gives_rays_own_default_every_interface() -> None:
    if ray.is_initialized():
        ray.shutdown()
    config = load_config(QUICK, ["cluster.bind_address=0.0.0.0"])
    with ray_session(config, None, verbose=False):
        sockets = listening()
        gcs = ray_ports()["gcs"]
        assert not is_loopback(sockets[gcs][0]), sockets[gcs]
