"""Fixtures for multi-node tests over a real network on one machine (network namespaces).

* ``netns_network`` (module): namespaces ``head``, ``w1``, ``w2`` (10.213.0.1-3/24) cabled by veth
  pairs to a bridge in a switch namespace; no Ray. Skipped, with the reason, only where a network
  namespace cannot be created (not root, no iproute2, a container without CAP_NET_ADMIN).
* ``netns_cluster`` (module): a real Ray cluster in that network (``raycluster.RayCluster``): head
  (0 CPUs; drivers run in its namespace) and two 1-CPU worker nodes, each with a custom resource
  named after it, Ray token auth on, health checks short enough that a node cut off is declared
  dead within about 2 s; worker nodes are restarted by the harness when their ``ray start`` ends.
  The head runs the dashboard (Ray's Jobs API at ``netns_cluster.dashboard_url``) for ``submit``.
  Starting it costs about 15 s.
* ``shaped_link`` (function): ``with shaped_link("w2", rate="100mbit", delay="5ms"): ...`` shapes
  both directions of a node's cable for the block. Rates work everywhere (tbf); a delay needs
  ``tc netem`` and skips the test, with that reason, on a kernel without it.

Everything a module started (namespaces and every process inside them) is killed and deleted when
the module ends; what a crashed run left behind is removed when the next one starts. Processes
run inside a node with ``netns_network.exec_argv(node, argv)`` (``ip netns exec``, which execs:
the process stays this test's child).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

from tests.cluster.netns import NetnsUnavailable, Network, ShapingUnavailable, probe, remove_stale
from tests.cluster.raycluster import FAST_HEALTH_CHECKS, NodeSpec, RayCluster, ray_cluster

NODES = ["head", "w1", "w2"]
SPECS = [NodeSpec("head", num_cpus=0, head=True), NodeSpec("w1", num_cpus=1), NodeSpec("w2", num_cpus=1)]


@contextlib.contextmanager
def namespace_network(nodes: Sequence[str] = NODES) -> Iterator[Network]:
    """A namespace network of ``nodes`` (no Ray), removed at the end; the test skips where this
    machine cannot make network namespaces. Stale namespaces of crashed runs are removed first."""
    remove_stale()
    try:
        probe()
    except NetnsUnavailable as err:
        pytest.skip(f"network namespaces unavailable: {err}")
    net = Network.create(list(nodes))
    try:
        yield net
    finally:
        net.delete()


@pytest.fixture(scope="module")
def netns_network() -> Iterator[Network]:
    """The three-node namespace network (no Ray); see the module docstring."""
    with namespace_network() as net:
        yield net


@pytest.fixture(scope="module")
def netns_cluster(netns_network: Network) -> Iterator[RayCluster]:
    """A Ray cluster on ``netns_network``; see the module docstring."""
    with ray_cluster(netns_network, SPECS, system_config=FAST_HEALTH_CHECKS, dashboard=True) as cluster:
        yield cluster


@pytest.fixture
def shaped_link(netns_network: Network) -> Iterator[Callable[..., Any]]:
    """``shaped_link(node, rate=None, delay=None)``: a context manager shaping ``node``'s cable."""
    shaped: set[str] = set()

    @contextlib.contextmanager
    def shape(node: str, rate: str | None = None, delay: str | None = None) -> Iterator[str]:
        try:
            qdisc = netns_network.shape(node, rate=rate, delay=delay)
        except ShapingUnavailable as err:
            pytest.skip(str(err))
        shaped.add(node)
        try:
            yield qdisc
        finally:
            netns_network.unshape(node)

    yield shape
    for node in shaped:  # a test that failed inside the block leaves nothing shaped
        netns_network.unshape(node)
