"""``trainforge bench data`` end to end at a tiny size: generation, cold read, one streamed epoch
through trainforge.fit on a local Ray, the memory sampler, the table and the JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.timing import scaled

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(300)  # 30-60 s on an idle 2-core machine, most of it Ray and Ray Data starting
def test_a_tiny_data_set_streams_one_epoch_and_reports_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "x.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]), "TERM": "dumb"}
    args = ["--size-gb", "0.02", "--image-size", "64", "--dir", str(tmp_path / "data"), "--output", str(out)]
    result = subprocess.run(
        [sys.executable, "-m", "trainforge", "bench", "data", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=scaled(280),
        check=False,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]

    report = json.loads(out.read_text())
    data, read, epoch, memory = report["data"], report["read"], report["epoch"], report["memory"]
    assert data["rows"] > 0 and data["rows"] % (64 * 2) == 0
    assert abs(data["bytes"] - 0.02e9) < 0.1 * 0.02e9
    assert epoch["samples"] == data["rows"], "one epoch trains every generated row"
    assert read["bytes"] == data["bytes"] and read["gb_per_s"] > 0
    assert epoch["samples_per_s"] > 0 and epoch["epoch_s"] > 0
    assert 0.0 <= epoch["data_wait_share"] <= 1.0
    assert epoch["steady_data_wait_share"] is None or 0.0 <= epoch["steady_data_wait_share"] <= 1.0
    assert len(memory["train_worker_peak_rss"]) == 2 and min(memory["train_worker_peak_rss"]) > 0
    assert memory["ray_data_process_peak_rss"] > 0
    assert memory["object_store_capacity"] > 0 and not memory["object_store_error"]
    assert memory["cpu_s_by_role"]["ray data"] > 0 and memory["cpu_s_by_role"]["train worker"] > 0

    for line in ("cold read:", "samples/s", "data wait / step time", "goal data wait <= 5% of step time"):
        assert line in result.stdout, result.stdout
    assert "deleted" in result.stdout and not list((tmp_path / "data").glob("*/*.parquet")), result.stdout
