"""Encrypt a namespace Network: every node's traffic to every other node through WireGuard.

What production clusters do to keep torch.distributed's tensors (gloo, NCCL: no TLS of their own)
off the wire in clear, made real on the namespace network (docs/security.md, docs/deploy.md). Each
node gets a WireGuard interface ``wgnet`` with an address of ``OVERLAY`` (node i: ``OVERLAY.i``),
one peer per other node (its cable address as the endpoint, its overlay address as the only
allowed IP), and fresh keys for every network. ``net.nodes`` then holds the overlay addresses and
``net.device`` is ``wgnet``, so Ray, the drivers and gloo (``GLOO_SOCKET_IFNAME``) use the tunnel;
on the cables only WireGuard's UDP (``PORT``) crosses, encrypted (ChaCha20-Poly1305).

This kernel has neither WireGuard nor IPsec's ESP built in (CONFIG_WIREGUARD, CONFIG_INET_ESP
unset, no modules to load), so the daemon is ``wireguard-go``, WireGuard's userspace
implementation on a TUN device (Debian's ``wireguard-go`` and ``wireguard-tools`` for ``wg``):
the same protocol and keys; slower than the kernel's, which a benchmark of its cost says.

wireguard-go names its control socket after the interface, under /var/run/wireguard, which
every namespace shares: each interface is created under a name unique on the machine
(``<prefix>w<i>``), configured, then renamed ``wgnet``. The daemon runs inside the node's
namespace, so killing the namespace's processes (a node restart by RayCluster's supervisor)
ends it and cuts the node off; the tests that use this restart no node.
"""

from __future__ import annotations

import os
import shutil
import subprocess

from tests.cluster.netns import Network, command, ip

OVERLAY = "10.214.0"
DEVICE = "wgnet"
PORT = 51820
TOOLS = ("wireguard-go", "wg")


def unavailable() -> str | None:
    """Why the network cannot be encrypted here (a tool or /dev/net/tun missing), or None."""
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(missing)} not installed (Debian: apt-get install wireguard-go wireguard-tools)"
    if not os.path.exists("/dev/net/tun"):
        return "no /dev/net/tun: wireguard-go needs a TUN device"
    return None


def keypair() -> tuple[str, str]:
    private = command(["wg", "genkey"]).stdout.strip()
    public = subprocess.run(["wg", "pubkey"], input=private, capture_output=True, text=True, check=True)
    return private, public.stdout.strip()


def encrypt(net: Network) -> None:
    """Put every node of ``net`` behind WireGuard to every other node (module docstring)."""
    cables = dict(net.cables)
    keys = {name: keypair() for name in cables}
    overlay = {name: f"{OVERLAY}.{address.rsplit('.', 1)[1]}" for name, address in cables.items()}
    for index, name in enumerate(cables, start=1):
        ns = net.ns(name)
        unique = f"{net.prefix}w{index}"
        command(["ip", "netns", "exec", ns, "wireguard-go", unique])  # forks the daemon, returns
        key_file = f"/dev/shm/{unique}.key"
        with open(os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as out:
            out.write(keys[name][0])
        try:
            argv = ["wg", "set", unique, "listen-port", str(PORT), "private-key", key_file]
            for peer, address in cables.items():
                if peer != name:
                    argv += [
                        "peer",
                        keys[peer][1],
                        "endpoint",
                        f"{address}:{PORT}",
                        "allowed-ips",
                        f"{overlay[peer]}/32",
                    ]
            command(["ip", "netns", "exec", ns, *argv])
        finally:
            os.unlink(key_file)
        ip("-n", ns, "link", "set", unique, "name", DEVICE)
        ip("-n", ns, "addr", "add", f"{overlay[name]}/24", "dev", DEVICE)
        ip("-n", ns, "link", "set", DEVICE, "up")
        net.nodes[name] = overlay[name]
    net.device = DEVICE
