"""A local Ray on loopback: while it starts, its node address is 127.0.0.1, so that its servers
listen on 127.0.0.1 only (docs/security.md). ``launch.ray_session`` starts every run's local Ray
through here, and so do the benchmarks that start one of their own (``metrics/overhead.py``,
``bench/peers.py``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

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
