"""Streaming sources: parquet, image files and JSON lines of any size, read by Ray Data.

The driver lists the files (a local directory, a glob or ``s3://...``), splits off the validation
files, counts the rows from metadata where the format has it, and builds one Ray ``Dataset`` per
split: read, then decoded and preprocessed in Ray Data's streaming executor on CPU
(``map_batches``), so memory stays bounded whatever the data size. Ray Train splits each dataset
over its workers (``streaming_split``); each worker reads its shard with
``get_dataset_shard(...).iter_torch_batches``, prefetching while it computes.

Exact resume. Every dataset runs with ``preserve_order``: blocks leave the executor in file order,
and Ray Data's output splitter then deals them to the ranks by a rule that depends only on that
order (the rank with the fewest rows so far gets the next block; locality hints are dropped). So
rank r's rows in an epoch are the same rows in the same order on every run with the same files and
the same number of workers. The per-epoch shuffle is a local shuffle buffer seeded from (seed,
epoch, rank). A resumed rank re-reads its epoch from the start and skips the rows it consumed
before the checkpoint: no row is seen twice and none is skipped. docs/data.md says where this holds.
"""

from __future__ import annotations

import fnmatch
import hashlib
import io
import itertools
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import pyarrow.fs as pafs

from trainforge.checkpoint.uris import open_uri
from trainforge.config import DataConfig, FactoryData, ImagesData, JsonlData, ParquetData, StreamedData
from trainforge.data.sources import SPLIT_SEED, mix_seed
from trainforge.data.spec import DataSpec
from trainforge.errors import ConfigError, DataError, shown_names

SUFFIXES: dict[str, tuple[str, ...]] = {
    "parquet": (".parquet", ".pq"),
    "images": (".png", ".jpg", ".jpeg", ".bmp", ".webp"),
    "jsonl": (".jsonl", ".json"),
}

# (input, target) column names when data.columns leaves them out.
DEFAULT_COLUMNS: dict[str, tuple[str, str]] = {
    "parquet": ("input", "target"),
    "images": ("image", "label"),
    "jsonl": ("input", "target"),
}

LAYOUTS = {
    "parquet": "a directory, glob or s3:// prefix of .parquet files",
    "images": "a directory or s3:// prefix with one folder of .png/.jpg images per class",
    "jsonl": "a directory, glob or s3:// prefix of .jsonl files (one JSON object per line)",
}


@dataclass(frozen=True)
class StreamShape:
    """What the workers need to know about the streamed data: rows per split and the DataSpec.

    Built on the driver, sent to every worker with the config (the file lists stay on the driver).
    """

    source: str
    train_rows: int
    val_rows: int
    spec: DataSpec
    classes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> StreamShape:
        spec = dict(state["spec"])
        spec["input_shape"] = tuple(spec["input_shape"])
        if spec.get("target_shape") is not None:
            spec["target_shape"] = tuple(spec["target_shape"])
        return cls(
            state["source"],
            int(state["train_rows"]),
            int(state["val_rows"]),
            DataSpec(**spec),
            tuple(state.get("classes", ())),
        )

    def rows_per_rank(self, world: int, *, val: bool = False) -> int:
        """Rows each of ``world`` ranks reads in an epoch: the split is equal, the remainder
        (fewer than ``world`` rows) is left out of that epoch."""
        return (self.val_rows if val else self.train_rows) // world


@dataclass
class Stream:
    """The driver's side: the Ray datasets to hand to the trainer, and the stream's shape for the workers."""

    train: Any  # ray.data.Dataset
    val: Any  # ray.data.Dataset | None
    shape: StreamShape
    origin: str = ""  # where the rows come from (data.path or data.factory), for the driver's log

    def datasets(self) -> dict[str, Any]:
        return {"train": self.train} | ({"val": self.val} if self.val is not None else {})


# ----------------------------------------------------------------------------------------------
# Files


@dataclass(frozen=True)
class Files:
    """The files of one split, on one file system."""

    fs: pafs.FileSystem
    paths: tuple[str, ...]
    sizes: tuple[int, ...]

    @property
    def bytes(self) -> int:
        return sum(self.sizes)


def list_files(uri: str, source: str, key: str = "data.path") -> Files:
    """The ``source``'s files under ``uri`` (a directory, a glob, a single file, local or ``s3://``), sorted."""
    pattern = None
    base = uri
    if any(ch in uri for ch in "*?["):
        cut = min(uri.index(ch) for ch in "*?[" if ch in uri)
        base = uri[:cut].rpartition("/")[0] or "."
        pattern = uri
    try:
        fs, root = open_uri(base, key, DataError) if "://" in base else (pafs.LocalFileSystem(), _local(base))
        info = fs.get_file_info(root)
        if info.type == pafs.FileType.NotFound:
            raise DataError(f"{key} {uri} does not exist: point it at {LAYOUTS[source]}")
        if info.type == pafs.FileType.File:
            found = [info]
        else:
            found = [f for f in fs.get_file_info(pafs.FileSelector(root, recursive=True)) if f.is_file]
    except (OSError, ValueError) as err:
        raise DataError(f"{key} {uri} cannot be listed: {str(err).splitlines()[0]}") from None
    if pattern is not None:
        prefix = base.rstrip("/") + "/"
        local_pattern = pattern[len(prefix) :] if pattern.startswith(prefix) else pattern
        found = [f for f in found if fnmatch.fnmatch(f.path[len(root.rstrip("/")) + 1 :], local_pattern)]
    suffixes = SUFFIXES[source]
    kept = sorted(
        (f for f in found if f.path.lower().endswith(suffixes) and not _hidden(f.path, root)), key=lambda f: f.path
    )
    if not kept:
        raise DataError(f"{key} {uri} holds no {'/'.join(suffixes)} files: point it at {LAYOUTS[source]}")
    return Files(fs, tuple(f.path for f in kept), tuple(int(f.size or 0) for f in kept))


def _local(path: str) -> str:
    from pathlib import Path

    return str(Path(path).expanduser().resolve())


def _hidden(path: str, root: str) -> bool:
    rel = path[len(root.rstrip("/")) + 1 :]
    return any(part.startswith((".", "_")) for part in rel.split("/"))


def split_files(files: Files, val_fraction: float, source: str) -> tuple[Files, Files | None]:
    """(train, val): ``val_fraction`` of the files validate, chosen by a hash of their names (not
    the run seed), so the split is the same in every run and a file never changes sides when
    others are added. Row-level splits would need a pass over the data; file-level ones need none."""
    if val_fraction <= 0:
        return files, None
    count = len(files.paths)
    num_val = max(1, round(count * val_fraction))
    if count - num_val < 1:
        raise DataError(
            f"data.val_fraction={val_fraction} splits whole files and data.path has {count} "
            f"{source} file{'s' * (count != 1)}: write the data as more files, or set data.val_path "
            "(or data.val_fraction: 0)"
        )
    order = sorted(range(count), key=lambda i: _name_hash(files.paths[i]))
    val = sorted(order[:num_val])
    train = sorted(order[num_val:])
    return _subset(files, train), _subset(files, val)


def _name_hash(path: str) -> bytes:
    name = path.rsplit("/", 2)[-2:]  # class folder and file name: the same wherever the data lives
    return hashlib.blake2b("/".join(name).encode(), digest_size=8, salt=SPLIT_SEED.to_bytes(8, "little")).digest()


def _subset(files: Files, keep: Sequence[int]) -> Files:
    return Files(files.fs, tuple(files.paths[i] for i in keep), tuple(files.sizes[i] for i in keep))


# ----------------------------------------------------------------------------------------------
# Rows


def count_rows(source: str, files: Files) -> int:
    """Rows in ``files``: parquet from its footers, images one per file, JSON lines by counting
    newlines (one streaming pass over the bytes)."""
    if source == "images":
        return len(files.paths)
    if source == "parquet":
        import pyarrow.parquet as pq

        total = 0
        for path in files.paths:
            try:
                with files.fs.open_input_file(path) as handle:
                    total += pq.ParquetFile(handle).metadata.num_rows
            except (OSError, ValueError) as err:
                raise DataError(f"{path} is not a readable parquet file: {str(err).splitlines()[0]}") from None
        return total
    total = 0
    for path in files.paths:
        with files.fs.open_input_stream(path) as handle:
            last = b"\n"
            while chunk := handle.read(1 << 22):
                total += chunk.count(b"\n")
                last = chunk[-1:]
            total += last != b"\n"  # a last line without its newline
    return total


# ----------------------------------------------------------------------------------------------
# Decoding (runs in Ray Data's tasks)


class Decode:
    """Turns a batch of raw rows into ``{"input": float32 (N, *shape), "target": int64 (N,)}``, or
    with float targets (``data.target``) ``"target": float32 (N,)`` or ``(N, k)``.

    Inputs may be encoded images (PNG/JPEG bytes, or decoded HWC arrays from ``read_images``),
    scaled to [0, 1] and laid out CHW, or fixed-length numeric lists reshaped to ``shape``.
    Targets are integers, or (images) the class folder of each file's path, or the float columns
    ``float_targets`` names: one name gives its values (a number per row, or a list), a tuple of
    names one number per column, side by side.
    """

    def __init__(
        self,
        input_col: str,
        target_col: str,
        shape: tuple[int, ...] | None,
        classes: Sequence[str] = (),
        image_size: int | None = None,
        float_targets: str | tuple[str, ...] | None = None,
    ) -> None:
        self.input_col = input_col
        self.target_col = target_col
        self.shape = shape
        self.classes = {name: i for i, name in enumerate(classes)}
        self.image_size = image_size
        self.float_targets = float_targets

    def __call__(self, batch: dict[str, Any]) -> dict[str, np.ndarray]:
        wanted = (self.input_col, *self.target_columns())
        for col in wanted:
            if col not in batch and not (col == self.target_col and self.classes):
                have = shown_names(sorted(map(str, batch))) or "none"  # the data's own names
                key = "data.columns" if col == self.input_col or self.float_targets is None else "data.target"
                raise DataError(f"the data has no column {col!r} (columns: {have}): set {key}")
        inputs = self.inputs(batch[self.input_col])
        if self.classes:
            names = [p.replace("\\", "/").rsplit("/", 2)[-2] for p in batch["path"]]
            targets = np.array([self.classes[n] for n in names], dtype=np.int64)
        elif self.float_targets is not None:
            targets = self.floats(batch)
        else:
            targets = self.classes_of(np.asarray(batch[self.target_col]))
        return {"input": inputs, "target": targets}

    def classes_of(self, column: np.ndarray) -> np.ndarray:
        """int64 classes; a fractional value is refused rather than truncated (it is a float target)."""
        values = column.astype(np.float64) if column.dtype == object and column.size else column
        if values.dtype.kind == "f" and not np.array_equal(values, np.round(values)):
            raise DataError(
                f"the target column {self.target_col!r} holds fractions ({values[values != np.round(values)][0]:g}), "
                f"not classes: for regression set data.target: {self.target_col} and model.task: regression"
            )
        return values.astype(np.int64)

    def target_columns(self) -> tuple[str, ...]:
        if self.float_targets is None:
            return (self.target_col,)
        return (self.float_targets,) if isinstance(self.float_targets, str) else self.float_targets

    def floats(self, batch: dict[str, Any]) -> np.ndarray:
        """float32 targets: (N,) or (N, *row) for one column, (N, k) for k columns of numbers."""
        columns = []
        for name in self.target_columns():
            column = batch[name]
            try:
                if isinstance(column, np.ndarray) and column.dtype != object:
                    values = column.astype(np.float32)
                else:
                    values = np.stack([np.asarray(row, dtype=np.float32) for row in column])
            except (TypeError, ValueError):
                raise DataError(f"data.target column {name!r} holds values that are not numbers") from None
            if isinstance(self.float_targets, tuple) and values.ndim != 1:
                raise DataError(
                    f"data.target column {name!r} holds lists; a list of columns needs one number per row in each "
                    "(or name that one column alone)"
                )
            columns.append(values)
        return columns[0] if isinstance(self.float_targets, str) else np.stack(columns, axis=1)

    def inputs(self, column: Any) -> np.ndarray:
        first = column[0]
        if isinstance(first, (bytes, bytearray)):
            images = np.stack([self.decode_image(bytes(raw)) for raw in column])
        elif isinstance(column, np.ndarray) and column.dtype != object:
            images = column
        else:
            images = np.stack([np.asarray(row) for row in column])
        if images.dtype == np.uint8 and images.ndim == 4:  # HWC images
            return np.ascontiguousarray(images.transpose(0, 3, 1, 2), dtype=np.float32) / np.float32(255.0)
        if images.dtype == np.uint8 and images.ndim == 3:  # grayscale HW
            return images[:, None].astype(np.float32) / np.float32(255.0)
        values = images.astype(np.float32, copy=False)
        if self.shape is None:
            return values
        if values[0].size != math.prod(self.shape):
            raise DataError(
                f"data.input_shape {list(self.shape)} holds {math.prod(self.shape)} values but the rows of "
                f"{self.input_col!r} hold {values[0].size}: set data.input_shape"
            )
        return values.reshape(len(values), *self.shape)

    def decode_image(self, raw: bytes) -> np.ndarray:
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(io.BytesIO(raw)) as opened:
                image = opened.convert("L" if opened.mode in ("L", "1", "I;16") else "RGB")
            if self.image_size and image.size != (self.image_size, self.image_size):
                image = image.resize((self.image_size, self.image_size), Image.Resampling.BILINEAR)
            return np.array(image, dtype=np.uint8)
        except (OSError, UnidentifiedImageError) as err:
            raise DataError(f"a row of {self.input_col!r} is not a readable image: {err}") from None


# ----------------------------------------------------------------------------------------------
# The driver's side


def build_stream(cfg: StreamedData, seed: int = 0, progress: Callable[[str], None] = lambda _: None) -> Stream:
    """The Ray datasets and the stream's shape for ``cfg`` (``data.name`` parquet, images or jsonl).

    ``seed`` is unused: the files, their split and their order are the same for every run seed.
    """
    import ray.data

    source = cfg.name
    if cfg.path is None:
        raise DataError(f"data.name {source} needs data.path: set it to {LAYOUTS[source]}")
    input_col, target_col = columns(cfg)
    files = list_files(cfg.path, source)
    val_files: Files | None
    if cfg.val_path is not None:
        train_files, val_files = files, list_files(cfg.val_path, source, "data.val_path")
    else:
        train_files, val_files = split_files(files, cfg.val_fraction, source)
    classes: tuple[str, ...] = ()
    if source == "images":
        classes = tuple(sorted({p.rsplit("/", 2)[-2] for p in train_files.paths}))
        if len(classes) < 2:
            raise DataError(f"data.path {cfg.path} has {len(classes)} class folder(s): {LAYOUTS[source]}")
    progress(f"counting rows in {len(files.paths)} {source} files ({files.bytes / 2**30:.2f} GiB)")
    train_rows = count_rows(source, train_files)
    val_rows = count_rows(source, val_files) if val_files is not None else 0
    if train_rows == 0:
        raise DataError(f"data.path {cfg.path} holds no rows")
    # parquet and jsonl rows may be numeric lists (input_shape) with declared classes; images
    # and parquet bytes may be resized (image_size); an images source's classes are its folders.
    declared, declared_classes = (
        (cfg.input_shape, cfg.num_classes) if isinstance(cfg, ParquetData | JsonlData) else (None, 0)
    )
    image_size = cfg.image_size if isinstance(cfg, ParquetData | ImagesData) else None
    float_targets = cfg.target if isinstance(cfg, ParquetData | JsonlData) else None
    decode = Decode(
        input_col,
        target_col,
        tuple(declared) if declared else None,
        classes,
        image_size,
        float_targets if isinstance(float_targets, str | None) else tuple(float_targets),
    )

    # Ray Data's file-based datasource v2 lists and sizes the files in a task at the start of every
    # execution, that is every epoch: 5-15 s an epoch on 2 cores for a handful of files, against
    # 0.75 s with the v1 datasource, which does that once here (docs/benchmarks.md).
    ray.data.DataContext.get_current().use_datasource_v2 = False

    def read(split: Files) -> Any:
        paths = list(split.paths)
        if source == "parquet":
            wanted = [input_col, *decode.target_columns()]
            ds = ray.data.read_parquet(paths, filesystem=split.fs, columns=wanted, shuffle=None)
        elif source == "images":
            size = (image_size, image_size) if image_size else None
            ds = ray.data.read_images(paths, filesystem=split.fs, include_paths=True, size=size, mode="RGB")
        else:
            ds = ray.data.read_json(paths, filesystem=split.fs, lines=True)
        return ds.map_batches(decode, batch_format="numpy", zero_copy_batch=False)

    train = read(train_files)
    val = read(val_files) if val_files is not None and val_rows else None
    first = decode(first_row(source, train_files, image_size))
    input_shape = tuple(int(d) for d in first["input"].shape[1:])
    if float_targets is not None:
        target_shape = tuple(int(d) for d in first["target"].shape[1:])
        spec = DataSpec(
            kind="image", input_shape=input_shape, target_shape=target_shape, train_size=train_rows, val_size=val_rows
        )
        return Stream(train, val, StreamShape(source, train_rows, val_rows, spec), cfg.path)
    num_classes = len(classes) if classes else declared_classes
    target = int(first["target"][0])
    if not 0 <= target < num_classes:
        raise DataError(f"a target is {target}, outside 0..{num_classes - 1}: set data.num_classes")
    spec = DataSpec(
        kind="image", input_shape=input_shape, num_classes=num_classes, train_size=train_rows, val_size=val_rows
    )
    return Stream(train, val, StreamShape(source, train_rows, val_rows, spec, classes), cfg.path)


def stream_from_factory(cfg: FactoryData, seed: int, progress: Callable[[str], None] = lambda _: None) -> Stream | None:
    """The stream of a ``data.factory`` that returns Ray Datasets; None when it returns map-style
    sets (the driver calls the factory once to learn which; the workers build map-style sets
    themselves). Rows are counted with ``Dataset.count()``; without a ``val`` dataset there is no
    validation (a Ray Dataset is not split here: that would materialise it)."""
    from trainforge.data.factory import is_ray_dataset, load_user_data

    user = load_user_data(cfg, seed)
    if not is_ray_dataset(user.train):
        return None
    if user.kind == "regression":
        raise DataError(
            f"data.factory {cfg.factory!r}: float targets from a ray.data.Dataset are not read; return map-style "
            "sets, or stream parquet or jsonl files with data.target"
        )
    input_col, target_col = cfg.columns.input or "input", cfg.columns.target or "target"
    shape = user.input_shape or (tuple(cfg.input_shape) if "input_shape" in cfg.model_fields_set else None)
    decode = Decode(input_col, target_col, shape)
    train = user.train.map_batches(decode, batch_format="numpy", zero_copy_batch=False)
    val = user.val.map_batches(decode, batch_format="numpy", zero_copy_batch=False) if user.val is not None else None
    train_rows, val_rows = user.train.count(), user.val.count() if user.val is not None else 0
    first = train.take_batch(1, batch_format="numpy")
    tokens = user.kind == "tokens"
    spec = DataSpec(
        kind="tokens" if tokens else "image",
        input_shape=tuple(int(d) for d in first["input"].shape[1:]),
        num_classes=None if tokens else (user.num_classes or cfg.num_classes),
        vocab_size=user.vocab_size if tokens else None,
        seq_len=user.seq_len if tokens else None,
        train_size=train_rows,
        val_size=val_rows,
    )
    return Stream(
        train, val if val_rows else None, StreamShape("factory", train_rows, val_rows, spec), str(cfg.factory)
    )


def first_row(source: str, files: Files, image_size: int | None) -> dict[str, Any]:
    """The first row of the first file as Ray Data would read it, read here on the driver (a few
    kilobytes) so that shapes and columns are checked before anything starts."""
    path = files.paths[0]
    if source == "parquet":
        import pyarrow.parquet as pq

        with files.fs.open_input_file(path) as handle:
            table = next(pq.ParquetFile(handle).iter_batches(batch_size=1))
        return {name: _one(table.column(name).to_pylist()[0]) for name in table.schema.names}
    if source == "jsonl":
        import json

        with files.fs.open_input_stream(path) as handle:
            head = b""
            while b"\n" not in head and (chunk := handle.read(1 << 16)):
                head += chunk
        line = head.split(b"\n", 1)[0]
        try:
            row = json.loads(line)
        except ValueError as err:
            raise DataError(f"{path}: the first line is not JSON ({err})") from None
        if not isinstance(row, dict):
            raise DataError(f"{path}: each line must be a JSON object, the first is {type(row).__name__}")
        return {name: _one(value) for name, value in row.items()}
    with files.fs.open_input_stream(path) as handle:
        raw = handle.read()
    image = Decode("image", "label", None, (), image_size).decode_image(raw)
    if image.ndim == 2:
        image = np.stack([image] * 3, axis=-1)  # read_images(mode="RGB")
    return {"image": image[None], "path": np.array([path])}


def _one(value: Any) -> np.ndarray:
    """A column of one row holding ``value`` as is (a list stays one object, not a row of numbers)."""
    column = np.empty(1, dtype=object)
    column[0] = value
    return column


def columns(cfg: StreamedData) -> tuple[str, str]:
    default_input, default_target = DEFAULT_COLUMNS[cfg.name]
    return cfg.columns.input or default_input, cfg.columns.target or default_target


def check_stream_config(cfg: DataConfig, *, tensor_parallel: int, auto_batch: bool) -> None:
    """What streaming sources do not combine with, refused before anything starts."""
    if tensor_parallel > 1:
        raise ConfigError(
            f"data.name {cfg.name} streams through Ray Train's per-worker shards, which split over every "
            "worker; parallel.tensor_parallel > 1 needs one batch per tensor-parallel group: "
            "use a map-style source or tensor_parallel: 1"
        )
    if auto_batch:
        raise ConfigError(f"train.batch_size: auto needs a map-style source; data.name {cfg.name} streams")


def ordered_split_config() -> Any:
    """Ray Train's data config for streamed sources: every dataset in file order, split equally
    by a rule that depends only on that order (no locality hints), so each rank's rows repeat."""
    import ray.train
    from ray.data import DataContext, ExecutionOptions

    current = DataContext.get_current().execution_options
    options = ExecutionOptions(
        resource_limits=current.resource_limits,
        preserve_order=True,
    )
    return ray.train.DataConfig(execution_options=options, enable_shard_locality=False)


# ----------------------------------------------------------------------------------------------
# The worker's side


class StreamEpoch:
    """One pass over a rank's validation shard: batches of (input, target) with a known length."""

    def __init__(self, batches: Callable[[], Iterator[list[Any]]], length: int) -> None:
        self._batches = batches
        self._length = length

    def __len__(self) -> int:
        return self._length

    def __iter__(self) -> Iterator[list[Any]]:
        return self._batches()


class PrimedEpoch:
    """An epoch's batches whose first one a thread is fetching (``StreamFeed.prime``)."""

    def __init__(self, key: tuple[int, int, bool], pairs: Iterator[list[Any]]) -> None:
        self.key = key  # (epoch, micro-batch, pin_memory)
        self.pairs = pairs
        self.first: list[list[Any]] = []
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._fetch, name="trainforge-stream-start", daemon=True)
        self.thread.start()

    def _fetch(self) -> None:
        try:
            self.first = [next(self.pairs)]
        except StopIteration:
            pass
        except BaseException as err:  # raised where the batches are taken, on the training thread
            self.error = err

    def take(self) -> Iterator[list[Any]]:
        self.thread.join()
        if self.error is not None:
            raise self.error
        return itertools.chain(self.first, self.pairs)

    def discard(self) -> None:
        self.thread.join()
        close = getattr(self.pairs, "close", None)
        if close is not None:
            close()


class StreamFeed:
    """A rank's streamed batches: its shard of each dataset, read in the same order on every run."""

    def __init__(
        self, shape: StreamShape, train: Any, val: Any, cfg: DataConfig, *, seed: int, rank: int, world: int
    ) -> None:
        if not isinstance(cfg, StreamedData | FactoryData):
            raise DataError(f"data.name {cfg.name} is not streamed, but the driver sent a stream for it")
        self.shape = shape
        self.train = train  # ray.data.DataIterator
        self.val = val
        self.cfg = cfg
        self.seed = seed
        self.rank = rank
        self.world = world
        self.primed: PrimedEpoch | None = None

    def per_rank_size(self) -> int:
        return self.shape.rows_per_rank(self.world)

    def train_batches(self, epoch: int, position: int, micro_batch: int, *, pin_memory: bool) -> Iterator[list[Any]]:
        """Training batches of the epoch from ``position`` (rows this rank already consumed) on.

        An epoch always streams from its first row (the order is the same on every run), so a
        position skips whole micro-batches of it; the epoch ``prime`` started is taken when it
        is the one asked for."""
        primed, self.primed = self.primed, None
        if primed is not None and primed.key == (epoch, micro_batch, pin_memory):
            pairs = primed.take()
        else:
            if primed is not None:
                primed.discard()  # a resume into a later epoch, or another split: start the stream anew
            pairs = self.epoch_pairs(epoch, micro_batch, pin_memory=pin_memory)
        return itertools.islice(pairs, position // micro_batch, None)

    def prime(self, micro_batch: int, *, pin_memory: bool) -> None:
        """Start the first epoch's stream now, on a thread, and wait for its first batch there:
        Ray Data starts its read and decode tasks while the worker builds its model (on every rank,
        as Ray Data's split coordinator starts an epoch once all ranks ask). A run that resumes
        into a later epoch drops it (``train_batches``)."""
        self.primed = PrimedEpoch((0, micro_batch, pin_memory), self.epoch_pairs(0, micro_batch, pin_memory=pin_memory))

    def epoch_pairs(self, epoch: int, micro_batch: int, *, pin_memory: bool) -> Iterator[list[Any]]:
        buffer = self.cfg.shuffle_buffer if self.cfg.shuffle else 0
        batches = self.train.iter_torch_batches(
            batch_size=micro_batch,
            drop_last=True,
            device="cpu",
            prefetch_batches=self.cfg.prefetch_batches,
            local_shuffle_buffer_size=buffer or None,
            local_shuffle_seed=mix_seed(self.seed, epoch, self.rank) if buffer else None,
            pin_memory=pin_memory,
        )
        return ([batch["input"], batch["target"]] for batch in batches)

    def val_batches(self, micro_batch: int) -> StreamEpoch | None:
        if self.val is None:
            return None
        rows = self.shape.rows_per_rank(self.world, val=True)

        def batches() -> Iterator[list[Any]]:
            loader = self.val.iter_torch_batches(
                batch_size=micro_batch, drop_last=False, device="cpu", prefetch_batches=self.cfg.prefetch_batches
            )
            return ([batch["input"], batch["target"]] for batch in loader)

        return StreamEpoch(batches, math.ceil(rows / micro_batch))
