"""Streamed parquet through Ray Data and Ray Train's dataset shards: training to accuracy, and a
worker SIGKILLed mid-epoch that resumes with every sample of the epoch seen exactly once.

The digits are written as parquet by the tests (tests.helpers.tables), rows in a shuffled order
as a user's exported table would be, so that a split by whole files is a random one. The same run
from ``s3://`` on the loopback S3 server is in test_s3.py (whose Ray carries the credentials).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

import trainforge
from tests.helpers.faults import events, kill_a_worker_after
from tests.helpers.runs import tiny_run
from tests.helpers.tables import write_parquet

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_local")]


def parquet_run(tmp_path: Path, path: str, **sections: Any) -> dict[str, Any]:
    """Digits from parquet, 2 workers, the quickstart's model and optimizer; evaluated at the end only
    (each pass over a streamed set starts a Ray Data execution: seconds on 2 cores)."""
    config = tiny_run(
        tmp_path,
        data={"name": "parquet", "path": path, "input_shape": [1, 8, 8]},
        model={"name": "mlp"},
        train={"max_steps": None, "epochs": 8, "batch_size": 32, "log_every_n_steps": 10, "eval_every_n_steps": 10_000},
        optim={"name": "adamw", "lr": 0.003, "weight_decay": 0.0001},
        schedule={"name": "cosine", "warmup_steps": 20},
        scaling={"num_workers": 2},
    )
    for name, values in sections.items():
        config[name] = {**config.get(name, {}), **values}
    return config


def test_parquet_digits_from_a_directory_reach_95_percent(tmp_path: Path) -> None:
    folder = write_parquet(tmp_path / "digits", shuffle_seed=1)
    summary = trainforge.fit(parquet_run(tmp_path, str(folder))).summary

    assert summary["status"] == "finished"
    assert summary["final_metrics"]["val/accuracy"] >= 0.95, summary["final_metrics"]


def recorded(folder: Path, rank: int) -> list[tuple[float, list[list[int]]]]:
    """Per process of ``rank``, oldest first: (last write time, ids of each training forward)."""
    found = []
    for path in folder.glob(f"rank{rank}-*.ids"):
        lines = [[int(v) for v in line.split()] for line in path.read_text().splitlines() if line]
        found.append((path.stat().st_mtime, lines))
    return sorted(found, key=lambda item: item[0])


def test_a_worker_killed_mid_epoch_resumes_with_every_sample_of_the_epoch_once(tmp_path: Path) -> None:
    folder = write_parquet(tmp_path / "digits", with_id=True, shuffle_seed=2)
    ids_dir = tmp_path / "ids"
    ids_dir.mkdir()
    config = parquet_run(
        tmp_path,
        str(folder),
        data={"input_shape": [65]},
        model={
            "name": None,
            "factory": "tests.helpers.user_models:id_recorder",
            "kwargs": {"record_to": str(ids_dir), "delay_s": 0.05},
        },
        train={"epochs": 2, "batch_size": 16},
        checkpoint={"every_n_steps": 10, "keep_last": 5},
        failure={"max_failures": 2},
    )
    run_dir = tmp_path / "t"
    killed = kill_a_worker_after(run_dir / "checkpoint_000000020")
    summary = trainforge.fit(config).summary

    assert killed, "no worker was killed"
    assert summary["status"] == "finished" and summary["restarts"] == 1
    resumed = [line for line in events(run_dir) if line.startswith("resumed from")]
    match = re.search(r"checkpoint_(\d+)", resumed[0]) if resumed else None
    assert match, events(run_dir)
    restart_step = int(match.group(1))
    steps_per_epoch = summary["global_step"] // 2
    assert 20 <= restart_step < steps_per_epoch, (restart_step, steps_per_epoch)

    epoch_ids: list[int] = []
    for rank in (0, 1):
        (_, before), (_, after) = recorded(ids_dir, rank)
        assert len(before) > restart_step, "the worker was killed before it passed the checkpoint"
        # The steps the killed process ran after the checkpoint are read again, the same rows in
        # the same order: the rank's order is a function of the files, the seed and the epoch.
        assert after[: len(before) - restart_step] == before[restart_step:]
        timeline = before[:restart_step] + after
        for step in timeline[:steps_per_epoch]:
            epoch_ids += step
    assert len(epoch_ids) == steps_per_epoch * 16 * 2
    assert len(set(epoch_ids)) == len(epoch_ids), "a sample was seen twice in the interrupted epoch"


def test_a_factory_returning_ray_datasets_streams_through_the_shards(tmp_path: Path) -> None:
    config = parquet_run(tmp_path, "unused", train={"epochs": 1}, schedule={"warmup_steps": 0})
    config["data"] = {"factory": "tests.helpers.user_data:digits_ray"}
    summary = trainforge.fit(config).summary

    assert summary["status"] == "finished"
    assert summary["global_step"] == 1437 // 2 // 32  # the rows Ray Data counted, split equally
    assert summary["final_metrics"]["val/accuracy"] >= 0.6, summary["final_metrics"]


def test_float_targets_stream_from_parquet_columns_and_an_mlp_regresses_them(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.helpers.regression_data import rows

    folder = tmp_path / "houses"
    folder.mkdir()
    inputs, targets = rows(1024, 1).tensors
    for part in range(4):  # one file of four validates
        chunk = slice(part * 256, (part + 1) * 256)
        table = {"features": inputs[chunk].tolist(), "price": targets[chunk, 0].tolist(), "rent": targets[chunk, 1]}
        pq.write_table(pa.table({**table, "rent": table["rent"].tolist()}), folder / f"part-{part}.parquet")
    config = parquet_run(
        tmp_path,
        str(folder),
        data={"name": "parquet", "path": str(folder), "columns": {"input": "features"}, "target": ["price", "rent"]},
        model={"name": "mlp", "task": "regression", "kwargs": {"hidden_sizes": [32]}},
        train={"epochs": 6, "batch_size": 16},
        optim={"name": "adamw", "lr": 0.01, "weight_decay": 0.0},
        scaling={"num_workers": 1},
    )
    config["data"].pop("input_shape")
    summary = trainforge.fit(config).summary

    assert summary["status"] == "finished"
    final = summary["final_metrics"]
    # the targets' variances are 1 and 9 (+ 0.01 of noise): variance-weighted r2 near 1
    assert final["val/r2"] > 0.95 and final["val/mse"] < 0.5, final
    assert "val/accuracy" not in final
