"""Every frame that crosses the switch, written to a file: a packet capture without tcpdump.

Run as ``python -m tests.cluster.capture FILE`` inside the switch namespace (``Capture`` does):
an ``AF_PACKET`` socket bound to no interface receives every frame of every port of the bridge
(each node's cable), and the frames are appended to FILE, each after its length (4 bytes, big
endian), until SIGTERM. Tests search the bytes for what must not cross in clear, and ``flows``
tells TLS connections from the others. Needs root (CAP_NET_RAW), as the namespaces do.
"""

from __future__ import annotations

import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from tests.cluster.netns import Network
from tests.helpers.timing import scaled

ETH_P_ALL = 0x0003
TLS_RECORD_TYPES = {0x14, 0x15, 0x16, 0x17}  # change cipher spec, alert, handshake, application data


@dataclass
class Flow:
    """One direction of a TCP connection as captured: its payload bytes and how it began."""

    payload_bytes: int = 0
    first: bytes = b""

    @property
    def tls(self) -> bool:
        """Whether the payload opens as a TLS record (a ClientHello or the server's answer)."""
        return len(self.first) >= 3 and self.first[0] in TLS_RECORD_TYPES and self.first[1] == 3


def flows(data: bytes) -> dict[tuple[str, int, str, int], Flow]:
    """The TCP payload of a capture file by (source, port, destination, port): IPv4 only, as the
    namespace network is."""
    found: dict[tuple[str, int, str, int], Flow] = {}
    at = 0
    while at + 4 <= len(data):
        (size,) = struct.unpack("!I", data[at : at + 4])
        frame = data[at + 4 : at + 4 + size]
        at += 4 + size
        if len(frame) < 34 or frame[12:14] != b"\x08\x00" or frame[23] != 6:  # IPv4 and TCP
            continue
        packet = frame[14:]
        header = (packet[0] & 15) * 4
        total = struct.unpack("!H", packet[2:4])[0]
        source, destination = socket.inet_ntoa(packet[12:16]), socket.inet_ntoa(packet[16:20])
        sport, dport = struct.unpack("!HH", packet[header : header + 4])
        payload = packet[header + (packet[header + 12] >> 4) * 4 : total]
        if payload:
            flow = found.setdefault((source, sport, destination, dport), Flow())
            flow.payload_bytes += len(payload)
            flow.first = flow.first or payload[:8]
    return found


@dataclass(frozen=True)
class Packet:
    """An IPv4 packet as captured: its addresses, IP protocol (6 TCP, 17 UDP, 50 ESP), ports (0
    for other protocols) and length."""

    source: str
    destination: str
    protocol: int
    sport: int
    dport: int
    size: int


def ipv4_packets(data: bytes) -> Iterator[Packet]:
    """Every IPv4 packet of a capture file."""
    at = 0
    while at + 4 <= len(data):
        (size,) = struct.unpack("!I", data[at : at + 4])
        frame = data[at + 4 : at + 4 + size]
        at += 4 + size
        if len(frame) < 34 or frame[12:14] != b"\x08\x00":
            continue
        packet = frame[14:]
        header = (packet[0] & 15) * 4
        protocol = packet[9]
        ports = struct.unpack("!HH", packet[header : header + 4]) if protocol in (6, 17) else (0, 0)
        source, destination = socket.inet_ntoa(packet[12:16]), socket.inet_ntoa(packet[16:20])
        yield Packet(source, destination, protocol, ports[0], ports[1], struct.unpack("!H", packet[2:4])[0])


def capture(path: Path) -> None:
    stop = False

    def on_term(signum: int, frame: FrameType | None) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    with socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(ETH_P_ALL)) as sniffer, open(path, "wb") as out:
        sniffer.settimeout(0.2)
        print("capturing", flush=True)
        while not stop:
            try:
                frame = sniffer.recv(1 << 16)
            except TimeoutError:
                continue
            except InterruptedError:
                continue
            out.write(struct.pack("!I", len(frame)) + frame)


class Capture:
    """A capture of the switch of ``net`` for a ``with`` block; ``data()`` is what crossed."""

    def __init__(self, net: Network, path: Path) -> None:
        self.net = net
        self.path = path
        self.process: subprocess.Popen[str] | None = None

    def __enter__(self) -> Capture:
        argv = [sys.executable, "-m", "tests.cluster.capture", str(self.path)]
        self.process = subprocess.Popen(
            ["ip", "netns", "exec", self.net.switch, *argv],
            stdout=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).resolve().parents[2],
        )
        assert self.process.stdout is not None
        deadline = time.monotonic() + scaled(30)
        line = self.process.stdout.readline()  # "capturing" once the socket is open
        assert line.strip() == "capturing" and time.monotonic() < deadline, f"capture did not start: {line!r}"
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.process is not None
        self.process.terminate()
        self.process.wait(timeout=scaled(30))

    def data(self) -> bytes:
        return self.path.read_bytes()


if __name__ == "__main__":
    capture(Path(sys.argv[1]))
