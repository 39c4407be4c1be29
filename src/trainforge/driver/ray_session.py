"""The run's Ray: connect to a cluster or start a local Ray, its driver-side logs in the run
directory, and a local Ray on loopback.

While a local Ray starts, its node address is 127.0.0.1, so that its servers listen on 127.0.0.1
only (docs/security.md): ``ray_session`` starts every run's local Ray through ``bound_to``, and so
do the benchmarks that start one of their own (``bench/prometheus.py``, ``bench/peers.py``).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import ray
from ray.experimental import internal_kv

from trainforge.config import Config
from trainforge.driver.tls import check_node_tls, check_tls, open_dashboard, tls_in_environment, use_tls
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
    try:
        parsed = urlparse(address if "://" in address else f"tcp://{address}")
        host, port = parsed.hostname, parsed.port or (10001 if parsed.scheme == "ray" else 6379)
    except ValueError:  # an unclosed IPv6 bracket, a port out of 0-65535 or not a number
        host = None
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


_ray_log: list[logging.Handler] = []  # ray_logs_to's file handlers, innermost last


def reattach_ray_log() -> None:
    """``ray.init(configure_logging=False)`` clears the "ray" logger's handlers: put the run's
    ray.log handler back once Ray is up (until then Ray's warnings reach Python's last resort)."""
    ray_logger = logging.getLogger("ray")
    for handler in _ray_log[-1:]:
        if handler not in ray_logger.handlers:
            ray_logger.addHandler(handler)


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
    _ray_log.append(handler)
    try:
        yield
    finally:
        _ray_log.remove(handler)
        ray_logger.removeHandler(handler)
        for old in parked:
            ray_logger.addHandler(old)
        handler.close()


@contextlib.contextmanager
def ray_session(config: Config, address: str | None, *, verbose: bool) -> Iterator[str]:
    """Connect to the cluster at ``address`` or start a local Ray; yields a description of it."""
    use_tls(config.cluster.tls)  # Ray was imported: only checks that the environment has cluster.tls
    started_early = not address and "ray" in _early  # being started on a thread: is_initialized may say so already
    if ray.is_initialized() and not started_early:
        yield "the Ray instance already running in this process"
        return
    quiet = {"log_to_driver": verbose, "configure_logging": False}
    if address:
        check_cluster_options(config.metrics)
        check_reachable(address)
        check_tls(address)  # a TLS mismatch in one line, not Ray's minutes of retries
        try:
            ray.init(address=address, **quiet)  # type: ignore[arg-type]
        except (ConnectionError, RuntimeError) as err:
            raise ClusterError(f"cannot connect to the Ray cluster at {address}: {err}") from None
        where = f"the Ray cluster at {address}"
        if tls_in_environment():
            warn_open_dashboard()
    else:
        where = start_local(config, verbose=verbose)
    reattach_ray_log()
    try:
        # Prometheus finds a local Ray's metrics agent through the file Ray's dashboard would write.
        with contextlib.nullcontext() if address else publish_local_targets(config.metrics):
            yield where
    finally:
        shutdown()


def warn_open_dashboard() -> None:
    """With TLS on, a warning when the cluster's dashboard is where the nodes reach it: Ray's TLS
    does not cover the event reports every node's dashboard agent sends it (``open_dashboard``)."""
    from ray._private import ray_constants

    try:
        recorded = internal_kv._internal_kv_get(
            ray_constants.DASHBOARD_ADDRESS.encode(), namespace=ray_constants.KV_NAMESPACE_DASHBOARD
        )
    except Exception as err:  # a question for a warning: the run goes on without the answer
        logging.getLogger("trainforge").debug("could not read the dashboard's address from the GCS: %s", err)
        return
    where = open_dashboard(recorded)
    if where is not None:
        logging.getLogger("trainforge").warning(
            "the cluster's dashboard is at %s, where its nodes reach it over plain HTTP: Ray's TLS does not cover "
            "the events each node's dashboard agent sends there, with the cluster's token; start the head with "
            "--dashboard-host=127.0.0.1, or encrypt the node network (docs/security.md)",
            where,
        )


def local_init_options(config: Config, *, verbose: bool) -> dict[str, object]:
    """``ray.init``'s arguments for the run's local Ray."""
    workers = config.scaling.max_workers
    cpus_per_worker = (config.scaling.resources_per_worker or {}).get("CPU", 1)
    # Logical CPUs: enough for every worker even on a 2-core laptop; threads are capped per worker.
    num_cpus = config.cluster.num_cpus or max(os.cpu_count() or 1, int(workers * cpus_per_worker) + 1, 4)
    # address="local": always a new cluster, never one some other `ray start` left on this machine.
    # No dashboard (11 more processes, ~0.9 GB); metrics export works without it (metrics/driver/session.py).
    return {
        "address": "local",
        "num_cpus": num_cpus,
        "include_dashboard": False,
        **local_ray_options(config.metrics),
        "log_to_driver": verbose,
        "configure_logging": False,
    }


def local_node_address(bind_address: str) -> str:
    """The node address a local Ray started now takes: where its servers listen and its processes dial."""
    from ray._private import services

    with bound_to(bind_address):
        return str(services.get_node_ip_address())


def check_local_tls(config: Config) -> None:
    """With TLS: the node certificate names the local Ray's node address (gRPC checks the address
    it dials against it, and Ray would retry the refused handshakes for minutes)."""
    if config.cluster.tls is not None or tls_in_environment():
        check_node_tls(config.cluster.tls, local_node_address(config.cluster.bind_address))


def start_local(config: Config, *, verbose: bool) -> str:
    """Start the run's local Ray (or take the one ``start_early`` started for it); says what it is."""
    options = local_init_options(config, verbose=verbose)
    early = _early.get("ray")
    if early is None or not early.take(options):
        check_local_tls(config)
        with bound_to(config.cluster.bind_address):
            init_local(options)
    return f"a local Ray ({options['num_cpus']} logical CPUs, listening on {config.cluster.bind_address})"


# Ray waits a fixed 30 s for a new node's raylet to register with its GCS (ray/_private/node.py);
# on a machine busy enough that wait runs out, and the run would end before it began.
STALLED = "timed out during startup"


def init_local(options: dict[str, object]) -> None:
    """``ray.init`` of a local Ray; started once more when its node stalled, the stalled node's
    processes killed first (nothing else would: they live as long as the thread that started them)."""
    try:
        ray.init(**options)  # type: ignore[arg-type]
    except Exception as err:
        if STALLED not in str(err):
            raise
        node = stalled_node(err)
        for started in node.all_processes.values() if node is not None else ():
            for info in started:  # ray's ProcessInfo: the Popen of each process the node started
                with contextlib.suppress(OSError):
                    info.process.kill()
                with contextlib.suppress(Exception):
                    info.process.wait(timeout=10)
        ray.shutdown()
        logging.getLogger("trainforge").warning(
            "the local Ray's node did not start within Ray's 30 s (a busy machine?): starting it again"
        )
        ray.init(**options)  # type: ignore[arg-type]


def stalled_node(err: BaseException) -> Any:
    """The ``ray._private.node.Node`` whose start raised ``err`` (its frame's ``self``)."""
    from ray._private.node import Node

    frame = err.__traceback__
    while frame is not None:
        candidate = frame.tb_frame.f_locals.get("self")
        if isinstance(candidate, Node):
            return candidate
        frame = frame.tb_next
    return None


def shutdown() -> None:
    """Stop this process's Ray, and the thread that started it early, if one did."""
    ray.shutdown()
    early = _early.pop("ray", None)
    if early is not None:
        early.release.set()


class HoldHandler(logging.Handler):
    """Python's last-resort handler while the early Ray starts. ``ray.init(configure_logging=False)``
    clears Ray's logger's handlers, so what Ray logs then (its token-authentication notice) would
    reach the terminal through the last resort; held instead, it goes to the run's ray.log once the
    run takes that Ray, or nowhere when a check fails first: the user's error stays one line. Ray's
    warning that a ``ray.init`` off the main thread sets no SIGTERM handler is dropped: the run
    installs its own (driver/run.py's graceful_stop)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "not the main thread" not in record.getMessage():
            self.records.append(record)


@dataclass
class EarlyRay:
    """A local Ray started on a thread while the command imports torch and the driver: Ray's
    processes boot on the machine's other cores in the seconds those imports take (the
    ``ray`` phase of a run's start, driver/startup.py).

    The thread lives until Ray is shut down: Ray's node processes die with the thread that
    started them (Linux's parent-death signal is per thread)."""

    options: dict[str, object]
    bind_address: str
    error: BaseException | None = None
    up: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)
    taken: bool = False
    held: HoldHandler = field(default_factory=HoldHandler)

    def __post_init__(self) -> None:
        threading.Thread(target=self._run, name="trainforge-ray", daemon=True).start()
        atexit.register(self.abandon)  # the last resort: cancel_early is the way

    def _run(self) -> None:
        last_resort, logging.lastResort = logging.lastResort, self.held
        try:
            with bound_to(self.bind_address):
                init_local(self.options)
        except BaseException as err:  # re-raised where the run asks for its Ray
            self.error = err
        finally:
            logging.lastResort = last_resort
            self.up.set()
        self.release.wait()

    def take(self, options: dict[str, object]) -> bool:
        """The early Ray for a run that wants ``options``: True when it is that Ray, up; False
        when the run wants another one (the early one is stopped). Raises what its start raised."""
        self.up.wait()
        atexit.unregister(self.abandon)
        if self.error is not None:
            _early.pop("ray", None)
            self.release.set()
            raise self.error
        if options != self.options:
            shutdown()
            return False
        self.taken = True
        for record in self.held.records:  # into the run's ray.log (ray_logs_to)
            for handler in _ray_log[-1:]:
                handler.handle(record)
        return True

    def abandon(self) -> None:
        self.up.wait(timeout=120)
        if _early.get("ray") is self:
            shutdown()


_early: dict[str, EarlyRay] = {}


def start_early(config: Config, address: str | None, *, verbose: bool) -> None:
    """Begin starting the local Ray the run will ask for, on a thread (``trainforge train`` calls
    this before it imports torch and the driver). Nothing for a cluster run or a running Ray."""
    use_tls(config.cluster.tls)
    if resolve_address(config, address) is not None or ray.is_initialized() or "ray" in _early:
        return
    check_local_tls(config)
    _early["ray"] = EarlyRay(local_init_options(config, verbose=verbose), config.cluster.bind_address)


def cancel_early() -> None:
    """Stop a Ray that ``start_early`` started and no run took (the run failed its checks first);
    nothing once a run took it (its session shuts it down)."""
    early = _early.get("ray")
    if early is not None and early.up.wait(timeout=120) and not early.taken:
        atexit.unregister(early.abandon)
        shutdown()


@contextlib.contextmanager
def early_local_ray(config: Config, address: str | None, *, verbose: bool) -> Iterator[None]:
    """Around a command's run: its local Ray starts now (``start_early``), and is stopped at the
    end if the run never took it (``cancel_early``: a check failed first)."""
    start_early(config, address, verbose=verbose)
    try:
        yield
    finally:
        cancel_early()
