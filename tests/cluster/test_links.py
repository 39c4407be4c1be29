"""The namespace network itself, without Ray: reachability across the switch, a cable pulled and
plugged back, rate and latency shaping measured with real TCP traffic, stale namespaces removed."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from typing import Any

import psutil

from tests.cluster import netns
from tests.cluster.netns import Network, rate_bits
from tests.cluster.traffic import Traffic
from tests.helpers.faults import wait_until


def test_every_node_reaches_every_other_across_the_switch(netns_network: Network) -> None:
    traffic = Traffic(netns_network)
    for src in netns_network.nodes:
        for dst in netns_network.nodes:
            if src != dst:
                assert traffic.reaches(src, dst), f"{src} cannot reach {dst} ({netns_network.nodes[dst]})"


def test_a_pulled_cable_cuts_the_node_off_until_it_is_plugged_back(netns_network: Network) -> None:
    traffic = Traffic(netns_network)
    netns_network.set_link("w2", False)
    try:
        assert not traffic.reachable("w1", "w2"), "w2 still answers with its cable pulled"
        assert not traffic.reachable("w2", "head"), "w2 still reaches the head with its cable pulled"
        assert traffic.reaches("w1", "head"), "pulling w2's cable cut w1 off too"
    finally:
        netns_network.set_link("w2", True)
    assert traffic.reaches("w1", "w2"), "w2 unreachable after its cable was plugged back"


def test_rate_shaping_limits_throughput_both_ways(netns_network: Network, shaped_link: Callable[..., Any]) -> None:
    traffic = Traffic(netns_network)
    rate = "50mbit"
    limit = rate_bits(rate)
    unshaped = traffic.throughput_bits("w1", "w2")
    with shaped_link("w2", rate=rate) as qdisc:
        into = traffic.throughput_bits("w1", "w2")
        out_of = traffic.throughput_bits("w2", "w1")
        between_others = traffic.throughput_bits("w1", "head")
    after = traffic.throughput_bits("w1", "w2")
    print(
        f"\n{rate} with {qdisc}: into w2 {into / 1e6:.1f} Mbit/s, out of w2 {out_of / 1e6:.1f} Mbit/s; "
        f"unshaped {unshaped / 1e6:.0f} Mbit/s before, {after / 1e6:.0f} after; w1->head {between_others / 1e6:.0f}"
    )
    # A shaper may let a burst through at the start; the rate over 1.5 s stays near the limit.
    for measured in (into, out_of):
        assert 0.5 * limit < measured < 1.2 * limit, f"{measured / 1e6:.1f} Mbit/s through a {rate} link"
    assert unshaped > 4 * limit and after > 4 * limit, "the unshaped link is not faster than the shaped one"
    assert between_others > 4 * limit, "shaping w2 slowed a link that does not touch it"


def test_latency_shaping_delays_each_round_trip(netns_network: Network, shaped_link: Callable[..., Any]) -> None:
    traffic = Traffic(netns_network)
    with shaped_link("w2", delay="50ms"):  # skips here when the kernel has no netem
        started = time.monotonic()
        assert traffic.reaches("w1", "w2")
        # The probe's TCP handshake crosses w2's cable twice (in and out), each delayed 50 ms.
        took = time.monotonic() - started
    print(f"\nconnect through a 50 ms link (plus a Python start): {took:.3f} s")
    assert took > 0.1


def test_namespaces_of_a_crashed_run_are_removed_with_their_processes(netns_network: Network) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()  # a PID that no longer exists: the "crashed run" that made the namespace
    name = f"{netns.BASE}{gone.pid}-head"
    netns.ip("netns", "add", name)
    straggler = subprocess.Popen(["ip", "netns", "exec", name, "sleep", "300"])
    try:
        wait_until(lambda: straggler.pid in netns.pids_in(name), 10, "the process inside the namespace")
        assert name in netns.remove_stale()
        assert name not in netns.namespaces()
        # (killed and reaped by remove_stale, which waits for what it kills)
        assert not psutil.pid_exists(straggler.pid), "a process in the stale namespace survived"
    finally:
        straggler.kill()
        netns.ip("netns", "delete", name, check=False)


def test_the_network_adds_nothing_to_the_host_namespace(netns_network: Network) -> None:
    host_links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    assert netns_network.prefix not in host_links
    assert "br0" not in host_links
