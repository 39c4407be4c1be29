"""Opening storage by URI: the schemes trainforge reads, and a bounded wait on every request.

Checkpoints (``checkpoint.storage_path``, ``--resume``, ``ckpt list|verify|inspect``) and streamed
data (``data.path``) live on a local or NFS directory, ``file://``, ``s3://`` or ``gs://``/``gcs://``.
Any other scheme is refused by name before a file system is created: pyarrow would otherwise try
``hdfs://`` through a JVM and print its failure, and name ``ftp://`` or ``file://`` mistakes in a
traceback.

Object stores answer over the network, and pyarrow's defaults wait on a silent endpoint for a
minute and a half (S3) or a quarter of an hour (GCS). Every store opened here gives up on a
request after about ``TRAINFORGE_STORAGE_TIMEOUT_S`` seconds (default 30, at least 3): S3's connect
and read timeouts are a third of it for each of its three attempts (curl counts whole seconds, hence
the least), GCS's retry time limit is all of it. A transfer that keeps moving is never cut short:
S3's read timeout is curl's low-speed limit, a stretch with no byte at all.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pyarrow.fs as pafs

from trainforge.errors import CheckpointError, ConfigError, TrainforgeError
from trainforge.redact import redact_text

TIMEOUT_ENV = "TRAINFORGE_STORAGE_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 30.0
MIN_TIMEOUT_S = 3.0  # a second per S3 attempt: curl's low-speed limit is whole seconds (0 turns it off)
MAX_TIMEOUT_S = 3600.0
S3_ATTEMPTS = 3
OBJECT_STORES = ("s3", "gs", "gcs")
SCHEMES = ("file", *OBJECT_STORES)


def storage_timeout_s() -> float:
    """Seconds a storage request may wait in all: ``TRAINFORGE_STORAGE_TIMEOUT_S``, or 30."""
    text = os.environ.get(TIMEOUT_ENV, "").strip()
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not MIN_TIMEOUT_S <= seconds <= MAX_TIMEOUT_S:  # NaN fails too
        raise ConfigError(f"{TIMEOUT_ENV}={text!r}: seconds from {MIN_TIMEOUT_S:g} to {MAX_TIMEOUT_S:g}")
    return seconds


def scheme_of(uri: str) -> str | None:
    """The scheme of ``uri`` in lower case, or None for a local path."""
    scheme, sep, _ = uri.partition("://")
    return scheme.lower() if sep else None


def check_scheme(uri: str, what: str, error: type[TrainforgeError] = CheckpointError) -> None:
    """``error`` when ``uri`` names a scheme trainforge does not read."""
    scheme = scheme_of(uri)
    if scheme is not None and scheme not in SCHEMES:
        raise error(
            f"{what} {redact_text(uri)}: {scheme}:// is not a storage trainforge reads; give a local path, "
            f"or a URI of {', '.join(f'{s}://' for s in SCHEMES)}"
        )


def open_uri(
    uri: str, what: str = "checkpoint storage", error: type[TrainforgeError] = CheckpointError
) -> tuple[pafs.FileSystem, str]:
    """The file system and path of a local path or a URI of one of SCHEMES, with bounded requests;
    ``error`` naming ``what`` for a scheme not read, or a URI pyarrow cannot open (an S3 bucket whose
    region cannot be found, a malformed URI)."""
    uri = plain(uri, what, error)
    scheme = scheme_of(uri)
    if scheme is None:
        return pafs.LocalFileSystem(), str(Path(uri).expanduser().resolve())
    timeout = storage_timeout_s()
    if scheme in ("gs", "gcs") and "retry_limit_seconds=" not in uri:
        uri = f"{uri}{'&' if '?' in uri else '?'}retry_limit_seconds={timeout:g}"
    try:
        fs, path = pafs.FileSystem.from_uri(uri)  # an S3 URI without region= asks S3 for the bucket's
    except (OSError, ValueError) as err:  # pyarrow.ArrowInvalid is a ValueError
        raise error(f"cannot open {what} {redact_text(uri)}: {first_line(err)}") from None
    if isinstance(fs, pafs.S3FileSystem):
        fs = _bounded_s3(fs, timeout)
    return fs, path


def _bounded_s3(fs: pafs.S3FileSystem, timeout_s: float) -> pafs.S3FileSystem:
    """The same S3 file system (credentials, region, endpoint, options: what pickling carries) with
    each of its attempts bounded to a third of ``timeout_s``."""
    options = dict(fs.__reduce__()[1][0])
    each = timeout_s / S3_ATTEMPTS
    options.update(
        connect_timeout=each,
        request_timeout=each,  # curl's low-speed limit: no byte for this long ends the attempt
        retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=S3_ATTEMPTS),
    )
    return pafs.S3FileSystem(**options)


def plain(uri: str, what: str = "checkpoint storage", error: type[TrainforgeError] = CheckpointError) -> str:
    """``uri`` checked (``check_scheme``), with a ``file:///abs/path`` (or ``file://localhost/...``)
    made the local path it names."""
    check_scheme(uri, what, error)
    if scheme_of(uri) != "file":
        return uri
    parts = urlsplit(uri)
    if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
        raise error(f"{what} {redact_text(uri)}: a file:// URI names an absolute local path, file:///dir")
    return str(Path(unquote(parts.path)).resolve())


def first_line(err: BaseException) -> str:
    """An error's first line, shortened: pyarrow's and the cloud SDKs' messages run long."""
    text = " ".join(str(err).strip().splitlines()[:1]) or type(err).__name__
    return redact_text(text if len(text) <= 300 else text[:297] + "...")
