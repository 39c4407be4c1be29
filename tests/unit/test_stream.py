"""Streamed sources without a cluster: listing and splitting files, counting rows, decoding rows as
Ray Data's tasks do, and the one-line errors for data a run cannot use."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from tests.helpers.tables import digits_rows, write_jsonl, write_parquet
from trainforge.config import DataConfig
from trainforge.data.spec import DataSpec
from trainforge.data.stream import (
    Decode,
    StreamShape,
    check_stream_config,
    count_rows,
    first_row,
    list_files,
    split_files,
)
from trainforge.errors import ConfigError, DataError


def test_files_are_listed_sorted_by_suffix_under_a_directory_or_a_glob(tmp_path: Path) -> None:
    folder = write_parquet(tmp_path / "d", files=5)
    (folder / "README.txt").write_text("not data")
    (folder / "_SUCCESS").write_text("")
    (folder / ".hidden.parquet").write_bytes(b"")
    files = list_files(str(folder), "parquet")
    assert [Path(p).name for p in files.paths] == [f"part-{i:03d}.parquet" for i in range(5)]
    assert files.bytes == sum((folder / f"part-{i:03d}.parquet").stat().st_size for i in range(5))
    globbed = list_files(str(folder / "part-00[12].parquet"), "parquet")
    assert [Path(p).name for p in globbed.paths] == ["part-001.parquet", "part-002.parquet"]


@pytest.mark.parametrize(
    ("path", "message"),
    [("missing", "does not exist"), ("empty", "holds no .parquet/.pq files")],
)
def test_a_path_without_files_is_one_line_naming_the_key(tmp_path: Path, path: str, message: str) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=message) as err:
        list_files(str(tmp_path / path), "parquet", "data.val_path")
    assert str(err.value).startswith("data.val_path ") and "\n" not in str(err.value)


def test_the_validation_files_are_a_fixed_fraction_chosen_by_name(tmp_path: Path) -> None:
    files = list_files(str(write_parquet(tmp_path / "d", files=10)), "parquet")
    train, val = split_files(files, 0.2, "parquet")
    assert val is not None and len(val.paths) == 2 and len(train.paths) == 8
    assert set(train.paths).isdisjoint(val.paths) and set(train.paths) | set(val.paths) == set(files.paths)
    assert split_files(files, 0.2, "parquet")[1] == val  # the same split every time
    assert split_files(files, 0.0, "parquet") == (files, None)
    one = list_files(str(tmp_path / "d" / "part-000.parquet"), "parquet")
    with pytest.raises(DataError, match=r"data.val_fraction=0.2 splits whole files.*data.val_path"):
        split_files(one, 0.2, "parquet")


def test_rows_are_counted_from_parquet_footers_and_json_lines(tmp_path: Path) -> None:
    assert count_rows("parquet", list_files(str(write_parquet(tmp_path / "p", files=3)), "parquet")) == 1797
    folder = write_jsonl(tmp_path / "j", files=3)
    with open(folder / "part-000.jsonl", "a") as out:
        out.write('{"input": [0], "target": 1}')  # a last line without its newline counts too
    assert count_rows("jsonl", list_files(str(folder), "jsonl")) == 1798


def test_numeric_lists_are_reshaped_and_targets_become_int64() -> None:
    columns = digits_rows()
    batch = {"input": np.array([*columns["input"][:5], None], dtype=object)[:5], "target": np.arange(5)}
    out = Decode("input", "target", (1, 8, 8))(batch)
    assert out["input"].shape == (5, 1, 8, 8) and out["input"].dtype == np.float32
    assert out["target"].dtype == np.int64
    np.testing.assert_array_equal(out["input"][2].ravel(), np.asarray(columns["input"][2], dtype=np.float32))
    with pytest.raises(DataError, match=r"data.input_shape \[3, 32, 32\] holds 3072 values .* hold 64"):
        Decode("input", "target", (3, 32, 32))(batch)
    with pytest.raises(DataError, match=r"no column 'pixels' .*set data.columns"):
        Decode("pixels", "target", None)(batch)


def test_encoded_images_decode_to_channels_first_floats_and_folders_name_the_classes() -> None:
    columns = digits_rows(png=True)
    batch = {"input": np.array(columns["input"][:3], dtype=object), "target": np.array(columns["target"][:3])}
    out = Decode("input", "target", None)(batch)
    assert out["input"].shape == (3, 1, 8, 8) and float(out["input"].max()) <= 1.0
    rgb = np.zeros((2, 4, 4, 3), dtype=np.uint8)
    rgb[1] = 255
    folders = Decode("image", "label", None, classes=["cat", "dog"])(
        {"image": rgb, "path": np.array(["/d/dog/1.png", "/d/cat/2.png"])}
    )
    assert folders["input"].shape == (2, 3, 4, 4) and folders["target"].tolist() == [1, 0]
    assert folders["input"][1].min() == 1.0
    with pytest.raises(DataError, match="not a readable image"):
        Decode("input", "target", None)({"input": np.array([b"not a png"], dtype=object), "target": np.array([0])})


def test_the_first_row_is_read_on_the_driver_as_ray_data_reads_it(tmp_path: Path) -> None:
    folder = write_parquet(tmp_path / "p", files=2, png=True)
    row = first_row("parquet", list_files(str(folder), "parquet"), None)
    assert Decode("input", "target", None)(row)["input"].shape == (1, 1, 8, 8)
    jsonl = write_jsonl(tmp_path / "j", files=1)
    row = first_row("jsonl", list_files(str(jsonl), "jsonl"), None)
    assert Decode("input", "target", (64,))(row)["input"].shape == (1, 64)
    image = tmp_path / "i" / "cat" / "a.png"
    image.parent.mkdir(parents=True)
    Image.new("L", (6, 5)).save(image)
    row = first_row("images", list_files(str(tmp_path / "i"), "images"), None)
    assert row["image"].shape == (1, 5, 6, 3)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "a.jsonl").write_text("[1, 2]\n")
    with pytest.raises(DataError, match="each line must be a JSON object"):
        first_row("jsonl", list_files(str(bad), "jsonl"), None)


def test_streams_refuse_tensor_parallel_and_auto_batch_in_one_line() -> None:
    cfg = DataConfig(name="parquet", path="x")
    with pytest.raises(ConfigError, match="tensor_parallel"):
        check_stream_config(cfg, tensor_parallel=2, auto_batch=False)
    with pytest.raises(ConfigError, match="batch_size: auto"):
        check_stream_config(cfg, tensor_parallel=1, auto_batch=True)
    check_stream_config(cfg, tensor_parallel=1, auto_batch=False)


def test_the_plan_travels_to_the_workers_as_plain_data() -> None:
    spec = DataSpec(kind="image", input_shape=(1, 8, 8), num_classes=10, train_size=11, val_size=5)
    shape = StreamShape("parquet", 11, 5, spec, ("a", "b"))
    again = StreamShape.from_dict(json.loads(json.dumps(shape.to_dict())))
    assert again == shape
    assert shape.rows_per_rank(2) == 5 and shape.rows_per_rank(4, val=True) == 1


def _png_bytes() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (2, 2)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_a_parquet_file_that_is_not_parquet_is_named(tmp_path: Path) -> None:
    folder = tmp_path / "p"
    folder.mkdir()
    pq.write_table(pa.table({"input": [_png_bytes()], "target": [0]}), folder / "a.parquet")
    (folder / "b.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DataError, match=r"b\.parquet is not a readable parquet file"):
        count_rows("parquet", list_files(str(folder), "parquet"))
