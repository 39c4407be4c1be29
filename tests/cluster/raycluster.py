"""Real Ray nodes in a namespace Network: one ``ray start --block`` per node namespace, each with
its own IP, resources and temp dir, talking to the others only across the veth links.

Nodes are supervised like pods under Kubernetes: when a worker node's ``ray start`` exits (a
raylet that the GCS declared dead exits by itself once it can reach the GCS again, and
``ray start --block`` then stops the node's other processes), the supervisor kills whatever is
left in that namespace and starts the node again; it rejoins the cluster as a new node. The head is
not supervised: without it there is no cluster. ``ray stop`` is never used (it stops every Ray on
the machine); every process is ended by namespace (``netns.kill_namespace_processes``).

The driver (``trainforge train --address``) runs inside the head's namespace: a Ray driver needs a
raylet on its own host, which the root namespace has not got.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import psutil

from tests.cluster.netns import BASE, Network, kill_namespace_processes, pids_in
from tests.helpers.timing import scaled

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
GCS_PORT = 6379
DASHBOARD_PORT = 8265

# The GCS declares a node dead after `threshold` failed health checks, one every `period` (each
# given `timeout` to answer). Ray's defaults are 5000 ms initial delay, 3000 ms period, 10000 ms
# timeout, threshold 5; these make a cut-off node dead within about 2 s.
FAST_HEALTH_CHECKS = {
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 500,
    "health_check_timeout_ms": 500,
    "health_check_failure_threshold": 3,
}

# The GCS's view of each live node (address -> free and total CPUs), asked from the head's namespace.
NODE_STATES = """
import json, sys
from ray._raylet import GcsClient
from ray.autoscaler.v2.sdk import get_cluster_resource_state
from ray.core.generated.autoscaler_pb2 import NodeStatus
state = get_cluster_resource_state(GcsClient(address=sys.argv[1]))
print(json.dumps({
    n.node_ip_address: {"free_cpus": n.available_resources.get("CPU", 0), "cpus": n.total_resources.get("CPU", 0)}
    for n in state.node_states if n.status != NodeStatus.DEAD
}))
"""


@dataclass
class NodeSpec:
    """One Ray node: its name (also its namespace's suffix), CPUs, and a custom resource ``name: 1``
    so a test can pin work to it."""

    name: str
    num_cpus: int
    head: bool = False


@dataclass
class RayNode:
    spec: NodeSpec
    address: str
    temp_dir: Path
    log: Path
    process: subprocess.Popen[bytes] | None = None
    starts: list[float] = field(default_factory=list)  # unix times the node was (re)started
    exits: list[tuple[float, int]] = field(default_factory=list)  # (unix time, exit code) of each end


class RayCluster:
    """A head and worker nodes in ``net``; ``system_config`` goes to the head (the GCS)."""

    def __init__(
        self,
        net: Network,
        specs: Sequence[NodeSpec],
        root: Path,
        *,
        system_config: dict[str, Any] | None = None,
        dashboard: bool = False,
        dashboard_host: str = "0.0.0.0",
        env: dict[str, str] | None = None,
    ) -> None:
        self.net = net
        self.root = root
        self.system_config = system_config or {}
        self.dashboard = dashboard
        self.dashboard_host = dashboard_host
        self.token = secrets.token_hex(32)
        self.env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),  # workers import tests.helpers (paced_net) from the checkout
            "OMP_NUM_THREADS": "1",
            "RAY_USAGE_STATS_ENABLED": "0",
            # Every namespace shares the machine's hostname, which resolves to 127.0.0.1: gloo would
            # advertise that to the other ranks. A node's address is on its net.device (eth0, the
            # cable; wgnet on an encrypted network, tests/cluster/wireguard.py).
            "GLOO_SOCKET_IFNAME": net.device,
            # A node's own setting that a run's scaling.env replaces (test_multinode's submit test).
            "TRAINFORGE_ENV_PROBE": "from-the-node",
            # A submitted job's entrypoint is `trainforge train`: on the PATH of every node's Ray.
            "PATH": os.pathsep.join([str(BIN), os.environ.get("PATH", "")]),
            # Ray's token authentication, on as for a real cluster: every node, driver and query
            # of this cluster carries the token (never the machine's ~/.ray/auth_token).
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": self.token,
            **(env or {}),
        }
        self.nodes = {s.name: RayNode(s, net.nodes[s.name], root / s.name, root / f"{s.name}.log") for s in specs}
        self.last_query_error: list[str] = []
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._supervisors: list[threading.Thread] = []

    @property
    def head(self) -> RayNode:
        return next(n for n in self.nodes.values() if n.spec.head)

    @property
    def gcs_address(self) -> str:
        return f"{self.head.address}:{GCS_PORT}"

    @property
    def dashboard_url(self) -> str:
        return f"http://{self.head.address}:{DASHBOARD_PORT}"

    def start_argv(self, node: RayNode) -> list[str]:
        argv = [
            str(BIN / "ray"),
            "start",
            "--block",
            f"--node-ip-address={node.address}",
            f"--num-cpus={node.spec.num_cpus}",
            f"--resources={json.dumps({node.spec.name: 1})}",
            f"--temp-dir={node.temp_dir}",
            "--disable-usage-stats",
        ]
        if node.spec.head:
            argv += [
                "--head",
                f"--port={GCS_PORT}",
                f"--system-config={json.dumps(self.system_config)}",
                f"--include-dashboard={str(self.dashboard).lower()}",
                f"--dashboard-host={self.dashboard_host}",
                f"--dashboard-port={DASHBOARD_PORT}",
            ]
        else:
            argv.append(f"--address={self.gcs_address}")
        return argv

    def launch(self, node: RayNode) -> None:
        node.temp_dir.mkdir(parents=True, exist_ok=True)
        with open(node.log, "ab") as log:
            log.write(f"\n--- ray start at {time.time():.3f}\n".encode())
            log.flush()
            node.process = subprocess.Popen(
                self.net.exec_argv(node.spec.name, self.start_argv(node)),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=ROOT,
            )
        node.starts.append(time.time())

    def start(self, timeout_s: float = 120) -> None:
        """Start every node (head first), wait until the GCS lists them all alive, then supervise
        the worker nodes."""
        self.launch(self.head)
        self.wait_alive([self.head.address], timeout_s)
        for node in self.nodes.values():
            if not node.spec.head:
                self.launch(node)
        self.wait_alive([n.address for n in self.nodes.values()], timeout_s)
        for node in self.nodes.values():
            if not node.spec.head:
                thread = threading.Thread(target=self._supervise, args=(node,), name=f"supervise-{node.spec.name}")
                thread.daemon = True
                thread.start()
                self._supervisors.append(thread)

    def _supervise(self, node: RayNode) -> None:
        """Restart ``node`` whenever its ``ray start`` ends, until the cluster stops."""
        while not self._stopping.is_set():
            process = node.process
            assert process is not None
            code = process.wait()
            with self._lock:
                if self._stopping.is_set():
                    return
                node.exits.append((time.time(), code))
                kill_namespace_processes(self.net.ns(node.spec.name))
                self.launch(node)

    def node_states(self) -> dict[str, dict[str, float]]:
        """Live nodes as the GCS sees them: address -> ``free_cpus``, ``cpus``; {} when it cannot answer."""
        done = subprocess.run(
            self.net.exec_argv(self.head.spec.name, [sys.executable, "-c", NODE_STATES, self.gcs_address]),
            capture_output=True,
            text=True,
            timeout=scaled(60),
            env=self.env,
        )
        if done.returncode != 0:
            self.last_query_error = done.stderr.strip().splitlines()[-1:] or [str(done.returncode)]
            return {}
        return dict(json.loads(done.stdout))

    def wait_alive(self, addresses: Sequence[str], timeout_s: float, *, idle: bool = False) -> None:
        """Wait until every address is a live node (``idle``: with all its CPUs free as well)."""
        deadline = time.monotonic() + scaled(timeout_s)
        states: dict[str, dict[str, float]] = {}
        while time.monotonic() < deadline:
            if self.head.process is not None and self.head.process.poll() is not None:
                raise RuntimeError(f"the head's ray start exited ({self.head.process.returncode}): see {self.head.log}")
            states = self.node_states()
            if all(a in states and (not idle or states[a]["free_cpus"] == states[a]["cpus"]) for a in addresses):
                return
            time.sleep(1)
        raise TimeoutError(
            f"nodes {list(addresses)} not all alive{' and idle' if idle else ''} after {timeout_s:.0f} s "
            f"(the GCS lists {states}; last query error {self.last_query_error}); see {self.root}/*.log"
        )

    def wait_whole(self, timeout_s: float = 120) -> None:
        """Every link up and every node alive and idle (a previous test's restarts and runs over)."""
        for name in self.nodes:
            self.net.set_link(name, True)
        self.wait_alive([n.address for n in self.nodes.values()], timeout_s, idle=True)

    def gcs_log(self) -> Path:
        return self.head.temp_dir / "session_latest" / "logs" / "gcs_server.out"

    def gcs_log_size(self) -> int:
        return self.gcs_log().stat().st_size if self.gcs_log().exists() else 0

    def gcs_lines_since(self, offset: int, pattern: str) -> list[str]:
        """GCS log lines written after byte ``offset`` that match ``pattern``."""
        with open(self.gcs_log(), "rb") as log:
            log.seek(offset)
            text = log.read().decode(errors="replace")
        return [line for line in text.splitlines() if re.search(pattern, line)]

    def driver(self, argv: Sequence[str], log: IO[bytes], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """Start ``argv`` (a trainforge command) in the head's namespace, output to ``log``."""
        return subprocess.Popen(
            self.net.exec_argv(self.head.spec.name, list(argv)),
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**self.env, **(env or {})},
            cwd=ROOT,
        )

    @contextlib.contextmanager
    def prioritised(self, niceness: int = -10, every_s: float = 0.5) -> Iterator[None]:
        """Run every process of the cluster (and what starts in it meanwhile: Ray's workers, the
        driver) at a raised CPU priority, then give it back.

        For measurements that compare the cluster with a model of it (the scaling predictor): on a
        machine busy with other work, two workers that share its cores wait for each other, and
        that wait shows up as communication time. At niceness -10 the scheduler gives the cluster
        about ten times the share of a niceness-0 process, so what is measured is the cluster's
        own work. Ray starts workers at its own niceness, so the renice is repeated every
        ``every_s`` until the block ends."""
        stop = threading.Event()

        def renice(value: int) -> None:
            for node in self.nodes.values():
                for pid in pids_in(self.net.ns(node.spec.name)):
                    with contextlib.suppress(psutil.Error):
                        process = psutil.Process(pid)
                        if process.nice() != value:
                            process.nice(value)

        def keep() -> None:
            while not stop.wait(every_s):
                renice(niceness)

        renice(niceness)
        thread = threading.Thread(target=keep, name="cluster-priority", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
            renice(0)

    def stop(self) -> None:
        """Stop supervising, kill every node's processes (drivers in the head's namespace too)."""
        self._stopping.set()
        with self._lock:
            for node in self.nodes.values():
                kill_namespace_processes(self.net.ns(node.spec.name))
                if node.process is not None:
                    node.process.kill()
                    node.process.wait()
        for thread in self._supervisors:
            thread.join(timeout=10)


@contextlib.contextmanager
def ray_cluster(
    net: Network,
    specs: Sequence[NodeSpec],
    *,
    system_config: dict[str, Any] | None = None,
    dashboard: bool = False,
    dashboard_host: str = "0.0.0.0",
    env: dict[str, str] | None = None,
) -> Iterator[RayCluster]:
    """A running RayCluster in ``net`` (one node per spec, each in the namespace of its name) for
    the block; ``env`` goes to every node and driver (e.g. Ray's TLS variables). Temp dirs live
    under /tmp/<the network's prefix>: Ray's socket paths, which live under them, are limited to
    about 107 bytes."""
    remove_stale_temp_dirs()
    root = Path("/tmp") / net.prefix
    shutil.rmtree(root, ignore_errors=True)
    cluster = RayCluster(
        net, specs, root, system_config=system_config, dashboard=dashboard, dashboard_host=dashboard_host, env=env
    )
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


def remove_stale_temp_dirs() -> None:
    """Temp dirs of clusters whose creating process is gone (a crashed run's Ray logs and sockets)."""
    for path in Path("/tmp").glob(f"{BASE}*"):
        found = re.fullmatch(rf"{BASE}(\d+)", path.name)
        if found and path.is_dir() and not psutil.pid_exists(int(found.group(1))):
            shutil.rmtree(path, ignore_errors=True)
