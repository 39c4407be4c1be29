"""TCP probes between namespaces (the machine has no ping): reachability and throughput.

Run as ``python -m tests.cluster.traffic serve PORT`` in one namespace (it binds every address,
accepts one connection, reads to the end and prints ``<bytes> <seconds>``) and
``python -m tests.cluster.traffic send HOST PORT SECONDS`` in another (it writes as fast as the
link allows for SECONDS). ``Traffic`` wraps both for tests.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from dataclasses import dataclass

from tests.cluster.netns import Network
from tests.helpers.timing import scaled

CHUNK = b"\0" * 65536


def serve(port: int) -> None:
    with socket.create_server(("0.0.0.0", port)) as server:
        print("listening", flush=True)
        conn, _ = server.accept()
        with conn:
            received, started = 0, time.monotonic()
            while data := conn.recv(1 << 20):
                received += len(data)
            print(received, time.monotonic() - started, flush=True)


def send(host: str, port: int, seconds: float) -> None:
    with socket.create_connection((host, port), timeout=10) as conn:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            conn.sendall(CHUNK)


def reachable(host: str, port: int, timeout_s: float) -> bool:
    """Whether a TCP connection to host:port is answered (accepted or refused) within the timeout:
    either way a packet came back over the link."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except ConnectionRefusedError:
        return True
    except OSError:
        return False


@dataclass
class Traffic:
    """Probes from one node of a Network to another, each side a process in its own namespace."""

    net: Network
    python: str = sys.executable

    def throughput_bits(self, src: str, dst: str, seconds: float = 1.5, port: int = 5201) -> float:
        """Bits per second that ``src`` can push to ``dst`` over TCP, measured at the receiver."""
        server = subprocess.Popen(
            self.net.exec_argv(dst, [self.python, "-m", "tests.cluster.traffic", "serve", str(port)]),
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert server.stdout is not None
            if server.stdout.readline().strip() != "listening":
                raise RuntimeError("the throughput server did not start")
            subprocess.run(
                self.net.exec_argv(
                    src,
                    [self.python, "-m", "tests.cluster.traffic", "send", self.net.nodes[dst], str(port), str(seconds)],
                ),
                check=True,
                timeout=seconds + 30,
            )
            received, elapsed = server.communicate(timeout=30)[0].split()
            return int(received) * 8 / float(elapsed)
        finally:
            server.kill()
            server.wait()

    def reachable(self, src: str, dst: str, port: int = 9, timeout_s: float = 1.0) -> bool:
        """Whether ``dst`` answers a TCP connection from ``src`` (refused counts: it answered)."""
        code = (
            "import sys; from tests.cluster.traffic import reachable; "
            f"sys.exit(0 if reachable({self.net.nodes[dst]!r}, {port}, {timeout_s}) else 1)"
        )
        done = subprocess.run(self.net.exec_argv(src, [self.python, "-c", code]), timeout=scaled(timeout_s + 30))
        return done.returncode == 0

    def reaches(self, src: str, dst: str, within_s: float = 10.0) -> bool:
        """Whether ``dst`` answers ``src`` within ``within_s`` (scaled by the machine's slowdown),
        probing again until then: a link that just came up, or a first SYN lost to a neighbour
        lookup on a loaded machine, is not a cut cable. (``reachable`` is one probe: for links
        that must stay down.)"""
        deadline = time.monotonic() + scaled(within_s)
        while True:
            if self.reachable(src, dst):
                return True
            if time.monotonic() > deadline:
                return False


def main(argv: list[str]) -> None:
    if argv[0] == "serve":
        serve(int(argv[1]))
    elif argv[0] == "send":
        send(argv[1], int(argv[2]), float(argv[3]))
    else:
        raise SystemExit(f"usage: serve PORT | send HOST PORT SECONDS (got {argv})")


if __name__ == "__main__":
    main(sys.argv[1:])
