"""Data sets written as a user would hold them: scikit-learn's digits as parquet or JSON lines files."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from trainforge.data.sources import digits_arrays


def digits_rows(*, with_id: bool = False, png: bool = False) -> dict[str, list]:
    """Columns of the 1797 digits: ``input`` (64 floats in [0, 1], or a PNG's bytes), ``target``,
    and with ``with_id`` an ``id`` (0..1796) that also leads each input (65 values)."""
    images, targets = digits_arrays()
    pixels = (images / 16.0).astype(np.float32).reshape(len(images), 64)
    if png:
        inputs: list = [_png((img * 255 / 16).astype(np.uint8)) for img in images]
    elif with_id:
        inputs = [np.concatenate([[float(i)], row]).tolist() for i, row in enumerate(pixels)]
    else:
        inputs = [row.tolist() for row in pixels]
    columns: dict[str, list] = {"input": inputs, "target": targets.astype(np.int64).tolist()}
    if with_id:
        columns["id"] = list(range(len(targets)))
    return columns


def write_parquet(folder: Path, files: int = 8, shuffle_seed: int | None = None, **options: bool) -> Path:
    """The digits as ``files`` parquet files in ``folder``: consecutive rows, or rows in the order
    of a permutation drawn from ``shuffle_seed`` (sklearn orders them roughly by writer)."""
    folder.mkdir(parents=True, exist_ok=True)
    columns = digits_rows(**options)
    rows = len(columns["target"])
    order = np.arange(rows) if shuffle_seed is None else np.random.default_rng(shuffle_seed).permutation(rows)
    for part, chunk in enumerate(np.array_split(order, files)):
        table = pa.table({name: [values[i] for i in chunk] for name, values in columns.items()})
        pq.write_table(table, folder / f"part-{part:03d}.parquet", row_group_size=64)
    return folder


def write_jsonl(folder: Path, files: int = 4) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    columns = digits_rows()
    rows = len(columns["target"])
    for part, chunk in enumerate(np.array_split(np.arange(rows), files)):
        with open(folder / f"part-{part:03d}.jsonl", "w") as out:
            for i in chunk:
                out.write(json.dumps({"input": columns["input"][i], "target": columns["target"][i]}) + "\n")
    return folder


def _png(image: np.ndarray) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(image, mode="L").save(buffer, format="PNG")
    return buffer.getvalue()
