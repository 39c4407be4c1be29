"""The run's Ray: connect to a cluster or start a local Ray, its driver-side logs in the run
directory, and a local Ray on loopback.

While a local Ray starts, its node address is 127.0.0.1, so that its servers listen on 127.0.0.1
only (docs/security.md): ``ray_session`` starts every run's local Ray through ``bound_to``, and so
do the benchmarks that start one of their own (``bench/prometheus.py``, ``bench/peers.py``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import ray

from trainforge.config import Config
from trainforge.errors import ClusterError
from trainforge.metrics.driver.session import check_cluster_options, local_ray_options, publish_local_targets
from trainforge.redact import redacting

LOOPBACK = "127.0.0.1"
# Ray reads this at import; False makes its node-address lookup answer 127.0.0.1 (as on macOS).
CLUSTER_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@contextlib.contextmanager
def bound_to(bind_address: str) -> Iterator[None]:
    """While a local Ray starts: make it take 127.0.0.1 as its node address, when asked to.

    Ray 2.60 on Linux replaces a loopback ``_node_ip_address`` by the machine's routable address
    (services.resolve_ip_for_localhost) and its servers listen on every interface. Its one path to
    a loopback node is the macOS/Windows one, ``ray_constants.ENABLE_RAY_CLUSTER`` false: then the
    node address is 127.0.0.1 and GCS, raylet, object manager, workers and the metrics agent listen
    on 127.0.0.1 only (tests/integration/test_loopback.py checks every listening socket). The
    environment variable carries the same choice to the processes ``ray.init`` spawns.
    """
    if bind_address != LOOPBACK:
        yield
        return
    from ray._private import ray_constants

    saved_flag, saved_env = ray_constants.ENABLE_RAY_CLUSTER, os.environ.get(CLUSTER_ENV)
    ray_constants.ENABLE_RAY_CLUSTER = False
    os.environ[CLUSTER_ENV] = "0"
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_flag
        if saved_env is None:
            os.environ.pop(CLUSTER_ENV, None)
        else:
            os.environ[CLUSTER_ENV] = saved_env


def resolve_address(config: Config, address: str | None) -> str | None:
    return address or config.cluster.address or os.environ.get("RAY_ADDRESS") or None


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Fail in seconds, with a clear message, instead of waiting on Ray's long connect retries."""
    if address == "auto":
        return
    parsed = urlparse(address if "://" in address else f"tcp://{address}")
    host, port = parsed.hostname, parsed.port or (10001 if parsed.scheme == "ray" else 6379)
    if not host:
        raise ClusterError(f"Ray address {address!r} is not host:port, ray://host:port or 'auto'")
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as err:
        raise ClusterError(
            f"cannot reach the Ray cluster at {address} ({err.strerror or err}); "
            "check the address, or unset RAY_ADDRESS/--address to train on a local Ray"
        ) from None


@contextlib.contextmanager
def ray_logs_to(path: Path, *, verbose: bool) -> Iterator[None]:
    """Ray's driver-side log lines go to ``path``; on the terminal too only when verbose."""
    ray_logger = logging.getLogger("ray")
    handler = redacting(logging.FileHandler(path))
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    # Ray installs its own stderr handler on import; park it unless the user asked for Ray's logs.
    parked = [] if verbose else list(ray_logger.handlers)
    for kept in ray_logger.handlers if verbose else []:
        redacting(kept)
    for old in parked:
        ray_logger.removeHandler(old)
    ray_logger.addHandler(handler)
    try:
        yield
    finally:
        ray_logger.removeHandler(handler)
        for old in parked:
            ray_logger.addHandler(old)
        handler.close()


@contextlib.contextmanager
def ray_session(config: Config, address: str | None, *, verbose: bool) -> Iterator[str]:
    """Connect to the cluster at ``address`` or start a local Ray; yields a description of it."""
    if ray.is_initialized():
        yield "the Ray instance already running in this process"
        return
    quiet = {"log_to_driver": verbose, "configure_logging": False}
    if address:
        check_cluster_options(config.metrics)
        check_reachable(address)
        try:
            ray.init(address=address, **quiet)  # type: ignore[arg-type]
        except (ConnectionError, RuntimeError) as err:
            raise ClusterError(f"cannot connect to the Ray cluster at {address}: {err}") from None
        where = f"the Ray cluster at {address}"
    else:
        workers = config.scaling.max_workers
        cpus_per_worker = (config.scaling.resources_per_worker or {}).get("CPU", 1)
        # Logical CPUs: enough for every worker even on a 2-core laptop; threads are capped per worker.
        num_cpus = config.cluster.num_cpus or max(os.cpu_count() or 1, int(workers * cpus_per_worker) + 1, 4)
        # address="local": always a new cluster, never one some other `ray start` left on this machine.
        # No dashboard (11 more processes, ~0.9 GB); metrics export works without it (metrics/driver/session.py).
        options = local_ray_options(config.metrics)
        with bound_to(config.cluster.bind_address):
            ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, **options, **quiet)  # type: ignore[arg-type]
        where = f"a local Ray ({num_cpus} logical CPUs, listening on {config.cluster.bind_address})"
    try:
        # Prometheus finds a local Ray's metrics agent through the file Ray's dashboard would write.
        with contextlib.nullcontext() if address else publish_local_targets(config.metrics):
            yield where
    finally:
        ray.shutdown()
