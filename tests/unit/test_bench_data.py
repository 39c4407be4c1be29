"""``trainforge bench data``'s pieces without Ray: the generated data set, its reuse, the cold read,
the data-wait arithmetic, the process roles, and the flags' checks."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from trainforge.bench.data import role_of, step_split
from trainforge.bench.imageset import MB, SPEC_FILE, DataSetSpec, cold_read, generate, row_counts
from trainforge.data.stream import Decode, list_files

SMALL = DataSetSpec(size_gb=0.004, image_size=64, rows_multiple=32, file_bytes=1 * MB)


def test_rows_fill_the_size_in_files_of_the_target_size() -> None:
    counts = row_counts(DataSetSpec(size_gb=1.0, rows_multiple=128, file_bytes=200 * MB), mean_row_bytes=40_000)
    assert sum(counts) == 24_960  # 25,000 rows of 40 kB, down to a multiple of 128
    assert counts[:-1] == [5000] * 4 and counts[-1] == 4960
    # Smaller than one multiple: one multiple, so an epoch has a step.
    assert row_counts(DataSetSpec(size_gb=1e-6, rows_multiple=128), mean_row_bytes=40_000) == [128]


def test_generated_files_are_near_the_target_size_and_hold_decodable_pngs(tmp_path: Path) -> None:
    data = generate(SMALL, tmp_path / "set")

    assert not data.reused and data.rows % SMALL.rows_multiple == 0
    assert abs(data.bytes - 4 * MB) < 0.1 * 4 * MB
    sizes = [path.stat().st_size for path in data.files]
    assert len(sizes) >= 3 and all(abs(size - MB) < 0.1 * MB for size in sizes[:-1]), sizes
    assert sum(pq.ParquetFile(path).metadata.num_rows for path in data.files) == data.rows
    assert sum(sizes) == data.bytes

    # The stream's own listing sees exactly the parquet files (the spec file starts with "_"),
    # and its decoder turns the rows into 32 x 32 RGB inputs in [0, 1] with classes 0-9.
    listed = list_files(str(data.folder), "parquet")
    assert [Path(p) for p in listed.paths] == list(data.files)
    table = pq.read_table(data.files[0]).slice(0, 40).to_pydict()
    assert table["input"][0][:8] == b"\x89PNG\r\n\x1a\n"
    batch = Decode("input", "target", None, image_size=32)(
        {name: np.array(v, dtype=object) for name, v in table.items()}
    )
    assert batch["input"].shape == (40, 3, 32, 32) and batch["input"].dtype == np.float32
    assert batch["input"].min() >= 0.0 and batch["input"].max() <= 1.0
    assert set(batch["target"].tolist()) <= set(range(10)) and len(set(batch["target"].tolist())) > 1


def test_a_data_set_of_the_same_spec_is_reused_and_another_spec_regenerates(tmp_path: Path) -> None:
    first = generate(SMALL, tmp_path / "set")
    again = generate(SMALL, tmp_path / "set")
    assert again.reused and (again.rows, again.bytes, again.files) == (first.rows, first.bytes, first.files)

    other = generate(DataSetSpec(size_gb=0.002, image_size=64, rows_multiple=32, file_bytes=MB), tmp_path / "set")
    assert not other.reused and other.bytes < first.bytes
    assert json.loads((tmp_path / "set" / SPEC_FILE).read_text())["rows"] == other.rows

    # A generation cut short (no spec file) is never reused.
    (tmp_path / "set" / SPEC_FILE).unlink()
    assert not generate(
        DataSetSpec(size_gb=0.002, image_size=64, rows_multiple=32, file_bytes=MB), tmp_path / "set"
    ).reused


def test_cold_read_reads_every_byte(tmp_path: Path) -> None:
    data = generate(SMALL, tmp_path / "set")
    read = cold_read(data.files)
    assert read.bytes == data.bytes and read.seconds > 0 and read.gb_per_s > 0


def test_data_wait_share_weighs_each_report_interval_by_its_steps(tmp_path: Path) -> None:
    def report(step: int, *points: tuple[int, float, float]) -> str:
        history = [{"step": s, "perf/data_wait_s": w, "perf/step_time_s": t} for s, w, t in points]
        return json.dumps({"step": step, "history": history})

    metrics = tmp_path / "metrics.jsonl"
    lines = [
        json.dumps({"event": "driver_start"}),
        report(20, (10, 1.0, 1.1), (20, 0.0, 0.1)),
        report(50, (50, 0.01, 0.1)),
    ]
    metrics.write_text("\n".join(lines) + "\n")
    split = step_split(metrics)
    assert split.steps == 50
    assert split.data_wait_s == pytest.approx(10 * 1.0 + 0 + 30 * 0.01)
    assert split.step_s == pytest.approx(10 * 1.1 + 10 * 0.1 + 30 * 0.1)
    assert split.share == pytest.approx(10.3 / 15.0)
    # Without the first interval (Ray Data starting): 0.3 s of 4 s.
    assert split.steady_share == pytest.approx(0.3 / 4.0)


@pytest.mark.parametrize(
    ("title", "role"),
    [
        ("ray::RayTrainWorker.run_train_fn", "train worker"),
        ("ray::TrainController.run", "train controller"),
        ("ray::SplitCoordinator.start_epoch", "ray data"),
        ("ray::ReadParquet->MapBatches(Decode)", "ray data"),
        ("ray::IDLE", "idle ray worker"),
        ("/venv/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet --node_id=...", "ray daemons"),
    ],
)
def test_processes_are_told_apart_by_their_titles(title: str, role: str) -> None:
    assert role_of(title) == role


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--size-gb", "0"], "--size-gb 0.0: a number of GB > 0"),
        (["--size-gb", "-2"], "--size-gb -2.0: a number of GB > 0"),
        (["--image-size", "4"], "--image-size 4: from 8 to 4096"),
        (["--workers", "0"], "--workers 0: from 1 to 64"),
        (["--endpoint-url", "http://127.0.0.1:9000"], "--endpoint-url http://127.0.0.1:9000: only with --s3"),
    ],
)
def test_bad_flags_exit_2_with_one_line_naming_the_flag(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], args: list[str], says: str
) -> None:
    import sys

    from trainforge.cli import main

    monkeypatch.setattr(sys, "argv", ["trainforge", "bench", "data", *args])
    with pytest.raises(SystemExit) as exited:
        main()
    err = capsys.readouterr().err
    assert exited.value.code == 2
    assert len(err.strip().splitlines()) == 1 and err.startswith("error:") and says in err, err
