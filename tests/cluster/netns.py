"""A small network of Linux network namespaces on one machine: one "switch" namespace holding a
bridge, one namespace per node, each node's ``eth0`` a veth cable into the switch.

Nothing is added to the machine's own (root) namespace, so the network never touches the host's
interfaces or routes, and deleting the namespaces removes every link with them. Names carry the
creating process's PID (``tfc<pid>-head``), so runs never collide, and namespaces left by a run
that crashed (its PID gone) are removed, with every process still in them, when the next one
starts. Needs root and iproute2 (``ip``, ``tc``).

Shaping (``Network.shape``): ``tc netem`` for latency and rate where the kernel has it, otherwise
``tbf`` for rate alone; a latency asked for without netem raises ``ShapingUnavailable``.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

BASE = "tfc"  # every namespace this harness creates is named tfc<pid>-<role>
SUBNET = "10.213.0"  # a private /24 inside the switch; node i gets .i (head .1)
SWITCH = "sw"
WIREGUARD_SOCKETS = Path("/var/run/wireguard")  # wireguard-go's control sockets, one per interface
STALE = re.compile(rf"^{BASE}(\d+)-")


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be created here (not root, no iproute2, a restricted container)."""


class ShapingUnavailable(RuntimeError):
    """The kernel lacks the queueing discipline a shaping request needs (netem for latency)."""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``ip ARGS``; a failure raises with ip's own message."""
    return command(["ip", *args], check=check)


def command(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip() or done.stdout.strip()}")
    return done


def pids_in(namespace: str) -> list[int]:
    """Processes whose network namespace is ``namespace`` (``ip netns pids``)."""
    done = ip("netns", "pids", namespace, check=False)
    return [int(p) for p in done.stdout.split()] if done.returncode == 0 else []


def kill_namespace_processes(namespace: str, timeout_s: float = 10.0) -> None:
    """SIGKILL everything running inside ``namespace`` and wait for it to go."""
    procs = []
    for pid in pids_in(namespace):
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            proc.send_signal(signal.SIGKILL)
            procs.append(proc)
    psutil.wait_procs(procs, timeout=timeout_s)


def namespaces() -> list[str]:
    done = ip("netns", "list", check=False)
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]


def remove_stale() -> list[str]:
    """Delete this harness's namespaces whose creating process is gone (a crashed or killed run),
    killing what still runs in them first. Returns their names."""
    removed = []
    for name in namespaces():
        found = STALE.match(name)
        if found is None or psutil.pid_exists(int(found.group(1))):
            continue
        kill_namespace_processes(name)
        ip("netns", "delete", name, check=False)
        removed.append(name)
    return removed


def probe() -> None:
    """Raise NetnsUnavailable unless a namespace and a veth pair can be made here."""
    name = f"{BASE}{os.getpid()}-probe"
    try:
        ip("netns", "add", name)
        ip("-n", name, "link", "add", "probe0", "type", "veth", "peer", "name", "probe1")
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as err:
        raise NetnsUnavailable(str(err)) from None
    finally:
        ip("netns", "delete", name, check=False)


@dataclass
class Network:
    """The namespaces and links of one harness instance. ``nodes`` maps node name to the IP address
    its processes use, on ``device``; ``cables`` maps it to its cable's (eth0's) address, the same
    unless the network is encrypted (tests/cluster/wireguard.py)."""

    prefix: str
    nodes: dict[str, str] = field(default_factory=dict)
    cables: dict[str, str] = field(default_factory=dict)
    device: str = "eth0"
    _netem: bool | None = None

    @classmethod
    def create(cls, names: Sequence[str], prefix: str | None = None) -> Network:
        """Switch plus one namespace per node name (addresses .1, .2, ... in order); on any
        failure everything made so far is deleted again."""
        net = cls(prefix or f"{BASE}{os.getpid()}")
        try:
            ip("netns", "add", net.switch)
            ip("-n", net.switch, "link", "set", "lo", "up")
            ip("-n", net.switch, "link", "add", "br0", "type", "bridge")
            ip("-n", net.switch, "link", "set", "br0", "up")
            for index, name in enumerate(names, start=1):
                net.add_node(name, f"{SUBNET}.{index}")
        except BaseException:
            net.delete()
            raise
        return net

    @property
    def switch(self) -> str:
        return f"{self.prefix}-{SWITCH}"

    def ns(self, node: str) -> str:
        """The namespace of ``node``."""
        return f"{self.prefix}-{node}"

    def add_node(self, name: str, address: str) -> None:
        """A namespace with ``lo`` up and ``eth0`` (``address``/24) cabled to the switch port ``name``."""
        ns = self.ns(name)
        ip("netns", "add", ns)
        self.nodes[name] = self.cables[name] = address
        ip("-n", ns, "link", "set", "lo", "up")
        ip("-n", self.switch, "link", "add", name, "type", "veth", "peer", "name", "eth0", "netns", ns)
        ip("-n", self.switch, "link", "set", name, "master", "br0")
        ip("-n", self.switch, "link", "set", name, "up")
        ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
        ip("-n", ns, "link", "set", "eth0", "up")

    def exec_argv(self, node: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside ``node``'s namespace (``ip netns exec`` execs it: same PID, our child)."""
        return ["ip", "netns", "exec", self.ns(node), *argv]

    def set_link(self, node: str, up: bool) -> None:
        """Plug or unplug ``node``'s cable at the switch: with it down no packet reaches or leaves
        the node, while everything on the node keeps running."""
        ip("-n", self.switch, "link", "set", node, "up" if up else "down")

    def netem_available(self) -> bool:
        """Whether this kernel has ``tc netem`` (tried once on the switch's loopback)."""
        if self._netem is None:
            tried = command(
                [
                    "ip",
                    "netns",
                    "exec",
                    self.switch,
                    "tc",
                    "qdisc",
                    "add",
                    "dev",
                    "lo",
                    "root",
                    "netem",
                    "delay",
                    "1ms",
                ],
                check=False,
            )
            self._netem = tried.returncode == 0
            command(["ip", "netns", "exec", self.switch, "tc", "qdisc", "del", "dev", "lo", "root"], check=False)
        return self._netem

    def shape(self, node: str, rate: str | None = None, delay: str | None = None) -> str:
        """Limit ``node``'s link in both directions to ``rate`` (tc units: ``100mbit``) and add
        ``delay`` (``5ms``) each way; returns the qdisc used. Without netem a ``delay`` raises
        ShapingUnavailable and ``rate`` uses tbf."""
        if rate is None and delay is None:
            raise ValueError("shape needs a rate, a delay or both")
        if self.netem_available():
            qdisc = ["netem", *(["delay", delay] if delay else []), *(["rate", rate] if rate else [])]
        elif delay is not None:
            raise ShapingUnavailable(
                "tc netem is not available in this kernel (CONFIG_NET_SCH_NETEM): no latency shaping"
            )
        else:
            assert rate is not None
            # burst: 1 ms of traffic at the rate (at least a few packets), so the limit holds on
            # any timescale a test measures (10 ms at 1gbit let a whole 1.2 MB all-reduce through
            # unshaped); latency: how long a packet may queue before a drop.
            burst = max(rate_bits(rate) // 8 // 1000, 16 * 1024)
            qdisc = ["tbf", "rate", rate, "burst", str(burst), "latency", "400ms"]
        for ns, dev in self.cable(node):
            command(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", *qdisc])
        return qdisc[0]

    def unshape(self, node: str) -> None:
        """Remove any shaping from ``node``'s cable (both ends)."""
        for ns, dev in self.cable(node):
            command(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"], check=False)

    def cable(self, node: str) -> list[tuple[str, str]]:
        """Both ends of ``node``'s cable as (namespace, device): node to switch, switch to node."""
        return [(self.ns(node), "eth0"), (self.switch, node)]

    def delete(self) -> None:
        """Kill every process inside the namespaces, then delete them (their links go with them),
        and the control sockets of their WireGuard daemons (tests/cluster/wireguard.py)."""
        for ns in [*(self.ns(n) for n in self.nodes), self.switch]:
            kill_namespace_processes(ns)
            ip("netns", "delete", ns, check=False)
        for socket_path in WIREGUARD_SOCKETS.glob(f"{self.prefix}w*.sock"):
            socket_path.unlink(missing_ok=True)


def rate_bits(rate: str) -> int:
    """A tc rate (``100mbit``, ``1gbit``, ``500kbit``, ``12500000bps``) in bits per second."""
    found = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmg]?)(bit|bps)", rate.strip().lower())
    if found is None:
        raise ValueError(f"not a tc rate: {rate!r}")
    number, prefix, unit = found.groups()
    scale = {"": 1, "k": 1000, "m": 1000**2, "g": 1000**3}[prefix] * (8 if unit == "bps" else 1)
    return int(float(number) * scale)


@contextlib.contextmanager
def network(names: Sequence[str]) -> Iterator[Network]:
    """A Network for the block, stale ones from crashed runs removed first, deleted at the end."""
    remove_stale()
    net = Network.create(names)
    try:
        yield net
    finally:
        net.delete()
