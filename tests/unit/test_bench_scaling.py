"""``trainforge bench scaling``'s arithmetic, runs' config, report and flags, without Ray.

The whole command runs on the namespace cluster with shaped links (tests/cluster/test_scaling.py).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helpers.runs import tiny_run
from trainforge.bench.scaling import Point, efficiencies, predicted, run_config, step_breakdown
from trainforge.config import load_config
from trainforge.predict.links import resolve_link
from trainforge.protocol import HISTORY_KEY
from trainforge.report.scaling import write_scaling_report


def interval(step: int, data: float, compute: float, optim: float) -> dict[str, float]:
    return {
        "step": step,
        "perf/step_time_s": data + compute + optim,
        "perf/data_wait_s": data,
        "perf/compute_s": compute,
        "perf/optimizer_s": optim,
    }


def test_the_step_split_leaves_out_warm_up_and_weights_intervals_by_their_steps() -> None:
    reports = [
        {  # the first interval (steps 1-10) is warm-up: 10x slower, left out
            "step": 20,
            HISTORY_KEY: [interval(10, 0.1, 1.0, 0.1), interval(20, 0.01, 0.1, 0.01)],
            "perf/comm_s": 0.5,
            "perf/comm_exposed_s": 0.4,
        },
        {
            "step": 50,
            HISTORY_KEY: [interval(30, 0.01, 0.1, 0.01), interval(50, 0.02, 0.13, 0.01)],  # 20 steps
            "perf/comm_s": 0.04,
            "perf/comm_exposed_s": 0.03,
        },
    ]
    parts = step_breakdown(reports)
    assert parts["steps_measured"] == 40
    # intervals 11-20 and 21-30 (10 steps each) at 0.01, 31-50 (20 steps) at 0.02
    assert parts["data_wait_s"] == pytest.approx((0.01 * 20 + 0.02 * 20) / 40)
    # the communication is per report: the first report (warm-up) is left out
    assert parts["comm_exposed_s"] == pytest.approx(0.03) and parts["comm_s"] == pytest.approx(0.04)
    # compute excludes the exposed communication, which DDP's backward waits for
    assert parts["compute_s"] == pytest.approx((0.1 * 20 + 0.13 * 20) / 40 - 0.03)
    assert parts["step_time_s"] == pytest.approx(parts["data_wait_s"] + parts["optimizer_s"] + 0.115)


def test_a_run_without_timed_reports_is_a_clear_error() -> None:
    from trainforge.errors import TrainforgeError

    with pytest.raises(TrainforgeError, match="raise --steps"):
        step_breakdown([{"event": "worker_error"}])


def test_efficiency_is_against_linear_from_the_smallest_count() -> None:
    assert efficiencies([1, 2, 4], [100.0, 180.0, 300.0]) == pytest.approx([1.0, 0.9, 0.75])
    assert efficiencies([4, 2], [300.0, 180.0]) == pytest.approx([300 / 360, 1.0])


def point(workers: int, **figures: float) -> Point:
    defaults = {"data_wait_s": 0.0, "compute_s": 0.1, "optimizer_s": 0.0, "comm_exposed_s": 0.0, "comm_s": 0.0}
    values = {**defaults, **figures}
    step = values["data_wait_s"] + values["compute_s"] + values["optimizer_s"] + values["comm_exposed_s"]
    return Point(
        workers,
        100.0,
        figures.get("efficiency", 1.0),
        step,
        steps_measured=10,
        run_dir="",
        **{k: v for k, v in values.items() if k != "efficiency"},
    )


def test_the_prediction_adds_the_links_all_reduce_to_each_counts_own_compute(tmp_path: Path) -> None:
    config = load_config(tiny_run(tmp_path))  # mlp on digits: 64-256-128-10
    params = 64 * 256 + 256 + 256 * 128 + 128 + 128 * 10 + 10
    link = resolve_link("100mbit@0us", None)
    comm = 4 * params / 12.5e6  # 2 ranks: each direction carries the whole buffer once
    one = point(1, compute_s=0.1)
    right = point(2, compute_s=0.12, comm_exposed_s=comm, efficiency=0.1 / (0.12 + comm))
    (_, none), (expected, error) = predicted(config, [one, right], link, workers_per_node=1)
    assert none == 0.0  # one worker: nothing to predict
    assert expected == pytest.approx(right.efficiency, rel=1e-6) and abs(error) < 1e-6
    slow = point(2, compute_s=0.12, comm_exposed_s=2 * comm, efficiency=0.1 / (0.12 + 2 * comm))
    ((_, _), (expected, error)) = predicted(config, [one, slow], link, workers_per_node=1)
    assert expected == pytest.approx(0.1 / (0.12 + comm), rel=1e-6) and error > 0  # the link was slower than said


def test_bench_runs_are_short_fixed_size_unobserved_and_never_resume(tmp_path: Path) -> None:
    config = load_config(
        tiny_run(tmp_path, scaling={"num_workers": [1, 4]}, checkpoint={"every_n_steps": 5}, train={"epochs": 3})
    )
    run = run_config(config, 2, 60, tmp_path / "bench")
    assert run.scaling.num_workers == 2 and run.train.max_steps == 60 and run.train.epochs is None
    assert run.train.log_every_n_steps == 10 and run.checkpoint.resume == "none"
    assert run.checkpoint.every_n_steps is None and not run.tracking.enabled and not run.metrics.enabled
    assert run.metrics.comm_timing and run.run_dir == (tmp_path / "bench" / "w2").resolve()


def test_the_report_has_both_plots_and_the_table(tmp_path: Path) -> None:
    points = [
        {**vars(point(1)), "predicted_efficiency": 1.0, "error_points": 0.0},
        {**vars(point(2, comm_exposed_s=0.05, efficiency=0.66)), "predicted_efficiency": 0.7, "error_points": 4.0},
    ]
    result: dict[str, Any] = {
        "config": "demo",
        "cluster": "a local Ray",
        "steps": 60,
        "link": {"name": "1gbit", "source": "given", "workers_per_node": 1},
        "points": points,
        "machine": {"cpu": "cpu", "cores": 2},
    }
    page = write_scaling_report(result, tmp_path).read_text()
    assert page.count("data:image/png;base64,") == 2
    assert "66.0%" in page and "+4.0 pts" in page and "1gbit" in page
    assert (tmp_path / "efficiency.png").stat().st_size > 10_000 and (tmp_path / "breakdown.png").exists()


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> subprocess.CompletedProcess[str]:
    from trainforge.cli import main

    capsys.readouterr()
    try:
        main(list(args))
        code = 0
    except SystemExit as exited:
        code = exited.code if isinstance(exited.code, int) else 1
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), code, out, re.sub(r"\x1b\[[0-9;]*m", "", err))


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--workers", "1,x"], "--workers '1,x': expected comma-separated integers"),
        (["--workers", "0,2"], "--workers '0,2': counts from 1 to 10000"),
        (["--workers", "2,2"], "--workers '2,2': each count once"),
        (["--steps", "5"], "--steps 5: from 10 to 100000"),
        (["--link", "pigeon"], "--link 'pigeon': one of nvlink"),
        (["--workers-per-node", "0"], "--workers-per-node 0: from 1 to 1024"),
        (["--output", "/absent/f.json"], "--output /absent/f.json: folder /absent does not exist"),
        (["--set", "parallel.strategy=fsdp"], "parallel.strategy must be ddp"),
        (["--set", "train.max_steps=-1"], "train.max_steps"),
    ],
)
def test_bad_flags_are_one_line_and_exit_code_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], expected: str
) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(tiny_run(tmp_path)))
    done = run_cli(capsys, "bench", "scaling", str(config), *args)
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and expected in errors[0], done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.yaml"]  # nothing written
