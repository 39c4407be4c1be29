"""The data set of ``trainforge bench data``: PNG images in parquet, generated at the speed of the disk.

Images of ``image_size`` pixels: a smooth random pattern tinted by the class, plus noise, so that
they compress like photographs rather than like flat colour (about 43 kB at 128 x 128). A pool of
a few hundred is encoded once; the files (about 192 MB each, columns ``input``: the PNG bytes,
``target``: the class) repeat it in a new permutation per file, so generating 10 GB costs what
writing 10 GB costs. A spec file written last marks a complete data set, which a later run of the
same spec reuses. Also here: reading the files cold, and putting them on S3.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from trainforge.errors import TrainforgeError

GB = 10**9
MB = 10**6
FILE_BYTES = 192 * MB
ROW_GROUP_ROWS = 512
POOL_IMAGES = 256
NUM_CLASSES = 10
ROWS_MULTIPLE = 128  # the global batch of the benchmark's default run
READ_CHUNK = 8 << 20
SPEC_FILE = "_bench_data.json"  # the stream's file listing skips names starting with "_"
GENERATOR_VERSION = 2  # 2: no dictionary encoding (it stored each pool image once per row group)

# ----------------------------------------------------------------------------------------------
# The data set


@dataclass(frozen=True)
class DataSetSpec:
    """What is generated; a folder holding a data set of the same spec is reused."""

    size_gb: float
    image_size: int = 128
    rows_multiple: int = ROWS_MULTIPLE  # a multiple of the global batch: one epoch trains every row
    file_bytes: int = FILE_BYTES
    seed: int = 0
    version: int = GENERATOR_VERSION

    @property
    def folder_name(self) -> str:
        return f"png{self.image_size}-{self.size_gb:g}gb-x{self.rows_multiple}"


@dataclass(frozen=True)
class DataSet:
    folder: Path
    files: tuple[Path, ...]
    rows: int
    bytes: int
    generate_s: float
    reused: bool


def image_pool(image_size: int, seed: int, count: int = POOL_IMAGES) -> tuple[list[bytes], np.ndarray]:
    """``count`` PNG images and their classes (image ``i`` is of class ``i % 10``)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    images, labels = [], np.arange(count, dtype=np.int64) % NUM_CLASSES
    for label in labels:
        grid = rng.random((4, 4, 3)) * 200
        grid[..., label % 3] += 5 * label  # a class tint: the classes differ, so training means something
        smooth = Image.fromarray(grid.clip(0, 255).astype(np.uint8)).resize(
            (image_size, image_size), Image.Resampling.BICUBIC
        )
        pixels = np.asarray(smooth, dtype=np.float32) + rng.normal(0, 24, (image_size, image_size, 3))
        buffer = io.BytesIO()
        Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(buffer, format="PNG", compress_level=1)
        images.append(buffer.getvalue())
    return images, labels


def row_counts(spec: DataSetSpec, mean_row_bytes: float) -> list[int]:
    """Rows per file: ``size_gb`` of rows in all, rounded down to ``rows_multiple`` (at least one
    multiple), about ``file_bytes`` a file."""
    wanted = spec.size_gb * GB / mean_row_bytes
    total = max(spec.rows_multiple, int(wanted // spec.rows_multiple) * spec.rows_multiple)
    per_file = max(1, round(spec.file_bytes / mean_row_bytes))
    files = math.ceil(total / per_file)
    return [min(per_file, total - i * per_file) for i in range(files)]


def generate(spec: DataSetSpec, folder: Path, progress: Callable[[str], None] = lambda _: None) -> DataSet:
    """The data set of ``spec`` in ``folder``: the one already there if its spec file matches,
    else written anew (the spec file last, so an interrupted generation is never reused)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    found = existing(spec, folder)
    if found is not None:
        progress(f"reusing the data set in {folder} ({found.rows:,} rows, {found.bytes / GB:.2f} GB)")
        return found
    started = time.monotonic()
    folder.mkdir(parents=True, exist_ok=True)
    for old in [*folder.glob("*.parquet"), folder / SPEC_FILE]:
        old.unlink(missing_ok=True)
    images, labels = image_pool(spec.image_size, spec.seed)
    pool = pa.array(images, type=pa.binary())
    counts = row_counts(spec, sum(map(len, images)) / len(images))
    schema = pa.schema([("input", pa.binary()), ("target", pa.int64())])
    files, written = [], 0
    for index, rows in enumerate(counts):
        order = pool_order(rows, len(images), (spec.seed, index))
        path = folder / f"part-{index:05d}.parquet"
        with pq.ParquetWriter(path, schema, compression="none", use_dictionary=False) as writer:
            for start in range(0, rows, ROW_GROUP_ROWS):
                picked = pa.array(order[start : start + ROW_GROUP_ROWS])
                table = pa.table({"input": pool.take(picked), "target": pa.array(labels[picked])}, schema=schema)
                writer.write_table(table, row_group_size=ROW_GROUP_ROWS)
        durable(path)  # dirty pages cannot be evicted: the cold read needs them on disk
        files.append(path)
        written += path.stat().st_size
        rate = written / MB / max(time.monotonic() - started, 1e-6)
        progress(f"generated {index + 1}/{len(counts)} files, {written / GB:.2f} GB ({rate:.0f} MB/s)")
    (folder / SPEC_FILE).write_text(json.dumps({"spec": asdict(spec), "rows": sum(counts), "bytes": written}))
    return DataSet(folder, tuple(files), sum(counts), written, time.monotonic() - started, reused=False)


def pool_order(rows: int, pool: int, seed: tuple[int, int]) -> np.ndarray:
    """Pool indices for ``rows`` rows: whole permutations of the pool, a new one each pass."""
    rng = np.random.default_rng(seed)
    passes = math.ceil(rows / pool)
    return np.concatenate([rng.permutation(pool) for _ in range(passes)])[:rows]


def existing(spec: DataSetSpec, folder: Path) -> DataSet | None:
    """The data set in ``folder`` if it was generated to ``spec`` and its files are intact."""
    try:
        recorded = json.loads((folder / SPEC_FILE).read_text())
    except (OSError, ValueError):
        return None
    files = tuple(sorted(folder.glob("*.parquet")))
    if recorded.get("spec") != asdict(spec) or sum(f.stat().st_size for f in files) != recorded.get("bytes"):
        return None
    return DataSet(folder, files, int(recorded["rows"]), int(recorded["bytes"]), 0.0, reused=True)


def durable(path: Path) -> None:
    with open(path, "rb+") as handle:
        os.fsync(handle.fileno())


# ----------------------------------------------------------------------------------------------
# Cold read


@dataclass(frozen=True)
class ReadFigure:
    bytes: int
    seconds: float
    method: str

    @property
    def gb_per_s(self) -> float:
        return self.bytes / GB / self.seconds if self.seconds > 0 else 0.0


def evict(files: tuple[Path, ...]) -> None:
    """Drop the files' pages from the page cache (theirs only: other processes' caches stay)."""
    for path in files:
        descriptor = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(descriptor)


def cold_read(files: tuple[Path, ...]) -> ReadFigure:
    """Every file evicted, then read once, sequentially."""
    evict(files)
    total, started = 0, time.perf_counter()
    for path in files:
        with open(path, "rb", buffering=0) as handle:
            while chunk := handle.read(READ_CHUNK):
                total += len(chunk)
    return ReadFigure(total, time.perf_counter() - started, "posix_fadvise(DONTNEED) per file, then 8 MiB reads")


def s3_read(uri: str) -> ReadFigure:
    """Every object under ``uri`` read once through pyarrow's S3 file system, as the stream reads it."""
    import pyarrow.fs as pafs

    fs, root = pafs.FileSystem.from_uri(uri)
    infos = [i for i in fs.get_file_info(pafs.FileSelector(root, recursive=True)) if i.is_file]
    total, started = 0, time.perf_counter()
    for info in infos:
        with fs.open_input_stream(info.path) as handle:
            while chunk := handle.read(READ_CHUNK):
                total += len(chunk)
    return ReadFigure(total, time.perf_counter() - started, "pyarrow S3 file system, 8 MiB reads, one object at a time")


# ----------------------------------------------------------------------------------------------
# S3


@contextlib.contextmanager
def s3_endpoint(endpoint_url: str | None) -> Iterator[dict[str, str]]:
    """The environment that points pyarrow (here and in Ray's workers) at the S3 server: the one at
    ``endpoint_url`` with the environment's credentials, or moto's, started here on loopback."""
    if endpoint_url:
        yield {"AWS_ENDPOINT_URL": endpoint_url}
        return
    try:
        from moto.server import ThreadedMotoServer
    except ImportError:
        raise TrainforgeError(
            "--s3 without --endpoint-url starts moto's S3 server on loopback, and moto is not installed: "
            "pip install 'moto[server]', or give --endpoint-url"
        ) from None
    from trainforge.driver.ray_session import LOOPBACK

    with contextlib.closing(socket.socket()) as probe:
        probe.bind((LOOPBACK, 0))
        port = int(probe.getsockname()[1])
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's server logs every request otherwise
    server = ThreadedMotoServer(ip_address=LOOPBACK, port=port, verbose=False)
    server.start()
    try:
        yield {
            "AWS_ENDPOINT_URL": f"http://{LOOPBACK}:{port}",
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }
    finally:
        server.stop()


def upload(data: DataSet, uri: str, progress: Callable[[str], None]) -> None:
    """The data set's files to ``uri`` (``s3://bucket/prefix``), the bucket created if need be."""
    import pyarrow.fs as pafs

    # Credentials from the environment; the endpoint too, but pyarrow's constructor reads it from
    # AWS_ENDPOINT_URL only through FileSystem.from_uri.
    fs = pafs.S3FileSystem(endpoint_override=os.environ.get("AWS_ENDPOINT_URL"), allow_bucket_creation=True)
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    fs.create_dir(bucket)
    started, sent = time.monotonic(), 0
    for index, path in enumerate(data.files):
        with open(path, "rb") as source, fs.open_output_stream(f"{bucket}/{prefix}/{path.name}") as target:
            while chunk := source.read(READ_CHUNK):
                target.write(chunk)
        sent += path.stat().st_size
        rate = sent / MB / max(time.monotonic() - started, 1e-6)
        progress(f"uploaded {index + 1}/{len(data.files)} files to {uri}, {sent / GB:.2f} GB ({rate:.0f} MB/s)")
