"""An endpoint that never answers: a TCP server on loopback that accepts every connection and
sends nothing (what a blackholed or hung storage endpoint looks like to a client)."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def silent_endpoint() -> Iterator[str]:
    """``127.0.0.1:PORT`` of the server while the block runs; its connections closed after."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:  # the accept timeout: look at stop again
                continue

    thread = threading.Thread(target=accept, name="silent-endpoint", daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.getsockname()[1]}"
    finally:
        stop.set()
        thread.join()
        for connection in held:
            connection.close()
        server.close()
