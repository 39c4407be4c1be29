"""A TLS-terminating TCP proxy, as an Ingress or a reverse proxy puts in front of Ray's dashboard
(which serves plain HTTP whatever RAY_USE_TLS says): ``python -m tests.cluster.tls_proxy PORT
TARGET_HOST TARGET_PORT CERT KEY`` accepts TLS on PORT with CERT/KEY and passes the bytes both
ways to TARGET (HTTP and websockets alike). Prints "listening" once it accepts."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import sys


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, ssl.SSLError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


async def serve(port: int, target: tuple[str, int], cert: str, key: str) -> None:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)

    async def handle(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*target)
        except OSError:
            client_writer.close()
            return
        await asyncio.gather(pipe(client_reader, upstream_writer), pipe(upstream_reader, client_writer))

    server = await asyncio.start_server(handle, "0.0.0.0", port, ssl=context)
    print("listening", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(serve(int(sys.argv[1]), (sys.argv[2], int(sys.argv[3])), sys.argv[4], sys.argv[5]))
