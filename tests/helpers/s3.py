"""An S3-compatible server (moto) on loopback for tests: real HTTP, stoppable mid-run."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import boto3
from moto.server import ThreadedMotoServer

BUCKET = "trainforge-test"


class S3Server:
    """moto's S3 on 127.0.0.1:port; ``stop`` closes the socket (clients get connection refused),
    ``start`` serves the same buckets again."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.endpoint = f"http://127.0.0.1:{port}"
        self._server: ThreadedMotoServer | None = None

    def start(self) -> None:
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()

    def stop(self) -> None:
        if self._server is None:
            return
        self._server.stop()
        # ThreadedMotoServer.stop leaves the listening socket open: requests would hang, not fail.
        self._server._server.server_close()  # type: ignore[union-attr]
        self._server = None

    @property
    def running(self) -> bool:
        return self._server is not None

    def client(self) -> Any:
        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1")

    def keys(self, prefix: str) -> dict[str, int]:
        """Object key -> size under ``prefix``."""
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
        return {obj["Key"]: obj["Size"] for page in pages for obj in page.get("Contents", [])}

    def committed(self, prefix: str) -> list[str]:
        """Checkpoint names under ``prefix`` whose manifest was uploaded (the last file of a save)."""
        if not self.running:
            return []
        names = {k.split("/")[-2] for k in self.keys(prefix) if k.endswith("/manifest.json")}
        return sorted(n for n in names if n.startswith("checkpoint_"))


@contextlib.contextmanager
def serving(port: int) -> Iterator[tuple[S3Server, dict[str, str]]]:
    """A started server with the bucket ``BUCKET``, and the AWS variables that point boto3 and
    pyarrow's S3 file system at it, set in this process's environment until the block ends (the
    variables are also returned, for a Ray runtime environment)."""
    server = S3Server(port)
    server.start()
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": server.endpoint,  # honoured by boto3 and by pyarrow's S3 file system
    }
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        server.client().create_bucket(Bucket=BUCKET)
        yield server, env
    finally:
        server.stop()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
