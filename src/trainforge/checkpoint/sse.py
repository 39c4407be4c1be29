"""``checkpoint.s3_sse``: S3 server-side encryption of every object a checkpoint writes.

pyarrow's S3 file system sends no server-side-encryption headers (the metadata it takes on upload
is ACL, Cache-Control, Content-Type and a few more; ``x-amz-server-side-encryption`` is dropped
without a word), so with ``s3_sse`` a store's uploads and server-side copies go through boto3 with
``ServerSideEncryption`` (and ``SSEKMSKeyId``), over the same credentials, region, endpoint and
timeouts as the store's pyarrow file system. Reads need nothing: S3 decrypts for any reader the
bucket (and, for ``aws:kms``, the key's policy) allows.

This is encryption by the storage service, with its keys; ``checkpoint.encryption`` (crypto.py)
encrypts before anything leaves the worker, with a key the service never sees. They combine.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs

from trainforge.errors import CheckpointError

MODES = ("aws:kms", "AES256")


@dataclass(frozen=True)
class ServerSide:
    """One S3 server-side encryption setting: ``AES256`` (S3's keys) or ``aws:kms`` (a KMS key:
    ``kms_key_id``, or the account's default S3 key when None)."""

    mode: str
    kms_key_id: str | None = None

    def extra_args(self) -> dict[str, str]:
        """The request parameters every upload and copy carries."""
        args = {"ServerSideEncryption": self.mode}
        if self.kms_key_id:
            args["SSEKMSKeyId"] = self.kms_key_id
        return args


class EncryptingWriter:
    """Uploads and server-side copies on an S3 file system, each asking for ``sse``."""

    def __init__(self, fs: pafs.FileSystem, sse: ServerSide) -> None:
        if not isinstance(fs, pafs.S3FileSystem):
            raise CheckpointError(f"checkpoint.s3_sse needs an s3:// checkpoint.storage_path, not {fs.type_name}")
        self.sse = sse
        self.client = _client(fs)

    def upload(self, local: Path, path: str) -> None:
        """``local`` to the object ``path`` (``bucket/key``)."""
        bucket, key = _split(path)
        self.client.upload_file(str(local), bucket, key, ExtraArgs=self.sse.extra_args())

    def copy(self, source: str, target: str) -> None:
        """A server-side copy (multipart when large), the copy encrypted as asked."""
        bucket, key = _split(source)
        target_bucket, target_key = _split(target)
        self.client.copy({"Bucket": bucket, "Key": key}, target_bucket, target_key, ExtraArgs=self.sse.extra_args())


def _split(path: str) -> tuple[str, str]:
    bucket, _, key = path.partition("/")
    return bucket, key


def _client(fs: pafs.S3FileSystem) -> Any:
    """A boto3 S3 client with ``fs``'s credentials, region, endpoint and timeouts (None where the
    file system took them from the environment: boto3's own chain finds the same)."""
    import boto3
    from botocore.config import Config

    options = dict(fs.__reduce__()[1][0])
    endpoint = options.get("endpoint_override") or None
    if endpoint and "://" not in endpoint:
        endpoint = f"{options.get('scheme') or 'https'}://{endpoint}"
    timeouts = {}
    for name, key in (("connect_timeout", "connect_timeout"), ("request_timeout", "read_timeout")):
        if float(options.get(name) or -1) > 0:
            timeouts[key] = float(options[name])
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name=options.get("region") or None,
        aws_access_key_id=options.get("access_key") or None,
        aws_secret_access_key=options.get("secret_key") or None,
        aws_session_token=options.get("session_token") or None,
        config=Config(retries={"max_attempts": 3, "mode": "standard"}, **timeouts),
    )


__all__ = ["MODES", "EncryptingWriter", "ServerSide"]
